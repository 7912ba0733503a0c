"""End-to-end tests of spark.readStream.format("beanstalk") with real broker processes.

Every test that needs a broker runs twice through the `server` fixture: against our
broker and against beanstalkd 1.12. One local[2] SparkSession serves the whole run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from spark_beanstalk.client import Connection, encode_put
from spark_beanstalk.offsets import decode_ranges, encode_ranges, make_offset
from spark_beanstalk.options import OptionError, SourceOptions
from tests.helpers import broker_process, free_port, wait_until

pytestmark = pytest.mark.spark

chispa = pytest.importorskip("chispa")
from chispa import assert_df_equality  # noqa: E402

# --- helpers ------------------------------------------------------------------------------

def put_jobs(conn: Connection, tube: str, bodies, ttr: int = 60, pri: int = 100) -> list[int]:
    conn.use(tube)
    ids = []
    for reply in conn.pipeline([encode_put(b, pri, 0, ttr) for b in bodies]):
        assert reply.status == b"INSERTED", reply
        ids.append(int(reply.args[0]))
    return ids


def tube_counts(conn: Connection, tube: str) -> dict:
    st = conn.stats_tube(tube) or {}
    return {k: int(st.get(f"current-jobs-{k}", 0)) for k in ("ready", "reserved", "delayed", "buried")}


def job_state(conn: Connection, job_id: int) -> dict | None:
    return conn.stats_job(job_id)


def source_report(query) -> dict:
    progress = query.lastProgress
    if not progress:
        return {}
    latest = progress["sources"][0].get("latestOffset")
    if isinstance(latest, str):
        latest = json.loads(latest)
    return latest if isinstance(latest, dict) else {}


def reader(spark, **options):
    r = spark.readStream.format("beanstalk")
    for key, value in options.items():
        r = r.option(key, str(value))
    return r.load()


class BatchRecorder:
    """foreachBatch sink that keeps (batch_id, rows) in the test process."""

    def __init__(self, hook=None) -> None:
        self.batches: list[tuple[int, list]] = []
        self.lock = threading.Lock()
        self.hook = hook

    def __call__(self, df, batch_id: int) -> None:
        rows = [tuple(r) for r in df.select("broker", "tube", "id", "body", "reserves").collect()]
        with self.lock:
            self.batches.append((batch_id, rows))
        if self.hook is not None:
            self.hook(batch_id, rows)

    def rows(self) -> list:
        with self.lock:
            return [row for _, rows in self.batches for row in rows]


# --- fast checks (no Spark query) -----------------------------------------------------------

def test_offsets_are_compact_and_canonical():
    assert encode_ranges([5, 1, 2, 3, 9, 10, 12]) == "1-3,5,9-10,12"
    assert decode_ranges("1-3,5,9-10,12") == [1, 2, 3, 5, 9, 10, 12]
    a = make_offset(3, {"h:2": ("s", [3, 4]), "h:1": ("s", [1])})
    b = make_offset(3, {"h:1": ("s", [1]), "h:2": ("s", [4, 3])})
    assert json.dumps(a) == json.dumps(b)
    assert list(a["jobs"]) == ["h:1", "h:2"]


@pytest.mark.parametrize("key", ["touchFraction", "socketTimeout", "replayWaitSeconds", "brokerRetrySeconds"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_float_options_are_refused(key, value):
    with pytest.raises(OptionError, match=f"option {key}=.* is not a finite number"):
        SourceOptions.parse({key: value})


def test_options_validation_messages():
    opts = SourceOptions.parse({"HOSTS": "a:1,b:2", "tubes": "x, y", "maxjobspertrigger": "7"})
    assert opts.hosts == (("a", 1), ("b", 2)) and opts.tubes == ("x", "y") and opts.max_jobs_per_trigger == 7
    with pytest.raises(OptionError, match=r"unknown beanstalk source option\(s\) tubez"):
        SourceOptions.parse({"tubez": "a"})
    with pytest.raises(OptionError, match="numPartitions=0 is below the minimum 1"):
        SourceOptions.parse({"numPartitions": "0"})
    with pytest.raises(OptionError, match="hosts"):
        SourceOptions.parse({"hosts": "h:notaport"})
    with pytest.raises(OptionError, match="not allow"):
        SourceOptions.parse({"tubes": "bad tube!"})
    with pytest.raises(OptionError, match="touchFraction"):
        SourceOptions.parse({"touchFraction": "0.95"})


def test_bulk_reserve_and_stats_parsing(server, conn_factory):
    """The source's batched protocol paths: reserve_many, stats_jobs (regex fast path and the
    one-by-one fallback when a job vanished), failed_commands, over replies larger than one recv."""
    from spark_beanstalk.source_wire import delete_jobs, failed_commands, stats_jobs

    conn = conn_factory(server)
    bodies = [b"\r\nUSING x\r\n" + bytes([i % 256]) * (3000 + i) for i in range(300)]   # marker-like bytes too
    ids = put_jobs(conn, "bulk", bodies, ttr=7, pri=42)
    worker = conn_factory(server)
    worker.watch_only(["bulk"])
    got, got_bodies, others = worker.reserve_many(310)
    assert got == ids and got_bodies == bodies and others == [b"TIMED_OUT"] * 10

    st = stats_jobs(worker, got)
    assert st.ids == ids and not st.missing
    assert set(st.tubes) == {"bulk"} and set(st.pris) == {42} and set(st.ttrs) == {7}
    assert set(st.reserves) == {1} and set(st.states) == {"reserved"}

    assert delete_jobs(worker, ids[:2]) == 2
    st = stats_jobs(worker, ids)      # two NOT_FOUND replies: the slow path, same columns
    assert st.missing == ids[:2] and st.ids == ids[2:] and set(st.ttrs) == {7} and set(st.states) == {"reserved"}

    assert failed_commands(worker, [b"touch %d\r\n" % j for j in ids], b"TOUCHED") == [0, 1]
    assert delete_jobs(worker, ids) == len(ids) - 2
    assert worker.call("list-tube-used").status == b"USING"    # the connection is still in step

def test_pyspark_discovers_default_source():
    """pyspark auto-registers DefaultSource of top-level pyspark_* modules (lookup_data_sources.py)."""
    code = ("import pkgutil, importlib;"
            "m=[i.name for i in pkgutil.iter_modules() if i.name=='pyspark_beanstalk'];"
            "print(m and importlib.import_module(m[0]).DefaultSource.name())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "beanstalk", (
        "pyspark_beanstalk is not visible to pkgutil.iter_modules from an arbitrary directory: "
        "setuptools' strict editable install hides it. Install with `pip install .` or "
        "`pip install -e . --config-settings editable_mode=compat`. " + out.stderr[-300:])


# --- end-to-end ------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_exactly_once_across_tubes_and_brokers(spark, server, server_factory, conn_factory, tmp_path):
    """N jobs over 3 tubes and 2 brokers reach a parquet sink exactly once; poison is buried."""
    from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType

    other = server_factory(server.kind)
    procs = [server, other]
    conns = [conn_factory(p) for p in procs]
    tubes = ["alpha", "beta", "gamma"]
    expected = []
    for proc, conn in zip(procs, conns, strict=True):
        for tube in tubes:
            bodies = [f"{proc.port}/{tube}/{i}".encode() for i in range(60)]
            for job_id, body in zip(put_jobs(conn, tube, bodies), bodies, strict=True):
                expected.append((proc.address, tube, job_id, body))
        put_jobs(conn, "unwatched", [b"stay"] * 5)
    # A poison job: already reserved twice; maxReserves=2 buries it on the 3rd reservation.
    poison_conn = conns[0]
    poison_id = put_jobs(poison_conn, "alpha", [b"poison"], pri=0)[0]
    poison_conn.watch("alpha")
    for _ in range(2):
        job = poison_conn.reserve(0)
        assert job is not None and job.id == poison_id
        poison_conn.release(poison_id, 0, 0)

    out = str(tmp_path / "out")
    df = reader(spark, hosts=",".join(p.address for p in procs), tubes=",".join(tubes), maxJobsPerTrigger=150,
                numPartitions=2, maxReserves=2)
    query = (df.writeStream.format("parquet").option("path", out)
             .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(processingTime="200 milliseconds").start())
    try:
        def drained():
            for conn in conns:
                for tube in tubes:
                    c = tube_counts(conn, tube)
                    if c["ready"] or c["reserved"]:
                        return False
            return True

        wait_until(drained, 90, interval=0.25, what="all watched tubes to be empty (jobs deleted after commit)")
        report = wait_until(lambda: (r := source_report(query)).get("deleted") == len(expected) and r, 20,
                            what="progress to report every job deleted")
    finally:
        query.stop()

    schema = StructType([StructField("broker", StringType()), StructField("tube", StringType()),
                         StructField("id", LongType()), StructField("body", BinaryType())])
    actual = spark.read.parquet(out).select("broker", "tube", "id", "body")
    assert_df_equality(actual, spark.createDataFrame(expected, schema), ignore_row_order=True,
                       ignore_nullable=True)
    # admission control: no micro-batch above maxJobsPerTrigger
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sizes and max(sizes) <= 150 and sum(sizes) == len(expected)
    # poison buried, never delivered; unwatched tube untouched
    assert job_state(poison_conn, poison_id)["state"] == "buried"
    assert report["buried"] == 1 and report["reserved"] == len(expected) + 1
    assert set(report["brokers"]) == {p.address for p in procs}
    for conn in conns:
        assert tube_counts(conn, "unwatched")["ready"] == 5
    reserves = spark.read.parquet(out).groupBy().max("reserves").collect()[0][0]
    assert reserves == 1
    assert actual.schema["id"].dataType == LongType() and \
        spark.read.parquet(out).schema["reserves"].dataType == IntegerType()


@pytest.mark.timeout(180)
def test_reserved_until_commit_touched_past_ttr_stop_and_replay(spark, server, conn_factory, tmp_path):
    """Before commit the jobs stay reserved (and touched past 3x TTR without a timeout); a query
    stopped mid-batch leaves them all in the broker; restarted from its checkpoint it replays the
    same batch, and after that commit they are gone."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    conn = conn_factory(server)
    n, ttr = 40, 2
    ids = put_jobs(conn, "slow", [f"s{i}".encode() for i in range(n)], ttr=ttr)
    gate = tmp_path / "gate"
    gate.write_text("closed")
    gate_path = str(gate)

    def hold(job_id):
        import os as _os
        import time as _time
        while _os.path.exists(gate_path):
            _time.sleep(0.05)
        return job_id

    hold_udf = F.udf(hold, LongType())
    ckpt = str(tmp_path / "ckpt")
    first = BatchRecorder()

    def start(recorder):
        df = reader(spark, hosts=server.address, tubes="slow", numPartitions=2)
        df = df.withColumn("held", hold_udf("id"))
        return df.writeStream.foreachBatch(recorder).option("checkpointLocation", ckpt).start()

    query = start(first)
    try:
        wait_until(lambda: tube_counts(conn, "slow")["reserved"] == n, 60, what="the batch to reserve every job")
        reserved_at = time.monotonic()
        assert all(job_state(conn, i)["state"] == "reserved" for i in ids), "jobs must not be deleted before commit"
        # The batch is now blocked in the UDF. Keep it running past 3x the TTR.
        time.sleep(max(0.0, reserved_at + 3 * ttr + 1.0 - time.monotonic()))
        stats = [job_state(conn, i) for i in ids]
        assert all(s["state"] == "reserved" for s in stats)
        assert sum(s["timeouts"] for s in stats) == 0
        assert int(conn.stats()["job-timeouts"]) == 0
        assert source_report(query) == {} or source_report(query).get("deleted", 0) == 0
    finally:
        query.stop()
    assert first.rows() == []
    # Stopped between planning and commit: everything goes back to ready, nothing is lost.
    wait_until(lambda: tube_counts(conn, "slow") == {"ready": n, "reserved": 0, "delayed": 0, "buried": 0}, 30,
               what="every job to be back in ready after the stop")

    gate.unlink()
    second = BatchRecorder()
    query = start(second)
    try:
        wait_until(lambda: tube_counts(conn, "slow")["ready"] + tube_counts(conn, "slow")["reserved"] == 0, 90,
                   what="the replayed batch to be committed and its jobs deleted")
        assert all(job_state(conn, i) is None for i in ids)
    finally:
        query.stop()
    batch_id, rows = second.batches[0]
    assert batch_id == 0, "the uncommitted batch 0 is replayed under its own id"
    assert sorted(r[2] for r in rows) == ids
    assert sorted(r[2] for r in second.rows()) == ids, "each job exactly once"
    assert {r[4] for r in rows} == {2}, "reserves counts the first (stopped) delivery too"
    assert int(conn.stats()["job-timeouts"]) == 0


