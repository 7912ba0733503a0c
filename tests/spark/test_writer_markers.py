"""The writer's replay protection: one marker tube per writer namespace, and a batch
replayed after a driver crash between its puts and Spark's commit is not put again."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from spark_beanstalk.client import Connection
from spark_beanstalk.options import WriterOptions
from spark_beanstalk.writer import (
    legacy_marker_tube,
    marker_exists,
    marker_namespace,
    marker_tube,
    write_marker,
)
from tests.helpers import drain_tube
from tests.spark.replay_app import run_query

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _marker_tubes(proc) -> list[str]:
    with Connection(proc.host, proc.port) as conn:
        return sorted(t for t in conn.list_tubes() if t.startswith("sbw."))


def test_200_batches_leave_one_marker_tube_per_namespace(server):
    opts = WriterOptions.parse({"hosts": server.address, "markerRetain": "1000"})
    spaces = [marker_namespace(q, opts, explicit=False) for q in ("query-a", "query-b")]
    with Connection(server.host, server.port) as conn:         # a marker left by the old one-tube-per-batch scheme
        conn.use(legacy_marker_tube(spaces[0], 3))
        conn.put(b'{"batch_id": 3}', priority=2**32 - 1, delay=2**31 - 1, ttr=1)
    for batch in range(200):
        for ns in spaces:
            assert marker_exists(opts, ns, batch) is None, batch     # not complete before its marker
            assert write_marker(opts, ns, batch, {"put": 1}) == 1
            assert marker_exists(opts, ns, batch) == server.address
    assert _marker_tubes(server) == sorted(marker_tube(ns) for ns in spaces)   # the legacy tube is gone too
    for ns in spaces:
        with Connection(server.host, server.port) as conn:
            assert conn.stats_tube(marker_tube(ns))["current-jobs-delayed"] == 1
        assert marker_exists(opts, ns, 199) == server.address and marker_exists(opts, ns, 200) is None
        assert marker_exists(opts, ns, 150) is None  # not a replay: a reused writer id's new checkpoint


def _run_until_killed(config: dict) -> None:
    """replay_app.py in its own process group (driver and JVM), which it SIGKILLs after batch `kill_at`'s puts."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               PYSPARK_PYTHON=sys.executable, SPARK_CONF_DIR=os.path.join(REPO, "conf"))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "spark", "replay_app.py"), json.dumps(config)],
                          check=False, capture_output=True, text=True, timeout=240, env=env, start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.timeout(600)
def test_batch_replayed_after_driver_kill_is_skipped(spark, broker, tmp_path):
    server = broker                       # markers behave alike on both servers (see the test above): one run
    src = tmp_path / "in"
    src.mkdir()
    expected = []
    for f in range(3):
        lines = [f"f{f}-r{r}" for r in range(100)]
        expected += lines
        (src / f"part-{f}.txt").write_text("\n".join(lines) + "\n")
    config = {"hosts": server.address, "tube": "rk", "input": str(src), "checkpoint": str(tmp_path / "ck"),
              "kill_at": 1, "flag": str(tmp_path / "killed")}
    _run_until_killed(config)
    assert os.path.exists(config["flag"])
    # the restart: the same query on the same checkpoint, here on the test session's Spark
    second = run_query(spark, config)
    assert second["1"] == {"put": 0, "skipped": True}, second      # Spark re-ran batch 1: not put again
    assert second["2"]["put"] == 100 and "0" not in second
    assert sorted(b.decode() for b in drain_tube(server, "rk")) == sorted(expected)   # each row once
    assert len(_marker_tubes(server)) == 1


