#!/usr/bin/env python3
"""Latency while a queue fills: the pauses a client sees when millions of jobs pile up.

Each server gets ``--conns`` clients putting 100-byte jobs one at a time (depth 1) for
``--seconds``, nothing reserved, so the queue grows by a million jobs or more. The load
generator reports every round trip's latency: p50 / p99 / p99.9 and the longest one. A
Python broker can stop every client while its cyclic garbage collector visits the jobs it
holds (``broker.gcpolicy``); beanstalkd has no collector but grows its arrays. The
2-second rows of broker_bench.py end before such a pause comes.

    python bench/bench_fill.py                                # beanstalkd, ours, ours-pure; 50 clients, 10 s
    python bench/bench_fill.py --servers ours --seconds 3 --conns 1

Prints a markdown table and writes bench/out/fill.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys

import benchlib

bb = benchlib.broker_bench()
servers = bb.servers


def one_run(kind: str, conns: int, seconds: float) -> dict:
    """broker_bench's put row at depth 1 (a fresh server, the load generator, its peak RSS), for longer."""
    opts = argparse.Namespace(ours_args=[], floor=None, body=100, seconds=seconds, warmup=0.2)
    return {"server": kind, **bb.one_run(kind, "put", conns, 1, False, opts)}


def table(rows: list[dict]) -> str:
    lines = ["| server | jobs put | puts/s | p50 | p99 | p99.9 | longest | peak RSS |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lat = r["lat_us"]
        rss = r.get("server_vmhwm")
        lines.append(f"| {r['server']} | {r['ops'] / 1e6:.2f}M | {r['ops_per_s'] / 1e3:.1f}k | {lat['p50']:.0f} us | "
                     f"{lat['p99']:.0f} us | {lat['p999']:.0f} us | **{lat['max'] / 1000:.1f} ms** | "
                     + ("-" if rss is None else f"{rss / 2**20:.0f} MiB") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="beanstalkd,ours,ours-pure", help="comma list of: beanstalkd, ours, ours-pure")
    p.add_argument("--conns", type=int, default=50)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--out", default=str(benchlib.OUT / "fill.json"))
    opts = p.parse_args(argv)
    kinds = [k for k in opts.servers.split(",") if k]
    for kind in kinds:
        if kind not in ("beanstalkd", "ours", "ours-pure"):
            p.error(f"unknown server {kind} (one of beanstalkd, ours, ours-pure)")
    if opts.conns < 1 or opts.seconds <= 0:
        p.error("--conns must be 1 or more and --seconds above 0")
    os.chdir(benchlib.ROOT)  # `python -m broker` must find the package
    bb.build_loadgen()
    bb.raise_nofile()
    started = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    load = os.getloadavg()[0]
    rows = []
    for kind in kinds:
        rows.append(one_run(kind, opts.conns, opts.seconds))
        print(f"  {kind:10} {rows[-1]['ops']:>9} jobs, longest round trip {rows[-1]['lat_us']['max'] / 1000:.1f} ms",
              file=sys.stderr)
    meta = {"started_utc": started, "git": bb.git_info(), "machine": servers.machine(), "loadavg_start": load,
            "loadavg_end": os.getloadavg()[0], "conns": opts.conns, "seconds": opts.seconds,
            "builds": {k: servers.build_of_ours(k == "ours-pure") for k in kinds if k != "beanstalkd"}}
    print(table(rows))
    print(f"\n{opts.conns} clients putting 100-byte jobs at depth 1 for {opts.seconds:g} s each, nothing reserved; "
          f"started {started}, commit {meta['git']['commit']}; load average {load:.2f} at the start, "
          f"{meta['loadavg_end']:.2f} at the end")
    print(bb.machine_line(meta))
    benchlib.write_json(opts.out, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
