"""The streaming reader of the "beanstalk" data source: the Spark methods, nothing else.

Where things happen (pyspark 4.3, see docs/source.md):

* ``latestOffset``/``partitions``/``commit``/``reportLatestOffset`` run on ONE reader
  object in ONE long-lived Python process per query run (the driver-side streaming
  source runner). There the reader owns an ``InFlight`` (spark_beanstalk/inflight.py):
  the beanstalk connections, the reservations on them, touches, read-ahead and deletes.
  It is created lazily, on first use, and never pickled.
* ``read(partition)`` runs in executor Python workers on an unpickled copy of the
  reader that has none of that state: the bodies travel inside the partition.

Life of a job: reserved in ``latestOffset`` (or ahead of time by the read-ahead) ->
named in the batch's end offset (spark_beanstalk/offsets.py) -> shipped to an executor
in an ``InputPartition`` -> touched while the batch runs -> deleted at the top of the
next ``latestOffset`` (whose ``start`` is only ever an offset Spark has already written
to its commit log), before anything new is reserved. If a connection or a broker goes
away meanwhile, the in-flight manager re-acquires the held jobs on a new connection; if
the process dies, the broker releases them (at-least-once) and a restarted query
rebuilds the uncommitted batch from the offset with ``reserve-job <id>``.
"""
from __future__ import annotations

import array
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from spark_beanstalk.batch import Batch, JobColumns
from spark_beanstalk.brokers import BeanstalkSourceError
from spark_beanstalk.inflight import InFlight
from spark_beanstalk.lag import Lag
from spark_beanstalk.offsets import Offset, make_offset, offset_seq
from spark_beanstalk.options import SourceOptions

__all__ = ["SCHEMA", "SCHEMA_DDL", "BeanstalkPartition", "BeanstalkSourceError", "BeanstalkStreamReader"]

_LAG_REFRESH_SECONDS = 1.0     # progress: stats-tube at most this often, so idle polling stays cheap
_WAIT_REFRESH_SECONDS = 0.25   # while a batch waits for minJobsPerTrigger: how stale the ready count may be
_UNLIMITED = 1 << 62
_TRACE = bool(os.environ.get("SPARK_BEANSTALK_TRACE"))  # executors print read() timings to stderr

SCHEMA = StructType([
    StructField("id", LongType(), False),
    StructField("tube", StringType(), True),
    StructField("body", BinaryType(), True),
    StructField("priority", LongType(), True),
    StructField("ttr", IntegerType(), True),
    StructField("reserves", IntegerType(), True),
    StructField("broker", StringType(), False),
    StructField("reserved_at", TimestampType(), True),
])
SCHEMA_DDL = ("id BIGINT, tube STRING, body BINARY, priority BIGINT, ttr INT, reserves INT, "
              "broker STRING, reserved_at TIMESTAMP")


# --- partitions ----------------------------------------------------------------------------

class BeanstalkPartition(InputPartition):
    """One Spark partition: its jobs as one Arrow record batch (bodies included).

    Built by the driver-side reader in ``partitions``: Arrow pickles as a few buffers, so
    shipping it is cheap, and ``read`` on the executor has nothing left to convert.
    """

    def __init__(self, broker: str, batch: pa.RecordBatch) -> None:
        super().__init__(None)
        self.broker = broker
        self.batch = batch    # pyarrow.RecordBatch in SCHEMA's column order

    def __repr__(self) -> str:
        return f"BeanstalkPartition({self.broker}, {self.batch.num_rows} jobs)"


