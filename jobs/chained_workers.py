"""Chained workers: tube -> Spark stage -> tube -> Spark stage -> tube.

    python jobs/chained_workers.py --hosts 127.0.0.1:11300 --input-tube events
    SPARK_CONF_DIR=conf spark-submit jobs/chained_workers.py --input-tube events
    python jobs/chained_workers.py --input-tube events --trigger-interval 2   # both stages live

How stages hand off work through beanstalkd (each arrow is a tube):

    events --[stage 1: orders]--> orders --[stage 2: notify]--> notifications --> (mail workers)
               |                                                                  any beanstalkd
               +--> events.rejected (bad JSON, kept for a human)                  client

Stage 1 (``orders``) reads the click/order events, keeps the purchases, prices them
(VAT by country, net amount) and puts one job per order into ``orders``; big orders
(>= 500 EUR) get an urgent priority so the next stage's workers take them first. Jobs
that are not valid JSON events go to ``events.rejected``. Both outputs are one
``foreachBatch(beanstalk_put)`` write: the per-row ``tube`` column routes each row.

Stage 2 (``notify``) reads ``orders`` and writes an e-mail job per order into
``notifications`` with ``writeStream.format("beanstalk")`` (the writer as a streaming
sink), for plain beanstalkd workers in any language to send.

A stage's input jobs are deleted only after Spark has committed the batch, i.e. after
its output jobs were put: a crash between the two repeats the hand-off (at-least-once),
it never loses a job. By default each stage drains its tube (Trigger.AvailableNow), one
after the other; with ``--trigger-interval`` both run at once and you can watch work
flow (``spark-beanstalk top`` in another terminal).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from _common import get_session, prepare_process, say, source_counters, tube_counts, watch_queries, watch_query

VAT = {"DE": 0.19, "FR": 0.20, "NL": 0.21, "ES": 0.21, "IT": 0.22, "PL": 0.23, "SE": 0.25, "AT": 0.20,
       "BE": 0.21, "IE": 0.23}
BIG_ORDER_EUR = 500
URGENT_PRIORITY = 10
NORMAL_PRIORITY = 2**31


def orders_stage(df, orders_tube: str, rejected_tube: str):
    """Stage 1's transform: source rows -> rows for the writer (body, tube, priority, ttr)."""
    from pyspark.sql import functions as F
    from streaming_etl import parse_events

    parsed = parse_events(df)
    vat = F.create_map(*[x for code, rate in sorted(VAT.items()) for x in (F.lit(code), F.lit(rate))])
    vat_rate = F.coalesce(vat[F.col("country")], F.lit(0.2))
    order = F.to_json(F.struct(
        F.col("event_id").alias("order_id"), "user_id", "session_id", "product_id", "category", "quantity",
        F.col("amount").alias("amount_gross"), vat_rate.alias("vat_rate"),
        F.round(F.col("amount") / (1 + vat_rate), 2).alias("amount_net"), "currency", "country", "device",
        F.date_format("event_time", "yyyy-MM-dd'T'HH:mm:ss.SSSXXX").alias("placed_at"),
        F.col("job_id").alias("source_job"),
    ))
    is_order = F.col("error").isNull() & (F.col("event_type") == "purchase")
    rejected = F.col("error").isNotNull()
    return (
        parsed.where(is_order | rejected)
        .select(
            F.when(is_order, order).otherwise(F.col("raw")).alias("body"),
            F.when(is_order, F.lit(orders_tube)).otherwise(F.lit(rejected_tube)).alias("tube"),
            F.when(is_order & (F.col("amount") >= BIG_ORDER_EUR), F.lit(URGENT_PRIORITY))
            .otherwise(F.lit(NORMAL_PRIORITY)).cast("bigint").alias("priority"),
            F.lit(60).alias("ttr"),
        )
    )


def notify_stage(df):
    """Stage 2's transform: order jobs -> e-mail jobs (body JSON)."""
    from pyspark.sql import functions as F

    order = F.from_json(F.col("body").cast("string"),
                        "order_id STRING, user_id STRING, amount_gross DECIMAL(12,2), currency STRING, "
                        "country STRING, placed_at STRING")
    o = df.select(order.alias("o"), F.col("id").alias("order_job"), F.col("priority"))
    vip = F.col("o.amount_gross") >= BIG_ORDER_EUR
    return o.select(
        F.to_json(F.struct(
            F.col("o.user_id").alias("to"),
            F.when(vip, F.lit("order_confirmation_vip")).otherwise(F.lit("order_confirmation")).alias("template"),
            F.col("o.order_id").alias("order_id"),
            F.col("o.amount_gross").alias("amount"),
            F.col("o.currency").alias("currency"),
            F.col("o.placed_at").alias("placed_at"),
            F.col("order_job"),
        )).alias("body"),
        F.col("priority"),  # urgent orders stay urgent downstream
    )


