"""Streaming ETL: JSON events from a beanstalk tube -> validated Parquet + event-time windows.

    python jobs/streaming_etl.py --hosts 127.0.0.1:11300 --tube events --out out/etl
    SPARK_CONF_DIR=conf spark-submit jobs/streaming_etl.py --tube events --out out/etl
    python jobs/streaming_etl.py --tube events --out out/etl --trigger-interval 5   # keep running

Two streaming queries, in the medallion style:

1. ``ingest`` reads jobs with ``spark.readStream.format("beanstalk")``, parses each body
   against the event schema and, per micro-batch (foreachBatch):
   - valid events -> ``OUT/events/`` (Parquet, partitioned by ``ingest_batch``; a batch
     Spark replays overwrites its own partition, so the table holds each job once);
   - everything else -> ``OUT/dead_letter/`` (JSON lines: job id, tube, broker, the reason
     and the raw body), and with ``--dead-letter-tube`` also back into that tube, so a
     bad job is never lost. The source deletes the jobs of a batch only after Spark has
     committed it, i.e. after both writes succeeded.
2. ``windows`` reads ``OUT/events/`` as a stream, applies a watermark on ``event_time``
   (default 10 minutes) and counts events, purchases, refunds, revenue and users per
   tumbling event-time window (default 5 minutes), appending each window to
   ``OUT/windows/`` (Parquet) once the watermark has passed its end. Windows newer than
   the watermark are still open when the job stops: they are written by a later run,
   when later events move the watermark past them (state is kept in the checkpoint).

By default both run with Trigger.AvailableNow: the tube is read until what was in it
when the job started is drained, then the windows query catches up, and the job exits.
With ``--trigger-interval SECONDS`` both run continuously until Ctrl-C (or --timeout).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _common import get_session, prepare_process, say, source_counters, tube_counts, watch_queries, watch_query

EVENT_TYPES = ("page_view", "add_to_cart", "remove_from_cart", "purchase", "refund")
MONEY_EVENTS = ("add_to_cart", "remove_from_cart", "purchase", "refund")
TIMESTAMP_FORMAT = "yyyy-MM-dd'T'HH:mm:ss[.SSS]XXX"

# Every field is read as a string first, then converted with try_* functions, so a bad
# value names its field in the dead letter instead of nulling the whole record.
RAW_SCHEMA = ("event_id STRING, event_time STRING, user_id STRING, session_id STRING, event_type STRING, "
              "product_id STRING, category STRING, quantity STRING, amount STRING, currency STRING, "
              "country STRING, device STRING, _corrupt STRING")

EVENTS_DDL = ("event_id STRING, event_time TIMESTAMP, user_id STRING, session_id STRING, event_type STRING, "
              "product_id STRING, category STRING, quantity INT, amount DECIMAL(12,2), currency STRING, "
              "country STRING, device STRING, job_id BIGINT, broker STRING, ingest_batch BIGINT")

DEAD_LETTER_COLUMNS = ("job_id", "tube", "broker", "reserves", "error", "body", "ingest_batch")


def parse_events(df):
    """Beanstalk source rows -> one row per job with typed event columns and `error` (null when valid)."""
    from pyspark.sql import functions as F

    raw = F.col("raw")
    e = F.from_json(raw, RAW_SCHEMA, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt"})
    parsed = df.select(
        F.col("id").alias("job_id"), "tube", "broker", "reserves",
        F.col("body").cast("string").alias("raw"),
    ).withColumn("e", e)
    f = {name: F.col(f"e.{name}") for name in ("event_id", "event_time", "user_id", "session_id", "event_type",
                                                "product_id", "category", "quantity", "amount", "currency",
                                                "country", "device", "_corrupt")}
    event_time = F.try_to_timestamp(f["event_time"], F.lit(TIMESTAMP_FORMAT))
    amount = F.expr("try_cast(e.amount AS DECIMAL(12,2))")
    quantity = F.expr("try_cast(e.quantity AS INT)")
    short = lambda c: F.substring(c, 1, 60)  # noqa: E731
    error = (
        F.when(F.col("e").isNull() | f["_corrupt"].isNotNull(), F.lit("malformed JSON (not a JSON object)"))
        .when(f["event_id"].isNull(), F.lit("missing event_id"))
        .when(f["event_time"].isNull(), F.lit("missing event_time"))
        .when(f["user_id"].isNull(), F.lit("missing user_id"))
        .when(f["event_type"].isNull(), F.lit("missing event_type"))
        .when(event_time.isNull(), F.concat(F.lit("bad event_time: "), short(f["event_time"])))
        .when(~f["event_type"].isin(*EVENT_TYPES), F.concat(F.lit("unknown event_type: "), short(f["event_type"])))
        .when(f["amount"].isNotNull() & amount.isNull(), F.concat(F.lit("bad amount: "), short(f["amount"])))
        .when(f["quantity"].isNotNull() & quantity.isNull(), F.concat(F.lit("bad quantity: "), short(f["quantity"])))
        .when(f["event_type"].isin(*MONEY_EVENTS) & amount.isNull(), F.lit("missing amount"))
    )
    return parsed.select(
        "job_id", "tube", "broker", "reserves", "raw",
        f["event_id"].alias("event_id"), event_time.alias("event_time"), f["user_id"].alias("user_id"),
        f["session_id"].alias("session_id"), f["event_type"].alias("event_type"),
        f["product_id"].alias("product_id"), f["category"].alias("category"), quantity.alias("quantity"),
        amount.alias("amount"), f["currency"].alias("currency"), f["country"].alias("country"),
        f["device"].alias("device"), error.alias("error"),
    )


class IngestBatch:
    """The foreachBatch function of the ingest query: split each micro-batch into events and dead letters."""

    def __init__(self, out: str, hosts: str, dead_letter_tube: str | None = None) -> None:
        self.events_dir = os.path.join(out, "events")
        self.dead_dir = os.path.join(out, "dead_letter")
        self.hosts = hosts
        self.dead_letter_tube = dead_letter_tube
        self.batches: dict[int, dict] = {}

    def __call__(self, df, batch_id: int) -> None:
        from pyspark.sql import functions as F

        parsed = parse_events(df).withColumn("ingest_batch", F.lit(batch_id).cast("bigint")).persist()
        try:
            counts = {bool(r["ok"]): r["n"] for r in
                      parsed.groupBy(F.col("error").isNull().alias("ok")).agg(F.count("*").alias("n")).collect()}
            good_n, bad_n = counts.get(True, 0), counts.get(False, 0)
            # Overwrite only this batch's partition: a batch Spark runs again replaces its own output.
            events = parsed.where(F.col("error").isNull()).select(*[c.split()[0] for c in EVENTS_DDL.split(", ")])
            (events.write.mode("overwrite").option("partitionOverwriteMode", "dynamic")
             .partitionBy("ingest_batch").parquet(self.events_dir))
            if bad_n:
                dead = parsed.where(F.col("error").isNotNull()).select(
                    "job_id", "tube", "broker", "reserves", "error", F.col("raw").alias("body"), "ingest_batch")
                (dead.write.mode("overwrite").option("partitionOverwriteMode", "dynamic")
                 .partitionBy("ingest_batch").json(self.dead_dir))
                if self.dead_letter_tube:
                    from spark_beanstalk.writer import beanstalk_put

                    writer = beanstalk_put.options(hosts=self.hosts, tube=self.dead_letter_tube)
                    writer(dead.select(F.col("body")), batch_id)
            self.batches[batch_id] = {"events": good_n, "dead_letters": bad_n}
        finally:
            parsed.unpersist()

    def describe(self, progress: dict) -> str:
        counts = self.batches.get(progress.get("batchId"))
        text = ""
        if counts:
            text = f"{counts['events']} events, {counts['dead_letters']} dead letters"
        held = source_counters(progress)
        if held:
            text += f" (source: reserved {held.get('reserved', 0)}, deleted {held.get('deleted', 0)})"
        return text


def window_aggregates(events, window: str, watermark: str):
    """Per event-time window: counts by type, revenue (purchases minus refunds), distinct users."""
    from pyspark.sql import functions as F

    def count_of(kind: str):
        return F.sum(F.when(F.col("event_type") == kind, 1).otherwise(0)).cast("bigint")

    revenue = F.sum(F.when(F.col("event_type").isin("purchase", "refund"), F.col("amount"))
                    .otherwise(F.lit(0).cast("decimal(12,2)")))
    return (
        events.withWatermark("event_time", watermark)
        .groupBy(F.window("event_time", window))
        .agg(
            F.count("*").alias("events"),
            count_of("page_view").alias("page_views"),
            count_of("add_to_cart").alias("add_to_cart"),
            count_of("purchase").alias("purchases"),
            count_of("refund").alias("refunds"),
            revenue.cast("decimal(14,2)").alias("revenue"),
            F.approx_count_distinct("user_id").alias("users"),
        )
        .select(F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                "events", "page_views", "add_to_cart", "purchases", "refunds", "revenue", "users")
    )


def start_ingest(spark, out: str, hosts: str, tube: str, max_jobs_per_trigger: int, num_partitions: int,
                 trigger: dict, dead_letter_tube: str | None, source_options: dict | None = None):
    ingest = IngestBatch(out, hosts, dead_letter_tube)
    reader = (spark.readStream.format("beanstalk").option("hosts", hosts).option("tubes", tube)
              .option("maxJobsPerTrigger", str(max_jobs_per_trigger)).option("numPartitions", str(num_partitions)))
    for key, value in (source_options or {}).items():
        reader = reader.option(key, str(value))
    query = (reader.load().writeStream.queryName("ingest").foreachBatch(ingest)
             .option("checkpointLocation", os.path.join(out, "_checkpoints", "ingest"))
             .trigger(**trigger).start())
    return query, ingest


def start_windows(spark, out: str, window: str, watermark: str, trigger: dict):
    events_dir = os.path.join(out, "events")
    os.makedirs(events_dir, exist_ok=True)
    events = spark.readStream.schema(EVENTS_DDL).parquet(events_dir)
    return (window_aggregates(events, window, watermark).writeStream.queryName("windows")
            .format("parquet").outputMode("append")
            .option("path", os.path.join(out, "windows"))
            .option("checkpointLocation", os.path.join(out, "_checkpoints", "windows"))
            .trigger(**trigger).start())


def _windows_describe(progress: dict) -> str:
    ops = progress.get("stateOperators") or []
    if not ops:
        return ""
    state = ops[0]
    return f"{state.get('numRowsTotal', 0)} windows open in state, {progress.get('numInputRows', 0)} events in"


def run(spark, out: str, hosts: str = "127.0.0.1:11300", tube: str = "events", window: str = "5 minutes",
        watermark: str = "10 minutes", max_jobs_per_trigger: int = 1000, num_partitions: int = 2,
        trigger_interval: float | None = None, timeout: float | None = None,
        dead_letter_tube: str | None = None, source_options: dict | None = None) -> dict:
    """Run the ETL; with trigger_interval None, until the tube is drained. Returns a summary dict."""
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    if trigger_interval is None:
        trigger = {"availableNow": True}
        say(f"ingest: draining tube {tube!r} on {hosts} (Trigger.AvailableNow, "
            f"at most {max_jobs_per_trigger} jobs per micro-batch)")
        query, ingest = start_ingest(spark, out, hosts, tube, max_jobs_per_trigger, num_partitions, trigger,
                                     dead_letter_tube, source_options)
        ingest_progress = watch_query(query, ingest.describe, timeout=timeout, label="ingest")
        say(f"windows: {window} windows, watermark {watermark}, over {os.path.join(out, 'events')}")
        wquery = start_windows(spark, out, window, watermark, trigger)
        windows_progress = watch_query(wquery, _windows_describe, timeout=timeout, label="windows")
    else:
        trigger = {"processingTime": f"{trigger_interval} seconds"}
        say(f"running continuously (every {trigger_interval:g}s); Ctrl-C to stop")
        query, ingest = start_ingest(spark, out, hosts, tube, max_jobs_per_trigger, num_partitions, trigger,
                                     dead_letter_tube, source_options)
        wquery = start_windows(spark, out, window, watermark, trigger)
        ingest_progress, windows_progress = _watch_both(query, ingest, wquery, timeout)
    left = tube_counts(hosts, [tube])[tube]
    windows_dir = os.path.join(out, "windows")
    watermark_at = None
    for p in reversed(windows_progress):
        wm = (p.get("eventTime") or {}).get("watermark")
        if wm:
            watermark_at = wm
            break
    return {
        "out": out,
        "events_dir": os.path.join(out, "events"),
        "windows_dir": windows_dir,
        "dead_letter_dir": os.path.join(out, "dead_letter"),
        "ingest_batches": len([b for b in ingest.batches]),
        "events": sum(b["events"] for b in ingest.batches.values()),
        "dead_letters": sum(b["dead_letters"] for b in ingest.batches.values()),
        "windows_batches": len(windows_progress),
        "watermark": watermark_at,
        "tube_left": {"ready": left["current-jobs-ready"], "reserved": left["current-jobs-reserved"],
                      "delayed": left["current-jobs-delayed"], "buried": left["current-jobs-buried"]},
        "seconds": round(time.monotonic() - started, 1),
        "last_source_counters": source_counters(ingest_progress[-1]) if ingest_progress else {},
    }


def _watch_both(query, ingest, wquery, timeout: float | None):
    """Continuous mode: print both queries' batches until Ctrl-C, --timeout, or one fails."""
    results = watch_queries([("ingest", query, ingest.describe), ("windows", wquery, _windows_describe)], timeout)
    return results.get("ingest", []), results.get("windows", [])


