"""Trigger control (minJobsPerTrigger + maxTriggerDelay) and lag in the progress, with real
brokers and Spark."""
from __future__ import annotations

import threading

import pytest

from spark_beanstalk.client import Connection
from spark_beanstalk.options import OptionError, SourceOptions
from tests.helpers import wait_until
from tests.spark.test_source import BatchRecorder, put_jobs, reader, source_report, tube_counts

pytestmark = pytest.mark.spark


def test_trigger_options_validation():
    opts = SourceOptions.parse({"minJobsPerTrigger": "500", "maxTriggerDelay": "3s"})
    assert (opts.min_jobs_per_trigger, opts.max_trigger_delay) == (500, 3.0)
    for text, seconds in (("500ms", 0.5), ("1m", 60.0), ("2h", 7200.0), (" 1.5S ", 1.5)):
        assert SourceOptions.parse({"minJobsPerTrigger": "1", "maxTriggerDelay": text}).max_trigger_delay == seconds
    assert SourceOptions.parse({"minJobsPerTrigger": "1"}).max_trigger_delay == 900.0   # Kafka's 15m
    with pytest.raises(OptionError, match=r"maxTriggerDelay='3' is not a duration.*500ms, 3s, 1m"):
        SourceOptions.parse({"minJobsPerTrigger": "1", "maxTriggerDelay": "3"})
    with pytest.raises(OptionError, match="maxTriggerDelay='soon' is not a duration"):
        SourceOptions.parse({"minJobsPerTrigger": "1", "maxTriggerDelay": "soon"})
    with pytest.raises(OptionError, match="maxTriggerDelay=0s must be above 0"):
        SourceOptions.parse({"minJobsPerTrigger": "1", "maxTriggerDelay": "0ms"})
    with pytest.raises(OptionError, match="minJobsPerTrigger=-1 is below the minimum 0"):
        SourceOptions.parse({"minJobsPerTrigger": "-1"})
    with pytest.raises(OptionError, match="minJobsPerTrigger=600 is above maxJobsPerTrigger=500"):
        SourceOptions.parse({"minJobsPerTrigger": "600", "maxJobsPerTrigger": "500"})
    with pytest.raises(OptionError, match="maxTriggerDelay only applies with minJobsPerTrigger"):
        SourceOptions.parse({"maxTriggerDelay": "3s"})
    # no maximum: a minimum alone is fine
    assert SourceOptions.parse({"minJobsPerTrigger": "10000000", "maxJobsPerTrigger": "0"}).min_jobs_per_trigger


def _data_batches(query) -> list[tuple[float, int]]:
    """(trigger start in seconds, rows) of every progress event with data, in batch order."""
    from datetime import datetime

    out = []
    for p in query.recentProgress:
        if p["numInputRows"] > 0:
            ts = datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()
            out.append((p["batchId"], ts, p["numInputRows"]))
    return [(ts, n) for _, ts, n in sorted(out)]


@pytest.mark.timeout(120)
def test_min_jobs_or_max_delay_never_fewer_and_sooner(spark, broker, conn_factory, tmp_path):
    """A burst (batches fill up to the minimum at once), then a 50/s trickle (batches wait 3 s)."""
    conn = conn_factory(broker)
    trickle = conn_factory(broker)
    ids = put_jobs(conn, "trig", [b"burst%d" % i for i in range(1600)])
    stop = threading.Event()

    def produce() -> None:
        for i in range(400):          # 50/s for 8 s
            if stop.wait(0.02):
                return
            ids.extend(put_jobs(trickle, "trig", [b"t%d" % i]))

    rec = BatchRecorder()
    df = reader(spark, hosts=broker.address, tubes="trig", maxJobsPerTrigger=500, minJobsPerTrigger=500,
                maxTriggerDelay="3s")
    query = (df.writeStream.foreachBatch(rec).option("checkpointLocation", str(tmp_path / "ckpt"))
             .trigger(processingTime="200 milliseconds").start())
    producer = threading.Thread(target=produce, daemon=True)
    try:
        wait_until(lambda: rec.batches, timeout=60, what="the first batch")
        producer.start()
        producer.join(30)
        wait_until(lambda: len(rec.rows()) >= len(ids), timeout=30, what="every job read")
        # the last batch is deleted by the next latestOffset (it starts from the committed end)
        empty = {"ready": 0, "reserved": 0, "delayed": 0, "buried": 0}
        wait_until(lambda: tube_counts(conn, "trig") == empty, timeout=30, what="the tube emptied")
        batches = _data_batches(query)
    finally:
        stop.set()
        query.stop()
    assert sorted(r[2] for r in rec.rows()) == sorted(ids)          # exactly once
    # Progress timestamps are trigger starts; the source decides a little after: 0.2 s of slack.
    gaps = [(b[0] - a[0], b[1]) for a, b in zip(batches, batches[1:], strict=False)]
    bad = [(round(gap, 2), n) for gap, n in gaps if n < 500 and gap < 3.0 - 0.2]
    assert not bad, f"batches both under 500 jobs and sooner than 3 s: {bad} (all: {gaps})"
    assert any(n >= 500 and gap < 2.5 for gap, n in gaps[1:]), f"no batch came early on the minimum: {gaps}"
    assert any(n < 500 for gap, n in gaps), f"no batch came on the delay: {gaps}"


