"""Drive a server's protocol object with no sockets: the Python cost of a command alone.

Feeds ``data_received`` the exact packets the load generator sends at depth 1 (one
command per packet) through a transport that only collects the replies, so no kernel,
no event loop and no uvloop show up. Under callgrind (``--instructions`` mode of this
script) the difference between two run lengths is the instructions per command of the
protocol code: ours against the floor, line by line comparable.

    python bench/socketless.py ours put 20000          # wall-clock us per command
    python bench/socketless.py --instructions          # callgrind, ours / ours-pure / floor
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

BODY = b"x" * 100
PUT = b"put 1024 0 120 100\r\n" + BODY + b"\r\n"


class Sink(asyncio.Transport):
    """Collects what the server writes; never pauses."""

    def __init__(self) -> None:
        super().__init__()
        self.last = b""
        self.writes = 0

    def write(self, data) -> None:  # noqa: ANN001 - the asyncio signature
        self.last = data
        self.writes += 1

    def get_extra_info(self, name, default=None):  # noqa: ANN001, ANN201
        return ("127.0.0.1", 1) if name == "peername" else default

    def set_write_buffer_limits(self, high=None, low=None) -> None:  # noqa: ANN001
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def make_ours():
    from broker.gcpolicy import tune_gc
    from broker.server import BrokerServer, ServerConfig

    tune_gc()  # as run_server does: millions of long-lived jobs must not be re-scanned
    server = BrokerServer(ServerConfig())
    server._loop = asyncio.get_running_loop()  # reserves set the loop timer: run inside a loop
    from broker.server import connection_class

    conn = connection_class(server.state)(server.state)
    conn.connection_made(Sink())
    conn.data_received(b"use bench\r\n")
    conn.data_received(b"watch bench\r\n")
    return conn


def make_floor(path: str):
    spec = importlib.util.spec_from_file_location("python_floor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    conn = module.Floor()
    conn.connection_made(Sink())
    conn.data_received(b"use bench\r\n")
    conn.data_received(b"watch bench\r\n")
    return conn


class Pipelined:
    """Packets of ``depth`` commands, as the load generator sends them pipelined; job ids are
    predicted (one tube, one priority: a reserve gets the oldest ready job), and ``check``
    verifies the prediction from the queue's counters afterwards."""

    def __init__(self, conn, workload: str, depth: int) -> None:
        self.conn = conn
        self.workload = workload
        self.per = max(1, depth // (2 if workload == "drain" else 3 if workload == "cycle" else 1))
        self.next_put = 1  # the id the next put gets (ours and the floor both count from 1)
        self.next_reserved = 1
        self.owed: list[int] = []  # reserved in the previous packet: deleted in the next

    def packet(self) -> bytes:
        dels = b"".join(b"delete %d\r\n" % i for i in self.owed)
        per = self.per
        if self.workload == "put":
            self.next_put += per
            return dels + PUT * per
        if self.workload == "cycle":
            self.next_put += per
            body = (PUT + b"reserve\r\n") * per
        else:
            body = b"reserve-with-timeout 0\r\n" * per
        self.owed = list(range(self.next_reserved, self.next_reserved + per))
        self.next_reserved += per
        return dels + body

    def fill(self, jobs: int) -> None:
        for _ in range(0, jobs, 64):
            self.conn.data_received(PUT * 64)
            self.next_put += 64

    def commands(self) -> int:
        return self.per * (1 if self.workload == "put" else 3 if self.workload == "cycle" else 2)


def run_pipelined(pipe: Pipelined, n: int, build: int) -> None:
    """Feed the packets of about n commands; packets for ``build`` commands are made first, so
    that two run lengths built alike differ only in what the server did (see instructions())."""
    count = max(1, build // pipe.commands())
    packets = [pipe.packet() for _ in range(count)]
    feed = pipe.conn.data_received
    for data in packets[:max(1, n // pipe.commands())]:
        feed(data)
    last = pipe.conn.transport.last if hasattr(pipe.conn, "transport") else pipe.conn.t.last
    if b"NOT_FOUND" in last or b"TIMED_OUT" in last:
        raise SystemExit(f"the predicted job ids were wrong: {last[-200:]!r}")


def run(conn, workload: str, n: int) -> None:
    """n commands, one per packet, as the load generator sends them at depth 1."""
    feed = conn.data_received
    sink = conn.transport if hasattr(conn, "transport") else conn.t
    if workload == "put":
        for _ in range(n):
            feed(PUT)
        return
    for _ in range(n // 3):
        feed(PUT)
        feed(b"reserve\r\n")
        job_id = sink.last.split(b" ", 2)[1]
        feed(b"delete " + job_id + b"\r\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("server", nargs="?", default="ours", choices=("ours", "floor"))
    ap.add_argument("workload", nargs="?", default="put", choices=("put", "cycle", "drain"))
    ap.add_argument("n", nargs="?", type=int, default=30000)
    ap.add_argument("--floor", default=None)
    ap.add_argument("--instructions", action="store_true", help="callgrind: instructions per command, both servers")
    ap.add_argument("--ops", type=int, default=30000)
    ap.add_argument("--depth", type=int, default=1, help="commands per packet (drain: depth > 1 only)")
    ap.add_argument("--build", type=int, default=0, help="depth > 1: make packets for this many commands")
    ap.add_argument("--servers", default="ours,ours-pure,floor", help="with --instructions")
    opts = ap.parse_args()
    if opts.instructions:
        return instructions(opts)
    import servers

    floor = str(servers.floor_script(opts.floor)) if opts.server == "floor" else ""

    async def measure() -> float:
        conn = make_ours() if opts.server == "ours" else make_floor(floor)
        if opts.depth > 1:
            build = max(opts.build, opts.n)
            pipe = Pipelined(conn, opts.workload, opts.depth)
            if opts.workload == "drain":
                pipe.fill(build + 3000 + 2 * opts.depth)
            run_pipelined(pipe, 3000, 3000)  # warm-up
            t0 = time.perf_counter()
            run_pipelined(pipe, opts.n, build)
            return time.perf_counter() - t0
        run(conn, opts.workload, 3000)  # warm-up
        t0 = time.perf_counter()
        run(conn, opts.workload, opts.n)
        return time.perf_counter() - t0

    dt = asyncio.run(measure())
    print(f"{opts.server} {opts.workload}: {dt / opts.n * 1e6:.2f} us per command ({opts.n} commands)")
    return 0


def _callgrind_total(argv: list[str], env: dict) -> int:
    out = f"/tmp/socketless.{os.getpid()}.cg"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv], env=env,
                   capture_output=True, check=True)
    text = Path(out).read_bytes()
    os.unlink(out)
    return max(int(m) for m in re.findall(rb"^(?:totals|summary):\s*(\d+)", text, re.M))


def instructions(opts) -> int:
    import servers

    kinds = opts.servers.split(",")
    floor = str(servers.floor_script(opts.floor)) if "floor" in kinds else ""
    workloads = ("put", "cycle", "drain") if opts.depth > 1 else ("put", "cycle")
    rows = []
    for label in kinds:
        server, pure = ("floor", False) if label == "floor" else ("ours", label == "ours-pure")
        env = servers._env(pure)
        for workload in workloads:
            base = [sys.executable, __file__, *(["--floor", floor] if floor else []), "--depth", str(opts.depth),
                    "--build", str(opts.ops + 3), server, workload]
            small = _callgrind_total([*base, "3" if opts.depth == 1 else str(3 * opts.depth)], env)
            big = _callgrind_total([*base, str(opts.ops + 3)], env)
            per = (big - small) / (opts.ops + 3 - (3 if opts.depth == 1 else 3 * opts.depth))
            rows.append((label, workload, per))
            print(f"{label:10} {workload:5} {per:8.0f} instructions per command (socket-free, depth {opts.depth})",
                  file=sys.stderr)
    print("| server | " + " | ".join(f"{w} instr/cmd" for w in workloads) + " |\n|---|" + "---:|" * len(workloads))
    for label in kinds:
        per = {w: p for lab, w, p in rows if lab == label}
        print(f"| {label} | " + " | ".join(f"{per[w]:,.0f}" for w in workloads) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
