"""Shared plumbing of the jobs in jobs/: a SparkSession, progress printing, small helpers.

Each job is runnable as ``python jobs/X.py ...`` and ``spark-submit jobs/X.py ...``; both
put this directory first on ``sys.path``, so ``import _common`` works. Each job's ``main``
calls :func:`prepare_process` first; importing this module changes nothing. Each job's
logic is a ``run(spark, ...)`` function, so the tests can call it with their one shared session.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.query import StreamingQuery
    from rich.console import Console

Progress = dict[str, Any]  # one StreamingQueryProgress as a dict

JOBS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(JOBS_DIR)
CONF_DIR = os.path.join(REPO_ROOT, "conf")
SAMPLE_DATA = os.path.join(JOBS_DIR, "data", "events.jsonl")

_PANDAS_WARNING = "PySpark does not yet fully support pandas"


def prepare_process() -> None:
    """Set up this Python process to run a job; each job's main calls it first.

    Puts the repository on ``sys.path`` (a checkout that is not pip-installed), and hides
    the warning pyspark 4.3 gives on every pandas/Arrow call under pandas 3 ("not yet fully
    supported"; the jobs use pandas only through Arrow batches, where it works): in this
    driver, and through PYTHONWARNINGS in the Python workers Spark starts. Explicit, not at
    import, so that importing this module (as the tests do) changes no process state.
    """
    if REPO_ROOT not in sys.path:
        sys.path.insert(1, REPO_ROOT)
    warnings.filterwarnings("ignore", message=_PANDAS_WARNING, category=FutureWarning)
    os.environ.setdefault("PYTHONWARNINGS", f"ignore:{_PANDAS_WARNING}:FutureWarning")


def under_spark_submit() -> bool:
    """True when spark-submit started this Python driver (the JVM is already up)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def get_session(app_name: str, master: str | None = None, **conf: str) -> SparkSession:
    """The job's SparkSession.

    With ``python jobs/X.py`` Spark is started here: local[2] (or ``master``), with
    SPARK_CONF_DIR pointing at conf/ (spark-defaults.conf, log4j2.properties) unless it
    is set already. Under spark-submit the session spark-submit configured is used as is
    (its --master and --conf win).
    """
    from spark_beanstalk.session import ensure_worker_python, get_spark

    ensure_worker_python()
    if under_spark_submit():
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.appName(app_name)
        for key, value in conf.items():
            builder = builder.config(key.replace("__", "."), value)
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
        return _register(spark)
    if os.path.isdir(CONF_DIR):
        os.environ.setdefault("SPARK_CONF_DIR", CONF_DIR)
    # Spark's Python workers import spark_beanstalk too: let them find this checkout even
    # when the package is not pip-installed (they inherit the environment, not sys.path).
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, *paths])
    conf.setdefault("spark.ui.showConsoleProgress", "false")
    return _register(get_spark(app_name, master=master or "local[2]", **conf))


def _register(spark: SparkSession) -> SparkSession:
    """Register the "beanstalk" format only where pyspark cannot find it by itself.

    pyspark registers the ``DefaultSource`` of every ``pyspark_*`` module on the Python
    path (here: pyspark_beanstalk) when a session starts; registering it again makes
    Spark log "replaced a statically registered data source" before every query. So
    register explicitly only when that module is not importable (e.g. a stale install).
    """
    import importlib.util

    if importlib.util.find_spec("pyspark_beanstalk") is None:
        from spark_beanstalk.datasource import register

        register(spark)
    return spark


def say(message: str = "") -> None:
    print(message, flush=True)


