#!/usr/bin/env python3
"""Memory benchmark: peak RSS holding 1,000,000 ready 100-byte jobs, ours vs beanstalkd 1.12.

For each server: start a fresh process, note its RSS, load N jobs with the C load
generator (one connection, pipeline depth 64, so the load time is also reported),
check with `stats-tube` that all N are ready, then read VmHWM (peak RSS) and VmRSS
from /proc/PID/status.

    python bench/rss_bench.py                      # 1,000,000 jobs, both servers
    python bench/rss_bench.py --jobs 100000 --servers beanstalkd

Prints a markdown table and writes bench/out/rss.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import broker_bench as bb  # noqa: E402


def stats_tube(host: str, port: int, tube: str) -> dict:
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(f"stats-tube {tube}\r\n".encode())
        buf = b""
        while b"\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError("server closed the connection")
            buf += chunk
        head, _, rest = buf.partition(b"\r\n")
        if not head.startswith(b"OK "):
            raise RuntimeError(f"stats-tube: {head!r}")
        size = int(head.split()[1])
        while len(rest) < size + 2:
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError("server closed the connection")
            rest += chunk
    out = {}
    for line in rest[:size].decode().splitlines():
        if ": " in line:
            k, v = line.split(": ", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


def measure(kind: str, opts) -> dict:
    srv = bb.start_server(kind, opts.ours_args, bb.OUT / "logs")
    try:
        time.sleep(0.2)
        rss0 = bb.proc_status(srv.pid, "VmRSS")
        data = bb.run_loadgen(["-h", srv.host, "-p", str(srv.port), "-P", str(srv.pid), "-w", "put", "-c", "1",
                               "-d", "64", "-n", str(opts.jobs), "-s", str(opts.body), "-T", "bench"],
                              None, timeout=opts.timeout)
        time.sleep(0.2)
        st = stats_tube(srv.host, srv.port, "bench")
        hwm = bb.proc_status(srv.pid, "VmHWM")
        rss = bb.proc_status(srv.pid, "VmRSS")
        ready = int(st.get("current-jobs-ready", -1))
        return {
            "server": kind,
            "jobs": opts.jobs,
            "ready": ready,
            "load_s": data["seconds"],
            "load_puts_per_s": data["ops_per_s"],
            "load_server_cpu_us_per_put": data.get("server_cpu_us_per_op"),
            "load_errors": data["errors"] + data["conn_errors"],
            "rss_start": rss0,
            "vmhwm": hwm,
            "vmrss": rss,
            "bytes_per_job": (hwm - (rss0 or 0)) / opts.jobs if hwm else None,
        }
    finally:
        srv.stop(timeout=30)
        if srv.proc is not None and srv.proc.poll() is None:
            srv.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=1_000_000)
    p.add_argument("--body", type=int, default=100)
    p.add_argument("--servers", default="beanstalkd,ours")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0, help="give up loading after this many seconds")
    p.add_argument("--ours-args", default="")
    p.add_argument("--out", default=str(bb.OUT / "rss.json"))
    opts = p.parse_args(argv)
    opts.ours_args = opts.ours_args.split()
    servers = [s for s in opts.servers.split(",") if s]
    os.chdir(ROOT)
    bb.build_loadgen()
    bb.raise_nofile()
    meta = {"started_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "git": bb.git_info(),
            "loadavg_start": os.getloadavg(), "jobs": opts.jobs, "body": opts.body}
    results: dict[str, list[dict]] = {}
    for rep in range(opts.reps):
        for kind in servers:
            try:
                r = measure(kind, opts)
            except Exception as exc:
                r = {"server": kind, "failed": f"{type(exc).__name__}: {exc}"[:500]}
            results.setdefault(kind, []).append(r)
            print(f"  rep {rep + 1} {kind:10} {r}", file=sys.stderr)

    def med(kind, key):
        vals = [r[key] for r in results.get(kind, []) if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    mb = lambda v: "-" if v is None else f"{v / 1e6:.0f} MB"  # noqa: E731
    lines = ["| server | jobs ready | load time | puts/s while loading | peak RSS (VmHWM) | bytes/job "
             "| ratio to beanstalkd |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base = med("beanstalkd", "vmhwm")
    summary = {}
    for kind in servers:
        hwm = med(kind, "vmhwm")
        ratio = hwm / base if (hwm and base) else None
        summary[kind] = {"vmhwm": hwm, "load_s": med(kind, "load_s"), "bytes_per_job": med(kind, "bytes_per_job"),
                         "ready": med(kind, "ready"), "ratio": ratio}
        ls = med(kind, "load_s")
        lp = med(kind, "load_puts_per_s")
        bpj = med(kind, "bytes_per_job")
        failed = [r["failed"] for r in results.get(kind, []) if r.get("failed")]
        lines.append(f"| {kind} | {'-' if summary[kind]['ready'] is None else int(summary[kind]['ready']):,} | "
                     f"{'-' if ls is None else f'{ls:.1f} s'} | "
                     f"{'-' if lp is None else f'{lp / 1000:.0f}k'} | {mb(hwm)} | "
                     f"{'-' if bpj is None else f'{bpj:.0f}'} | {'-' if ratio is None else f'{ratio:.2f}'}"
                     f"{' (failed: ' + failed[0] + ')' if failed else ''} |")
    table = "\n".join(lines)
    meta["finished_utc"] = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta["loadavg_end"] = os.getloadavg()
    print(table)
    print(f"\n{opts.jobs:,} x {opts.body}-byte jobs; started {meta['started_utc']}, commit {meta['git']['commit']}"
          f"{' + uncommitted broker/' if meta['git']['broker_dirty'] else ''}; load {meta['loadavg_start'][0]:.2f}")
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results, "summary": summary, "table_md": table}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
