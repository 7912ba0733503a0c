"""Auto-registration hook: pyspark registers the ``DefaultSource`` of every top-level
``pyspark_*`` module it finds on the Python path, under ``DefaultSource.name()``.
So with this package installed, ``spark.readStream.format("beanstalk")`` works in a
fresh SparkSession without an explicit ``spark.dataSource.register(...)``.
"""
from spark_beanstalk.datasource import BeanstalkDataSource


class DefaultSource(BeanstalkDataSource):
    """The "beanstalk" data source (see spark_beanstalk.datasource)."""


__all__ = ["DefaultSource"]
