"""The "beanstalk" Python Data Source: a streaming reader (source.py) and writers (writer.py).

Use it with ``spark.readStream.format("beanstalk")`` (auto-registered through the
``pyspark_beanstalk`` module, or ``register(spark)`` / ``spark.dataSource.register``).
Options are parsed and validated by ``SourceOptions`` / the writer's options in
``spark_beanstalk.options``; nothing here opens a connection.
"""
from __future__ import annotations

from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from spark_beanstalk.options import OptionError, SourceOptions


class BeanstalkDataSource(DataSource):
    """spark.readStream.format("beanstalk") reads jobs; df.write(Stream).format("beanstalk") puts them."""

    @classmethod
    def name(cls) -> str:
        return "beanstalk"

    def __init__(self, options: Any) -> None:
        # Spark hands a case-insensitive mapping; keep a plain, picklable copy.
        super().__init__(options)
        self.options = dict(options or {})

    def schema(self) -> StructType:
        from spark_beanstalk.source import SCHEMA

        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from spark_beanstalk.source import SCHEMA, BeanstalkStreamReader

        opts = SourceOptions.parse(self.options)
        if schema is not None and [f.name for f in schema.fields] != [f.name for f in SCHEMA.fields]:
            raise OptionError(
                "the beanstalk source has a fixed schema (" + ", ".join(f.name for f in SCHEMA.fields)
                + "); do not pass .schema(...), select or cast columns downstream instead")
        return BeanstalkStreamReader(opts, SCHEMA)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from spark_beanstalk.writer import make_batch_writer

        return make_batch_writer(self.options, schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from spark_beanstalk.writer import make_stream_writer

        return make_stream_writer(self.options, schema, overwrite)


def register(spark: Any) -> None:
    """Register the "beanstalk" format on a session explicitly (auto-registration needs no call)."""
    spark.dataSource.register(BeanstalkDataSource)