def _put_partition(opts: WriterOptions, bodies: list[str], ctx: dict) -> dict:
    """Put `bodies` as one partition of a streaming write (`ctx`: partition, batch_id, namespace); its summary."""
    import pyarrow as pa
    from pyspark.sql.types import StringType, StructField, StructType

    from spark_beanstalk.writer import ColumnSpec, _arrow_chunks, put_partition

    spec = ColumnSpec.from_schema(StructType([StructField("body", StringType())]), opts)
    batch = pa.RecordBatch.from_pydict({"body": bodies}, schema=pa.schema([("body", pa.string())]))
    return put_partition(_arrow_chunks([batch], spec), spec, opts, ctx)


def test_partition_markers_skip_only_the_same_rows_and_go_with_the_batch_marker(server):
    """A partition put by an earlier attempt of the batch is skipped only if its rows are the same (in any order);
    the batch's marker clears the partition markers."""
    from spark_beanstalk.writer import PartitionMark

    opts = WriterOptions.parse({"hosts": server.address, "tube": "pm"})
    ns = marker_namespace("pm-query", opts, explicit=False)

    def put(bodies: list[str], partition: int = 0) -> dict:
        return _put_partition(opts, bodies, {"partition": partition, "batch_id": 7, "namespace": ns})

    first = put(["a", "b", "c"])
    assert first["put"] == 3 and not first["resumed"]
    again = put(["c", "a", "b"])                      # the replay's partition 0: the same rows, another order
    assert again["put"] == 0 and again["resumed"]
    other = put(["a", "b", "d"])                      # not the same rows (a non-deterministic plan): put them
    assert other["put"] == 3 and not other["resumed"]
    assert put(["a", "b", "c"], partition=1)["put"] == 3   # partition 1 has no mark yet
    assert sorted(drain_tube(server, "pm")) == sorted(bytes([c]) for c in b"abcabdabc")
    assert PartitionMark(ns, 7, 0).tube in _marker_tubes(server)
    write_marker(opts, ns, 7, {"put": 9})
    assert _marker_tubes(server) == [marker_tube(ns)]   # the batch marker alone


@pytest.mark.timeout(300)
def test_query_stopped_mid_batch_and_restarted_puts_the_batch_once(spark, broker, tmp_path):
    """query.stop() during foreachBatch: Spark gives up on the call, the Python function carries on and its
    tasks put the rows, but the batch fails and is replayed by the next start. Its partitions are found put
    (partition markers) and not put again: before them, the whole batch was there twice."""
    import threading
    import time

    from spark_beanstalk.writer import beanstalk_put
    from tests.helpers import last_committed, wait_until

    put = beanstalk_put.options(hosts=broker.address, tube="mid")
    ckpt = tmp_path / "ck"
    stopping, first = threading.Event(), [True]

    def write(df, batch_id: int) -> None:
        if batch_id == 2 and first[0]:
            first[0] = False
            stopping.set()
            time.sleep(3)                     # query.stop() happens now; this call goes on after it
        put(df, batch_id)

    def start():
        return (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 100).load()
                .selectExpr("cast(value as string) as body").writeStream.foreachBatch(write)
                .option("checkpointLocation", str(ckpt)).trigger(processingTime="200 milliseconds").start())

    query = start()
    assert stopping.wait(120), "batch 2 never started"
    query.stop()
    query = start()
    try:
        wait_until(lambda: last_committed(ckpt) >= 4, 120, what="batches 2-4 committed after the restart")
    finally:
        query.stop()
    end = (last_committed(ckpt) + 1) * 100
    counts: dict[int, int] = {}
    for body in drain_tube(broker, "mid"):
        counts[int(body)] = counts.get(int(body), 0) + 1
    assert [v for v in range(end) if v not in counts] == []
    assert {v: n for v, n in counts.items() if n > 1} == {}, "rows put twice"


def test_an_empty_partition_leaves_no_partition_marker(server):
    opts = WriterOptions.parse({"hosts": server.address, "tube": "pe"})
    done = _put_partition(opts, [], {"partition": 3, "batch_id": 1, "namespace": "e"})
    assert done["put"] == 0 and _marker_tubes(server) == []
