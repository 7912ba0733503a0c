#!/usr/bin/env python3
"""Spark source benchmark: broker -> spark.readStream.format("beanstalk") -> parquet, delete on commit.

For each server (our broker, beanstalkd 1.12) in the same run, after draining --warmup jobs
(the JIT needs a couple of full batches before the numbers mean anything):

1. drain: N jobs (100-byte bodies) are loaded into a paused tube while the query idles;
   the tube is un-paused and the clock runs until every job is deleted (= its batch
   committed). Sustained jobs/s = N / that time.
2. latency: a producer process puts jobs at a fixed rate for D seconds, each body
   carrying its put time. A job is "visible" when the parquet sink's metadata log entry
   of its batch is written (that is when readers of the table can see it). Reports
   p50/p90/p99 of visible - put.

Where the time goes: the source's own timers (reserve, stats-job, touch, delete, as
reported under lastProgress.sources[0].latestOffset) and Spark's per-trigger
durationMs (latestOffset, planning, addBatch, commits), summed over the phase.

    python bench/bench_source.py                          # both servers, defaults
    python bench/bench_source.py --servers beanstalkd --jobs 100000 --rate 10000 --duration 15
    python bench/bench_source.py --reps 2      # ours,beanstalkd then beanstalkd,ours; same-run ratios per rep

Before the measured runs, one short unmeasured run against beanstalkd primes the JVM and
Spark's Python workers (--no-prime skips it): without it the first server measured paid
for them (drain 0.76-0.79x when ours ran first, 1.00-1.08x when it ran second, same machine).

Prints a markdown summary and writes bench/out/source.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import struct
import tempfile
import time
from pathlib import Path

from benchlib import BENCH, OUT, ROOT, broker_bench  # noqa: F401 (puts the repository on sys.path)

from spark_beanstalk.client import Connection, encode_put  # noqa: E402
from spark_beanstalk.embedded import beanstalkd_process, broker_process  # noqa: E402

TUBE = "bench"
BODY_SIZE = 100


def body(kind: bytes, ts: float) -> bytes:
    head = kind + struct.pack("<d", ts)
    return head + b"x" * (BODY_SIZE - len(head))


def fill(address: str, n: int, kind: bytes = b"D") -> float:
    host, port = address.rsplit(":", 1)
    t0 = time.perf_counter()
    with Connection(host, int(port)) as conn:
        conn.use(TUBE)
        chunk = 5000
        for lo in range(0, n, chunk):
            cmds = [encode_put(body(kind, time.time()), 100, 0, 120) for _ in range(min(chunk, n - lo))]
            for reply in conn.pipeline(cmds, window=1024):
                if reply.status != b"INSERTED":
                    raise RuntimeError(f"put failed: {reply}")
    return time.perf_counter() - t0


def producer(address: str, rate: int, duration: float, done) -> None:
    """Put `rate` jobs/s for `duration` s in 10 ms ticks; each body carries its put time."""
    host, port = address.rsplit(":", 1)
    conn = Connection(host, int(port))
    conn.use(TUBE)
    start = time.time()
    sent = 0
    while True:
        now = time.time()
        if now - start >= duration:
            break
        due = int((now - start) * rate) - sent
        if due > 0:
            cmds = [encode_put(body(b"L", time.time()), 100, 0, 120) for _ in range(due)]
            for reply in conn.pipeline(cmds, window=1024):
                if reply.status != b"INSERTED":
                    raise RuntimeError(f"put failed: {reply}")
            sent += due
        time.sleep(0.01)
    done.value = sent
    conn.close()


def tube_busy(conn: Connection) -> int:
    st = conn.stats_tube(TUBE) or {}
    return int(st.get("current-jobs-ready", 0)) + int(st.get("current-jobs-reserved", 0))


def wait_drained(conn: Connection, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while tube_busy(conn):
        if time.monotonic() > deadline:
            raise TimeoutError(f"tube not drained after {timeout}s: {conn.stats_tube(TUBE)}")
        time.sleep(0.02)
    return time.monotonic()


def visibility(out_dir: Path) -> list[tuple[float, list[str]]]:
    """(visible_at, [parquet files first listed]) per sink batch, from the metadata log."""
    meta = out_dir / "_spark_metadata"
    entries = []
    for f in meta.iterdir():
        name = f.name
        if name.startswith("."):
            continue
        batch = int(name.split(".")[0])
        entries.append((batch, f))
    seen: set[str] = set()
    result = []
    for _batch, f in sorted(entries):
        files = []
        for line in f.read_text().splitlines()[1:]:
            path = json.loads(line)["path"]
            if path not in seen:
                seen.add(path)
                files.append(path)
        result.append((f.stat().st_mtime, files))
    return result


def latencies(out_dir: Path, kind: bytes) -> list[float]:
    import pyarrow.parquet as pq

    result = []
    for visible_at, files in visibility(out_dir):
        for path in files:
            local = path[len("file:"):] if path.startswith("file:") else path
            for b in pq.read_table(local, columns=["body"]).column("body").to_pylist():
                if b[:1] == kind:
                    result.append(visible_at - struct.unpack("<d", b[1:9])[0])
    return result


def sum_progress(progresses: list[dict]) -> dict:
    dur: dict[str, float] = {}
    for p in progresses:
        for k, v in (p.get("durationMs") or {}).items():
            dur[k] = dur.get(k, 0) + v
    return dur


def per_batch(progresses: list[dict]) -> list[dict]:
    """Rows and the main durations of each micro-batch (to see warm-up and uneven batches)."""
    keys = ("latestOffset", "queryPlanning", "addBatch", "walCommit", "commitOffsets", "triggerExecution")
    return [{"rows": p.get("numInputRows"), **{k: (p.get("durationMs") or {}).get(k) for k in keys}}
            for p in progresses]


def source_timing(query) -> dict:
    p = query.lastProgress
    if not p:
        return {}
    latest = p["sources"][0].get("latestOffset")
    latest = json.loads(latest) if isinstance(latest, str) else latest
    return latest or {}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_server(spark, kind: str, args) -> dict:
    factory = broker_process if kind == "ours" else beanstalkd_process
    proc = factory().start()
    work = Path(tempfile.mkdtemp(prefix=f"bench-source-{kind}-"))
    out_dir = work / "out"
    result: dict = {"server": kind}
    try:
        conn = Connection(proc.host, proc.port)
        # warm up: the first micro-batch of a query costs ~10 s of JVM/Python start-up, and the
        # JIT needs a few full batches before it is fast (without this the first server measured
        # pays for it: up to 3x the addBatch time of the second)
        fill(proc.address, args.warmup, b"W")
        df = (spark.readStream.format("beanstalk").option("hosts", proc.address).option("tubes", TUBE)
              .option("maxJobsPerTrigger", str(args.max_jobs_per_trigger))
              .option("numPartitions", str(args.num_partitions)).load())
        query = (df.writeStream.format("parquet").option("path", str(out_dir))
                 .option("checkpointLocation", str(work / "ckpt"))
                 .trigger(processingTime=args.trigger).start())
        wait_drained(conn, 300)
        time.sleep(1.0)

        # 1. drain
        conn.call(f"pause-tube {TUBE} 3600")
        result["fill_s"] = round(fill(proc.address, args.jobs), 2)
        n_before = len(query.recentProgress)
        before = source_timing(query).get("timing_ms", {})
        t0 = time.monotonic()
        wall0 = time.time()
        conn.call(f"pause-tube {TUBE} 0")
        t1 = wait_drained(conn, 600)
        drain_s = t1 - t0
        wall1 = time.time()
        time.sleep(1.0)
        after = source_timing(query)
        progresses = [p for p in query.recentProgress[n_before:] if p.get("numInputRows")]
        result["drain"] = {
            "jobs": args.jobs,
            "seconds": round(drain_s, 2),
            "jobs_per_s": round(args.jobs / drain_s),
            "batches": len(progresses),
            "source_ms": {k: round(after.get("timing_ms", {}).get(k, 0) - before.get(k, 0))
                          for k in after.get("timing_ms", {})},
            "spark_duration_ms": sum_progress(progresses),
            "per_batch": per_batch(progresses),
            "wall": [wall0, wall1],
        }

        # 2. latency at a fixed rate
        ctx = mp.get_context("spawn")
        done = ctx.Value("i", 0)
        n_before = len(query.recentProgress)
        before = after.get("timing_ms", {})
        prod = ctx.Process(target=producer, args=(proc.address, args.rate, args.duration, done))
        prod.start()
        prod.join(args.duration + 60)
        wait_drained(conn, 120)
        time.sleep(1.0)
        after = source_timing(query)
        progresses = [p for p in query.recentProgress[n_before:] if p.get("numInputRows")]
        query.stop()
        lat = latencies(out_dir, b"L")
        result["latency"] = {
            "rate": args.rate,
            "seconds": args.duration,
            "jobs": len(lat),
            "p50_s": round(pct(lat, 0.5), 3),
            "p90_s": round(pct(lat, 0.9), 3),
            "p99_s": round(pct(lat, 0.99), 3),
            "max_s": round(max(lat), 3) if lat else None,
            "batches": len(progresses),
            "source_ms": {k: round(after.get("timing_ms", {}).get(k, 0) - before.get(k, 0))
                          for k in after.get("timing_ms", {})},
            "spark_duration_ms": sum_progress(progresses),
        }
        total = spark.read.parquet(str(out_dir)).count()
        result["sink_rows"] = total
        result["expected_rows"] = args.warmup + args.jobs + done.value
        result["counters"] = {k: after.get(k) for k in ("reserved", "deleted", "touched", "lost", "connections")}
        conn.close()
    finally:
        proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    return result


def print_ratios(results: list[dict]) -> None:
    """ours/beanstalkd within each repetition (drain jobs/s; p50 and p99 put-to-sink)."""
    for rep in sorted({r["rep"] for r in results}):
        by = {r["server"]: r for r in results if r["rep"] == rep}
        if "ours" in by and "beanstalkd" in by:
            o, b = by["ours"], by["beanstalkd"]
            order = ",".join(r["server"] for r in results if r["rep"] == rep)
            drain = o["drain"]["jobs_per_s"] / b["drain"]["jobs_per_s"]
            print(f"rep {rep} ({order}): ours/beanstalkd drain {drain:.2f}x, "
                  f"p50 {o['latency']['p50_s'] / b['latency']['p50_s']:.2f}x, "
                  f"p99 {o['latency']['p99_s'] / b['latency']['p99_s']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", default="ours,beanstalkd")
    ap.add_argument("--jobs", type=int, default=200_000, help="jobs in the drain phase")
    ap.add_argument("--rate", type=int, default=5_000, help="jobs/s put in the latency phase")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of the latency phase")
    ap.add_argument("--trigger", default="500 milliseconds")
    ap.add_argument("--max-jobs-per-trigger", type=int, default=50_000)
    ap.add_argument("--num-partitions", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT / "source.json", help="where the JSON results go")
    ap.add_argument("--warmup", type=int, default=100_000, help="jobs drained before measuring (JIT warm-up)")
    ap.add_argument("--reps", type=int, default=1,
                    help="repetitions; the server order is reversed every other one (the first server measured in "
                         "a fresh JVM pays for it), and the same-run ratios are printed per repetition")
    ap.add_argument("--no-prime", dest="prime", action="store_false",
                    help="skip the unmeasured priming run (a short run against beanstalkd first, so that the first "
                         "server measured does not pay for the JVM's and the Python workers' first minutes)")
    args = ap.parse_args()

    from spark_beanstalk.session import get_spark

    spark = get_spark("bench-source")
    kinds = [kind.strip() for kind in args.servers.split(",") if kind.strip()]
    if args.prime:
        run_server(spark, "beanstalkd", argparse.Namespace(**{**vars(args), "jobs": 50_000, "duration": 5.0}))
    results = []
    for rep in range(args.reps):
        for kind in kinds if rep % 2 == 0 else list(reversed(kinds)):
            results.append({**run_server(spark, kind, args), "rep": rep + 1})
    spark.stop()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "results": results}, indent=2))
    print("\n| rep | server | drain jobs/s | drain s | batches | put-to-sink p50 | p90 | p99 | rate | rows ok |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        d, lat = r["drain"], r["latency"]
        print(f"| {r['rep']} | {r['server']} | {d['jobs_per_s']:,} | {d['seconds']} | {d['batches']} | "
              f"{lat['p50_s']} s | {lat['p90_s']} s | {lat['p99_s']} s | {lat['rate']:,}/s | "
              f"{r['sink_rows'] == r['expected_rows']} |")
    print_ratios(results)
    for r in results:
        print(f"\n{r['server']} drain: source ms {r['drain']['source_ms']}")
        print(f"{r['server']} drain: spark durationMs {r['drain']['spark_duration_ms']}")
        print(f"{r['server']} latency: source ms {r['latency']['source_ms']}")
        print(f"{r['server']} latency: spark durationMs {r['latency']['spark_duration_ms']}")


if __name__ == "__main__":
    main()
