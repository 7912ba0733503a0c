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
        assert marker_exists(opts, ns, 150) == server.address and marker_exists(opts, ns, 200) is None


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
