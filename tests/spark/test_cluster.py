"""The connector on a real cluster: `spark-submit --master local-cluster[2,1,1024]` runs two
executors in their own JVMs with their own Python workers, and the package reaches them
the way the README documents: a zip of the packages passed with --py-files (pyspark puts
.zip/.egg/.jar there on the workers' path, not .whl), and PYSPARK_PYTHON naming an
interpreter that has pyspark's own dependencies.

The application (tests/spark/remote_app.py) chains the source (AvailableNow), the
streaming data source writer, foreachBatch(beanstalk_put) and the batch writer through
our broker and beanstalkd 1.12 (the other way round from the Connect test).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.spark.test_connect import (
    APP,
    REPO,
    app_env,
    check_chain,
    enqueue,
    run_app,
    spark_bin,
)

PACKAGES = ("spark_beanstalk", "pyspark_beanstalk", "beanstalk_rules")


def build_zip(out: str) -> str:
    """As the README says:
    `python -m zipfile -c spark_beanstalk.zip spark_beanstalk pyspark_beanstalk beanstalk_rules`."""
    proc = subprocess.run([sys.executable, "-m", "zipfile", "-c", out, *PACKAGES], check=False,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.timeout(900)
def test_every_reader_and_writer_on_a_local_cluster(server_factory, tmp_path):
    a, b = server_factory("beanstalkd"), server_factory("ours")
    bodies = enqueue(a, "in", 600)
    t0 = time.monotonic()
    shipped = build_zip(str(tmp_path / "spark_beanstalk.zip"))
    env = app_env()
    env.pop("PYTHONPATH")               # only the shipped zip: not this checkout
    argv = [spark_bin("spark-submit"), "--master", "local-cluster[2,1,1024]",
            "--conf", "spark.executor.memory=512m", "--conf", "spark.sql.shuffle.partitions=2",
            "--py-files", shipped, APP]
    config = {"remote": None, "a": a.address, "b": b.address, "work": str(tmp_path), "per_trigger": 1000}
    result = run_app(argv, config, env, 840)
    check_chain(a, b, bodies, result)
    origins = [json.loads(o) for o in result["executors"]]
    assert len({o["pid"] for o in origins}) >= 2, origins                 # several worker processes
    # imported from the shipped zip (Spark copies it into each executor's work directory)
    assert all(o["file"].endswith("spark_beanstalk.zip/spark_beanstalk/__init__.py") for o in origins), origins
    print(f"cluster chain: {time.monotonic() - t0:.1f}s")
