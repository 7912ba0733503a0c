"""The Spark writers end to end, with a real broker process and the session's local[2] SparkSession.

Every test that takes `server` runs against our broker and against beanstalkd 1.12.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from spark_beanstalk.client import Connection, encode, parse_yaml
from spark_beanstalk.writer import (
    PARTITION_MARK,
    BeanstalkUnavailableError,
    BeanstalkWriteError,
    beanstalk_put,
    key_host,
    marker_namespace,
    marker_tube,
)
from tests.helpers import wait_until

pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]

TUBES = ("wa", "wb", "wc")
N = 100_000


def _expected(i: int) -> tuple:
    """tube, priority, delay, ttr of row i of the mixed DataFrame."""
    return TUBES[i % 3], (i * 7919) % 5000, 3600 if i % 5 == 0 else 0, 30 + i % 11


def _mixed_df(spark, n: int):
    from pyspark.sql import functions as F

    i = F.col("id")
    return spark.range(n, numPartitions=2).select(
        F.concat(F.lit("job-"), i.cast("string")).alias("body"),
        F.element_at(F.array(*[F.lit(t) for t in TUBES]), (i % 3 + 1).cast("int")).alias("tube"),
        ((i * 7919) % 5000).alias("priority"),
        F.when(i % 5 == 0, F.lit(3600)).otherwise(F.lit(0)).alias("delay"),
        (F.lit(30) + i % 11).cast("int").alias("ttr"),
    )


def _all_jobs(proc, max_id: int) -> dict[bytes, tuple]:
    """body -> (tube, pri, delay, ttr, state) of jobs 1..max_id, via pipelined peek + stats-job."""
    cmds = []
    for job_id in range(1, max_id + 1):
        cmds.append(encode(f"peek {job_id}"))
        cmds.append(encode(f"stats-job {job_id}"))
    out: dict[bytes, tuple] = {}
    with Connection(proc.host, proc.port, timeout=60) as c:
        replies = c.pipeline(cmds, window=1024)
        for peek in replies:
            st = next(replies)
            if peek.status != b"FOUND":
                continue
            s = parse_yaml(st.body or b"")
            out[peek.body] = (s["tube"], s["pri"], s["delay"], s["ttr"], s["state"])
    return out


def _bodies(proc, tube: str, limit: int = 10**9) -> list[bytes]:
    out = []
    with Connection(proc.host, proc.port) as c:
        c.watch_only([tube])
        while len(out) < limit:
            job = c.reserve(0)
            if job is None:
                break
            out.append(job.body)
            c.delete(job.id)
    return out


def test_100k_rows_mixed_tubes_priorities_delays_land_exactly(spark, server):
    df = _mixed_df(spark, N)
    t0 = time.monotonic()
    summary = beanstalk_put.options(hosts=server.address).write(df)
    elapsed = time.monotonic() - t0
    assert (summary.put, summary.rows, summary.dead_lettered) == (N, N, 0)
    assert summary.tubes == {t: N // 3 + (1 if k < N % 3 else 0) for k, t in enumerate(TUBES)}
    with Connection(server.host, server.port) as c:
        for k, tube in enumerate(TUBES):
            st = c.stats_tube(tube)
            rows = [i for i in range(k, N, 3)]
            delayed = sum(1 for i in rows if i % 5 == 0)
            assert (st["current-jobs-ready"], st["current-jobs-delayed"], st["total-jobs"]) == \
                (len(rows) - delayed, delayed, len(rows)), (tube, st)
    jobs = _all_jobs(server, N)
    assert len(jobs) == N
    for i in range(N):
        tube, pri, delay, ttr = _expected(i)
        assert jobs[b"job-%d" % i] == (tube, pri, delay, ttr, "delayed" if delay else "ready"), i
    print(f"\n{server.kind}: {N} rows put in {elapsed:.2f}s ({N / elapsed:,.0f} rows/s)")


def test_json_bodies_and_data_source_batch_writer(spark, server):
    import datetime

    from pyspark.sql import Row

    df = spark.createDataFrame([Row(id=1, name="ä", ts=datetime.datetime(2024, 5, 1, 12, 0), tube="js"),
                                Row(id=2, name=None, ts=None, tube=None)])
    # no body column: each row is a JSON object of its non-control columns
    df.write.format("beanstalk").option("hosts", server.address).option("tube", "jdef").mode("append").save()
    with Connection(server.host, server.port) as c:
        c.watch_only(["js", "jdef"])
        got = sorted((json.loads(c.reserve(0).body) for _ in range(2)), key=lambda d: d["id"])
    assert got[0]["id"] == 1 and got[0]["name"] == "ä" and got[0]["ts"].startswith("2024-05-01T12:00")
    assert got[1] == {"id": 2, "name": None, "ts": None}
    # the Row-based variant (arrow=false) gives the same result
    spark.range(500).selectExpr("cast(id as string) as body").write.format("beanstalk") \
        .options(hosts=server.address, tube="rows", arrow="false").mode("append").save()
    assert sorted(_bodies(server, "rows")) == sorted(str(i).encode() for i in range(500))


def test_error_cases_name_the_row_and_reason(spark, server, tmp_path):
    from pyspark.sql import Row

    put = beanstalk_put.options(hosts=server.address, tube="err")
    cases = [
        (Row(body="x" * 70000, tube=None, priority=None),
         "JOB_TOO_BIG: body is 70000 bytes, the server's max-job-size is 65535"),
        (Row(body="b", tube="no spaces", priority=None), "bad tube name 'no spaces'"),
        (Row(body="c", tube=None, priority=2**32), "priority 4294967296 out of range 0..4294967295"),
        (Row(body="d", tube=None, priority=-1), "priority -1 out of range"),
    ]
    schema = "body string, tube string, priority long"
    good = [Row(body=f"good-{i}", tube=None, priority=None) for i in range(3)]
    df = spark.createDataFrame(good + [r for r, _ in cases], schema).coalesce(1)
    with pytest.raises(BeanstalkWriteError) as info:
        put(df, None)                                   # foreachBatch path
    msg = str(info.value)
    for row, (_, reason) in enumerate(cases, start=len(good)):
        assert f"row {row} of partition 0" in msg and reason in msg, msg
    with pytest.raises(Exception) as info:              # data source path: Spark wraps the same message
        df.write.format("beanstalk").options(hosts=server.address, tube="err").mode("append").save()
    assert "row 3 of partition 0" in str(info.value) and "JOB_TOO_BIG" in str(info.value)
    with Connection(server.host, server.port) as c:
        assert c.stats_tube("err") is None              # validated before sending: nothing half-written
    # the same rows with a dead-letter path: the good rows are put, the bad ones kept aside
    s = put.options(deadLetterPath=str(tmp_path / "dead")).write(df)
    assert (s.put, s.dead_lettered) == (3, 4)
    recs = [json.loads(line) for f in s.dead_letter_files for line in Path(f).read_text().splitlines()]
    assert [r["row"] for r in recs] == [3, 4, 5, 6]
    assert all(reason.split(":")[0] in r["reason"] for r, (_, reason) in zip(recs, cases, strict=True))
    assert sorted(_bodies(server, "err")) == [b"good-0", b"good-1", b"good-2"]
    # validate=batch: a bad row in one partition stops the good partitions too (checked before any put)
    two = spark.createDataFrame(good + [cases[0][0]], schema).repartition(2)
    with pytest.raises(BeanstalkWriteError, match="JOB_TOO_BIG"):
        put.options(validate="batch", tube="vb").write(two)
    with Connection(server.host, server.port) as c:
        assert c.stats_tube("vb") is None
    # a body column of the wrong type is refused before any task runs
    with pytest.raises(Exception, match="column 'body' .* must be binary or string, not bigint"):
        put.write(spark.range(3).withColumnRenamed("id", "body"))


def test_several_brokers_hash_failover_and_all_down(spark, server, server_factory):
    from pyspark.sql import functions as F

    procs = [server, server_factory(server.kind), server_factory(server.kind)]
    hosts = ",".join(p.address for p in procs)
    df = spark.range(3000, numPartitions=2).select(
        F.concat(F.lit("u"), (F.col("id") % 97).cast("string")).alias("user"),
        F.col("id").cast("string").alias("body"))
    put = beanstalk_put.options(hosts=hosts, tube="hk", keyColumn="user")
    s = put.write(df)
    assert s.put == 3000 and s.failovers == 0
    users = {str(i): f"u{i % 97}" for i in range(3000)}
    for h, p in enumerate(procs):
        got = _bodies(p, "hk")
        assert got and all(key_host(users[b.decode()], 3) == h for b in got)   # one key, one broker
    procs[2].kill()
    s = put.options(retries=0).write(df)
    assert s.put == 3000 and s.failovers > 0 and procs[2].address not in s.hosts
    assert sorted(_bodies(procs[0], "hk") + _bodies(procs[1], "hk")) == sorted(str(i).encode() for i in range(3000))
    procs[0].kill()
    procs[1].kill()
    with pytest.raises(BeanstalkUnavailableError, match="no broker accepted the rows after 1 attempt") as info:
        put.options(retries=0, brokerRetrySeconds=0).write(df)
    assert all(p.address in str(info.value) for p in procs)


def test_replayed_batch_id_is_not_put_twice(spark, server):
    df = spark.range(1000, numPartitions=2).selectExpr("cast(id as string) as body")
    put = beanstalk_put.options(hosts=server.address, tube="rp", writerId="job-42")
    first = put(df, 7)
    again = put(df, 7)                                   # Spark re-running batch 7 after a failure
    nxt = put(df, 8)
    assert (first.put, again.skipped, again.put, nxt.put) == (1000, True, 0, 1000)
    with Connection(server.host, server.port) as c:
        assert c.stats_tube("rp")["current-jobs-ready"] == 2000
        ns = marker_namespace("job-42", put_opts(put), explicit=True)
        assert c.stats_tube(marker_tube(ns))["current-jobs-delayed"] == 1
        c.use(marker_tube(ns))
        assert json.loads(c.peek_delayed().body)["batch_id"] == 8
    # dedup=false: the caller opts out
    assert put.options(dedup=False)(df, 7).put == 1000


def put_opts(put):
    from spark_beanstalk.options import WriterOptions

    return WriterOptions.parse(put._options)


def test_data_source_stream_writer(spark, server, tmp_path):
    stream = (spark.readStream.format("rate").option("rowsPerSecond", 400).option("numPartitions", 2).load()
              .selectExpr("cast(value as string) as body", "'sw' as tube"))
    q = (stream.writeStream.format("beanstalk").option("hosts", server.address)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="500 milliseconds").start())
    try:
        # a progress event comes after the batch's sink commit
        wait_until(lambda: sum(p["numInputRows"] for p in q.recentProgress) >= 300, 90, "300 rows through the sink")
        done = sum(p["numInputRows"] for p in q.recentProgress)
        batch = max(p["batchId"] for p in q.recentProgress if p["numInputRows"])
    finally:
        q.stop()
    values = sorted(int(b) for b in _bodies(server, "sw"))
    assert len(values) == len(set(values))                 # no duplicate
    assert set(range(done)) <= set(values)                 # every row of the completed batches
    with Connection(server.host, server.port) as c:        # sink commit recorded the batch in the broker
        # one batch-marker tube for the query, not one per batch (and partition markers only of the batch
        # the stop interrupted, if any)
        markers = [t for t in c.list_tubes() if t.startswith("sbw.") and not PARTITION_MARK.search(t)]
        assert len(markers) == 1, markers
        c.use(markers[0])
        assert json.loads(c.peek_delayed().body)["batch_id"] >= batch


def test_top_level_import():
    # issue 5 asks for `from spark_beanstalk import beanstalk_put` (needs one line in spark_beanstalk/__init__.py)
    from spark_beanstalk import beanstalk_put as top
    assert top is beanstalk_put


@pytest.mark.timeout(240)
def test_streaming_round_trip_tube_a_to_tube_b(spark, server, tmp_path):
    """source (tube ra) -> transform -> foreachBatch(beanstalk_put) (tube rb), settings from Spark conf."""
    from pyspark.sql import functions as F

    n = 3000
    with Connection(server.host, server.port) as c:
        c.use("ra")
        list(c.pipeline([b"put 100 0 60 %d\r\nin-%d\r\n" % (len(b"in-%d" % i), i) for i in range(n)]))
    spark.conf.set("spark.beanstalk.hosts", server.address)
    spark.conf.set("spark.beanstalk.tube", "rb")
    try:
        src = (spark.readStream.format("beanstalk").option("hosts", server.address).option("tubes", "ra")
               .option("maxJobsPerTrigger", 1500).load())
        out = src.select(F.concat(F.lit("out-"), F.substring(F.col("body").cast("string"), 4, 20)).alias("body"),
                         (F.col("priority") + 1).alias("priority"))
        q = (out.writeStream.foreachBatch(beanstalk_put).option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
        assert q.awaitTermination(90), "round trip did not finish"
        assert q.exception() is None
    finally:
        spark.conf.unset("spark.beanstalk.hosts")
        spark.conf.unset("spark.beanstalk.tube")
    with Connection(server.host, server.port) as c:
        st = c.stats_tube("rb")
        assert st["current-jobs-ready"] == n and st["total-jobs"] == n, st
        c.watch_only(["rb"])
        job = c.reserve(0)
        assert c.stats_job(job.id)["pri"] == 101
    got = _bodies(server, "rb")
    assert sorted(got) == sorted(b"out-%d" % i for i in range(n))     # no loss, no duplicate
    assert beanstalk_put.last_summary is not None and beanstalk_put.last_summary.batch_id is not None


def _replay_last_batch(ck) -> int:
    """Make Spark re-run the last batch on restart: drop its entry from the commit log."""
    commits = sorted(int(p.name) for p in (ck / "commits").iterdir() if p.name.isdigit())
    last = commits[-1]
    (ck / "commits" / str(last)).unlink()
    crc = ck / "commits" / f".{last}.crc"
    if crc.exists():
        crc.unlink()
    return last


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sink", ["foreachBatch", "format"])
def test_spark_rerunning_a_completed_batch_does_not_put_it_twice(spark, beanstalkd, tmp_path, sink):
    """A real replay: the commit log loses the last batch, the restarted query runs it again."""
    src = tmp_path / "in"
    src.mkdir()
    for f in range(2):
        (src / f"f{f}.txt").write_text("".join(f"line-{f}-{i}\n" for i in range(200)))
    ck = tmp_path / "ck"

    put = beanstalk_put.options(hosts=beanstalkd.address, tube="replay")

    def run():
        df = (spark.readStream.format("text").option("maxFilesPerTrigger", 1).load(str(src))
              .withColumnRenamed("value", "body"))
        w = df.writeStream.option("checkpointLocation", str(ck)).trigger(availableNow=True)
        if sink == "foreachBatch":
            w = w.foreachBatch(put)
        else:
            w = w.format("beanstalk").option("hosts", beanstalkd.address).option("tube", "replay")
        q = w.start()
        assert q.awaitTermination(120)
        assert q.exception() is None
        return [p["batchId"] for p in q.recentProgress if p["numInputRows"]]

    assert run() == [0, 1]
    with Connection(beanstalkd.host, beanstalkd.port) as c:
        assert c.stats_tube("replay")["current-jobs-ready"] == 400
    assert _replay_last_batch(ck) == 1
    replayed = run()
    if sink == "foreachBatch":                            # Spark did run batch 1 again ...
        assert (put.last_summary.batch_id, put.last_summary.skipped) == (1, True)
    else:
        assert replayed == [1]
    with Connection(beanstalkd.host, beanstalkd.port) as c:
        assert c.stats_tube("replay")["current-jobs-ready"] == 400   # ... and nothing was put twice
