"""The connector through Spark Connect: a local Connect server with the package importable
server-side, and a Connect client in its own process (tests/spark/remote_app.py) that
runs the source (AvailableNow), ``writeStream.format("beanstalk")``,
``foreachBatch(beanstalk_put)`` with no option but the session conf, and the batch
writer, against our broker and beanstalkd 1.12.

The client runs in a subprocess: the test session's classic SparkSession and a Connect
session would share pyspark's active-session slots in one process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from spark_beanstalk.client import Connection, encode_put
from tests.helpers import drain_tube, free_port, tube_jobs, wait_for_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APP = os.path.join(REPO, "tests", "spark", "remote_app.py")
JOBS = 600


def spark_bin(name: str) -> str:
    import pyspark

    return os.path.join(os.path.dirname(pyspark.__file__), "bin", name)


def app_env(**extra: str) -> dict[str, str]:
    """Environment of Spark processes started by these tests: this checkout importable,
    the Python workers running this interpreter, the repo's quiet log4j2 config."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != REPO]
    env.update(PYTHONPATH=os.pathsep.join([REPO, *paths]), PYSPARK_PYTHON=sys.executable,
               PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_CONF_DIR=os.path.join(REPO, "conf"),
               PYTHONWARNINGS="ignore::FutureWarning")
    env.update(extra)
    return env


def enqueue(proc, tube: str, count: int) -> list[str]:
    bodies = [f"job-{i:05d}" for i in range(count)]
    with Connection(proc.host, proc.port) as conn:
        conn.use(tube)
        for reply in conn.pipeline([encode_put(b.encode(), 100, 0, 60) for b in bodies]):
            assert reply.status == b"INSERTED", reply
    return bodies


def check_chain(a, b, bodies: list[str], result: dict) -> None:
    """Exactly once into the Parquet sink and into the batch writer's tube; nothing left behind."""
    assert result["bodies"] == bodies, "Parquet sink: every job exactly once"
    assert sorted(x.decode() for x in drain_tube(b, "s3")) == bodies, "batch writer: every row exactly once"
    empty = {"ready": 0, "reserved": 0, "delayed": 0, "buried": 0}
    for proc, tube in ((a, "in"), (b, "s1"), (a, "s2"), (b, "s3")):
        assert tube_jobs(proc, tube) == empty, (proc.kind, tube)


def run_app(argv: list[str], config: dict, env: dict[str, str], timeout: float) -> dict:
    proc = subprocess.run([*argv, json.dumps(config)], check=False, capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=config["work"])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture
def connect_server(tmp_path):
    """`spark-submit --class ...SparkConnectServer`: the connect jar ships in pyspark's jars/."""
    port = free_port()
    argv = [spark_bin("spark-submit"), "--master", "local[2]",
            "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
            "--conf", f"spark.connect.grpc.binding.port={port}",
            "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
            "--conf", "spark.sql.shuffle.partitions=2"]
    with open(tmp_path / "connect-server.log", "wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=log, env=app_env(), stdin=subprocess.DEVNULL)
        try:
            wait_for_port("127.0.0.1", port, 180, server)
            yield f"sc://127.0.0.1:{port}"
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)


@pytest.mark.timeout(600)
def test_every_reader_and_writer_through_spark_connect(connect_server, server_factory, tmp_path):
    a, b = server_factory("ours"), server_factory("beanstalkd")
    bodies = enqueue(a, "in", JOBS)
    t0 = time.monotonic()
    config = {"remote": connect_server, "a": a.address, "b": b.address, "work": str(tmp_path),
              "per_trigger": 1000}
    result = run_app([sys.executable, APP], config, app_env(), 540)
    check_chain(a, b, bodies, result)
    # foreachBatch ran server-side without a query id: the batches were put, and no marker tube
    # was left behind for a namespace nobody can find again
    with Connection(a.host, a.port) as conn:
        assert not [t for t in conn.list_tubes() if t.startswith("sbw.")]
    print(f"connect chain: {time.monotonic() - t0:.1f}s")
