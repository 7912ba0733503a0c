"""Enqueue a dataset: put every row of a file into a beanstalk tube through the writer.

    python jobs/enqueue.py --hosts 127.0.0.1:11300 --tube events jobs/data/events.jsonl
    SPARK_CONF_DIR=conf spark-submit jobs/enqueue.py --tube events jobs/data/events.jsonl
    python jobs/enqueue.py --tube orders --format csv --key-column user_id orders.csv

Formats: JSON lines (``.jsonl``/``.json``/``.ndjson``), CSV (with a header) and Parquet,
picked from the file name unless --format says. A JSON-lines line is put as is (its
exact text is the job body, so a malformed line reaches the consumer unchanged to be
dead-lettered there); a CSV or Parquet row is put as a JSON object of its columns
(the writer's rule for a DataFrame without a ``body`` column). Rows are put from the
Spark executors, pipelined, one connection per partition and broker.

A progress bar follows the tube's job count on the brokers while the write runs; a
summary (rows put, per tube, per broker, rate) follows. ``--json`` prints the summary as
JSON on stdout instead.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import _common
from _common import get_session, prepare_process

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet",
           ".txt": "text"}


def detect_format(path: str) -> str:
    ext = os.path.splitext(path.rstrip("/"))[1].lower()
    if os.path.isdir(path) and not ext:
        return "parquet"
    if ext not in FORMATS:
        raise SystemExit(f"cannot tell the format of {path!r} from its name; pass --format jsonl|csv|parquet|text")
    return FORMATS[ext]


def load(spark, path: str, fmt: str, body_column: str | None = None):
    """The dataset as a DataFrame ready for the writer (a `body` column, or columns for JSON)."""
    if not os.path.exists(path):
        raise SystemExit(f"no such file: {path}")
    if fmt in ("jsonl", "text"):
        df = spark.read.text(path).withColumnRenamed("value", "body")
        return df.where("length(trim(body)) > 0")
    if fmt == "csv":
        df = spark.read.option("header", True).option("inferSchema", True).csv(path)
    elif fmt == "parquet":
        df = spark.read.parquet(path)
    else:
        raise SystemExit(f"unknown format {fmt!r}")
    if body_column:
        if body_column not in df.columns:
            raise SystemExit(f"--body-column {body_column!r}: no such column; columns are {', '.join(df.columns)}")
        df = df.withColumnRenamed(body_column, "body")
    return df


class TubeProgress:
    """A rich progress bar fed by the brokers' own count of jobs put into the tube."""

    def __init__(self, hosts: str, tube: str, total: int, enabled: bool = True, interval: float = 0.2) -> None:
        self.hosts = hosts
        self.tube = tube
        self.total = total
        self.enabled = enabled
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.baseline = self._count()

    def _count(self) -> int:
        from _common import tube_counts

        try:
            return tube_counts(self.hosts, [self.tube])[self.tube]["total-jobs"]
        except Exception:
            return 0

    def __enter__(self) -> TubeProgress:
        if not self.enabled:
            return self
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("[bold]put[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(), transient=False)
        self._task = self._progress.add_task(f"-> {self.tube}", total=self.total)
        self._progress.start()
        self._thread = threading.Thread(target=self._loop, name="enqueue-progress", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._progress.update(self._task, completed=min(self.total, self._count() - self.baseline))

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._progress.update(self._task, completed=min(self.total, self._count() - self.baseline))
        self._progress.stop()


def run(spark, path: str, hosts: str = "127.0.0.1:11300", tube: str = "default", fmt: str | None = None,
        body_column: str | None = None, priority: int | None = None, delay: int | None = None,
        ttr: int | None = None, key_column: str | None = None, partitions: int | None = None,
        dead_letter_path: str | None = None, progress: bool = True, limit: int | None = None) -> dict:
    """Put every row of `path` into `tube`; returns the summary dict."""
    from spark_beanstalk.writer import beanstalk_put

    fmt = fmt or detect_format(path)
    df = load(spark, path, fmt, body_column)
    if limit:
        df = df.limit(limit)
    if partitions:
        df = df.repartition(partitions)
    df = df.cache()
    rows = df.count()
    options = {"hosts": hosts, "tube": tube}
    for key, value in (("priority", priority), ("delay", delay), ("ttr", ttr), ("keyColumn", key_column),
                       ("deadLetterPath", dead_letter_path)):
        if value is not None:
            options[key] = value
    writer = beanstalk_put.options(**options)
    started = time.monotonic()
    try:
        with TubeProgress(hosts, tube, rows, enabled=progress and rows > 0):
            result = writer.write(df)
    finally:
        df.unpersist()
    elapsed = time.monotonic() - started
    return {
        "input": os.path.abspath(path),
        "format": fmt,
        "rows": rows,
        "put": result.put,
        "buried": result.buried,
        "dead_lettered": result.dead_lettered,
        "dead_letter_files": result.dead_letter_files,
        "partitions": result.partitions,
        "tubes": result.tubes,
        "hosts": result.hosts,
        "seconds": round(elapsed, 3),
        "rows_per_second": round(result.put / elapsed, 1) if elapsed > 0 else None,
    }


def print_summary(summary: dict) -> None:
    from _common import console
    from rich.table import Table

    table = Table(title=f"enqueued {summary['input']}", title_justify="left", show_header=False)
    table.add_column(style="cyan")
    table.add_column()
    table.add_row("rows read", f"{summary['rows']:,} ({summary['format']})")
    table.add_row("jobs put", f"{summary['put']:,} in {summary['seconds']:.2f}s "
                              f"({summary['rows_per_second'] or 0:,.0f} jobs/s, {summary['partitions']} partitions)")
    for tube, n in sorted(summary["tubes"].items()):
        table.add_row("  into tube", f"{tube}: {n:,}")
    for host, n in sorted(summary["hosts"].items()):
        table.add_row("  on broker", f"{host}: {n:,}")
    if summary["buried"]:
        table.add_row("buried by the server", f"{summary['buried']:,} (out of memory)")
    if summary["dead_lettered"]:
        table.add_row("dead-lettered", f"{summary['dead_lettered']:,} -> {', '.join(summary['dead_letter_files'])}")
    console().print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="enqueue.py", description="Put every row of a dataset file into a beanstalk tube.",
        epilog="example: python jobs/enqueue.py --hosts 127.0.0.1:11300 --tube events jobs/data/events.jsonl")
    parser.add_argument("path", nargs="?", default=_common.SAMPLE_DATA,
                        help="dataset file (default: the sample data, jobs/data/events.jsonl)")
    parser.add_argument("--hosts", default=os.environ.get("SPARK_BEANSTALK_HOST", "127.0.0.1:11300"),
                        help="broker(s), host:port[,host:port] (default $SPARK_BEANSTALK_HOST or 127.0.0.1:11300)")
    parser.add_argument("--tube", default="events", help="tube to put into (default events)")
    parser.add_argument("--format", dest="fmt", choices=["jsonl", "csv", "parquet", "text"],
                        help="input format (default: from the file name)")
    parser.add_argument("--body-column", help="CSV/Parquet: put this column as the body instead of the row as JSON")
    parser.add_argument("--priority", type=int, help="job priority (default 2**31; 0 is most urgent)")
    parser.add_argument("--delay", type=int, help="seconds before the jobs become ready (default 0)")
    parser.add_argument("--ttr", type=int, help="time-to-run of the jobs in seconds (default 120)")
    parser.add_argument("--key-column", help="with several brokers: spread rows by this column's hash")
    parser.add_argument("--partitions", type=int, help="repartition the input first (default: as read)")
    parser.add_argument("--dead-letter-path", help="rows the server refuses go to JSON files here instead of failing")
    parser.add_argument("--limit", type=int, help="put only the first N rows")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    prepare_process()
    args = parse_args(argv)
    if not os.path.exists(args.path):
        raise SystemExit(f"no such file: {args.path}")
    fmt = args.fmt or detect_format(args.path)
    spark = get_session("spark-beanstalk-enqueue")
    try:
        summary = run(spark, args.path, hosts=args.hosts, tube=args.tube, fmt=fmt, body_column=args.body_column,
                      priority=args.priority, delay=args.delay, ttr=args.ttr, key_column=args.key_column,
                      partitions=args.partitions, dead_letter_path=args.dead_letter_path,
                      progress=not args.no_progress and not args.json, limit=args.limit)
    finally:
        spark.stop()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