def _stats_backlog(conn: Connection, tube: str) -> int:
    c = tube_counts(conn, tube)
    return c["ready"] + c["delayed"]


@pytest.mark.timeout(120)
def test_progress_backlog_matches_stats_tube(spark, server, conn_factory, tmp_path):
    """A query held back by a minimum it never reaches: its progress shows the tube's backlog."""
    conn = conn_factory(server)
    put_jobs(conn, "lag", [b"r%d" % i for i in range(300)])
    for i in range(5):
        conn.put(b"d%d" % i, delay=3600)
    conn.watch_only(["lag"])
    for _ in range(2):
        job = conn.reserve(0)
        assert job is not None and conn.bury(job.id)
    spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", "200ms")
    df = reader(spark, hosts=server.address, tubes="lag,other", maxJobsPerTrigger=0, minJobsPerTrigger=1000000,
                maxTriggerDelay="1h")
    query = (df.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ckpt"))
             .trigger(processingTime="100 milliseconds").start())
    try:
        def lag_matches(expected: int, min_age: int) -> bool:
            rep = source_report(query)
            return rep.get("backlog") == expected and rep.get("oldestReadyAgeSeconds", -1) >= min_age

        wait_until(lambda: lag_matches(_stats_backlog(conn, "lag"), 1), timeout=60, what="backlog in progress")
        rep = source_report(query)
        tube = rep["lag"]["tubes"][server.address]["lag"]
        assert (tube["ready"], tube["delayed"], tube["buried"]) == (298, 5, 2)
        assert rep["lag"]["tubes"][server.address]["other"]["ready"] == 0
        put_jobs(conn, "lag", [b"more"] * 40)
        wait_until(lambda: lag_matches(_stats_backlog(conn, "lag"), 1), timeout=15, what="backlog refreshed")
        assert source_report(query)["backlog"] == 343
    finally:
        query.stop()
        spark.conf.unset("spark.sql.streaming.noDataProgressEventInterval")


@pytest.mark.timeout(180)
def test_query_restart_after_partial_delete_reads_no_committed_job_again(spark, broker, conn_factory, tmp_path):
    """Batch 0 commits; the query stops before its jobs are deleted (they go back to ready); 40 of
    them are deleted by hand, splitting two blocks of 64 ids; restarted from the checkpoint, the
    query deletes the other 110 and reads only the new jobs: 0 duplicates."""
    conn = conn_factory(broker)
    wait_until(lambda: int(conn.stats()["uptime"]) >= 3, 10, what="the broker up for 3 s")
    ids = put_jobs(conn, "pdq", [b"pd%d" % i for i in range(150)])
    ckpt = str(tmp_path / "ckpt")
    rec = BatchRecorder()

    def start(**trigger):
        df = reader(spark, hosts=broker.address, tubes="pdq", prefetch="false")
        return df.writeStream.foreachBatch(rec).option("checkpointLocation", ckpt).trigger(**trigger).start()

    # Trigger.Once: batch 0 commits, then the query ends without another latestOffset, so nothing
    # deletes batch 0. (A long processingTime did not do that: Spark aligns processing-time triggers
    # to multiples of the interval on the wall clock, so when batch 0 ran across such a boundary,
    # batch 1's latestOffset came at once and deleted batch 0 before the test stopped the query.)
    query = start(once=True)
    try:
        assert query.awaitTermination(90), "batch 0 did not end within 90 s"
        assert [p["batchId"] for p in query.recentProgress] == [0]
    finally:
        query.stop()
    assert sorted(r[2] for r in rec.rows()) == ids
    wait_until(lambda: tube_counts(conn, "pdq")["ready"] == 150, 30, what="batch 0 back in ready after the stop")
    assert all(conn.delete(j) for j in ids[10:40] + ids[100:110])
    more = put_jobs(conn, "pdq", [b"new%d" % i for i in range(5)])
    query = start(processingTime="120 seconds")
    try:
        wait_until(lambda: len(rec.rows()) >= 155, 90, what="the new jobs read")
        assert all(conn.stats_job(j) is None for j in ids), "committed jobs left on the broker"
    finally:
        query.stop()
    got = sorted(r[2] for r in rec.rows())
    assert got == sorted(ids + more), f"{len(got) - len(set(got))} duplicates"