def arrow_batch(schema: pa.Schema, broker: str, cols: JobColumns, lo: int, hi: int) -> pa.RecordBatch:
    """Rows lo:hi of a broker's columns as a pyarrow.RecordBatch of `schema` (the Arrow form of SCHEMA)."""
    ids, tubes, bodies = cols.ids[lo:hi], cols.tubes[lo:hi], cols.bodies[lo:hi]
    n = len(ids)
    first = tubes[0] if tubes else ""
    # pa.array is slow on large Python ints; array('q') converts them in C.
    return pa.RecordBatch.from_arrays([
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(array.array("q", ids))]),
        pa.repeat(first, n) if tubes.count(first) == n else pa.array(tubes, pa.string()),
        pa.array(bodies, pa.binary()),
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(array.array("q", cols.pris[lo:hi]))]),
        pa.array(cols.ttrs[lo:hi], pa.int32()),
        pa.array(cols.reserves[lo:hi], pa.int32()),
        pa.repeat(broker, n),
        pa.Array.from_buffers(pa.timestamp("us", tz="UTC"), n,
                              [None, pa.py_buffer(array.array("q", cols.reserved_at_us[lo:hi]))]),
    ], schema=schema)


class BeanstalkStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Reads jobs from beanstalkd tubes; see the module docstring for the life of a job."""

    def __init__(self, options: SourceOptions, schema: StructType | None = None) -> None:
        self.opts = options
        self.schema = schema or SCHEMA
        self._init_runtime()

    # Everything below is runtime state of the driver-side runner: never pickled.
    def _init_runtime(self) -> None:
        self._inflight: InFlight | None = None
        self._stopped = False
        self._cleaned = False
        self._lag = Lag(self.opts.tubes)
        self._last_batch_at: float | None = None   # time.monotonic() when the last batch was planned

    def __getstate__(self) -> dict[str, Any]:
        return {"opts": self.opts, "schema": self.schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.opts = state["opts"]
        self.schema = state["schema"]
        self._init_runtime()

    def _started(self, resuming: bool = False) -> InFlight:
        """The in-flight manager, connected on first use. `resuming`: Spark handed an offset from
        the checkpoint (a batch to replay, or a start past 0), so the brokers were right before."""
        if self._stopped:     # never connect again after stop: nothing would close it
            raise BeanstalkSourceError("beanstalk source: the reader was stopped")
        if self._inflight is None:
            inflight = InFlight(self.opts)
            inflight.start(resuming)
            self._inflight = inflight
        return self._inflight

    # --- Spark API: offsets ---------------------------------------------------------------
    def initialOffset(self) -> Offset:
        return make_offset(0, {})

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_jobs_per_trigger > 0:
            return ReadMaxRows(self.opts.max_jobs_per_trigger)
        if self.opts.min_jobs_per_trigger > 0:
            # Not ReadAllAvailable: that is what Trigger.Once passes, and Once must not wait.
            return ReadMaxRows(_UNLIMITED)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: read at most what is ready in the tubes now, then stop."""
        inflight = self._started()
        budget: dict[str, int] = {}
        for b in inflight.brokers:
            inflight.wait_up(b)
            with b.lock:
                assert b.control is not None
                budget[b.address] = sum(int((b.control.stats_tube(t) or {}).get("current-jobs-ready", 0))
                                        for t in self.opts.tubes)
        inflight.an_budget = budget

    def _budget(self, limit: ReadLimit, inflight: InFlight) -> int:
        """Admission control, in one place: how many jobs the next batch may take."""
        budget = max(0, int(limit.max_rows)) if isinstance(limit, ReadMaxRows) else _UNLIMITED
        if inflight.an_budget is not None:
            budget = min(budget, sum(inflight.an_budget.values()))
        return budget

    def _hold_back(self, limit: ReadLimit, inflight: InFlight) -> bool:
        """minJobsPerTrigger/maxTriggerDelay: True while fewer jobs are ready (in the tubes plus
        read ahead) than the minimum and the delay since the last batch has not passed yet.

        Not under AvailableNow (its batches must drain a fixed amount and stop) nor Trigger.Once
        (Spark passes ReadAllAvailable): both take what there is at once.
        """
        if self.opts.min_jobs_per_trigger <= 0 or inflight.an_budget is not None or not isinstance(limit, ReadMaxRows):
            return False
        now = time.monotonic()
        if self._last_batch_at is None:
            self._last_batch_at = now     # the first batch of a run waits as if one had just run
        if now - self._last_batch_at >= self.opts.max_trigger_delay:
            return False
        self._lag.refresh(inflight.brokers, _WAIT_REFRESH_SECONDS)
        return self._lag.ready() + inflight.pool.count() < self.opts.min_jobs_per_trigger

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:
        start_seq = offset_seq(start)
        inflight = self._started(resuming=start_seq > 0)
        # Spark calls latestOffset(start=X) only once the batch ending at X is in its commit log.
        if not self._cleaned:
            self._cleaned = True
            if start_seq > 0 and start_seq not in inflight.batches:
                inflight.cleanup(start)
        # Delete the committed batch before reserving: a job of it that went back to ready must
        # not be reserved into the next batch first.
        inflight.commit(start_seq)
        inflight.flush_deletes()
        inflight.check_health()
        pending = inflight.batches.get(start_seq + 1)
        if pending is not None and pending.offset is not None:   # planned earlier, not used yet (defensive)
            return pending.offset
        budget = self._budget(limit, inflight)
        if budget <= 0 or self._hold_back(limit, inflight):
            return start     # byte-identical: Spark sees no new data and asks again
        may_block = self.opts.reserve_timeout > 0 and inflight.an_budget is None
        batch = inflight.next_batch(start_seq + 1, budget, may_block)
        # Read ahead for the next batch while this one runs (not under AvailableNow: its end is fixed).
        if (self.opts.prefetch and inflight.an_budget is None and isinstance(limit, ReadMaxRows)
                and budget < _UNLIMITED):
            inflight.prefetch_cap = budget
        inflight.work.set()
        if batch.count() == 0:
            return start
        self._last_batch_at = time.monotonic()
        return inflight.plan(batch)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        """Counters shown under sources[].latestOffset in the query's progress."""
        if self._inflight is None:
            return None
        report = self._inflight.report(len(self._inflight.batches))
        self._lag.refresh(self._inflight.brokers, _LAG_REFRESH_SECONDS)
        report["lag"] = self._lag.report()
        report["backlog"] = report["lag"]["backlog"]
        report["oldestReadyAgeSeconds"] = report["lag"]["oldestReadyAgeSeconds"]
        return report

    def commit(self, end: Offset) -> None:
        """Backstop: latestOffset normally deleted these jobs already."""
        if self._inflight is None:
            return
        self._inflight.commit(offset_seq(end))
        self._inflight.work.set()

    def stop(self) -> None:
        self._stopped = True
        if self._inflight is not None:
            self._inflight.close()
        self._inflight = None

    # --- Spark API: planning and reading ----------------------------------------------------
    def partitions(self, start: Offset, end: Offset) -> Sequence[InputPartition]:
        seq = offset_seq(end)
        if seq == offset_seq(start):
            return []
        inflight = self._started(resuming=True)  # first call of a run: the replay of a checkpointed batch
        t0 = time.perf_counter()
        batch = inflight.batches.get(seq)
        if batch is None or batch.offset != end:
            batch = inflight.replay(end)
        parts = self._split(batch)
        inflight.timing.partitions_ms += (time.perf_counter() - t0) * 1000
        return parts

    def _split(self, batch: Batch) -> list[InputPartition]:
        from pyspark.sql.pandas.types import to_arrow_schema

        schema = to_arrow_schema(self.schema, timezone="UTC")
        parts: list[InputPartition] = []
        n = self.opts.num_partitions
        for addr in sorted(batch.jobs):
            cols = batch.jobs[addr]
            size = len(cols.ids)
            if size == 0:
                continue
            step = -(-size // min(n, size))
            for lo in range(0, size, step):
                parts.append(BeanstalkPartition(addr, arrow_batch(schema, addr, cols, lo, lo + step)))
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Yield the partition's record batch: it was built by ``partitions`` on the driver side."""
        assert isinstance(partition, BeanstalkPartition)
        if _TRACE:
            print(f"SBTRACE read {partition.batch.num_rows} rows pid={os.getpid()}", file=sys.stderr)
        yield partition.batch
