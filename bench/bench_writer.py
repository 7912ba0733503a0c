"""Rows/s put from Spark into beanstalk tubes: our broker vs beanstalkd 1.12, 100 B and 4 KiB bodies.

    python bench/bench_writer.py                      # everything (a few minutes)
    python bench/bench_writer.py --servers beanstalkd --sizes 100 --variants foreachBatch

Variants (all put from the executors, pipelined, one connection per partition):
  foreachBatch  beanstalk_put (mapInArrow under the hood), what streaming jobs use
  ds-arrow      df.write.format("beanstalk")                   (DataSourceArrowWriter)
  ds-row        df.write.format("beanstalk").option("arrow", "false")   (DataSourceWriter, Rows)

The input DataFrame is cached and counted first, so the time is the write alone
(Spark job + Python workers + puts). A fresh server process per measurement; the
median of --repeat runs is reported. Results go to stdout and bench/out/writer.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from spark_beanstalk.client import Connection  # noqa: E402
from spark_beanstalk.embedded import start_server  # noqa: E402
from spark_beanstalk.session import get_spark  # noqa: E402


def make_df(spark, rows: int, size: int, partitions: int):
    from pyspark.sql import functions as F

    pad = "x" * size
    df = spark.range(rows, numPartitions=partitions).select(
        F.substring(F.concat(F.col("id").cast("string"), F.lit("-"), F.lit(pad)), 1, size).alias("body"))
    df = df.cache()
    df.count()
    return df


def run_variant(variant: str, df, address: str) -> None:
    from spark_beanstalk.writer import beanstalk_put

    if variant == "foreachBatch":
        beanstalk_put.options(hosts=address, tube="bench").write(df)
    elif variant == "ds-arrow":
        df.write.format("beanstalk").options(hosts=address, tube="bench").mode("append").save()
    elif variant == "ds-row":
        df.write.format("beanstalk").options(hosts=address, tube="bench", arrow="false").mode("append").save()
    else:
        raise SystemExit(f"unknown variant {variant}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="beanstalkd,ours")
    ap.add_argument("--sizes", default="100,4096")
    ap.add_argument("--variants", default="foreachBatch,ds-arrow,ds-row")
    ap.add_argument("--rows", type=int, default=200_000, help="rows for 100-byte bodies")
    ap.add_argument("--big-rows", type=int, default=50_000, help="rows for bodies over 1 KiB")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "writer.json"))
    args = ap.parse_args()

    spark = get_spark("bench-writer", **{"spark.ui.showConsoleProgress": "false"})
    results = []
    try:
        for size in [int(s) for s in args.sizes.split(",")]:
            rows = args.rows if size <= 1024 else args.big_rows
            df = make_df(spark, rows, size, args.partitions)
            for kind in args.servers.split(","):
                for variant in args.variants.split(","):
                    times = []
                    for rep in range(args.repeat + 1):          # first run warms workers up, not counted
                        srv = start_server(kind)
                        try:
                            t0 = time.perf_counter()
                            run_variant(variant, df, srv.address)
                            dt = time.perf_counter() - t0
                            with Connection(srv.host, srv.port) as c:
                                landed = c.stats_tube("bench")["current-jobs-ready"]
                            assert landed == rows, f"{landed} of {rows} rows landed"
                        finally:
                            srv.stop()
                        if rep:
                            times.append(dt)
                    med = statistics.median(times)
                    rec = {"server": kind, "body_bytes": size, "variant": variant, "rows": rows,
                           "partitions": args.partitions, "seconds": [round(t, 3) for t in times],
                           "rows_per_s": round(rows / med), "MB_per_s": round(rows * size / med / 1e6, 1)}
                    results.append(rec)
                    print(f"{kind:>10}  {size:>5} B  {variant:<12}  {rec['rows_per_s']:>8,} rows/s  "
                          f"{rec['MB_per_s']:>6} MB/s  runs {rec['seconds']}", flush=True)
            df.unpersist()
    finally:
        spark.stop()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "load_avg_at_end": os.getloadavg(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
