"""The pipelines in jobs/ against a real broker process, with the one shared SparkSession.

The demo (enqueue the sample data, drain it with the streaming ETL) runs once, as the
user runs it (`python jobs/demo.py`, its own Spark), and its outputs are checked with
chispa against expectations computed here independently, in plain Python, from the
sample file. The other jobs run in-process through their ``run(spark, ...)`` functions
on the one shared SparkSession.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from spark_beanstalk.client import Connection
from spark_beanstalk.embedded import free_port, wait_for_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.path.join(REPO, "jobs")
CONF = os.path.join(REPO, "conf")
SAMPLE = os.path.join(JOBS, "data", "events.jsonl")
if JOBS not in sys.path:
    sys.path.insert(0, JOBS)

EVENT_TYPES = ("page_view", "add_to_cart", "remove_from_cart", "purchase", "refund")
MONEY = ("add_to_cart", "remove_from_cart", "purchase", "refund")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


# --- independent expectations from the sample file ----------------------------------------------


def _parse_time(text):
    if not isinstance(text, str):
        return None
    try:
        dt = datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%f%z")
    except ValueError:
        try:
            dt = datetime.strptime(text, "%Y-%m-%dT%H:%M:%S%z")
        except ValueError:
            return None
    return dt.astimezone(UTC)


def _is_money(value) -> bool:
    try:
        Decimal(str(value))
        return not isinstance(value, bool)
    except Exception:
        return False


def classify(line: str):
    """(event dict, None) for a valid event, (None, reason) for a dead letter: the ETL's rules."""
    try:
        e = json.loads(line)
    except ValueError:
        return None, "malformed JSON"
    if not isinstance(e, dict):
        return None, "malformed JSON"
    for key in ("event_id", "event_time", "user_id", "event_type"):
        if e.get(key) is None:
            return None, f"missing {key}"
    if _parse_time(e["event_time"]) is None:
        return None, "bad event_time"
    if e["event_type"] not in EVENT_TYPES:
        return None, "unknown event_type"
    if e.get("amount") is not None and not _is_money(e["amount"]):
        return None, "bad amount"
    if e["event_type"] in MONEY and e.get("amount") is None:
        return None, "missing amount"
    return e, None


def sample_expectations(lines: list[str]):
    good, bad = [], []
    for line in lines:
        event, reason = classify(line)
        (good.append(event) if event else bad.append((reason, line)))
    return good, bad


def micros(dt: datetime) -> int:
    return (dt - EPOCH) // timedelta(microseconds=1)


# --- configuration files and the jobs' command lines (no Spark) --------------------------------------


