"""spark-beanstalk: a PySpark connector for beanstalkd tubes (and our broker)."""
from __future__ import annotations

__version__ = "0.1.0"
