"""The Spark application of the Connect and cluster tests, run in its own process.

`python remote_app.py CONFIG` with ``"remote": "sc://..."`` runs as a Spark Connect
client; under `spark-submit` (``"remote": null``) it uses the session spark-submit
configured (e.g. ``local-cluster[2,1,1024]`` with the package shipped by --py-files).
It chains every reader and writer of the connector through the brokers A and B:

1. source (tube ``in`` on A), AvailableNow -> ``writeStream.format("beanstalk")`` -> ``s1`` on B
2. source (``s1`` on B), AvailableNow -> ``foreachBatch(beanstalk_put)``, settings from
   the session conf only -> ``s2`` on A
3. source (``s2`` on A), AvailableNow -> Parquet (the file sink: exactly-once)
4. batch ``df.write.format("beanstalk")`` of that Parquet -> ``s3`` on B

and prints one JSON line: the Parquet bodies and, under spark-submit, where the
executors imported spark_beanstalk from. The test checks the brokers itself.
"""
from __future__ import annotations

import json
import sys
from typing import Any


def _session(remote: str | None) -> Any:
    from pyspark.sql import SparkSession

    if remote:
        return SparkSession.builder.remote(remote).getOrCreate()
    return SparkSession.builder.getOrCreate()


def _drain(spark: Any, hosts: str, tube: str, per_trigger: int, checkpoint: str) -> Any:
    return (spark.readStream.format("beanstalk").option("hosts", hosts).option("tubes", tube)
            .option("maxJobsPerTrigger", str(per_trigger)).load().selectExpr("body")
            .writeStream.option("checkpointLocation", checkpoint).trigger(availableNow=True))


def _finish(query: Any, what: str) -> None:
    if not query.awaitTermination(300):
        query.stop()
        raise SystemExit(f"{what} did not finish within 300 s")
    if query.exception() is not None:
        raise SystemExit(f"{what} failed: {query.exception()}")


def _executor_origins(spark: Any) -> list[str]:
    """Where each executor's Python worker imported spark_beanstalk from (cluster runs only)."""
    def origin(_rows: Any) -> Any:
        import os
        import sys

        import spark_beanstalk

        yield json.dumps({"pid": os.getpid(), "file": spark_beanstalk.__file__, "path": sys.path[:3]})

    return sorted(set(spark.sparkContext.parallelize(range(4), 4).mapPartitions(origin).collect()))


def main(config: dict[str, Any]) -> dict[str, Any]:
    from spark_beanstalk.writer import beanstalk_put

    spark = _session(config.get("remote"))
    a, b, work, per = config["a"], config["b"], config["work"], int(config["per_trigger"])
    q = (_drain(spark, a, "in", per, f"{work}/ck1").format("beanstalk")
         .option("hosts", b).option("tube", "s1").start())
    _finish(q, "source -> writeStream.format('beanstalk')")
    spark.conf.set("spark.beanstalk.hosts", a)
    spark.conf.set("spark.beanstalk.tube", "s2")
    q = _drain(spark, b, "s1", per, f"{work}/ck2").foreachBatch(beanstalk_put).start()
    _finish(q, "source -> foreachBatch(beanstalk_put)")
    q = _drain(spark, a, "s2", per, f"{work}/ck3").format("parquet").option("path", f"{work}/out").start()
    _finish(q, "source -> parquet")
    out = spark.read.parquet(f"{work}/out")
    out.write.format("beanstalk").option("hosts", b).option("tube", "s3").mode("append").save()
    bodies = sorted(bytes(r.body).decode() for r in out.collect())
    result: dict[str, Any] = {"bodies": bodies}
    if not config.get("remote"):
        result["executors"] = _executor_origins(spark)
    spark.stop()
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
