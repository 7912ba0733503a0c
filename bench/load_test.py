#!/usr/bin/env python3
"""Load test (issue 7): 10,000 concurrent connections, 10,000 tubes and 1,000,000 held jobs
at once; the broker's RSS and the p99 put/reserve latency of an active client meanwhile,
for our broker and for beanstalkd 1.12.

For each server, on loopback only, every phase bounded in time:

  baseline  fresh server; an active client measures put / reserve / delete latency
  conns     a pool process holds --conns connections, together watching --tubes tubes
            (so that many tubes exist), and sends a trickle of commands (--pool-rate/s);
            the active client measures again
  loading   the C load generator (bench/loadgen.c) puts --jobs 100-byte jobs into tube
            `bulk` as fast as the server takes them while the active client measures
            on its own tube (the pool stays connected)
  held      all of it at once: --conns connections, --tubes tubes, --jobs jobs held; the
            active client puts into and reserves from `bulk` itself, so reserve works
            on the 1,000,000-job heap (the count stays constant)

The active client is one connection doing put -> reserve-with-timeout -> delete, paced at
--active-rate cycles/s (not a throughput test: it measures what one well-behaved client
sees while the server carries the load). RSS is VmRSS/VmHWM from /proc/PID/status.
We raise RLIMIT_NOFILE (soft, up to the hard limit) for ourselves; the server and pool
children inherit it.

    python bench/load_test.py                 # full size, both servers
    python bench/load_test.py --quick         # 1,000 conns/tubes, 50,000 jobs, 2 s windows
    python bench/load_test.py --servers ours --ours-args "--max-connections 20000"

Prints a markdown table and writes bench/out/load_test.json (or --out).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import broker_bench as bb  # noqa: E402

from spark_beanstalk.embedded import beanstalkd_process, broker_process, cpu_seconds  # noqa: E402

# `ours+limits`: our broker with every issue-7 limit on, set high enough not to refuse this
# load, so the table shows what the checks cost.
LIMIT_ARGS = ["--max-connections", "20000", "--max-jobs", "5000000", "--max-job-bytes", str(4 << 30),
              "--max-tubes", "50000", "--max-reserved-per-connection", "1000", "--idle-timeout", "3600",
              "--max-output-bytes", str(16 << 20), "--extended-stats"]


# ------------------------------------------------------------------------------------------
# small blocking protocol helpers
# ------------------------------------------------------------------------------------------
class Conn:
    def __init__(self, host: str, port: int, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("server closed the connection")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def body(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("server closed the connection")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def cmd(self, data: bytes) -> bytes:
        self.sock.sendall(data)
        return self.line()

    def yaml(self, command: str) -> dict:
        head = self.cmd(command.encode() + b"\r\n")
        if not head.startswith(b"OK "):
            raise RuntimeError(f"{command}: {head!r}")
        out = {}
        for ln in self.body(int(head.split()[1])).decode().splitlines()[1:]:
            k, _, v = ln.partition(": ")
            out[k] = v.strip().strip('"')
        return out

    def close(self) -> None:
        self.sock.close()


def server_stats(host: str, port: int) -> dict:
    c = Conn(host, port, timeout=60)
    try:
        return c.yaml("stats")
    finally:
        c.close()


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


# ------------------------------------------------------------------------------------------
# the active client
# ------------------------------------------------------------------------------------------
def measure_active(host: str, port: int, tube: str, seconds: float, rate: float,
                   until: threading.Event | None = None, max_seconds: float | None = None) -> dict:
    """put -> reserve-with-timeout 5 -> delete, paced at `rate` cycles/s, for `seconds`
    (or, with `until`, until it is set, at most max_seconds). Latencies in microseconds."""
    c = Conn(host, port)
    lat = {"put": [], "reserve": [], "delete": []}
    errors: list[str] = []
    try:
        for cmd, ok in ((f"use {tube}", b"USING"), (f"watch {tube}", b"WATCHING")):
            r = c.cmd(cmd.encode() + b"\r\n")
            assert r.startswith(ok), r
        if tube != "default":
            c.cmd(b"ignore default\r\n")
        body = b"a" * 100
        put = b"put 1024 0 60 100\r\n" + body + b"\r\n"
        start = time.monotonic()
        end = start + (max_seconds if until is not None and max_seconds else seconds)
        interval = 1.0 / rate if rate > 0 else 0.0
        next_t = start
        while True:
            now = time.monotonic()
            if now >= end or (until is not None and until.is_set()):
                break
            if interval and now < next_t:
                time.sleep(min(next_t - now, 0.01))
                continue
            next_t += interval
            t0 = time.perf_counter_ns()
            r = c.cmd(put)
            t1 = time.perf_counter_ns()
            if not r.startswith(b"INSERTED"):
                errors.append(f"put: {r!r}")
                continue
            r = c.cmd(b"reserve-with-timeout 5\r\n")
            if not r.startswith(b"RESERVED"):
                errors.append(f"reserve: {r!r}")
                continue
            _, jid, size = r.split()
            c.body(int(size))
            t3 = time.perf_counter_ns()
            r = c.cmd(b"delete " + jid + b"\r\n")
            t4 = time.perf_counter_ns()
            if r != b"DELETED":
                errors.append(f"delete: {r!r}")
            lat["put"].append((t1 - t0) / 1000)
            lat["reserve"].append((t3 - t1) / 1000)
            lat["delete"].append((t4 - t3) / 1000)
        elapsed = time.monotonic() - start
    except (OSError, EOFError, AssertionError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        elapsed = None
    finally:
        c.close()
    out = {"cycles": len(lat["put"]), "seconds": elapsed, "errors": len(errors), "first_error": errors[:1]}
    for k, v in lat.items():
        out[k] = {"p50_us": pct(v, 0.5), "p99_us": pct(v, 0.99), "max_us": max(v) if v else None}
    return out


# ------------------------------------------------------------------------------------------
# the connection pool (a child process: `load_test.py --_pool HOST PORT CONNS TUBES RATE`)
# ------------------------------------------------------------------------------------------
def pool_main(host: str, port: int, nconns: int, ntubes: int, rate: float) -> int:
    bb.raise_nofile(nconns + 256)
    socks: list[socket.socket] = []
    t0 = time.monotonic()
    failed = 0
    batch = 200
    try:
        for first in range(0, nconns, batch):
            opened = []
            for i in range(first, min(nconns, first + batch)):
                try:
                    s = socket.create_connection((host, port), timeout=60)
                except OSError:
                    failed += 1
                    continue
                tubes = [f"t{k}" for k in range(i, ntubes, nconns)] if i < ntubes else []
                s.sendall(b"".join(f"watch {t}\r\n".encode() for t in tubes) + b"list-tube-used\r\n")
                opened.append((s, len(tubes) + 1))
            for s, replies in opened:
                got = b""
                try:
                    while got.count(b"\r\n") < replies:
                        chunk = s.recv(4096)
                        if not chunk:
                            raise EOFError
                        got += chunk
                    socks.append(s)
                except (OSError, EOFError):
                    failed += 1
                    s.close()
    except KeyboardInterrupt:
        return 1
    print(json.dumps({"ready": len(socks), "failed": failed, "open_s": round(time.monotonic() - t0, 2)}), flush=True)
    # trickle: round-robin `list-tube-used` on the held connections until stdin closes
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    sent = errors = 0
    interval = 1.0 / rate if rate > 0 else None
    i = 0
    while not stop.is_set():
        if interval is None or not socks:
            stop.wait(0.5)
            continue
        s = socks[i % len(socks)]
        i += 1
        try:
            s.sendall(b"list-tube-used\r\n")
            if not s.recv(4096).startswith(b"USING"):
                errors += 1
            sent += 1
        except OSError:
            errors += 1
        stop.wait(interval)
    print(json.dumps({"trickle_sent": sent, "trickle_errors": errors}), flush=True)
    for s in socks:
        s.close()
    return 0


class Pool:
    def __init__(self, host: str, port: int, conns: int, tubes: int, rate: float, timeout: float) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--_pool", host, str(port), str(conns), str(tubes),
                                      str(rate)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise TimeoutError(f"the pool did not open {conns} connections within {timeout:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"the pool exited with {self.proc.wait()}")
        self.info = json.loads(line)

    def close(self) -> dict:
        info = {}
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                out = self.proc.stdout.read()
                self.proc.wait(30)
                info = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
            except (subprocess.TimeoutExpired, ValueError, OSError):
                self.proc.kill()
                self.proc.wait()
        return info


# ------------------------------------------------------------------------------------------
# one server
# ------------------------------------------------------------------------------------------
def snapshot(srv, note: str, cpu0: float) -> dict:
    st = server_stats(srv.host, srv.port)
    return {
        "phase": note,
        "vmrss": bb.proc_status(srv.pid, "VmRSS"),
        "vmhwm": bb.proc_status(srv.pid, "VmHWM"),
        "fds": len(os.listdir(f"/proc/{srv.pid}/fd")),
        "server_cpu_s": round(cpu_seconds(srv.pid) - cpu0, 2),
        "current_connections": int(st.get("current-connections", -1)),
        "current_tubes": int(st.get("current-tubes", -1)),
        "current_jobs_ready": int(st.get("current-jobs-ready", -1)),
    }


def run_server(kind: str, opts, log) -> dict:
    log_dir = bb.OUT / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if kind in ("ours", "ours+limits"):
        extra = opts.ours_args + (LIMIT_ARGS if kind == "ours+limits" else [])
        srv = broker_process(extra_args=extra, stderr_path=str(log_dir / f"load_test.{kind}.log"))
    else:
        srv = beanstalkd_process(stderr_path=str(log_dir / "load_test.beanstalkd.log"))
    srv.start(timeout=30)
    phases: list[dict] = []
    result = {"server": kind, "phases": phases}
    pool = None
    deadline = time.monotonic() + opts.timeout
    try:
        time.sleep(0.3)
        cpu0 = cpu_seconds(srv.pid)
        # baseline
        lat = measure_active(srv.host, srv.port, "active", opts.measure_seconds, opts.active_rate)
        phases.append({**snapshot(srv, "baseline", cpu0), "active": lat})
        log(f"{kind}: baseline {phases[-1]['vmrss'] / 1e6:.0f} MB, p99 put {lat['put']['p99_us']:.0f} us")
        # conns + tubes
        t0 = time.monotonic()
        pool = Pool(srv.host, srv.port, opts.conns, opts.tubes, opts.pool_rate,
                    timeout=max(10.0, deadline - time.monotonic()))
        result["pool"] = pool.info
        log(f"{kind}: pool {pool.info} in {time.monotonic() - t0:.1f}s")
        lat = measure_active(srv.host, srv.port, "active", opts.measure_seconds, opts.active_rate)
        phases.append({**snapshot(srv, f"{opts.conns} conns, {opts.tubes} tubes", cpu0), "active": lat})
        log(f"{kind}: conns {phases[-1]['vmrss'] / 1e6:.0f} MB, p99 put {lat['put']['p99_us']:.0f} us")
        # loading: loadgen puts --jobs into `bulk` while the active client measures
        loadgen = subprocess.Popen([str(bb.BIN), "-h", srv.host, "-p", str(srv.port), "-P", str(srv.pid), "-w", "put",
                                    "-c", "1", "-d", "64", "-n", str(opts.jobs), "-s", "100", "-T", "bulk",
                                    "-W", "0", "-G", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        done = threading.Event()
        lg_out: dict = {}

        def wait_loadgen():
            try:
                out, err = loadgen.communicate(timeout=max(10.0, deadline - time.monotonic()))
                lg_out.update(json.loads(out.strip().splitlines()[-1]) if out.strip() else {"stderr": err[-300:]})
            except subprocess.TimeoutExpired:
                loadgen.kill()
                loadgen.communicate()
                lg_out["failed"] = "timed out"
            finally:
                done.set()

        waiter = threading.Thread(target=wait_loadgen, daemon=True)
        waiter.start()
        lat = measure_active(srv.host, srv.port, "active", 0, opts.active_rate, until=done,
                             max_seconds=max(1.0, deadline - time.monotonic()))
        waiter.join()
        phases.append({**snapshot(srv, f"loading {opts.jobs} jobs", cpu0), "active": lat,
                       "load_s": lg_out.get("seconds"), "load_puts_per_s": lg_out.get("ops_per_s"),
                       "load_errors": (lg_out.get("errors", 0) or 0) + (lg_out.get("conn_errors", 0) or 0),
                       "loadgen_failed": lg_out.get("failed") or lg_out.get("stderr")})
        log(f"{kind}: loaded in {lg_out.get('seconds')}s, p99 put {lat['put']['p99_us']} us")
        # held: everything at once; the active client cycles on the bulk tube itself
        lat = measure_active(srv.host, srv.port, "bulk", opts.measure_seconds, opts.active_rate)
        snap = snapshot(srv, f"held: {opts.conns} conns + {opts.tubes} tubes + {opts.jobs} jobs", cpu0)
        phases.append({**snap, "active": lat})
        log(f"{kind}: held {snap['vmrss'] / 1e6:.0f} MB, ready {snap['current_jobs_ready']}, "
            f"p99 put {lat['put']['p99_us']} us, reserve {lat['reserve']['p99_us']} us")
        result["pool_end"] = pool.close()
        pool = None
        result["alive"] = srv.proc.poll() is None
    except Exception as exc:  # report what failed, keep the other server's run
        result["failed"] = f"{type(exc).__name__}: {exc}"[:500]
        log(f"{kind}: FAILED {result['failed']}")
    finally:
        if pool is not None:
            pool.close()
        result["exit_code"] = srv.stop(timeout=60)
    return result


def markdown(results: list[dict]) -> str:
    def us(v):
        return "-" if v is None else (f"{v / 1000:.1f} ms" if v >= 1000 else f"{v:.0f} µs")

    lines = ["| server | phase | conns | tubes | jobs ready | RSS | peak RSS | active p50/p99 put | "
             "active p50/p99 reserve | cycles | errors | loading puts/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for ph in r["phases"]:
            a = ph["active"]
            rate = f"{ph['load_puts_per_s']:,.0f}" if ph.get("load_puts_per_s") else ""
            lines.append(
                f"| {r['server']} | {ph['phase']} | {ph['current_connections']:,} | {ph['current_tubes']:,} | "
                f"{ph['current_jobs_ready']:,} | {ph['vmrss'] / 1e6:.0f} MB | {ph['vmhwm'] / 1e6:.0f} MB | "
                f"{us(a['put']['p50_us'])} / {us(a['put']['p99_us'])} | "
                f"{us(a['reserve']['p50_us'])} / {us(a['reserve']['p99_us'])} | {a['cycles']:,} | {a['errors']} | "
                f"{rate} |")
        if r.get("failed"):
            lines.append(f"| {r['server']} | FAILED: {r['failed']} | | | | | | | | | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_pool":
        host, port, conns, tubes, rate = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), float(argv[5])
        return pool_main(host, port, conns, tubes, rate)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="ours,beanstalkd",
                    help="comma-separated: ours, ours+limits (every limit on, set high), beanstalkd")
    ap.add_argument("--conns", type=int, default=10_000)
    ap.add_argument("--tubes", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--measure-seconds", type=float, default=10.0, help="active-client window per phase")
    ap.add_argument("--active-rate", type=float, default=300.0, help="active client put/reserve/delete cycles/s")
    ap.add_argument("--pool-rate", type=float, default=500.0, help="commands/s trickled over the pool's connections")
    ap.add_argument("--timeout", type=float, default=900.0, help="per server, all phases")
    ap.add_argument("--quick", action="store_true", help="1,000 conns and tubes, 50,000 jobs, 2 s windows")
    ap.add_argument("--ours-args", default="", help="extra flags for our broker, e.g. '--max-connections 20000'")
    ap.add_argument("--out", default=str(bb.OUT / "load_test.json"))
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.conns, opts.tubes = min(opts.conns, 1000), min(opts.tubes, 1000)
        opts.jobs, opts.measure_seconds = min(opts.jobs, 50_000), min(opts.measure_seconds, 2)
    opts.ours_args = opts.ours_args.split()
    soft = bb.raise_nofile(opts.conns + 512)
    if soft < opts.conns + 64:
        print(f"RLIMIT_NOFILE is {soft} (hard limit); cannot hold {opts.conns} connections", file=sys.stderr)
        return 2
    bb.build_loadgen()

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    meta = {"started_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "git": bb.git_info(),
            "loadavg_start": os.getloadavg(), "conns": opts.conns, "tubes": opts.tubes, "jobs": opts.jobs,
            "measure_seconds": opts.measure_seconds, "active_rate": opts.active_rate, "pool_rate": opts.pool_rate,
            "ours_args": opts.ours_args, "nofile": soft, "cpus": os.cpu_count()}
    results = [run_server(kind, opts, log) for kind in opts.servers.split(",") if kind]
    meta["finished_utc"] = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta["loadavg_end"] = os.getloadavg()
    table = markdown(results)
    print(table)
    print(f"\n{opts.conns:,} connections, {opts.tubes:,} tubes, {opts.jobs:,} x 100-byte jobs; active client "
          f"{opts.active_rate:g} cycles/s; load average {meta['loadavg_start'][0]:.1f} at start "
          f"on {os.cpu_count()} CPUs")
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results, "table_md": table}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    ok = all(not r.get("failed") and r.get("alive") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