def test_broker_toml_documents_every_flag_and_changes_nothing(broker):
    """conf/broker.toml names every flag of the broker, and as shipped equals no flags at all."""
    from broker.cli import broker_command

    with open(os.path.join(CONF, "broker.toml"), "rb") as fh:
        active = tomllib.load(fh)
    assert active["listen"] == "127.0.0.1" and active["port"] == 11300
    text = Path(CONF, "broker.toml").read_text()
    flags = {p.name for p in broker_command.params if p.name not in ("help", "config", "version")}
    keys = {"binlog_size": "binlog_segment_size", "binlog_ignore_damage": "--binlog-ignore-damage", "metrics": "http"}
    for name in flags:
        key = keys.get(name, name)
        assert f"\n{key} = " in text or f"\n# {key} = " in text or key.startswith("--") and key in text, key
    for key, value in active.items():  # the active values are the flags' defaults
        param = next(p for p in broker_command.params if p.name == {"binlog_segment_size": "binlog_size"}.get(key, key))
        assert value == param.default, key

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spark_beanstalk.cli", "broker", "--config",
                             os.path.join(CONF, "broker.toml"), "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 20, proc)
        with Connection("127.0.0.1", port) as conn, Connection(broker.host, broker.port) as plain:
            configured, default = conn.stats(), plain.stats()
        assert list(configured) == list(default)  # same keys (no extended stats switched on)
        assert configured["max-job-size"] == active["max_job_size"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_spark_conf_files_are_well_formed():
    entries = {}
    for line in Path(CONF, "spark-defaults.conf").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, value = line.split(None, 1)
            entries[key] = value
    assert entries["spark.master"] == "local[2]"
    assert all(k.startswith("spark.") for k in entries)
    log4j = dict(line.split(" = ", 1) for line in Path(CONF, "log4j2.properties").read_text().splitlines()
                 if " = " in line and not line.startswith("#"))
    assert log4j["rootLogger.level"] == "warn"
    assert os.path.exists(os.path.join(CONF, "connector.md"))


@pytest.mark.parametrize("job", ["enqueue.py", "streaming_etl.py", "chained_workers.py", "demo.py",
                                 "make_sample_data.py"])
def test_job_help(job):
    proc = subprocess.run([sys.executable, os.path.join(JOBS, job), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_sample_data_is_deterministic_and_shipped(tmp_path):
    import make_sample_data

    out = tmp_path / "events.jsonl"
    assert make_sample_data.main(["--out", str(out)]) == 0
    assert out.read_bytes() == Path(SAMPLE).read_bytes()
    manifest = json.loads((tmp_path / "events.manifest.json").read_text())
    lines = out.read_text().splitlines()
    good, bad = sample_expectations(lines)
    assert manifest["lines"] == len(lines) == 3012
    assert manifest["good"] == len(good) == 3000 and manifest["malformed"] == len(bad) == 12
    assert len({e["event_id"] for e in good}) == 3000
    assert manifest["purchases"] == sum(e["event_type"] == "purchase" for e in good)


# --- the demo path: enqueue + streaming ETL, checked with chispa ---------------------------------------


def check_demo_outputs(spark, broker, out: str, summary: dict) -> None:
    """The demo's summary, its dead-letter tube and its three outputs against expectations computed
    here from the sample file (chispa): every valid event once, typed; every closed window; every bad line."""
    import demo
    from chispa import assert_df_equality
    from pyspark.sql import functions as F

    lines = Path(SAMPLE).read_text().splitlines()
    good, bad = sample_expectations(lines)

    # enqueue put every line, the ETL drained the tube and accounted for every job
    assert summary["enqueued"]["put"] == len(lines)
    assert summary["events"] == len(good) and summary["dead_letters"] == len(bad)
    assert summary["tube_left"] == {"ready": 0, "reserved": 0, "delayed": 0, "buried": 0}
    with Connection(broker.host, broker.port) as conn:
        stats = conn.stats_tube("events")
        assert stats is None or stats["current-jobs-ready"] == stats["current-jobs-reserved"] == 0
        dead_tube = conn.stats_tube(demo.DEAD_LETTER_TUBE)
        assert dead_tube["current-jobs-ready"] == len(bad)
        conn.watch(demo.DEAD_LETTER_TUBE)
        dead_bodies = []
        while (job := conn.reserve(0)) is not None:
            dead_bodies.append(job.body.decode())
        assert sorted(dead_bodies) == sorted(line for _, line in bad)

    # events/: exactly the valid events, each once, with typed columns
    events = spark.read.parquet(os.path.join(out, "events"))
    cols = ["event_id", "t", "user_id", "event_type", "category", "quantity", "amount", "country"]
    actual = events.select("event_id", F.unix_micros("event_time").alias("t"), "user_id", "event_type", "category",
                           "quantity", "amount", "country")
    expected = spark.createDataFrame(
        [(e["event_id"], micros(_parse_time(e["event_time"])), e["user_id"], e["event_type"], e["category"],
          e["quantity"], None if e["amount"] is None else Decimal(str(e["amount"])).quantize(Decimal("0.01")),
          e["country"]) for e in good],
        "event_id string, t bigint, user_id string, event_type string, category string, quantity int, "
        "amount decimal(12,2), country string")
    assert_df_equality(actual.select(*cols), expected, ignore_row_order=True, ignore_nullable=True)

    # windows/: every closed 5-minute window, equal to a plain-Python aggregation
    watermark = _parse_time(summary["watermark"])
    assert watermark is not None
    buckets: dict[datetime, dict] = defaultdict(lambda: dict(events=0, page_views=0, add_to_cart=0, purchases=0,
                                                             refunds=0, revenue=Decimal("0.00"), users=set()))
    for e in good:
        t = _parse_time(e["event_time"])
        start = t.replace(minute=t.minute - t.minute % 5, second=0, microsecond=0)
        b = buckets[start]
        b["events"] += 1
        b["page_views"] += e["event_type"] == "page_view"
        b["add_to_cart"] += e["event_type"] == "add_to_cart"
        b["purchases"] += e["event_type"] == "purchase"
        b["refunds"] += e["event_type"] == "refund"
        if e["event_type"] in ("purchase", "refund"):
            b["revenue"] += Decimal(str(e["amount"]))
        b["users"].add(e["user_id"])
    closed = {s: b for s, b in buckets.items() if s + timedelta(minutes=5) <= watermark}
    assert len(closed) == 21  # 09:00 .. 10:45; the three windows after the watermark stay open
    windows = spark.read.parquet(os.path.join(out, "windows"))
    actual_w = windows.select(F.unix_micros("window_start").alias("start"), "events", "page_views", "add_to_cart",
                              "purchases", "refunds", "revenue")
    expected_w = spark.createDataFrame(
        [(micros(s), b["events"], b["page_views"], b["add_to_cart"], b["purchases"], b["refunds"],
          b["revenue"].quantize(Decimal("0.01"))) for s, b in sorted(closed.items())],
        "start bigint, events bigint, page_views bigint, add_to_cart bigint, purchases bigint, refunds bigint, "
        "revenue decimal(14,2)")
    assert_df_equality(actual_w, expected_w, ignore_row_order=True, ignore_nullable=True)
    for row in windows.select(F.unix_micros("window_start").alias("start"), "users").collect():
        exact = len(next(b for s, b in closed.items() if micros(s) == row["start"])["users"])
        assert abs(row["users"] - exact) <= max(2, exact * 0.1)  # approx_count_distinct

    # dead_letter/: every bad line, with its reason and raw body
    dead = spark.read.json(os.path.join(out, "dead_letter"))
    actual_d = dead.select(F.regexp_extract("error", r"^[^:(]*", 0).alias("reason"), "body")
    actual_d = actual_d.select(F.trim("reason").alias("reason"), "body")
    expected_d = spark.createDataFrame(bad, "reason string, body string")
    assert_df_equality(actual_d, expected_d, ignore_row_order=True, ignore_nullable=True)


# --- enqueue from Parquet/CSV: rows become JSON jobs ---------------------------------------------------


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_enqueue_parquet_and_csv_rows_as_json(spark, broker, tmp_path):
    import enqueue

    rows = [(i, f"user-{i}", float(i) * 1.5) for i in range(40)]
    df = spark.createDataFrame(rows, "n int, user string, score double")
    df.write.parquet(str(tmp_path / "in.parquet"))
    df.coalesce(1).write.option("header", True).csv(str(tmp_path / "in.csv"))

    s1 = enqueue.run(spark, str(tmp_path / "in.parquet"), hosts=broker.address, tube="pq", priority=7, ttr=30,
                     progress=False)
    s2 = enqueue.run(spark, str(tmp_path / "in.csv"), hosts=broker.address, tube="csv", fmt="csv", progress=False)
    assert (s1["format"], s1["rows"], s1["put"], s1["tubes"]) == ("parquet", 40, 40, {"pq": 40})
    assert (s2["rows"], s2["put"], s2["tubes"]) == (40, 40, {"csv": 40})
    with Connection(broker.host, broker.port) as conn:
        for tube in ("pq", "csv"):
            conn.watch(tube)
        conn.ignore("default")
        got = {}
        while (job := conn.reserve(0)) is not None:
            st = conn.stats_job(job.id)
            got.setdefault(str(st["tube"]), []).append((json.loads(job.body), st["pri"], st["ttr"]))
            conn.delete(job.id)
    assert sorted((b["n"], b["user"], b["score"]) for b, _, _ in got["pq"]) == rows
    assert {(pri, ttr) for _, pri, ttr in got["pq"]} == {(7, 30)}
    assert sorted((b["n"], b["user"], b["score"]) for b, _, _ in got["csv"]) == rows


def test_enqueue_command_line_missing_file(broker, tmp_path):
    """`python jobs/enqueue.py MISSING`: a clear message (before Spark starts, so it is cheap)."""
    proc = subprocess.run([sys.executable, os.path.join(JOBS, "enqueue.py"), str(tmp_path / "missing.jsonl"),
                           "--hosts", broker.address], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no such file" in proc.stderr


# --- chained workers: events -> orders -> notifications -------------------------------------------


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_chained_workers_hand_off(spark, broker, tmp_path):
    import chained_workers

    lines = Path(SAMPLE).read_text().splitlines()[:600]
    lines.append("this is not json")
    good, bad = sample_expectations(lines)
    purchases = {e["event_id"]: e for e in good if e["event_type"] == "purchase"}
    assert purchases and bad
    with Connection(broker.host, broker.port) as conn:
        conn.use("clicks")
        for line in lines:
            conn.put(line.encode())

    summary = chained_workers.run(spark, hosts=broker.address, input_tube="clicks", checkpoints=str(tmp_path / "ck"),
                                  timeout=300)
    assert summary["orders"] == len(purchases)
    assert summary["notifications"] == len(purchases)
    assert summary["rejected"] == len(bad)
    assert summary["read"] == len(lines)
    t = summary["tubes"]
    assert t["clicks"]["ready"] == t["clicks"]["reserved"] == 0  # drained: every job deleted after its hand-off
    assert t["orders"]["ready"] == t["orders"]["reserved"] == 0 and t["orders"]["read"] == len(purchases)
    assert t["notifications"]["ready"] == len(purchases) and t["clicks.rejected"]["ready"] == len(bad)

    with Connection(broker.host, broker.port) as conn:
        conn.watch("notifications")
        conn.watch("clicks.rejected")
        conn.ignore("default")
        mails, rejected = {}, []
        while (job := conn.reserve(0)) is not None:
            st = conn.stats_job(job.id)
            if str(st["tube"]) == "notifications":
                body = json.loads(job.body)
                mails[body["order_id"]] = (body, st["pri"])
            else:
                rejected.append(job.body.decode())
            conn.delete(job.id)
    assert sorted(rejected) == sorted(line for _, line in bad)
    assert set(mails) == set(purchases)
    for order_id, (mail, pri) in mails.items():
        e = purchases[order_id]
        assert mail["to"] == e["user_id"]
        assert Decimal(str(mail["amount"])) == Decimal(str(e["amount"]))
        big = e["amount"] >= chained_workers.BIG_ORDER_EUR
        assert mail["template"] == ("order_confirmation_vip" if big else "order_confirmation")
        assert pri == (chained_workers.URGENT_PRIORITY if big else chained_workers.NORMAL_PRIORITY)


# --- the demo, as a user runs it: the README's command, its outputs checked with chispa --------------


@pytest.mark.spark
@pytest.mark.timeout(900)
def test_demo_command_end_to_end(spark, broker, tmp_path):
    """`python jobs/demo.py --hosts H:P`: its own Spark, end to end, a quiet run; then every output
    checked against the sample file (one demo run serves both: it is the costliest part of this file)."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, os.path.join(JOBS, "demo.py"), "--out", str(out), "--json",
                           "--hosts", broker.address, "--max-jobs-per-trigger", "2000"],   # two micro-batches
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # a quiet run: no log4j WARN line (e.g. "DataSourceManager: The data source beanstalk replaced a
    # statically registered data source" before every micro-batch) and no Python warning
    noisy = [line for line in (proc.stdout + proc.stderr).splitlines()
             if re.search(r"\bWARN\b|Warning: ", line)]
    assert not noisy, noisy
    summary = json.loads(proc.stdout[proc.stdout.index("\n{\n") + 1:])
    assert summary["events"] == 3000 and summary["dead_letters"] == 12
    for part in ("events", "windows", "dead_letter"):
        assert (out / part).is_dir()
    check_demo_outputs(spark, broker, str(out), summary)


def test_demo_starts_our_broker_by_default():
    """Without --hosts the demo starts our broker, not the beanstalkd fallback (the command above
    runs with --hosts so that the test can inspect the dead-letter tube afterwards)."""
    import demo

    server, what = demo.start_broker("auto")
    try:
        assert what == "spark-beanstalk broker" and server.argv[1:3] == ["-m", "broker"]
        with Connection(server.host, server.port) as conn:
            assert conn.stats()["current-connections"] == 1     # it serves
    finally:
        server.stop()