class StageCounter:
    """foreachBatch wrapper that puts the stage's rows and remembers per-batch counts."""

    def __init__(self, hosts: str, orders_tube: str, rejected_tube: str) -> None:
        self.hosts = hosts
        self.orders_tube = orders_tube
        self.rejected_tube = rejected_tube
        self.batches: dict[int, dict] = {}

    def __call__(self, df, batch_id: int) -> None:
        from spark_beanstalk.writer import beanstalk_put

        out = orders_stage(df, self.orders_tube, self.rejected_tube)
        summary = beanstalk_put.options(hosts=self.hosts, tube=self.orders_tube)(out, batch_id)
        self.batches[batch_id] = {"put": summary.put, "tubes": dict(summary.tubes), "skipped": summary.skipped}

    def describe(self, progress: dict) -> str:
        b = self.batches.get(progress.get("batchId"))
        if not b:
            return ""
        if b["skipped"]:
            return "already put by an earlier attempt (replayed batch skipped)"
        parts = ", ".join(f"{n} -> {t}" for t, n in sorted(b["tubes"].items()))
        return f"put {parts or 'nothing'}"


def start_orders(spark, hosts, input_tube, orders_tube, rejected_tube, checkpoints, trigger, max_jobs):
    stage = StageCounter(hosts, orders_tube, rejected_tube)
    query = (spark.readStream.format("beanstalk").option("hosts", hosts).option("tubes", input_tube)
             .option("maxJobsPerTrigger", str(max_jobs)).load()
             .writeStream.queryName("orders").foreachBatch(stage)
             .option("checkpointLocation", os.path.join(checkpoints, "orders")).trigger(**trigger).start())
    return query, stage


def start_notify(spark, hosts, orders_tube, notify_tube, checkpoints, trigger, max_jobs):
    orders = (spark.readStream.format("beanstalk").option("hosts", hosts).option("tubes", orders_tube)
              .option("maxJobsPerTrigger", str(max_jobs)).load())
    return (notify_stage(orders).writeStream.queryName("notify").format("beanstalk")
            .option("hosts", hosts).option("tube", notify_tube)
            .option("checkpointLocation", os.path.join(checkpoints, "notify")).trigger(**trigger).start())


def _notify_describe(progress: dict) -> str:
    held = source_counters(progress)
    n = progress.get("numInputRows", 0)
    return f"{n} e-mail jobs put" + (f" (source deleted {held.get('deleted', 0)} orders so far)" if held else "")


def run(spark, hosts: str = "127.0.0.1:11300", input_tube: str = "events", orders_tube: str = "orders",
        notify_tube: str = "notifications", rejected_tube: str | None = None, checkpoints: str | None = None,
        trigger_interval: float | None = None, timeout: float | None = None, max_jobs_per_trigger: int = 1000) -> dict:
    rejected_tube = rejected_tube or f"{input_tube}.rejected"
    checkpoints = checkpoints or tempfile.mkdtemp(prefix="chained-workers-")
    tubes = [input_tube, orders_tube, notify_tube, rejected_tube]
    started = time.monotonic()
    if trigger_interval is None:
        trigger = {"availableNow": True}
        say(f"stage 1 (orders): {input_tube} -> {orders_tube} (+ {rejected_tube}), draining {input_tube}")
        q1, stage = start_orders(spark, hosts, input_tube, orders_tube, rejected_tube, checkpoints, trigger,
                                 max_jobs_per_trigger)
        p1 = watch_query(q1, stage.describe, timeout=timeout, label="orders")
        say(f"stage 2 (notify): {orders_tube} -> {notify_tube}, draining {orders_tube}")
        q2 = start_notify(spark, hosts, orders_tube, notify_tube, checkpoints, trigger, max_jobs_per_trigger)
        p2 = watch_query(q2, _notify_describe, timeout=timeout, label="notify")
    else:
        trigger = {"processingTime": f"{trigger_interval} seconds"}
        say(f"both stages running every {trigger_interval:g}s: {input_tube} -> {orders_tube} -> {notify_tube}; "
            "Ctrl-C to stop")
        q1, stage = start_orders(spark, hosts, input_tube, orders_tube, rejected_tube, checkpoints, trigger,
                                 max_jobs_per_trigger)
        q2 = start_notify(spark, hosts, orders_tube, notify_tube, checkpoints, trigger, max_jobs_per_trigger)
        p1, p2 = _watch(q1, stage, q2, timeout)
    # What each stage did, from Spark's side (a tube the broker emptied may be gone by now).
    put: dict[str, int] = dict.fromkeys(tubes, 0)
    for b in stage.batches.values():
        for tube, n in b["tubes"].items():
            put[tube] = put.get(tube, 0) + n
    put[notify_tube] = sum(p.get("numInputRows", 0) for p in p2)
    read = {input_tube: sum(p.get("numInputRows", 0) for p in p1), orders_tube: put[notify_tube]}
    after = tube_counts(hosts, tubes)
    return {
        "hosts": hosts,
        "tubes": {t: {"read": read.get(t, 0), "put": put.get(t, 0), "ready": after[t]["current-jobs-ready"],
                      "reserved": after[t]["current-jobs-reserved"], "buried": after[t]["current-jobs-buried"]}
                  for t in tubes},
        "read": read[input_tube],
        "orders": put[orders_tube],
        "rejected": put[rejected_tube],
        "notifications": put[notify_tube],
        "checkpoints": checkpoints,
        "seconds": round(time.monotonic() - started, 1),
    }


