"""The chaos soak (bench/soak.py), short: a streaming query reading through a broker that is
killed, cut off and partitioned, and restarted from its checkpoint, all at seeded random times,
while a producer keeps putting (24 s); and a streaming query writing through the same faults
with foreachBatch(beanstalk_put) (18 s). Each fault has its own test
(test_source_faults.py, test_writer_restart.py, test_writer_markers.py); these run them one after
another without a pause, as a long soak does, and keep the tool working.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
SEED = 166  # its schedule in 24 s: cut, kill, partition, requery
WRITE_SEED = 9  # in 18 s: kill, requery, cut


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_soak_every_fault_in_a_row_loses_and_duplicates_nothing(spark, tmp_path):
    out = tmp_path / "soak.json"
    status = _soak_module().main(["--minutes", "0.4", "--seed", str(SEED), "--rate", "300", "--max-jobs", "200",
                                  "--drain-timeout", "120", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["acked"] > 3000
    assert {"cut", "kill"} <= set(result["actions"]) and sum(result["actions"].values()) >= 3, result["actions"]
    assert result["drained"], "acknowledged jobs still missing from the sink, or left in the tube"
    assert result["lost_count"] == 0 and result["duplicated_count"] == 0 and result["unexpected_count"] == 0, result
    assert result["failures"] == []
    assert status == 0


def test_soak_writer_through_faults_loses_nothing(spark, tmp_path):
    # foreachBatch(beanstalk_put) only: the format("beanstalk") sink shares the partition writer and the markers,
    # and a run of it costs the Spark worker (the suite's critical path) another ~45 s; run it with bench/soak.py
    out = tmp_path / "soak.json"
    status = _soak_module().main(["--side", "write", "--sink", "foreachbatch", "--minutes", "0.3",
                                  "--seed", str(WRITE_SEED), "--rows-per-batch", "1000", "--drain-timeout", "120",
                                  "--out", str(out)])
    result = json.loads(out.read_text())
    assert {"kill", "requery"} <= set(result["actions"]), result["actions"]
    assert result["settled"], "the query did not commit two batches after the faults"
    assert result["rows_committed"] >= 10_000, result
    assert result["lost_count"] == 0 and result["unexpected_count"] == 0, result
    assert result["duplicated_count"] <= result["dup_bound"], result
    assert result["markers"] == 1, "one completion marker per writer, whatever the batches and faults"
    assert result["failures"] == []
    assert status == 0
