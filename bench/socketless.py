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
    from broker.server import BrokerServer, ServerConfig, tune_gc

    tune_gc()  # as run_server does: millions of long-lived jobs must not be re-scanned
    server = BrokerServer(ServerConfig())
    server._loop = asyncio.get_running_loop()  # reserves set the loop timer: run inside a loop
    from broker.server import BrokerConnection

    conn = BrokerConnection(server.state)
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
    ap.add_argument("workload", nargs="?", default="put", choices=("put", "cycle"))
    ap.add_argument("n", nargs="?", type=int, default=30000)
    ap.add_argument("--floor", default=None)
    ap.add_argument("--instructions", action="store_true", help="callgrind: instructions per command, both servers")
    ap.add_argument("--ops", type=int, default=30000)
    opts = ap.parse_args()
    if opts.instructions:
        return instructions(opts)
    import servers

    floor = str(servers.floor_script(opts.floor))

    async def measure() -> float:
        conn = make_ours() if opts.server == "ours" else make_floor(floor)
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

    floor = str(servers.floor_script(opts.floor))
    rows = []
    for label, server, pure in (("ours", "ours", False), ("ours-pure", "ours", True), ("floor", "floor", False)):
        env = servers._env(pure)
        for workload in ("put", "cycle"):
            base = [sys.executable, __file__, "--floor", floor, server, workload]
            small = _callgrind_total([*base, "3"], env)
            big = _callgrind_total([*base, str(opts.ops + 3)], env)
            per = (big - small) / opts.ops
            rows.append((label, workload, per))
            print(f"{label:10} {workload:5} {per:8.0f} instructions per command (socket-free)", file=sys.stderr)
    print("| server | put instr/cmd | cycle instr/cmd |\n|---|---:|---:|")
    for label in ("ours", "ours-pure", "floor"):
        per = {w: p for lab, w, p in rows if lab == label}
        print(f"| {label} | {per['put']:,.0f} | {per['cycle']:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
