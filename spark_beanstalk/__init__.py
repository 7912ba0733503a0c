"""spark-beanstalk: a PySpark connector for beanstalkd tubes (and our broker)."""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`from spark_beanstalk import beanstalk_put` without importing pyspark at package import."""
    if name == "beanstalk_put":
        from spark_beanstalk.writer import beanstalk_put

        return beanstalk_put
    raise AttributeError(f"module 'spark_beanstalk' has no attribute {name!r}")