def summarize(spark, summary: dict, top: int = 8) -> None:
    """Print what the output holds: events by type, revenue, windows, dead letters."""
    from _common import console as make_console
    from pyspark.sql import functions as F
    from rich.table import Table

    console = make_console()
    events = spark.read.schema(EVENTS_DDL).parquet(summary["events_dir"])
    by_type = {r["event_type"]: (r["n"], r["amount"]) for r in
               events.groupBy("event_type").agg(F.count("*").alias("n"), F.sum("amount").alias("amount")).collect()}
    total = sum(n for n, _ in by_type.values())
    console.print(f"[bold]events[/]: {total:,} valid events  [dim]Parquet: {summary['events_dir']}[/]")
    t = Table()
    t.add_column("event_type", style="cyan")
    t.add_column("events", justify="right")
    t.add_column("amount EUR", justify="right")
    for kind in EVENT_TYPES:
        n, amount = by_type.get(kind, (0, None))
        t.add_row(kind, f"{n:,}", f"{amount:,.2f}" if amount is not None else "")
    console.print(t)

    if os.path.isdir(summary["windows_dir"]):
        windows = spark.read.parquet(summary["windows_dir"]).orderBy("window_start")
        rows = windows.collect()
    else:
        rows = []
    console.print(f"[bold]windows[/]: {len(rows)} closed event-time windows, watermark "
                  f"{summary.get('watermark') or '-'}  [dim]Parquet: {summary['windows_dir']}[/]")
    t = Table()
    for col in ("window", "events", "views", "carts", "purchases", "refunds", "revenue EUR", "users"):
        t.add_column(col, justify="left" if col == "window" else "right", no_wrap=True)
    shown = rows if len(rows) <= top else rows[: top // 2] + [None] + rows[-top // 2:]
    for r in shown:
        if r is None:
            t.add_row("...", *[""] * 7)
            continue
        t.add_row(f"{r['window_start']:%H:%M}-{r['window_end']:%H:%M}", str(r["events"]), str(r["page_views"]),
                  str(r["add_to_cart"]), str(r["purchases"]), str(r["refunds"]), f"{r['revenue']:,.2f}",
                  str(r["users"]))
    console.print(t)
    if rows:
        last_end = max(r["window_end"] for r in rows)
        max_time = events.agg(F.max("event_time")).first()[0]
        if max_time is not None and max_time >= last_end:
            console.print(f"[dim]windows after {last_end:%H:%M} are still open: the watermark "
                          f"(latest event {max_time:%H:%M:%S} minus the delay) has not passed their end; "
                          "they are written when later events arrive.[/]")

    if os.path.isdir(summary["dead_letter_dir"]):
        dead = spark.read.json(summary["dead_letter_dir"])
        reasons = dead.groupBy(F.regexp_extract("error", r"^[^:(]*", 0).alias("reason")).count().orderBy(
            F.desc("count"), "reason").collect()
        console.print(f"[bold]dead letters[/]: {dead.count()} jobs kept with their raw body  "
                      f"[dim]JSON lines: {summary['dead_letter_dir']}[/]")
        t = Table()
        t.add_column("reason", style="yellow")
        t.add_column("jobs", justify="right")
        for r in reasons:
            t.add_row(r["reason"].strip(), str(r["count"]))
        console.print(t)
    left = summary["tube_left"]
    console.print(f"tube left on the broker: ready {left['ready']}, reserved {left['reserved']}, "
                  f"delayed {left['delayed']}, buried {left['buried']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="streaming_etl.py", description="Stream JSON events from a beanstalk tube into Parquet, "
                                             "with dead letters and event-time windows.",
        epilog="example: python jobs/streaming_etl.py --hosts 127.0.0.1:11300 --tube events --out out/etl")
    parser.add_argument("--hosts", default=os.environ.get("SPARK_BEANSTALK_HOST", "127.0.0.1:11300"),
                        help="broker(s), host:port[,host:port] (default $SPARK_BEANSTALK_HOST or 127.0.0.1:11300)")
    parser.add_argument("--tube", default="events", help="tube to read (default events)")
    parser.add_argument("--out", default="out/etl", help="output directory (default out/etl)")
    parser.add_argument("--window", default="5 minutes", help="event-time window length (default '5 minutes')")
    parser.add_argument("--watermark", default="10 minutes", help="allowed lateness (default '10 minutes')")
    parser.add_argument("--max-jobs-per-trigger", type=int, default=1000,
                        help="jobs per micro-batch at most (default 1000)")
    parser.add_argument("--num-partitions", type=int, default=2, help="source partitions per broker (default 2)")
    parser.add_argument("--dead-letter-tube", help="also put bad jobs' bodies into this tube")
    parser.add_argument("--trigger-interval", type=float,
                        help="run continuously with this processing-time trigger (seconds) instead of draining")
    parser.add_argument("--timeout", type=float, help="stop after this many seconds")
    parser.add_argument("--json", action="store_true", help="print the run summary as JSON instead of tables")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    prepare_process()
    args = parse_args(argv)
    spark = get_session("spark-beanstalk-streaming-etl", **{"spark.sql.session.timeZone": "UTC"})
    try:
        summary = run(spark, args.out, hosts=args.hosts, tube=args.tube, window=args.window,
                      watermark=args.watermark, max_jobs_per_trigger=args.max_jobs_per_trigger,
                      num_partitions=args.num_partitions, trigger_interval=args.trigger_interval,
                      timeout=args.timeout, dead_letter_tube=args.dead_letter_tube)
        if args.json:
            print(json.dumps(summary, indent=2, default=str))
        else:
            say(f"done in {summary['seconds']}s: {summary['events']:,} events, {summary['dead_letters']} dead letters "
                f"in {summary['ingest_batches']} micro-batches -> {summary['out']}")
            summarize(spark, summary)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