@pytest.mark.timeout(120)
def test_available_now_drains_and_stops(spark, server, conn_factory, tmp_path):
    conn = conn_factory(server)
    late_conn = conn_factory(server)
    ids = put_jobs(conn, "an", [f"a{i}".encode() for i in range(90)])
    late_ids: list[int] = []

    def hook(batch_id, rows):
        if batch_id == 0:
            late_ids.extend(put_jobs(late_conn, "an", [b"late"] * 10))

    rec = BatchRecorder(hook)
    # minJobsPerTrigger/maxTriggerDelay do not apply under AvailableNow: the last batch (10 jobs)
    # must not wait an hour for 35.
    df = reader(spark, hosts=server.address, tubes="an", maxJobsPerTrigger=40, minJobsPerTrigger=35,
                maxTriggerDelay="1h")
    query = (df.writeStream.foreachBatch(rec).option("checkpointLocation", str(tmp_path / "ckpt"))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(90), "AvailableNow query did not stop by itself"
    assert query.exception() is None
    assert sorted(r[2] for r in rec.rows()) == ids
    assert len(rec.batches) >= 3 and max(len(rows) for _, rows in rec.batches) <= 40
    assert len(late_ids) == 10
    assert tube_counts(conn, "an") == {"ready": 10, "reserved": 0, "delayed": 0, "buried": 0}
    assert all(job_state(conn, i) is None for i in ids)


@pytest.mark.timeout(120)
def test_clear_errors_for_bad_options_and_unreachable_broker(spark):
    from spark_beanstalk.datasource import BeanstalkDataSource

    spark.dataSource.register(BeanstalkDataSource)   # explicit registration works as well

    def run(**options) -> str:
        try:
            query = reader(spark, **options).writeStream.format("noop").start()
        except Exception as exc:    # raised while planning
            return str(exc)
        try:
            query.awaitTermination(60)
        except Exception as exc:    # the query failed: awaitTermination re-raises its error
            return str(exc)
        finally:
            query.stop()
        return f"no error; query.exception()={query.exception()}"

    msg = run(hosts="127.0.0.1:1", maxJobsPerTriger="5")
    assert "unknown beanstalk source option(s) maxjobspertriger; known options: hosts, tubes, maxJobsPerTrigger" in msg
    msg = run(hosts="127.0.0.1:1", numPartitions="zero")
    assert "numPartitions='zero' is not an integer" in msg
    port = free_port()
    msg = run(hosts=f"127.0.0.1:{port}")
    assert f"cannot reach broker 127.0.0.1:{port}" in msg


# --- reader-level checks (no Spark query: the driver-side reader driven by hand) -------------------

def _crash(reader) -> None:
    """What a killed driver process looks like to the broker: every socket closes, nothing is deleted."""
    reader._inflight.abandon()


@pytest.mark.timeout(60)
def test_reader_restart_after_commit_deletes_the_committed_batch(server, conn_factory):
    """Crash after Spark committed batch 1 but before its jobs were deleted: they come back to ready,
    and the restarted reader deletes them (they are in the commit log) before reading on."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_beanstalk.source import SCHEMA, BeanstalkStreamReader

    conn = conn_factory(server)
    ids = put_jobs(conn, "r", [f"r{i}".encode() for i in range(10)])
    opts = SourceOptions.parse({"hosts": server.address, "tubes": "r", "prefetch": "false"})
    a = BeanstalkStreamReader(opts, SCHEMA)
    start = a.initialOffset()
    end = a.latestOffset(start, ReadMaxRows(4))
    parts = a.partitions(start, end)
    rows = [row for p in parts for batch in a.read(p) for row in batch.to_pylist()]
    assert sorted(r["id"] for r in rows) == ids[:4]
    assert {r["body"] for r in rows} == {f"r{i}".encode() for i in range(4)}
    assert tube_counts(conn, "r")["reserved"] == 4
    _crash(a)
    wait_until(lambda: tube_counts(conn, "r")["ready"] == 10, 10, what="the crashed reader's jobs to be released")

    b = BeanstalkStreamReader(opts, SCHEMA)
    try:
        nxt = b.latestOffset(end, ReadMaxRows(100))      # Spark restarts with start = the committed end
        assert decode_ranges(nxt["jobs"][server.address]["ids"]) == ids[4:]
        assert all(job_state(conn, i) is None for i in ids[:4]), "committed jobs are deleted, not redelivered"
        assert b.reportLatestOffset()["cleaned"] == 4
    finally:
        b.stop()


@pytest.mark.timeout(60)
def test_reader_restart_after_partial_delete_deletes_the_rest(server, conn_factory):
    """The previous run died half-way through deleting committed batch 1: blocks of 64 ids with
    some jobs gone fail their digest, yet the rest are still ours and are deleted, not read again."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_beanstalk.source import SCHEMA, BeanstalkStreamReader

    conn = conn_factory(server)
    # ids are judged by "broker up since before the batch was reserved", in whole seconds
    wait_until(lambda: int(conn.stats()["uptime"]) >= 3, 10, what="the broker up for 3 s")
    ids = put_jobs(conn, "pd", [b"pd%d" % i for i in range(150)])        # blocks of 64, 64, 22
    opts = SourceOptions.parse({"hosts": server.address, "tubes": "pd", "prefetch": "false"})
    a = BeanstalkStreamReader(opts, SCHEMA)
    start = a.initialOffset()
    end = a.latestOffset(start, ReadMaxRows(1000))
    assert decode_ranges(end["jobs"][server.address]["ids"]) == ids
    _crash(a)
    wait_until(lambda: tube_counts(conn, "pd")["ready"] == 150, 10, what="the crashed reader's jobs released")
    gone = ids[10:40] + ids[100:110]             # deleted before the crash: two blocks partly
    assert all(conn.delete(j) for j in gone)
    more = put_jobs(conn, "pd", [b"new%d" % i for i in range(5)])

    b = BeanstalkStreamReader(opts, SCHEMA)
    try:
        nxt = b.latestOffset(end, ReadMaxRows(1000))
        assert decode_ranges(nxt["jobs"][server.address]["ids"]) == more, "committed jobs read again"
        assert all(job_state(conn, i) is None for i in ids)
        report = b.reportLatestOffset()
        assert (report["cleaned"], report["lost_to_restart"]) == (110, 0)
    finally:
        b.stop()


@pytest.mark.timeout(60)
def test_reader_stop_during_read_ahead_releases_everything_and_never_reconnects(server, conn_factory):
    """stop() while the read-ahead is reserving the next batch: every reservation and connection
    goes at once (not after the TTR), stop() returns with its threads ended, and a step of the
    worker still running after stop (maintain, deletes, read-ahead) cannot reconnect and reserve."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_beanstalk.source import SCHEMA, BeanstalkSourceError, BeanstalkStreamReader

    conn = conn_factory(server)
    put_jobs(conn, "st", [b"s%d" % i for i in range(3000)], ttr=120)
    opts = SourceOptions.parse({"hosts": server.address, "tubes": "st", "maxJobsPerTrigger": "1000"})
    r = BeanstalkStreamReader(opts, SCHEMA)
    start = r.initialOffset()
    r.latestOffset(start, ReadMaxRows(1000))          # batch 1 held; the worker reads the next 1000 ahead
    inflight = r._inflight
    wait_until(lambda: tube_counts(conn, "st")["reserved"] > 1000, 10, what="the read-ahead to start", interval=0.002)
    r.stop()
    assert not any(t.is_alive() for t in inflight._threads), "stop() returned with its threads still running"
    inflight._maintain()                # what a worker step caught half-way by stop() does next
    inflight.flush_deletes()
    assert inflight.fill(inflight.pool, 1000) == 0

    def released() -> bool:
        st = conn.stats()
        return int(st["current-jobs-reserved"]) == 0 and int(st["current-connections"]) == 1
    wait_until(released, 5, what="no reservation and no connection of the stopped reader left")
    assert tube_counts(conn, "st")["ready"] == 3000
    with pytest.raises(BeanstalkSourceError, match="stopped"):
        r.latestOffset(start, ReadMaxRows(1000))
    assert int(conn.stats()["current-connections"]) == 1


@pytest.mark.timeout(90)
def test_a_replayed_batch_does_the_deletes_it_carries(tmp_path, conn_factory):
    """Brokers A and B; B dies while batch 1 runs, Spark commits batch 1 (B's deletes are owed, and
    batch 2's offset carries them), the driver dies during batch 2 and B comes back from its binlog
    with batch 1's jobs ready again. The restarted reader replays batch 2: it must also do the deletes
    batch 2 carries, or batch 1's committed jobs on B are read again into batch 3."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_beanstalk.source import SCHEMA, BeanstalkStreamReader

    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    a = broker_process(extra_args=["-b", str(a_dir)]).start()
    b = broker_process(extra_args=["-b", str(b_dir)]).start()
    try:
        put_jobs(conn_factory(a), "dr", [b"a1-%d" % i for i in range(5)])
        b_ids = put_jobs(conn_factory(b), "dr", [b"b1-%d" % i for i in range(5)])
        opts = SourceOptions.parse({"hosts": f"{a.address},{b.address}", "tubes": "dr", "prefetch": "false"})
        first = BeanstalkStreamReader(opts, SCHEMA)
        start = first.initialOffset()
        end1 = first.latestOffset(start, ReadMaxRows(100))
        assert decode_ranges(end1["jobs"][b.address]["ids"]) == b_ids
        first.partitions(start, end1)
        b.kill()                                          # B dies while batch 1 is written
        put_jobs(conn_factory(a), "dr", [b"a2-%d" % i for i in range(5)])
        end2 = first.latestOffset(end1, ReadMaxRows(100))  # batch 1 committed: A's deletes done, B's owed
        assert decode_ranges(end2["jobs"][b.address]["del"]) == b_ids, end2
        _crash(first)                                     # the driver dies during batch 2
        b.restart()                                       # from its binlog: batch 1's jobs are ready again
        conn_b = conn_factory(b)
        wait_until(lambda: tube_counts(conn_b, "dr")["ready"] == 5, 10, what="B's jobs back in ready")

        second = BeanstalkStreamReader(opts, SCHEMA)
        try:
            second.partitions(end1, end2)                 # Spark replays batch 2
            end3 = second.latestOffset(end2, ReadMaxRows(100))
            again = decode_ranges(end3["jobs"][b.address]["ids"]) if b.address in end3["jobs"] else []
            assert sorted(set(again) & set(b_ids)) == [], "committed batch 1 read again"
            assert all(job_state(conn_b, i) is None for i in b_ids)
        finally:
            second.stop()
    finally:
        a.stop()
        b.stop()


@pytest.mark.timeout(90)
def test_a_hung_broker_does_not_hold_up_the_touches_of_another(conn_factory):
    """Brokers A and B; B hangs (SIGSTOP: connections stay open, nothing answers) while a batch holds
    jobs of both. Touching B waits socketTimeout (3 s here), and so did A's touches when one thread
    served every broker: A's jobs (TTR 2 s) went past their TTR, back to ready, to be read again.
    Each broker has its own touch thread now."""
    import signal

    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_beanstalk.source import SCHEMA, BeanstalkStreamReader

    a = broker_process().start()
    b = broker_process().start()
    conn_a = conn_factory(a)
    try:
        a_ids = put_jobs(conn_a, "hb", [b"a%d" % i for i in range(5)], ttr=2)
        put_jobs(conn_factory(b), "hb", [b"b%d" % i for i in range(5)], ttr=2)
        opts = SourceOptions.parse({"hosts": f"{a.address},{b.address}", "tubes": "hb", "prefetch": "false",
                                    "socketTimeout": "3"})
        reader = BeanstalkStreamReader(opts, SCHEMA)
        try:
            end = reader.latestOffset(reader.initialOffset(), ReadMaxRows(100))
            assert decode_ranges(end["jobs"][a.address]["ids"]) == a_ids
            os.kill(b.pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 7       # two socket timeouts on B, and more
                while time.monotonic() < deadline:
                    states = {(job_state(conn_a, i) or {}).get("state") for i in a_ids}
                    assert states == {"reserved"}, f"A's held jobs went back: {states}"
                    time.sleep(0.1)
            finally:
                os.kill(b.pid, signal.SIGCONT)
        finally:
            reader.stop()
    finally:
        a.stop()
        b.stop()


@pytest.mark.timeout(60)
def test_a_job_whose_touch_failed_is_reacquired_not_read_again(broker, conn_factory):
    """A touch held up past the TTR (here: the broker link's lock held by the test; in life a stalled
    thread or a long GC) is answered NOT_FOUND. The job was let go while its batch delivered it, and
    came back ready into the next batch: read twice. It is re-acquired into its batch now.

    Our broker only: beanstalkd 1.12 does not release a job whose TTR passed while its connection
    is idle after a `reserve-with-timeout 0` (stats-job shows time-left going negative, state
    reserved, for as long as we watched), so the condition cannot be made there this way."""
    server = broker
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_beanstalk.source import SCHEMA, BeanstalkStreamReader

    conn = conn_factory(server)
    ids = put_jobs(conn, "tf", [b"tf%d" % i for i in range(3)], ttr=1)
    opts = SourceOptions.parse({"hosts": server.address, "tubes": "tf", "prefetch": "false"})
    reader = BeanstalkStreamReader(opts, SCHEMA)
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadMaxRows(100))
        assert decode_ranges(end["jobs"][server.address]["ids"]) == ids
        link = reader._inflight.brokers[0]
        with link.lock:                                   # no touch gets through: the TTR passes
            wait_until(lambda: tube_counts(conn, "tf")["ready"] == 3, 10, what="the TTR to pass")
        wait_until(lambda: tube_counts(conn, "tf")["reserved"] == 3, 10, what="the jobs re-acquired")
        rows = [row for p in reader.partitions(start, end) for batch in reader.read(p) for row in batch.to_pylist()]
        assert sorted(r["id"] for r in rows) == ids
        nxt = reader.latestOffset(end, ReadMaxRows(100))  # batch 1 committed
        assert nxt == end or server.address not in nxt["jobs"], f"read again: {nxt}"
        wait_until(lambda: all(job_state(conn, i) is None for i in ids), 10, what="batch 1 deleted")
    finally:
        reader.stop()


@pytest.mark.timeout(90)
def test_a_replay_rides_through_a_broker_restart(tmp_path, conn_factory):
    """A restarted query replays its uncommitted batch while the broker restarts too (one job is held
    by another client, so the replay waits for it, and the broker is killed and started again on its
    binlog meanwhile). The replay lost its connection and failed the query; now it reconnects, keeps
    what it had replayed and replays the rest."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_beanstalk.source import SCHEMA, BeanstalkStreamReader

    broker = broker_process(extra_args=["-b", str(tmp_path)]).start()
    try:
        conn = conn_factory(broker)
        ids = put_jobs(conn, "rr", [b"rr%d" % i for i in range(5)])
        opts = SourceOptions.parse({"hosts": broker.address, "tubes": "rr", "prefetch": "false"})
        first = BeanstalkStreamReader(opts, SCHEMA)
        start = first.initialOffset()
        end = first.latestOffset(start, ReadMaxRows(100))
        _crash(first)
        wait_until(lambda: tube_counts(conn, "rr")["ready"] == 5, 10, what="the crashed reader's jobs released")
        other = Connection(broker.host, broker.port)
        assert other.reserve_job(ids[0]) is not None          # held elsewhere: the replay waits for it
        watch = Connection(broker.host, broker.port)

        def restart_while_replaying() -> None:
            # the replay holds the four free jobs again (the fifth is the other client's)
            wait_until(lambda: int(watch.stats()["current-jobs-reserved"]) == 5, 30, what="the replay under way")
            watch.close()
            broker.restart()

        bounce = threading.Thread(target=restart_while_replaying, daemon=True)
        bounce.start()
        second = BeanstalkStreamReader(opts, SCHEMA)
        try:
            parts = second.partitions(start, end)              # raised ConnectionLost before the fix
            bounce.join(30)
            rows = [row for part in parts for batch in second.read(part) for row in batch.to_pylist()]
            assert sorted(r["id"] for r in rows) == ids
            second.latestOffset(end, ReadMaxRows(100))         # committed: every job goes
            conn_after = conn_factory(broker)
            wait_until(lambda: all(job_state(conn_after, i) is None for i in ids), 15, what="the batch deleted")
        finally:
            second.stop()
            other.close()
    finally:
        broker.stop()


@pytest.mark.timeout(60)
def test_reader_replays_uncommitted_batch_from_offset(server, conn_factory):
    """A fresh reader asked for partitions(end[N-1], end[N]) first rebuilds batch N with reserve-job."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_beanstalk.source import SCHEMA, BeanstalkStreamReader

    conn = conn_factory(server)
    ids = put_jobs(conn, "p", [f"p{i}".encode() for i in range(6)], ttr=5)
    opts = SourceOptions.parse({"hosts": server.address, "tubes": "p", "prefetch": "false", "numPartitions": "3"})
    a = BeanstalkStreamReader(opts, SCHEMA)
    start = a.initialOffset()
    end = a.latestOffset(start, ReadMaxRows(100))
    _crash(a)
    wait_until(lambda: tube_counts(conn, "p")["ready"] == 6, 10, what="release after the crash")

    b = BeanstalkStreamReader(opts, SCHEMA)
    try:
        parts = b.partitions(start, end)
        assert len(parts) == 3
        rows = [row for p in parts for batch in b.read(p) for row in batch.to_pylist()]
        assert sorted(r["id"] for r in rows) == ids
        assert {r["reserves"] for r in rows} == {2} and {r["ttr"] for r in rows} == {5}
        assert tube_counts(conn, "p")["reserved"] == 6
        b.latestOffset(end, ReadMaxRows(100))            # batch committed: its jobs go
        wait_until(lambda: all(job_state(conn, i) is None for i in ids), 10, what="deletes after commit")
        assert b.reportLatestOffset()["replayed"] == 6
    finally:
        b.stop()
