"""The flagship demo: a broker, the sample data, the streaming ETL, and what came out.

    python jobs/demo.py                  # everything below, in about a minute
    SPARK_CONF_DIR=conf spark-submit jobs/demo.py

1. starts an embedded spark-beanstalk broker on a free port (``python -m broker``);
2. enqueues the sample dataset (jobs/data/events.jsonl: 3,000 e-commerce events and a
   dozen malformed lines) into the tube ``events`` with the Spark writer;
3. runs the streaming ETL (jobs/streaming_etl.py) with Trigger.AvailableNow until the
   tube is drained: valid events to Parquet, bad ones to a dead-letter path and tube,
   5-minute event-time windows with a 10-minute watermark to Parquet;
4. prints where the output is and a summary of what it contains, then stops the broker.

``--hosts HOST:PORT`` uses a broker you run yourself instead of starting one;
``--broker beanstalkd`` starts the real beanstalkd instead of ours.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import _common
from _common import get_session, prepare_process, say

DEMO_TUBE = "events"
DEAD_LETTER_TUBE = "events.dead"


def start_broker(kind: str):
    """An embedded server on a free port: ours, or beanstalkd (kind 'auto': ours, else beanstalkd)."""
    from spark_beanstalk.embedded import beanstalkd_process, broker_process

    if kind in ("ours", "auto"):
        try:
            return broker_process().start(timeout=20), "spark-beanstalk broker"
        except Exception as exc:  # noqa: BLE001
            if kind == "ours":
                raise SystemExit(f"could not start the spark-beanstalk broker: {exc}") from exc
            say(f"note: the spark-beanstalk broker did not start ({exc}); using beanstalkd instead")
    return beanstalkd_process().start(), "beanstalkd"


def ensure_sample_data(path: str) -> None:
    if os.path.exists(path):
        return
    import make_sample_data

    make_sample_data.main(["--out", path])


def run(spark, hosts: str, out: str, data: str = _common.SAMPLE_DATA, max_jobs_per_trigger: int = 1000,
        timeout: float | None = 600) -> dict:
    """Steps 2-4 against a running broker; returns the ETL summary plus the enqueue summary."""
    import enqueue
    import streaming_etl

    _common.clear_dir(out, must_contain=("_checkpoints", "events", "windows", "dead_letter"))
    say(f"\n== 1/3 enqueue {_common.shown_path(data)} into tube {DEMO_TUBE!r} on {hosts}")
    put = enqueue.run(spark, data, hosts=hosts, tube=DEMO_TUBE, progress=sys.stdout.isatty())
    enqueue.print_summary(put)
    say(f"\n== 2/3 streaming ETL: drain {DEMO_TUBE!r} (Trigger.AvailableNow) -> {out}")
    summary = streaming_etl.run(spark, out, hosts=hosts, tube=DEMO_TUBE, max_jobs_per_trigger=max_jobs_per_trigger,
                                dead_letter_tube=DEAD_LETTER_TUBE, timeout=timeout)
    summary["enqueued"] = put
    say(f"\n== 3/3 what came out ({summary['seconds']}s of streaming, {summary['ingest_batches']} micro-batches)")
    streaming_etl.summarize(spark, summary)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="demo.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/demo", help="output directory, replaced on each run (default out/demo)")
    parser.add_argument("--hosts", help="use this running broker (host:port) instead of starting one")
    parser.add_argument("--broker", choices=["auto", "ours", "beanstalkd"], default="auto",
                        help="which server to start (default auto: ours, beanstalkd if ours cannot start)")
    parser.add_argument("--data", default=_common.SAMPLE_DATA, help="dataset to enqueue (default the sample data)")
    parser.add_argument("--max-jobs-per-trigger", type=int, default=1000, help="jobs per micro-batch (default 1000)")
    parser.add_argument("--json", action="store_true", help="also print the run summary as JSON at the end")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    prepare_process()
    args = parse_args(argv)
    started = time.monotonic()
    ensure_sample_data(args.data)
    server = None
    if args.hosts:
        hosts, what = args.hosts, "your broker"
    else:
        server, what = start_broker(args.broker)
        hosts = server.address
    say(f"spark-beanstalk demo: {what} on {hosts} (pid {server.pid if server else '-'})")
    spark = None
    try:
        say("starting Spark (local[2]) ...")
        spark = get_session("spark-beanstalk-demo", **{"spark.sql.session.timeZone": "UTC"})
        summary = run(spark, hosts, os.path.abspath(args.out), args.data, args.max_jobs_per_trigger)
    finally:
        if spark is not None:
            spark.stop()
        if server is not None:
            server.stop()
    out = summary["out"]
    say(f"\ndone in {time.monotonic() - started:.0f}s. Output in {out}:")
    say(f"  events/       {summary['events']:,} valid events, Parquet, partitioned by ingest_batch")
    say("  windows/      5-minute windows closed by the watermark, Parquet")
    say(f"  dead_letter/  {summary['dead_letters']} bad jobs with their raw body and the reason, JSON lines")
    say("Read them with: python -c \"import pandas as pd; "
        f"print(pd.read_parquet('{_common.shown_path(out)}/windows').sort_values('window_start'))\"")
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
