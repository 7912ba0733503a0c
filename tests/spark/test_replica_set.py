"""The connector follows the leader of a replica set (issue 15 item 4): ``hosts`` =
``cluster:a,b,c`` is one logical broker. Real processes: etcd + 3 members with
``--sync-replicas 1`` on loopback; the leader is SIGKILLed mid-stream and a new one is
elected (about 1.5 s). The source must deliver every job exactly once into an idempotent
sink (one file per batch id) without the query failing; a writer must put every row,
duplicating only rows whose INSERTED reply was lost with the connection, and none at all when
the leader is stopped with SIGTERM (it hands over: every put it read is answered).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest

from spark_beanstalk.client import Connection, ConnectionLost
from spark_beanstalk.embedded import ServerProcess
from spark_beanstalk.writer import beanstalk_put
from tests.helpers import (
    BatchFiles,
    ReplicaSet,
    assert_exactly_once,
    drain_tube,
    left_in,
    put_bodies,
    start_query,
    wait_until,
)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

JOBS = 2000


@pytest.fixture
def replica_set(tmp_path):
    rs = ReplicaSet(str(tmp_path / "rs"))
    yield rs
    rs.stop()


def _new_leader(rs: ReplicaSet, old: ServerProcess) -> ServerProcess:
    wait_until(lambda: rs.leader() not in (None, old), 15, what="a new leader")
    leader = rs.leader()
    assert leader is not None
    return leader


def test_source_reads_through_a_leader_failover(spark, replica_set, tmp_path):
    """SIGKILL of the leader while a batch is being written (jobs reserved, not yet deleted):
    0 lost, 0 duplicates, the query never fails, and it reads on from the new leader."""
    rs = replica_set
    leader = rs.leader()
    assert leader is not None
    first = [f"a-{i}".encode() for i in range(JOBS)]
    put_bodies(leader, "t", first)
    killed: list[ServerProcess] = []

    def kill_during_batch(batch_id: int, rows: list[tuple[str, str]]) -> None:
        if not killed and batch_id >= 2:
            killed.append(rs.kill_leader())

    sink = BatchFiles(tmp_path / "out", hook=kill_during_batch)
    started = time.monotonic()
    query = start_query(spark, sink, tmp_path / "ckpt", rs.hosts, maxJobsPerTrigger=200)
    try:
        wait_until(lambda: bool(killed) or query.exception() is not None, 60, what="the leader killed mid-batch")
        new = _new_leader(rs, killed[0])
        second = [f"b-{i}".encode() for i in range(JOBS // 2)]
        put_bodies(new, "t", second)                  # taken by the new leader, read through the same `hosts`
        expected = {(rs.hosts, b.decode()) for b in first + second}

        def done() -> bool:
            if query.exception() is not None:
                raise AssertionError(f"the query failed: {query.exception()}")
            return expected <= set(sink.seen()) and left_in(new, "t") == 0

        wait_until(done, 120, interval=0.25, what="every job in the sink and none left ready or reserved")
        assert_exactly_once(sink, expected)
        assert query.exception() is None
        progress = query.lastProgress or {}
        print(f"source through failover: {len(expected)} jobs in {time.monotonic() - started:.1f}s, "
              f"{len(sink.batches())} batches, progress {progress.get('batchId')}")
    finally:
        query.stop()


def _total_jobs(rs: ReplicaSet, tube: str) -> int:
    leader = rs.leader()
    if leader is None:
        return 0
    try:
        with Connection(leader.host, leader.port, timeout=5, connect_timeout=1) as conn:
            return int((conn.stats_tube(tube) or {}).get("total-jobs", 0))
    except (ConnectionLost, OSError):
        return 0


def _end_leader_when(rs: ReplicaSet, at_least: int, ended: list[Any], planned: bool = False) -> None:
    """Once `at_least` rows are in the tube, SIGKILL the leader (SIGTERM if `planned`); record it in `ended`."""
    wait_until(lambda: _total_jobs(rs, "w") >= at_least, 120, interval=0.01, what=f"{at_least} rows put")
    ended.append(rs.stop_leader() if planned else rs.kill_leader())


def test_writer_puts_through_a_leader_failover(spark, replica_set):
    """A write with the leader SIGKILLed at a third: every row arrives on the new leader; the only
    duplicates are rows whose reply was lost (at most one window per partition's connection)."""
    rs = replica_set
    rows, partitions, window = 3000, 2, 16
    df = spark.range(rows, numPartitions=partitions).selectExpr("cast(id as string) as body")
    killed: list[Any] = []
    killer = threading.Thread(target=_end_leader_when, args=(rs, rows // 3, killed), daemon=True)
    killer.start()
    started = time.monotonic()
    summary = beanstalk_put.options(hosts=rs.hosts, tube="w", window=window).write(df)
    elapsed = time.monotonic() - started
    killer.join(30)
    assert killed, "the leader was not killed during the write"
    assert summary.reconnect_rounds >= 1, "the write finished before the leader went down"
    new = _new_leader(rs, killed[0])
    counts = Counter(int(b) for b in drain_tube(new, "w"))
    duplicates = sum(c - 1 for c in counts.values())
    print(f"writer through failover: {rows} rows in {elapsed:.1f}s, duplicates {duplicates}, "
          f"reconnect rounds {summary.reconnect_rounds}, failovers {summary.failovers}")
    assert set(counts) == set(range(rows))
    assert duplicates <= window * partitions
    assert summary.put == rows
    assert list(summary.hosts) == [rs.hosts]       # one logical broker, whichever member led


def test_writer_puts_every_row_once_through_a_planned_leader_restart(spark, replica_set):
    """The leader SIGTERMed at a third of a write (a planned restart). It answers every put it read
    before it closes, and its replicas have them all (docs/replication.md, "Stopping the leader"); the
    puts it never read were never applied. So the writer, putting again what had no reply, makes no
    duplicate, where a crash allows up to a window per partition."""
    rs = replica_set
    rows, partitions, window = 6000, 2, 64
    df = spark.range(rows, numPartitions=partitions).selectExpr("cast(id as string) as body")
    stopped: list[Any] = []
    stopper = threading.Thread(target=_end_leader_when, args=(rs, rows // 3, stopped, True), daemon=True)
    stopper.start()
    summary = beanstalk_put.options(hosts=rs.hosts, tube="w", window=window).write(df)  # default backoff
    stopper.join(30)
    assert stopped, "the leader was not stopped during the write"
    assert summary.reconnect_rounds >= 1, "the write finished before the leader went down"
    new = _new_leader(rs, stopped[0])
    counts = Counter(int(b) for b in drain_tube(new, "w"))
    print(f"writer through a planned restart: duplicates {sum(c - 1 for c in counts.values())}, "
          f"reconnect rounds {summary.reconnect_rounds}, paused {summary.reconnect_seconds:.2f}s")
    assert set(counts) == set(range(rows))
    assert max(counts.values()) == 1, [row for row, c in counts.items() if c > 1][:10]
    # the new leader takes puts ~0.2 s after the stop, so the pauses stay short: from 0.1 s, doubling
    # (the old default began at 1 s: every pause at least that)
    assert summary.reconnect_seconds / summary.reconnect_rounds < 1.0, summary


def test_a_member_that_does_not_lead_is_a_lost_connection_not_lost_jobs(replica_set):
    """A leader whose lease lapsed (a pause, a VM stall) answers the changes it reads before it steps
    down as a replica does: OUT_OF_MEMORY (DRAINING to a put). The source counted a touch or delete
    so answered as a job gone (and let it go: read again later), and a reserve so answered failed the
    query. It is a lost connection now: find the leader again, re-acquire. Shown against a replica,
    which answers the same way every time; a lone broker (not listed as cluster:) gets a clear error."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from spark_beanstalk.options import SourceOptions
    from spark_beanstalk.source import SCHEMA, BeanstalkSourceError, BeanstalkStreamReader
    from spark_beanstalk.source_wire import delete_jobs, failed_commands

    rs = replica_set
    leader = rs.leader()
    assert leader is not None
    replica = next(m for m in rs.members if m is not leader)
    with Connection(leader.host, leader.port) as conn:
        conn.use("nl")
        ids = [conn.put(b"nl%d" % i) for i in range(3)]
        assert failed_commands(conn, [b"touch %d\r\n" % ids[0]], b"TOUCHED") == [0]  # NOT_FOUND: not ours
    wait_until(lambda: ReplicaSet.caught_up(leader, replica), 15, what="the replica has the jobs")
    with Connection(replica.host, replica.port) as conn, pytest.raises(ConnectionLost, match="does not lead"):
        failed_commands(conn, [b"touch %d\r\n" % i for i in ids], b"TOUCHED")
    with Connection(replica.host, replica.port) as conn, pytest.raises(ConnectionLost, match="does not lead"):
        delete_jobs(conn, ids)
    reader = BeanstalkStreamReader(SourceOptions.parse({"hosts": replica.address, "tubes": "nl",
                                                        "prefetch": "false"}), SCHEMA)
    try:
        with pytest.raises(BeanstalkSourceError, match=r"OUT_OF_MEMORY.*a replica: list the set as cluster:"):
            reader.latestOffset(reader.initialOffset(), ReadMaxRows(10))
    finally:
        reader.stop()
    with Connection(leader.host, leader.port) as conn:
        assert all(conn.stats_job(i) is not None for i in ids)  # nothing was deleted or lost