def _watch(q1, stage, q2, timeout):
    progress = watch_queries([("orders", q1, stage.describe), ("notify", q2, _notify_describe)], timeout)
    return progress.get("orders", []), progress.get("notify", [])


def print_summary(summary: dict) -> None:
    from _common import console
    from rich.table import Table

    t = Table(title=f"tubes on {summary['hosts']} after the run ({summary['seconds']}s)", title_justify="left")
    for col in ("tube", "jobs read", "jobs put", "ready now", "reserved", "buried"):
        t.add_column(col, justify="left" if col == "tube" else "right")
    for tube, s in summary["tubes"].items():
        t.add_row(tube, f"{s['read']:,}", f"{s['put']:,}", f"{s['ready']:,}", str(s["reserved"]), str(s["buried"]))
    console().print(t)
    say(f"{summary['orders']} orders and {summary['notifications']} e-mail jobs handed on, "
        f"{summary['rejected']} bad jobs set aside. Look at one: "
        f"spark-beanstalk peek --ready {list(summary['tubes'])[2]} -H {summary['hosts'].split(',')[0]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="chained_workers.py", description="Two Spark stages handing work on through beanstalk tubes.",
        epilog="example: python jobs/chained_workers.py --hosts 127.0.0.1:11300 --input-tube events")
    parser.add_argument("--hosts", default=os.environ.get("SPARK_BEANSTALK_HOST", "127.0.0.1:11300"),
                        help="broker(s), host:port[,host:port] (default $SPARK_BEANSTALK_HOST or 127.0.0.1:11300)")
    parser.add_argument("--input-tube", default="events", help="stage 1 input (default events)")
    parser.add_argument("--orders-tube", default="orders", help="stage 1 output, stage 2 input (default orders)")
    parser.add_argument("--notify-tube", default="notifications", help="stage 2 output (default notifications)")
    parser.add_argument("--rejected-tube", help="bad input jobs go here (default INPUT.rejected)")
    parser.add_argument("--checkpoints", help="checkpoint directory (default: a new temporary one)")
    parser.add_argument("--max-jobs-per-trigger", type=int, default=1000, help="jobs per micro-batch (default 1000)")
    parser.add_argument("--trigger-interval", type=float,
                        help="run both stages continuously with this processing-time trigger (seconds)")
    parser.add_argument("--timeout", type=float, help="stop after this many seconds")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    prepare_process()
    args = parse_args(argv)
    spark = get_session("spark-beanstalk-chained-workers", **{"spark.sql.session.timeZone": "UTC"})
    try:
        summary = run(spark, hosts=args.hosts, input_tube=args.input_tube, orders_tube=args.orders_tube,
                      notify_tube=args.notify_tube, rejected_tube=args.rejected_tube, checkpoints=args.checkpoints,
                      trigger_interval=args.trigger_interval, timeout=args.timeout,
                      max_jobs_per_trigger=args.max_jobs_per_trigger)
    finally:
        spark.stop()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
