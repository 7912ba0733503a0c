#!/usr/bin/env python3
"""What busy polling (``--busy-poll-us``) buys and costs: one worker, one command at a time.

One client connection sends ``put`` and waits for the reply, then "works" for a fixed
time before the next one (a busy loop for gaps under 2 ms, as a worker computing; a sleep
for longer ones, as a worker waiting on something else). For each gap and server, in the
same run: round trips per second, the round trip's p50 / p99 as the client sees it, and
the server's CPU time as a share of one core (``/proc/PID/stat``). Servers: beanstalkd, and
ours once per ``--windows`` value W (``ours-pollW``: ``--busy-poll-us W``; the default 100 is
the shipped setting, 0 never polls).
Client and server are pinned to different CPUs, as broker_bench.py does with one
connection. ``--hog``: a CPU-bound process shares the server's CPU (a Spark executor, say), and
its share of that CPU is reported too.

    python bench/bench_busypoll.py                      # gaps 0, 20 us, 100 us, 1 ms, 10 ms; 2 s each
    python bench/bench_busypoll.py --gaps 0,50 --seconds 1
    python bench/bench_busypoll.py --windows 50,100,200,0 --gaps 0,10,20,50,100
    python bench/bench_busypoll.py --hog --gaps 0                 # beside a CPU-bound process

Prints a markdown table and writes bench/out/busypoll.json.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import benchlib

from spark_beanstalk.embedded import cpu_seconds

bb = benchlib.broker_bench()
servers = bb.servers

PUT = b"put 0 0 60 100\r\n" + b"x" * 100 + b"\r\n"


def pause(gap_ns: int) -> None:
    if gap_ns <= 0:
        return
    if gap_ns >= 2_000_000:
        time.sleep(gap_ns / 1e9)
        return
    end = time.perf_counter_ns() + gap_ns
    while time.perf_counter_ns() < end:
        pass


def one_run(label: str, gap_us: int, seconds: float, hog: bool = False) -> dict:
    """label: beanstalkd, or ours-pollW (ours with --busy-poll-us W)."""
    kind, args = ("beanstalkd", []) if label == "beanstalkd" else ("ours", ["--busy-poll-us", label[len("ours-poll"):]])
    srv = bb.start_server(kind, args, benchlib.OUT / "logs")
    hog_proc = None
    try:
        bb.set_affinity(srv.pid, {bb.SERVER_CPU})
        if hog:
            hog_proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            bb.set_affinity(hog_proc.pid, {bb.SERVER_CPU})
        os.sched_setaffinity(0, {bb.CLIENT_CPU})
        with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            gap_ns = gap_us * 1000
            for _ in range(200):  # warm-up
                sock.sendall(PUT)
                sock.recv(64)
            samples: list[int] = []
            cpu0 = cpu_seconds(srv.pid)
            hog0 = cpu_seconds(hog_proc.pid) if hog_proc is not None else 0.0
            start = time.perf_counter_ns()
            stop = start + int(seconds * 1e9)
            now = start
            while now < stop:
                t0 = time.perf_counter_ns()
                sock.sendall(PUT)
                reply = sock.recv(64)
                now = time.perf_counter_ns()
                if not reply.startswith(b"INSERTED"):
                    raise RuntimeError(f"{label}: unexpected reply {reply!r}")
                samples.append(now - t0)
                pause(gap_ns)
                now = time.perf_counter_ns()
            wall = (now - start) / 1e9
            cpu = cpu_seconds(srv.pid) - cpu0
            hog_cpu = cpu_seconds(hog_proc.pid) - hog0 if hog_proc is not None else None
    finally:
        os.sched_setaffinity(0, bb.all_cpus())
        if hog_proc is not None:
            hog_proc.kill()
            hog_proc.wait()
        srv.stop(timeout=10)
    samples.sort()
    n = len(samples)
    return {"server": label, "gap_us": gap_us, "commands": n, "per_s": n / wall,
            "p50_us": samples[n // 2] / 1000, "p99_us": samples[min(n - 1, n * 99 // 100)] / 1000,
            "server_cpu_share": cpu / wall, "server_cpu_us_per_cmd": cpu / n * 1e6,
            "hog_cpu_share": None if hog_cpu is None else hog_cpu / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gaps", default="0,20,100,1000,10000", help="client work between commands, us (comma list)")
    ap.add_argument("--seconds", type=float, default=2.0, help="measured time per row")
    ap.add_argument("--windows", default="50,0", help="--busy-poll-us of each run of ours, us (comma list)")
    ap.add_argument("--hog", action="store_true", help="a CPU-bound process shares the server's CPU")
    opts = ap.parse_args()
    try:
        gaps = [int(g) for g in opts.gaps.split(",")]
        windows = [int(w) for w in opts.windows.split(",")]
    except ValueError:
        ap.error(f"--gaps and --windows take whole microseconds, not {opts.gaps!r} / {opts.windows!r}")
    if any(g < 0 for g in gaps) or any(w < 0 for w in windows) or opts.seconds <= 0:
        ap.error("gaps and windows must be >= 0 and --seconds > 0")
    labels = ["beanstalkd", *(f"ours-poll{w}" for w in windows)]
    load = os.getloadavg()[0]
    rows = [one_run(label, gap, opts.seconds, opts.hog) for gap in gaps for label in labels]
    meta = {"machine": servers.machine(), "builds": {"ours": servers.build_of_ours()}, "git": bb.git_info(),
            "loadavg_1m": [load, os.getloadavg()[0]]}
    hog_col = " | CPU-bound neighbour's share of that core" if opts.hog else ""
    print("| client work between commands | server | round trips/s | p50 / p99 | server CPU (share of a core) "
          f"| server CPU us/cmd{hog_col} |")
    print("|---|---|---:|---:|---:|---:|" + ("---:|" if opts.hog else ""))
    for r in rows:
        hog_cell = f" {r['hog_cpu_share'] * 100:.0f}% |" if opts.hog else ""
        print(f"| {r['gap_us']} us | {r['server']} | {r['per_s'] / 1000:.1f}k | {r['p50_us']:.0f} us / "
              f"{r['p99_us']:.0f} us | {r['server_cpu_share'] * 100:.0f}% | {r['server_cpu_us_per_cmd']:.1f} |"
              + hog_cell)
    print(f"\n{bb.machine_line(meta)}; git {meta['git']['commit']}; load average {load:.2f} -> "
          f"{meta['loadavg_1m'][1]:.2f}")
    benchlib.OUT.mkdir(parents=True, exist_ok=True)
    (benchlib.OUT / "busypoll.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
