"""The connector on a real cluster: `spark-submit --master local-cluster[2,1,1024]` runs two
executors in their own JVMs with their own Python workers, and the package reaches them
the way the README documents: a wheel built from this checkout, passed with --py-files,
and PYSPARK_PYTHON naming an interpreter that has pyspark's own dependencies.

The application (tests/spark/remote_app.py) chains the source (AvailableNow), the
streaming data source writer, foreachBatch(beanstalk_put) and the batch writer through
our broker and beanstalkd 1.12 (the other way round from the Connect test).
"""
from __future__ import annotations

import glob
import json
import os
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


def build_wheel(out_dir: str) -> str:
    """`pip wheel --no-deps .` (offline when setuptools>=68 and wheel are installed: the test extra)."""
    base = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out_dir]
    proc = subprocess.run([*base, "--no-build-isolation", REPO], check=False, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        proc = subprocess.run([*base, REPO], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = glob.glob(os.path.join(out_dir, "spark_beanstalk-*.whl"))
    return wheel


@pytest.mark.timeout(900)
def test_every_reader_and_writer_on_a_local_cluster(server_factory, tmp_path):
    a, b = server_factory("beanstalkd"), server_factory("ours")
    bodies = enqueue(a, "in", 600)
    t0 = time.monotonic()
    wheel = build_wheel(str(tmp_path / "dist"))
    t_wheel = time.monotonic() - t0
    env = app_env()
    env.pop("PYTHONPATH")               # only the shipped wheel: not this checkout
    argv = [spark_bin("spark-submit"), "--master", "local-cluster[2,1,1024]",
            "--conf", "spark.executor.memory=512m", "--conf", "spark.sql.shuffle.partitions=2",
            "--py-files", wheel, APP]
    config = {"remote": None, "a": a.address, "b": b.address, "work": str(tmp_path), "per_trigger": 1000}
    result = run_app(argv, config, env, 840)
    check_chain(a, b, bodies, result)
    origins = [json.loads(o) for o in result["executors"]]
    print(origins)
    assert len({o["pid"] for o in origins}) >= 2, origins                 # several worker processes
    assert all(".whl" in o["file"] for o in origins), origins             # imported from the wheel
    print(f"cluster chain: wheel {t_wheel:.1f}s, total {time.monotonic() - t0:.1f}s")
