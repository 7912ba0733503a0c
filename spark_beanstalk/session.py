"""Build a SparkSession whose executor Python workers run this interpreter.

Executors start `PYSPARK_PYTHON`; left unset they use the system `python3`, which may
lack this package, and then fail to connect back. Every entry point (jobs, tests,
benchmarks) gets its session here.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def ensure_worker_python() -> None:
    """Point Spark's Python workers at the current interpreter unless the user chose one."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def get_spark(app_name: str = "spark-beanstalk", master: str = "local[2]", **conf: str) -> SparkSession:
    """A SparkSession tuned for small local runs (few shuffle partitions, no UI)."""
    ensure_worker_python()
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.streaming.metricsEnabled", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
    )
    for key, value in conf.items():
        builder = builder.config(key.replace("__", "."), value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark
