#!/usr/bin/env python3
"""A connection per job: what opening and closing connections costs each server.

Many producers (a web request in PHP, a cron script) connect, ``use`` a tube, ``put`` one job
and hang up. Each connection then costs the server an accept, its per-connection state, and
a teardown, on top of the two commands. One client does that over and over, one connection
at a time, for every server in the same run (beanstalkd, ours, ours-pure and the Python
floor by default), alternating servers within each repetition.

Reported per server: connections a second (bounded by this Python client, the same for every
server) and the server's CPU per connection (user + system, ``/proc/PID/stat``), which does
not depend on the client. Client and server are pinned to different CPUs, as
broker_bench.py does with one connection. ``ours-poll0`` (and ``ours-pure-poll0``) is ours with
``--busy-poll-us 0``: a busy poll spins after each command for the next one, which buys a
connection-per-job client its replies sooner and shows up here as server CPU.

    python bench/bench_connect.py                          # 3 repetitions of 3,000 connections (~1.5 min)
    python bench/bench_connect.py --gap-us 1000            # producers that come 1 ms apart, not back to back
    python bench/bench_connect.py --connections 10000 --reps 5 --servers beanstalkd,ours-poll0

Prints a markdown table and writes bench/out/connect.json (``--out``).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import benchlib

from spark_beanstalk.embedded import cpu_seconds

bb = benchlib.broker_bench()
servers = bb.servers

USE = b"use bench\r\n"
PUT = b"put 0 0 60 100\r\n" + b"x" * 100 + b"\r\n"
WARMUP = 300


def _reply(sock: socket.socket) -> bytes:
    """One reply line (the replies here are short and come whole)."""
    data = b""
    while not data.endswith(b"\r\n"):
        chunk = sock.recv(256)
        if not chunk:
            raise RuntimeError(f"the server closed the connection after {data!r}")
        data += chunk
    return data


def one_connection(host: str, port: int) -> None:
    """Connect, use a tube, put one job, hang up (as a producer that connects per job)."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(USE)
        if not _reply(sock).startswith(b"USING "):
            raise RuntimeError("use failed")
        sock.sendall(PUT)
        reply = _reply(sock)
        if not reply.startswith(b"INSERTED "):
            raise RuntimeError(f"put failed: {reply!r}")


NO_POLL = "-poll0"


def one_run(label: str, connections: int, floor: str | None, gap_s: float = 0.0) -> dict:
    """label: a server kind of bench/servers.py, or ours / ours-pure + "-poll0" (``--busy-poll-us 0``)."""
    kind = label.removesuffix(NO_POLL)
    args = ["--busy-poll-us", "0"] if label.endswith(NO_POLL) else []
    srv = bb.start_server(kind, args, benchlib.OUT / "logs", floor=floor)
    try:
        bb.set_affinity(srv.pid, {bb.SERVER_CPU})
        os.sched_setaffinity(0, {bb.CLIENT_CPU})
        for _ in range(WARMUP):
            one_connection(srv.host, srv.port)
        cpu0 = cpu_seconds(srv.pid)
        start = time.perf_counter()
        for _ in range(connections):
            one_connection(srv.host, srv.port)
            if gap_s:
                time.sleep(gap_s)
        wall = time.perf_counter() - start
        # The last connections' teardown runs after the client's close: let the server finish it.
        time.sleep(0.2)
        cpu = cpu_seconds(srv.pid) - cpu0
    finally:
        os.sched_setaffinity(0, bb.all_cpus())
        srv.stop(timeout=10)
    return {"server": label, "connections": connections, "per_s": connections / wall,
            "server_cpu_us_per_conn": cpu / connections * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="beanstalkd,ours,ours-poll0,ours-pure,ours-pure-poll0,floor",
                    help="comma list: kinds of bench/servers.py, and ours / ours-pure with -poll0 (no busy poll)")
    ap.add_argument("--connections", type=int, default=3000, help="measured connections per server and repetition")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (medians are reported)")
    ap.add_argument("--gap-us", type=int, default=0,
                    help="pause after each connection (producers that come apart; 0: back to back, the default)")
    ap.add_argument("--floor", default=None, help="path of python_floor.py (default: shared/tools/ beside the repo)")
    ap.add_argument("--out", default=str(benchlib.OUT / "connect.json"), help="where to write the JSON")
    opts = ap.parse_args()
    kinds = [k.strip() for k in opts.servers.split(",") if k.strip()]
    # Not the ceiling server: it answers every packet with one constant reply, not `use` and `put`.
    known = ("beanstalkd", "ours", "ours-pure", "floor", "ours" + NO_POLL, "ours-pure" + NO_POLL)
    unknown = [k for k in kinds if k not in known]
    if unknown or not kinds:
        ap.error(f"unknown server kind(s) {unknown}: choose from {', '.join(known)}")
    if opts.connections < 1 or opts.reps < 1:
        ap.error("--connections and --reps must be at least 1")
    if opts.gap_us < 0:
        ap.error("--gap-us must be 0 or more")
    load = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(opts.reps):
        for kind in kinds:
            runs[kind].append(one_run(kind, opts.connections, opts.floor, opts.gap_us / 1e6))
    rows = {k: {"per_s": statistics.median(r["per_s"] for r in rs),
                "cpu_us": statistics.median(r["server_cpu_us_per_conn"] for r in rs)} for k, rs in runs.items()}
    meta = {"machine": servers.machine(),
            "builds": {k: servers.build_of_ours(k == "ours-pure") for k in ("ours", "ours-pure")
                       if any(label.removesuffix(NO_POLL) == k for label in kinds)},
            "git": bb.git_info(), "loadavg_1m": [load, os.getloadavg()[0]], "reps": opts.reps,
            "connections": opts.connections, "gap_us": opts.gap_us}
    base = rows.get("beanstalkd", {}).get("cpu_us")
    floor_cpu = rows.get("floor", {}).get("cpu_us")
    print("| server | connections/s (this client) | server CPU us / connection | CPU vs beanstalkd | CPU vs floor |")
    print("|---|---:|---:|---:|---:|")
    for kind, row in rows.items():
        vs_bs = f"{row['cpu_us'] / base:.2f}x" if base else "-"
        vs_floor = f"{row['cpu_us'] / floor_cpu:.2f}x" if floor_cpu else "-"
        print(f"| {kind} | {row['per_s'] / 1000:.1f}k | {row['cpu_us']:.1f} | {vs_bs} | {vs_floor} |")
    gap = f", {opts.gap_us} us apart" if opts.gap_us else ", back to back"
    print(f"\nconnect, use, put (100 bytes), close{gap}; {opts.connections} connections x {opts.reps} repetitions, "
          f"medians; {bb.machine_line(meta)}; git {meta['git']['commit']}; "
          f"load average {load:.2f} -> {meta['loadavg_1m'][1]:.2f}")
    benchlib.write_json(opts.out, {"meta": meta, "rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
