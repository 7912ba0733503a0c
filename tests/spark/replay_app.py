"""Driver of the replay test: a streaming query into foreachBatch(beanstalk_put) that kills
its own process group (Python driver and JVM: a driver crash) right after batch N was put
and marked complete, before Spark records the batch in the commit log.

`python replay_app.py CONFIG` runs until the kill. The restart on the same checkpoint is
the same query (`run_query`), which the test runs on its own SparkSession: one Spark start
fewer than a second process. Prints one ``RESULT {json}`` line if it ever gets that far.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any


def run_query(spark: Any, config: dict[str, Any], after_put: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Text files -> foreachBatch(beanstalk_put), AvailableNow; returns what beanstalk_put did per batch."""
    from spark_beanstalk.writer import beanstalk_put

    put = beanstalk_put.options(hosts=config["hosts"], tube=config["tube"])   # no writerId: the query id
    done: dict[str, Any] = {}

    def write(df: Any, batch_id: int) -> None:
        summary = put(df, batch_id)
        done[str(batch_id)] = {"put": summary.put, "skipped": summary.skipped}
        if after_put is not None:
            after_put(batch_id)

    query = (spark.readStream.format("text").option("maxFilesPerTrigger", 1).load(config["input"])
             .selectExpr("value as body").writeStream.foreachBatch(write)
             .option("checkpointLocation", config["checkpoint"]).trigger(availableNow=True).start())
    if not query.awaitTermination(180):
        query.stop()
        raise AssertionError("the replay query did not finish within 180 s")
    if query.exception() is not None:
        raise AssertionError(f"the replay query failed: {query.exception()}")
    return done


def main(config: dict[str, Any]) -> dict[str, Any]:
    from spark_beanstalk.session import get_spark

    def crash(batch_id: int) -> None:
        if batch_id == config["kill_at"] and not os.path.exists(config["flag"]):
            open(config["flag"], "w").close()
            os.killpg(os.getpgrp(), signal.SIGKILL)        # after the puts and the marker, before the commit

    return run_query(get_spark("replay-test", master="local[1]"), config, crash)


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