def shown_path(path: str) -> str:
    """`path` relative to the current directory when it is inside it, else absolute."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def fmt_duration(ms: float | int | None) -> str:
    if ms is None:
        return "-"
    return f"{ms / 1000:.2f}s" if ms >= 1000 else f"{int(ms)}ms"


def watch_query(query: StreamingQuery, describe: Callable[[Progress], str] | None = None, poll: float = 0.25,
                timeout: float | None = None, label: str | None = None) -> list[Progress]:
    """Print one line per finished micro-batch until the query ends; return all progress dicts.

    Raises the query's exception if it failed, TimeoutError if `timeout` passes first
    (the query is stopped then).
    """
    label = label or query.name or "query"
    seen = -1
    progress: list[Progress] = []
    deadline = None if timeout is None else time.monotonic() + timeout

    def drain() -> None:
        nonlocal seen
        for item in query.recentProgress:
            p: Progress = item if isinstance(item, dict) else item.jsonValue()
            if p.get("batchId", -1) <= seen:
                continue
            seen = p["batchId"]
            progress.append(p)
            line = f"[{label}] batch {p['batchId']}: {p.get('numInputRows', 0)} rows"
            duration = (p.get("durationMs") or {}).get("triggerExecution")
            if duration is not None:
                line += f" in {fmt_duration(duration)}"
            rate = p.get("processedRowsPerSecond")
            if rate:
                line += f" ({rate:,.0f} rows/s)"
            watermark = (p.get("eventTime") or {}).get("watermark")
            if watermark and not watermark.startswith("1970-01-01"):
                line += f", watermark {watermark}"
            if describe is not None:
                extra = describe(p)
                if extra:
                    line += f"; {extra}"
            say(line)

    while query.isActive:
        query.awaitTermination(poll)  # type: ignore[arg-type]  # typed int, takes float seconds
        drain()
        if deadline is not None and time.monotonic() > deadline and query.isActive:
            query.stop()
            drain()
            raise TimeoutError(f"{label} did not finish within {timeout:.0f}s")
    drain()
    error = query.exception()
    if error is not None:
        raise RuntimeError(f"{label} failed: {error}")
    return progress


def watch_queries(watched: list[tuple[str, StreamingQuery, Callable[[Progress], str] | None]],
                  timeout: float | None) -> dict[str, list[Progress]]:
    """Continuous mode: print each query's batches (one thread each) until Ctrl-C, the
    timeout, or a query fails; then stop them all. Returns each query's progress list."""
    import threading

    results: dict[str, list[Progress]] = {}
    errors: list[BaseException] = []

    def watch(name: str, query: StreamingQuery, describe: Callable[[Progress], str] | None) -> None:
        try:
            results[name] = watch_query(query, describe, label=name)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=watch, args=item, daemon=True) for item in watched]
    for thread in threads:
        thread.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while any(t.is_alive() for t in threads) and not errors:
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        say("stopping ...")
    finally:
        for _name, query, _describe in watched:
            if query.isActive:
                query.stop()
        for thread in threads:
            thread.join(30)
    if errors:
        raise errors[0]
    return results


def source_counters(progress: Progress) -> dict[str, Any]:
    """The beanstalk source's counters (reportLatestOffset) from a progress dict, if present."""
    for source in progress.get("sources") or []:
        latest = source.get("latestOffset")
        if isinstance(latest, str):
            import json

            try:
                latest = json.loads(latest)
            except ValueError:
                continue
        if isinstance(latest, dict):
            return latest
    return {}


def clear_dir(path: str, must_contain: Iterable[str] = ()) -> None:
    """Remove `path` if it is empty or looks like our output (holds one of must_contain)."""
    if not os.path.exists(path):
        return
    entries = set(os.listdir(path))
    if entries and not entries & set(must_contain):
        raise SystemExit(f"refusing to delete {path}: it does not look like output of this job "
                         f"(expected one of {sorted(must_contain)}); pass another --out")
    shutil.rmtree(path)


def tube_counts(hosts: str, tubes: Iterable[str]) -> dict[str, dict[str, int]]:
    """stats-tube of each tube summed over the brokers in `hosts` (missing tubes count 0)."""
    from beanstalk_rules.hosts import parse_hosts
    from spark_beanstalk.client import Connection

    keys = ("current-jobs-ready", "current-jobs-reserved", "current-jobs-delayed", "current-jobs-buried",
            "total-jobs", "cmd-delete")
    result = {t: dict.fromkeys(keys, 0) for t in tubes}
    for host, port in parse_hosts(hosts):
        with Connection(host, port, timeout=10) as conn:
            for tube in result:
                stats = conn.stats_tube(tube) or {}
                for key in keys:
                    result[tube][key] += int(stats.get(key, 0))
    return result


def console() -> Console:
    """A rich Console; when output is not a terminal (piped, captured), 110 columns instead of 80."""
    from rich.console import Console

    con = Console(highlight=False)
    if not con.is_terminal and con.width < 110:
        con = Console(highlight=False, width=110)
    return con
