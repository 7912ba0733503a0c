#!/usr/bin/env python3
"""Binlog (-b) benchmark: our broker vs beanstalkd 1.12 with the same flags, in the same run.

1. put throughput with -b and -f 0 / -f 50 / -F (loadgen, 100-byte bodies), ours and
   beanstalkd alternating, medians over --reps; reported as ours/beanstalkd ratios.
2. recovery of a log holding --jobs (1,000,000) live jobs: time from start to listening,
   the broker's own "recovered ..." report, peak RSS (VmHWM). beanstalkd too, for scale.
3. disk use under churn: --cycles (1,000,000) put+reserve+delete cycles with -F and the
   default -s (10 MiB); bytes of the binlog directory sampled during the run and at the end.

    python bench/bench_binlog.py                  # everything (~6-8 min on 2 cores)
    python bench/bench_binlog.py --only put --reps 1 --seconds 2
    python bench/bench_binlog.py --only recovery --jobs 200000

Prints a markdown summary and writes bench/out/binlog.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchlib import BENCH, OUT, ROOT, broker_bench  # noqa: F401 (puts the repository on sys.path)

from spark_beanstalk.embedded import beanstalkd_process, broker_process  # noqa: E402

bb = broker_bench()


def start(kind: str, directory: str, flags: list[str], log: str | None = None, timeout: float = 120.0):
    os.makedirs(directory, exist_ok=True)
    factory = broker_process if kind == "ours" else beanstalkd_process
    return factory(extra_args=["-b", directory, *flags], stderr_path=log).start(timeout=timeout)


def dir_bytes(directory: str) -> int:
    """Bytes allocated on disk by the files of a directory (st_blocks, so preallocation counts)."""
    total = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        try:
            st = os.stat(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        total += st.st_blocks * 512
    return total


# ---------------------------------------------------------------- 1. put throughput
FSYNC_MODES = {"-f 0": ["-f", "0"], "-f 50": ["-f", "50"], "-F": ["-F"]}


def put_throughput(opts) -> list[dict]:
    """Rows of puts/s and server CPU per put; "ours-no-b" (our broker without -b) shows what the log itself costs."""
    rows = []
    shapes = [tuple(int(x) for x in s.split("x")) for s in opts.shapes.split(",")]
    kinds = ("beanstalkd", "ours", "ours-no-b")
    for mode, flags in FSYNC_MODES.items():
        for conns, depth in shapes:
            runs: dict[str, list[float]] = {k: [] for k in kinds}
            cpu: dict[str, list[float]] = {k: [] for k in kinds}
            for rep in range(opts.reps):
                order = kinds if rep % 2 == 0 else tuple(reversed(kinds))
                for kind in order:
                    tmp = tempfile.mkdtemp(prefix=f"bench-binlog-{kind}-", dir=opts.tmp)
                    if kind == "ours-no-b":
                        no_b_log = str(OUT / "logs" / "binlog-ours-no-b.stderr.log")
                        srv = broker_process(stderr_path=no_b_log).start(timeout=60)
                    else:
                        srv = start(kind, tmp, flags, log=str(OUT / "logs" / f"binlog-{kind}.stderr.log"))
                    try:
                        data = bb.run_loadgen(["-h", srv.host, "-p", str(srv.port), "-P", str(srv.pid), "-s", "100",
                                               "-w", "put", "-c", str(conns), "-d", str(depth), "-t", str(opts.seconds),
                                               "-W", "0.5", "-T", "bench"], None, timeout=opts.seconds + 120)
                        runs[kind].append(data["ops_per_s"])
                        if data.get("server_cpu_us_per_op") is not None:
                            cpu[kind].append(data["server_cpu_us_per_op"])
                    finally:
                        srv.stop()
                        shutil.rmtree(tmp, ignore_errors=True)
            med = {k: statistics.median(v) for k, v in runs.items()}
            mcpu = {k: (statistics.median(v) if v else None) for k, v in cpu.items()}
            row = {"mode": mode, "conns": conns, "depth": depth, "beanstalkd_ops_s": med["beanstalkd"],
                   "ours_ops_s": med["ours"], "ours_no_b_ops_s": med["ours-no-b"],
                   "ratio": med["ours"] / med["beanstalkd"] if med["beanstalkd"] else None,
                   "cpu_us_per_put": mcpu, "runs": runs}
            rows.append(row)
            print(f"  put {mode:6} c={conns:<3} d={depth:<3} beanstalkd {med['beanstalkd']:>9.0f}/s  "
                  f"ours {med['ours']:>9.0f}/s  ratio {row['ratio']:.2f}   (ours without -b {med['ours-no-b']:.0f}/s; "
                  f"server CPU us/put: beanstalkd {mcpu['beanstalkd']}, ours {mcpu['ours']}, ours without -b "
                  f"{mcpu['ours-no-b']})", flush=True)
    return rows


# ---------------------------------------------------------------- 2. recovery of N live jobs
def recovery(opts) -> dict:
    result = {"jobs": opts.jobs}
    for kind in ("ours", "beanstalkd"):
        tmp = tempfile.mkdtemp(prefix=f"bench-recovery-{kind}-", dir=opts.tmp)
        log = os.path.join(tmp, "stderr.log")
        d = os.path.join(tmp, "bl")
        try:
            srv = start(kind, d, ["-F"], log=log)
            t0 = time.monotonic()
            fill = bb.run_loadgen(["-h", srv.host, "-p", str(srv.port), "-s", "100", "-w", "put", "-c", "1",
                                   "-d", "64", "-n", str(opts.jobs), "-T", "bench"], None, timeout=1800)
            fill_s = time.monotonic() - t0
            srv.stop(timeout=60)
            log_bytes = dir_bytes(d)
            from spark_beanstalk.client import Connection
            t0 = time.monotonic()
            srv = start(kind, d, ["-F"], log=log, timeout=600)
            listening_s = time.monotonic() - t0
            # beanstalkd listens before it replays its log: time the first answer, not the port
            with Connection(srv.host, srv.port, timeout=600) as conn:
                ready_jobs = conn.stats()["current-jobs-ready"]
            ready_s = time.monotonic() - t0
            rss = bb.proc_status(srv.pid, "VmHWM")
            srv.stop(timeout=60)
            report = ""
            m = None
            if kind == "ours":
                text = Path(log).read_text()
                m = re.findall(r"binlog: recovered .*", text)
                report = m[-1] if m else ""
            result[kind] = {"fill_s": round(fill_s, 2), "fill_puts_per_s": round(fill.get("ops_per_s", 0)),
                            "start_to_listening_s": round(listening_s, 2),
                            "start_to_first_reply_s": round(ready_s, 2), "peak_rss_bytes": rss,
                            "jobs_after_restart": ready_jobs, "log_bytes": log_bytes, "report": report}
            print(f"  recovery {kind:10} {ready_jobs:,} jobs: first reply after {ready_s:.2f}s, peak RSS "
                  f"{(rss or 0) / 2**20:.0f} MiB, log {log_bytes / 2**20:.0f} MiB  {report}", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return result


# ---------------------------------------------------------------- 3. disk use under churn
def churn(opts) -> dict:
    result = {"cycles": opts.cycles}
    for kind in ("ours", "beanstalkd"):
        tmp = tempfile.mkdtemp(prefix=f"bench-churn-{kind}-", dir=opts.tmp)
        d = os.path.join(tmp, "bl")
        try:
            srv = start(kind, d, ["-F"])
            peak = [0]
            stop = threading.Event()

            def sample(stop: threading.Event = stop, peak: list[int] = peak, d: str = d) -> None:
                while not stop.wait(0.25):
                    peak[0] = max(peak[0], dir_bytes(d))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t0 = time.monotonic()
            data = bb.run_loadgen(["-h", srv.host, "-p", str(srv.port), "-s", "100", "-w", "cycle", "-c", "50",
                                   "-d", "16", "-n", str(opts.cycles), "-T", "bench"], None, timeout=3600)
            secs = time.monotonic() - t0
            stop.set()
            sampler.join()
            end_bytes = dir_bytes(d)
            files = sorted(os.listdir(d))
            srv.stop(timeout=60)
            result[kind] = {"seconds": round(secs, 1), "jobs_per_s": round(data.get("jobs_per_s", 0)),
                            "peak_dir_bytes": max(peak[0], end_bytes), "end_dir_bytes": end_bytes,
                            "files_at_end": files, "errors": data.get("errors", 0)}
            print(f"  churn {kind:10} {opts.cycles:,} put+reserve+delete in {secs:.0f}s: binlog dir peak "
                  f"{max(peak[0], end_bytes) / 2**20:.1f} MiB, at end {end_bytes / 2**20:.1f} MiB ({len(files)} files)",
                  flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return result


def markdown(res: dict) -> str:
    out = []
    if "put" in res:
        out += ["| fsync mode | conns x depth | beanstalkd puts/s | ours puts/s | ours / beanstalkd "
                "| ours without -b | "
                "server CPU us/put (beanstalkd / ours / ours without -b) |",
                "|---|---|---:|---:|---:|---:|---|"]
        for r in res["put"]:
            c = r["cpu_us_per_put"]
            out.append(f"| {r['mode']} | {r['conns']} x {r['depth']} | {r['beanstalkd_ops_s']:,.0f} | "
                       f"{r['ours_ops_s']:,.0f} | {r['ratio']:.2f} | {r['ours_no_b_ops_s']:,.0f} | "
                       f"{c['beanstalkd']} / {c['ours']} / {c['ours-no-b']} |")
        out.append("")
    if "recovery" in res:
        r = res["recovery"]
        out += [f"Recovery of {r['jobs']:,} live jobs (100-byte bodies):", "",
                "| server | start to first reply (all jobs loaded) | peak RSS | log size |", "|---|---:|---:|---:|"]
        for kind in ("ours", "beanstalkd"):
            if kind in r:
                x = r[kind]
                rss_mib = (x['peak_rss_bytes'] or 0) / 2**20
                out.append(f"| {kind} | {x['start_to_first_reply_s']:.2f} s | {rss_mib:.0f} MiB | "
                           f"{x['log_bytes'] / 2**20:.0f} MiB |")
        if "ours" in r:
            out.append(f"\nours: `{r['ours']['report']}`")
        out.append("")
    if "churn" in res:
        c = res["churn"]
        out += [f"Binlog directory under {c['cycles']:,} put+reserve+delete cycles (-F, -s 10 MiB):", "",
                "| server | peak | at end | files at end |", "|---|---:|---:|---|"]
        for kind in ("ours", "beanstalkd"):
            if kind in c:
                x = c[kind]
                out.append(f"| {kind} | {x['peak_dir_bytes'] / 2**20:.1f} MiB | {x['end_dir_bytes'] / 2**20:.1f} MiB | "
                           f"{', '.join(x['files_at_end'])} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="put,recovery,churn", help="comma list of: put, recovery, churn")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--shapes", default="1x1,50x1", help="put rows as CONNSxDEPTH, comma separated")
    p.add_argument("--jobs", type=int, default=1_000_000)
    p.add_argument("--cycles", type=int, default=1_000_000)
    p.add_argument("--tmp", default=None, help="directory for the binlogs (default: the system temp dir)")
    p.add_argument("--out", default=str(OUT / "binlog.json"))
    opts = p.parse_args(argv)
    bb.build_loadgen()
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    only = set(opts.only.split(","))
    res: dict = {"meta": {"started_utc": _dt.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
                          "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "args": vars(opts),
                          "beanstalkd_version": subprocess.run(["beanstalkd", "-v"], capture_output=True,
                                                               text=True).stdout.strip()}}
    if "put" in only:
        print("put throughput with -b:", flush=True)
        res["put"] = put_throughput(opts)
    if "recovery" in only:
        print("recovery:", flush=True)
        res["recovery"] = recovery(opts)
    if "churn" in only:
        print("churn:", flush=True)
        res["churn"] = churn(opts)
    res["meta"]["loadavg_end"] = os.getloadavg()
    res["table_md"] = markdown(res)
    Path(opts.out).write_text(json.dumps(res, indent=1))
    print()
    print(res["table_md"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
