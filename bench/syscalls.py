#!/usr/bin/env python3
"""System calls, page faults and user/system CPU per command, per server, for one row.

Each server (the kinds of bench/servers.py) is started pinned to CPU 0; the load generator
runs on CPU 1 for 3 s, and `perf stat` counts the server's syscall tracepoints for 2 s of it.
Tells "more system calls" apart from "the same calls costing more" when one server spends
more kernel time per command than another. Needs `perf` with tracepoints (root, or
kernel.perf_event_paranoid <= -1); the tracepoints slow every server down, so read the
ops/s here only against each other.

    python bench/syscalls.py                                    # put 50x1: ours, ceiling, floor, beanstalkd
    python bench/syscalls.py --servers ours,ours-pure --workload cycle --conns 1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
for _path in (str(BENCH.parent), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import broker_bench as bb  # noqa: E402

EVENTS = ("raw_syscalls:sys_enter", "syscalls:sys_enter_read", "syscalls:sys_enter_write",
          "syscalls:sys_enter_writev", "syscalls:sys_enter_epoll_wait", "syscalls:sys_enter_epoll_pwait",
          "syscalls:sys_enter_epoll_ctl", "page-faults", "context-switches")


def short(event: str) -> str:
    return event.split(":")[-1].replace("sys_enter_", "").replace("sys_enter", "syscalls")


def measure(kind: str, opts: argparse.Namespace) -> dict[str, float]:
    srv = bb.start_server(kind, opts.ours_args.split(), bb.OUT / "logs", floor=opts.floor)
    try:
        bb.set_affinity(srv.pid, {0})
        argv = [str(bb.BIN), "-h", srv.host, "-p", str(srv.port), "-P", str(srv.pid), "-s", "100",
                "-w", opts.workload, "-c", str(opts.conns), "-d", str(opts.depth), "-t", "3", "-W", "0.5",
                "-T", "bench"]
        gen = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: os.sched_setaffinity(0, {1}))
        time.sleep(1.0)
        stat = subprocess.run(["perf", "stat", "-x", ",", "-e", ",".join(EVENTS), "-p", str(srv.pid),
                               "--", "sleep", "2"], capture_output=True, text=True)
        out = json.loads(gen.communicate(timeout=60)[0].strip().splitlines()[-1])
    finally:
        srv.stop(timeout=10)
    ops = out["ops_per_s"] * 2  # commands in perf's 2 s window
    row = {"ops_per_s": out["ops_per_s"], "user_us": out["server_user_us_per_op"],
           "sys_us": out["server_sys_us_per_op"]}
    for line in stat.stderr.splitlines():
        fields = line.split(",")
        if len(fields) > 3 and fields[2] in EVENTS and fields[0].replace(".", "").isdigit():
            row[short(fields[2])] = float(fields[0]) / ops
    if len(row) == 3:
        raise RuntimeError(f"perf stat counted nothing (tracepoints not readable?): {stat.stderr.strip()[-300:]}")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="ours,ceiling,floor,beanstalkd")
    p.add_argument("--workload", default="put", choices=("put", "cycle", "drain"))
    p.add_argument("--conns", type=int, default=50)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--floor", default=None, help="path of python_floor.py (default: shared/tools/ beside the repo)")
    p.add_argument("--ours-args", default="", help="extra arguments for our broker (space separated)")
    opts = p.parse_args(argv)
    bb.build_loadgen()
    bb.raise_nofile()
    meta = {"machine": bb.servers.machine(), "builds": {"ours": bb.servers.build_of_ours()}}
    print(f"# {opts.workload} {opts.conns}x{opts.depth}, per command; {bb.machine_line(meta)}; "
          f"load {meta['machine']['loadavg'][0]:.2f}")
    for kind in opts.servers.split(","):
        row = measure(kind, opts)
        counts = "  ".join(f"{short(e)} {row[short(e)]:.3f}" for e in EVENTS if row.get(short(e)))
        print(f"{kind:11} {row['ops_per_s'] / 1000:6.1f}k ops/s  user {row['user_us']:5.2f} us  "
              f"sys {row['sys_us']:5.2f} us  {counts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
