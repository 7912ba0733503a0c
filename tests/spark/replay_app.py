"""Driver of the replay test: a streaming query into foreachBatch(beanstalk_put) that kills
its own process group (Python driver and JVM: a driver crash) right after batch N was put
and marked complete, before Spark records the batch in the commit log.

`python replay_app.py CONFIG`; run again with the same checkpoint to restart. Prints one
``RESULT {json}`` line with what beanstalk_put did for each batch of the run.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any


def main(config: dict[str, Any]) -> dict[str, Any]:
    from spark_beanstalk.session import get_spark
    from spark_beanstalk.writer import beanstalk_put

    spark = get_spark("replay-test", master="local[1]")
    put = beanstalk_put.options(hosts=config["hosts"], tube=config["tube"])   # no writerId: the query id
    done: dict[str, Any] = {}

    def write(df: Any, batch_id: int) -> None:
        summary = put(df, batch_id)
        done[str(batch_id)] = {"put": summary.put, "skipped": summary.skipped}
        if batch_id == config["kill_at"] and not os.path.exists(config["flag"]):
            open(config["flag"], "w").close()
            os.killpg(os.getpgrp(), signal.SIGKILL)        # after the puts and the marker, before the commit

    query = (spark.readStream.format("text").option("maxFilesPerTrigger", 1).load(config["input"])
             .selectExpr("value as body").writeStream.foreachBatch(write)
             .option("checkpointLocation", config["checkpoint"]).trigger(availableNow=True).start())
    query.awaitTermination()
    return done


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
