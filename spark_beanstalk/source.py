"""The streaming reader of the "beanstalk" data source.

Where things happen (pyspark 4.3, see docs/source.md):

* ``latestOffset``/``partitions``/``commit``/``reportLatestOffset`` run on ONE reader
  object in ONE long-lived Python process per query run (the driver-side streaming
  source runner). That process holds the beanstalk connections, the reservations on
  them, the jobs' bodies and a touch thread. It opens them lazily, on first use.
* ``read(partition)`` runs in executor Python workers on an unpickled copy of the
  reader that has none of that state: the bodies travel inside the partition.

Life of a job: reserved in ``latestOffset`` (on one of the reservation connections of
its broker, which stays open for the life of the micro-batch) -> named in the batch's
end offset (compact ranges of ids per broker) -> shipped to an executor in an
``InputPartition`` -> touched by the touch thread before its TTR runs out while the
batch runs -> deleted at the top of the next ``latestOffset`` (whose ``start`` is only
ever an offset Spark has already written to its commit log) or in ``commit``. If the
process dies first, the broker releases the job to ready (at-least-once); a restarted
query rebuilds the uncommitted batch from the offset with ``reserve-job <id>``.
"""
from __future__ import annotations

import array
import logging
import os
import re
import threading
import time
from collections import deque
from typing import Iterator, NamedTuple, Sequence

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import (BinaryType, IntegerType, LongType, StringType, StructField, StructType,
                               TimestampType)

from spark_beanstalk.client import BeanstalkError, Connection, ConnectionLost, split_replies
from spark_beanstalk.options import SourceOptions

log = logging.getLogger("spark_beanstalk.source")
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

OFFSET_VERSION = 1
_PIPELINE_WINDOW = 1024


class BeanstalkSourceError(RuntimeError):
    """A broker the source needs cannot be used (unreachable, protocol error)."""


# --- offsets -------------------------------------------------------------------------------

def encode_ranges(ids: Sequence[int]) -> str:
    """[1,2,3,7,9,10] -> '1-3,7,9-10' (ids sorted first)."""
    out: list[str] = []
    it = iter(sorted(ids))
    try:
        lo = hi = next(it)
    except StopIteration:
        return ""
    for i in it:
        if i == hi + 1:
            hi = i
            continue
        out.append(str(lo) if lo == hi else f"{lo}-{hi}")
        lo = hi = i
    out.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return ",".join(out)


def decode_ranges(text: str) -> list[int]:
    ids: list[int] = []
    for part in text.split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            ids.extend(range(int(lo), int(hi) + 1))
        else:
            ids.append(int(lo))
    return ids


def make_offset(seq: int, jobs: dict[str, tuple[str, list[int]]]) -> dict:
    """The offset of batch `seq`: {"seq": n, "v": 1, "jobs": {"host:port": {"sid": server id, "ids": "1-9,12"}}}.

    Spark serialises it with json.dumps and compares offsets as strings, so every key
    is always present and dicts are built in sorted key order.
    """
    return {
        "jobs": {addr: {"ids": encode_ranges(ids), "sid": sid}
                 for addr, (sid, ids) in sorted(jobs.items()) if ids},
        "seq": int(seq),
        "v": OFFSET_VERSION,
    }


def offset_jobs(offset: dict) -> dict[str, tuple[str, list[int]]]:
    return {addr: (entry.get("sid", ""), decode_ranges(entry.get("ids", "")))
            for addr, entry in (offset or {}).get("jobs", {}).items()}


def _field(body: bytes, key: bytes) -> bytes | None:
    i = body.find(key)
    if i < 0:
        return None
    i += len(key)
    j = body.find(b"\n", i)
    return body[i:] if j < 0 else body[i:j]


def parse_stats_job(body: bytes) -> tuple[str, int, int, int, str]:
    """(tube, pri, ttr, reserves, state) from a stats-job YAML body, without a general parser."""
    tube = _field(body, b"\ntube: ")
    pri = _field(body, b"\npri: ")
    ttr = _field(body, b"\nttr: ")
    reserves = _field(body, b"\nreserves: ")
    state = _field(body, b"\nstate: ")
    if tube is not None and pri is not None and ttr is not None and reserves is not None and state is not None:
        try:
            return tube.strip(b'"').decode(), int(pri), int(ttr), int(reserves), state.decode()
        except ValueError:
            pass
    return _parse_stats_job_slow(body)


def _parse_stats_job_slow(body: bytes) -> tuple[str, int, int, int, str]:
    tube, pri, ttr, reserves, state = "", 0, 0, 0, ""
    for line in body.split(b"\n"):
        key, _, value = line.partition(b": ")
        if key == b"tube":
            tube = value.strip(b'"').decode()
        elif key == b"pri":
            pri = int(value)
        elif key == b"ttr":
            ttr = int(value)
        elif key == b"reserves":
            reserves = int(value)
        elif key == b"state":
            state = value.decode()
    return tube, pri, ttr, reserves, state


# One whole stats-job reply as beanstalkd 1.12 and our broker print it (fields in this order).
# Groups: id, tube, state, pri, ttr, reserves. Replies in another layout take the slow path.
_STATS_JOB = re.compile(
    rb"OK \d+\r\n---\nid: (\d+)\ntube: ([^\n]*)\nstate: ([a-z]+)\npri: (\d+)\nage: [^\n]*\ndelay: [^\n]*\n"
    rb"ttr: (\d+)\ntime-left: [^\n]*\nfile: [^\n]*\nreserves: (\d+)\n[^\r]*\r\n")


class JobStats(NamedTuple):
    """Columns of the stats of the jobs that still exist, in the order asked; `missing` = the others."""

    ids: list[int]
    tubes: list[str]
    pris: list[int]
    ttrs: list[int]
    reserves: list[int]
    states: list[str]
    missing: list[int]


def stats_jobs(conn: Connection, ids: Sequence[int]) -> JobStats:
    """stats-job every id, one round trip per _PIPELINE_WINDOW ids, each parsed with one regex pass.

    The source pays this for every job it reads, so it avoids per-reply Python work: the
    replies of a run are matched at once, checked against the ids asked for, and only if
    that fails (a job gone, an unexpected layout) parsed one by one.
    """
    if len(ids) <= _PIPELINE_WINDOW:
        return _stats_run(conn, ids)
    out = JobStats([], [], [], [], [], [], [])
    for lo in range(0, len(ids), _PIPELINE_WINDOW):
        for column, part in zip(out, _stats_run(conn, ids[lo:lo + _PIPELINE_WINDOW])):
            column.extend(part)
    return out


def _stats_run(conn: Connection, ids: Sequence[int]) -> JobStats:
    raw = conn.bulk(b"".join([b"stats-job %d\r\n" % j for j in ids]))
    rows = _STATS_JOB.findall(raw)
    found = [int(r[0]) for r in rows]
    if len(rows) != len(ids) or found != list(ids):
        return _stats_jobs_slow(raw, ids)
    names: dict[bytes, str] = {}
    for r in rows:
        if r[1] not in names:
            names[r[1]] = r[1].strip(b'"').decode()
    states = {b"reserved": "reserved"}
    return JobStats(found, [names[r[1]] for r in rows], [int(r[3]) for r in rows], [int(r[4]) for r in rows],
                    [int(r[5]) for r in rows], [states.get(r[2]) or r[2].decode() for r in rows], [])


def _stats_jobs_slow(raw: bytes, ids: Sequence[int]) -> JobStats:
    out = JobStats([], [], [], [], [], [], [])
    for jid, (_line, body) in zip(ids, split_replies(raw)):
        if body is None:
            out.missing.append(jid)
            continue
        tube, pri, ttr, reserves, state = parse_stats_job(body)
        for column, value in zip(out, (jid, tube, pri, ttr, reserves, state)):
            column.append(value)
    return out


def failed_commands(conn: Connection, commands: Sequence[bytes], ok: bytes) -> list[int]:
    """Send commands with one-line replies (delete, touch, release, bury) in runs of
    _PIPELINE_WINDOW; returns the indexes of those whose reply was not `ok` (usually none)."""
    failed: list[int] = []
    want = ok + b"\r\n"
    for lo in range(0, len(commands), _PIPELINE_WINDOW):
        run = commands[lo:lo + _PIPELINE_WINDOW]
        raw = conn.bulk(b"".join(run))
        if raw.count(want) != len(run):
            failed.extend(lo + i for i, line in enumerate(raw.split(b"\r\n")[:len(run)]) if line != ok)
    return failed


def delete_jobs(conn: Connection, ids: Sequence[int]) -> int:
    """Delete the jobs; returns how many were deleted (the rest were gone or not ours)."""
    return len(ids) - len(failed_commands(conn, [b"delete %d\r\n" % j for j in ids], b"DELETED"))


# --- partitions ----------------------------------------------------------------------------

class BeanstalkPartition(InputPartition):
    """One Spark partition: its jobs as one Arrow record batch (bodies included).

    Built by the driver-side reader in ``partitions``: Arrow pickles as a few buffers, so
    shipping it is cheap, and ``read`` on the executor has nothing left to convert.
    """

    def __init__(self, broker: str, batch) -> None:
        super().__init__(None)
        self.broker = broker
        self.batch = batch    # pyarrow.RecordBatch in SCHEMA's column order

    def __repr__(self) -> str:
        return f"BeanstalkPartition({self.broker}, {self.batch.num_rows} jobs)"


def arrow_batch(schema, broker: str, cols: tuple[list, ...], lo: int, hi: int):
    """Rows lo:hi of a broker's columns (ids, tubes, bodies, pris, ttrs, reserves, reserved_at_us)
    as a pyarrow.RecordBatch of `schema` (the Arrow form of SCHEMA)."""
    import pyarrow as pa

    ids, tubes, bodies, pris, ttrs, reserves, at_us = (c[lo:hi] for c in cols)
    n = len(ids)
    first = tubes[0] if tubes else ""
    # pa.array is slow on large Python ints; array('q') converts them in C.
    return pa.RecordBatch.from_arrays([
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(array.array("q", ids))]),
        pa.repeat(first, n) if tubes.count(first) == n else pa.array(tubes, pa.string()),
        pa.array(bodies, pa.binary()),
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(array.array("q", pris))]),
        pa.array(ttrs, pa.int32()),
        pa.array(reserves, pa.int32()),
        pa.repeat(broker, n),
        pa.Array.from_buffers(pa.timestamp("us", tz="UTC"), n, [None, pa.py_buffer(array.array("q", at_us))]),
    ], schema=schema)


class _Batch:
    """The jobs of one planned micro-batch, as held by the driver-side reader."""

    __slots__ = ("seq", "offset", "columns", "held")

    def __init__(self, seq: int) -> None:
        self.seq = seq
        self.offset: dict | None = None
        # broker address -> column lists (ids, tubes, bodies, pris, ttrs, reserves, reserved_at_us)
        self.columns: dict[str, tuple[list, ...]] = {}
        # reservation connection -> ids of this batch held on it
        self.held: dict["_ResConn", list[int]] = {}

    def extend(self, rc: "_ResConn", columns: tuple[list, ...]) -> None:
        """Add the jobs just reserved on rc, as columns in the order of `self.columns`' lists."""
        cols = self.columns.get(rc.broker.address)
        if cols is None:
            cols = self.columns[rc.broker.address] = ([], [], [], [], [], [], [])
        for mine, new in zip(cols, columns):
            mine.extend(new)
        self.held.setdefault(rc, []).extend(columns[0])

    def count(self) -> int:
        return sum(len(c[0]) for c in self.columns.values())


class _ResConn:
    """A reservation connection and the jobs held on it (shared with the touch thread)."""

    def __init__(self, broker: "_Broker", conn: Connection) -> None:
        self.broker = broker
        self.conn = conn
        self.lock = threading.Lock()
        self.held: dict[int, int] = {}    # job id -> ttr (seconds)
        self.last_touch = 0.0              # monotonic time every held job was last reserved/touched (at the latest)
        self.min_ttr = 0
        self.dead = False

    def add_held(self, ids: list[int], ttrs: list[int], now: float) -> None:
        """Jobs just reserved on this connection (touch scheduling follows the smallest TTR)."""
        if not ids:
            return
        if not self.held:
            self.last_touch = now
            self.min_ttr = min(ttrs)
        else:
            self.min_ttr = min(self.min_ttr, min(ttrs))
        self.held.update(zip(ids, ttrs))

    def touch_due(self, fraction: float) -> float:
        return self.last_touch + max(self.min_ttr, 1) * fraction


class _Broker:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self.sid = ""
        self.control: Connection | None = None   # stats, replay checks, cleanup deletes
        self.conns: list[_ResConn] = []
        self.probe = 1                            # next reserve window (grows while jobs keep coming)
        self.counters = dict(reserved=0, touched=0, deleted=0, buried=0, replayed=0, lost=0, cleaned=0)


class BeanstalkStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Reads jobs from beanstalkd tubes; see the module docstring for the life of a job."""

    def __init__(self, options: SourceOptions, schema: StructType | None = None) -> None:
        self.opts = options
        self.schema = schema or SCHEMA
        self._init_runtime()

    # Everything below is runtime state of the driver-side runner: never pickled.
    def _init_runtime(self) -> None:
        self._brokers: list[_Broker] | None = None
        self._batches: dict[int, _Batch] = {}
        self._touch_thread: threading.Thread | None = None
        self._wake: threading.Event | None = None
        self._stopping = False
        self._an_budget: dict[str, int] | None = None
        self._cleaned_upto = -1
        self._last_seq = 0
        self._timing = dict(reserve_ms=0.0, prefetch_ms=0.0, stats_ms=0.0, touch_ms=0.0, delete_ms=0.0,
                            partitions_ms=0.0)
        self._touch_error: str | None = None
        self._polls = 0
        # prefetch and background deletes (see _worker_loop)
        self._pool: _Batch | None = None
        self._pool_lock: threading.Lock | None = None
        self._prefetch_cap = 0
        self._delete_queue: deque = deque()
        self._worker: threading.Thread | None = None
        self._work: threading.Event | None = None
        self._worker_error: BaseException | None = None
        self._delete_lock: threading.Lock | None = None

    def __getstate__(self) -> dict:
        return {"opts": self.opts, "schema": self.schema}

    def __setstate__(self, state: dict) -> None:
        self.opts = state["opts"]
        self.schema = state["schema"]
        self._init_runtime()

    # --- connections --------------------------------------------------------------------
    def _connect(self, host: str, port: int) -> Connection:
        try:
            return Connection(host, port, timeout=self.opts.socket_timeout, connect_timeout=10.0,
                              **self.opts.security.connect_kwargs())
        except ConnectionLost as exc:
            raise BeanstalkSourceError(
                f"beanstalk source: cannot reach broker {host}:{port} ({exc}); check the 'hosts' option") from None

    def _ensure_started(self) -> list[_Broker]:
        if self._brokers is not None:
            return self._brokers
        brokers = []
        for host, port in self.opts.hosts:
            b = _Broker(host, port)
            b.control = self._connect(host, port)
            try:
                stats = b.control.stats()
                b.sid = str(stats.get("id", "")) if isinstance(stats, dict) else ""
            except BeanstalkError:
                b.sid = ""
            for _ in range(self.opts.num_partitions):
                b.conns.append(self._new_res_conn(b))
            brokers.append(b)
        self._brokers = brokers
        self._wake = threading.Event()
        self._touch_thread = threading.Thread(target=self._touch_loop, name="beanstalk-touch", daemon=True)
        self._touch_thread.start()
        self._pool = _Batch(-1)
        self._pool_lock = threading.Lock()
        self._delete_lock = threading.Lock()
        self._work = threading.Event()
        self._worker = threading.Thread(target=self._worker_loop, name="beanstalk-prefetch", daemon=True)
        self._worker.start()
        return brokers

    def _new_res_conn(self, b: _Broker) -> _ResConn:
        conn = self._connect(b.host, b.port)
        tubes = list(self.opts.tubes)
        cmds = [f"watch {t}\r\n".encode() for t in tubes]
        if "default" not in tubes:
            cmds.append(b"ignore default\r\n")
        for reply in conn.pipeline(cmds):
            if reply.status != b"WATCHING":
                raise BeanstalkSourceError(f"beanstalk source: {b.address} refused to watch {tubes}: {reply.status!r}")
        return _ResConn(b, conn)

    def _res_conn_with_room(self, b: _Broker, start: int) -> tuple[int, _ResConn]:
        """The first live reservation connection at index >= start with room; opens one if none."""
        cap = self.opts.jobs_per_connection
        i = start
        while i < len(b.conns):
            rc = b.conns[i]
            if not rc.dead and len(rc.held) < cap:
                return i, rc
            i += 1
        rc = self._new_res_conn(b)
        b.conns.append(rc)
        return len(b.conns) - 1, rc

    # --- Spark API: offsets ---------------------------------------------------------------
    def initialOffset(self) -> dict:
        return make_offset(0, {})

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_jobs_per_trigger > 0:
            return ReadMaxRows(self.opts.max_jobs_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: read at most what is ready in the tubes now, then stop."""
        brokers = self._ensure_started()
        budget = {}
        for b in brokers:
            total = 0
            for tube in self.opts.tubes:
                st = b.control.stats_tube(tube)
                if st:
                    total += int(st.get("current-jobs-ready", 0))
            budget[b.address] = total
        self._an_budget = budget
        log.info("beanstalk source: AvailableNow will read at most %s", budget)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        brokers = self._ensure_started()
        self._raise_touch_error()
        if self._worker_error is not None:
            err, self._worker_error = self._worker_error, None
            raise err
        start_seq = int((start or {}).get("seq", 0))
        # Spark calls latestOffset(start=X) only once the batch ending at X is in its commit log.
        if self._cleaned_upto < 0:
            self._cleaned_upto = start_seq
            if start_seq > 0 and start_seq not in self._batches:
                self._cleanup_unheld(start)
        # Queued now, started after this call's reserving: both go to the same broker, and the
        # reserving is what Spark is waiting for.
        self._delete_committed(start_seq, wake=False)
        self._last_seq = max(self._last_seq, start_seq)
        # A batch planned earlier and not used yet (defensive; Spark does not normally do this).
        pending = self._batches.get(start_seq + 1)
        if pending is not None and pending.offset is not None:
            self._work.set()
            return pending.offset

        if isinstance(limit, ReadMaxRows):
            budget = max(0, int(limit.max_rows))
        else:
            budget = 1 << 62
        if self._an_budget is not None:
            budget = min(budget, sum(self._an_budget.values()))
        if budget <= 0:
            self._flush_deletes()
            return start

        t0 = time.perf_counter()
        assert self._pool_lock is not None
        with self._pool_lock:
            batch = self._pool
            self._pool = _Batch(-1)
            batch.seq = start_seq + 1
            if batch.count() > budget:
                self._give_back(batch, batch.count() - budget)
            got = self._fill_batch(brokers, batch, budget - batch.count())
            if got == 0 and batch.count() == 0 and self.opts.reserve_timeout > 0 and self._an_budget is None:
                self._reserve_blocking(brokers[self._polls % len(brokers)], batch, budget)
        self._timing["reserve_ms"] += (time.perf_counter() - t0) * 1000
        # Read ahead for the next batch while this one runs (not under AvailableNow: its end is fixed).
        if self.opts.prefetch and self._an_budget is None and isinstance(limit, ReadMaxRows):
            self._prefetch_cap = budget
        self._work.set()    # the deletes queued above, then the read-ahead
        if batch.count() == 0:
            # No new batch: Spark may end the query now (AvailableNow, Once, a stop) and the process
            # may be killed without stop(): the committed jobs must be gone before we answer.
            self._flush_deletes()
            return start
        batch.offset = make_offset(batch.seq, {addr: (self._broker(addr).sid, cols[0])
                                               for addr, cols in batch.columns.items()})
        self._batches[batch.seq] = batch
        self._last_seq = batch.seq
        return batch.offset

    def _fill_batch(self, brokers: list[_Broker], batch: _Batch, budget: int) -> int:
        """Reserve (without blocking) up to `budget` jobs into `batch`, spread over the brokers."""
        if budget <= 0:
            return 0
        self._polls += 1
        n_brokers = len(brokers)
        first = self._polls % n_brokers
        order = brokers[first:] + brokers[:first]
        total = 0
        for k, b in enumerate(order):
            share = -(-budget // (n_brokers - k))   # ceil: what is left, spread over the brokers left
            if self._an_budget is not None:
                share = min(share, self._an_budget.get(b.address, 0))
            if share <= 0:
                continue
            got = self._reserve_from(b, batch, share)
            budget -= got
            total += got
            if self._an_budget is not None:
                self._an_budget[b.address] -= got
        return total

    def _give_back(self, batch: _Batch, excess: int) -> None:
        """Release the last `excess` jobs of a (prefetched) batch: the limit shrank."""
        drop: dict[int, int] = {}     # id -> priority
        for addr in sorted(batch.columns, key=lambda a: -len(batch.columns[a][0])):
            cols = batch.columns[addr]
            k = min(excess - len(drop), len(cols[0]))
            if k <= 0:
                break
            drop.update(zip(cols[0][-k:], cols[3][-k:]))
            for c in cols:
                del c[-k:]
        for rc, ids in list(batch.held.items()):
            gone = [j for j in ids if j in drop]
            if not gone:
                continue
            batch.held[rc] = [j for j in ids if j not in drop]
            with rc.lock:
                for j in gone:
                    rc.held.pop(j, None)
                if not rc.dead:
                    try:
                        failed_commands(rc.conn, [b"release %d %d 0\r\n" % (j, drop[j]) for j in gone], b"RELEASED")
                    except ConnectionLost as exc:
                        self._conn_lost(rc, exc)

    def reportLatestOffset(self) -> dict | None:
        """Counters shown under sources[].latestOffset in the query's progress."""
        if self._brokers is None:
            return None
        per_broker = {}
        totals = dict(held=0, reserved=0, touched=0, deleted=0, buried=0, replayed=0, lost=0, cleaned=0,
                      connections=0)
        for b in self._brokers:
            held = sum(len(rc.held) for rc in b.conns)
            entry = dict(b.counters, held=held, connections=len(b.conns))
            per_broker[b.address] = entry
            for key in totals:
                totals[key] += entry[key]
        report = dict(totals)
        report["brokers"] = per_broker
        report["batches_held"] = len(self._batches)
        report["prefetched"] = self._pool.count() if self._pool is not None else 0
        report["timing_ms"] = {k: round(v, 1) for k, v in self._timing.items()}
        if self._an_budget is not None:
            report["available_now_left"] = sum(self._an_budget.values())
        return report

    def commit(self, end: dict) -> None:
        """Backstop: latestOffset normally deleted these jobs already."""
        if self._brokers is None:
            return
        self._delete_committed(int((end or {}).get("seq", 0)))

    def stop(self) -> None:
        try:
            self._flush_deletes()    # committed batches must not come back
        except Exception as exc:
            log.warning("beanstalk source: deletes at stop failed: %s", exc)
        self._stopping = True
        if self._work is not None:
            self._work.set()
        if self._wake is not None:
            self._wake.set()
        for b in self._brokers or []:
            for rc in b.conns:
                with rc.lock:
                    rc.conn.close()
                    rc.dead = True
            if b.control is not None:
                b.control.close()
        self._brokers = None

    # --- Spark API: planning and reading ----------------------------------------------------
    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        t0 = time.perf_counter()
        seq = int((end or {}).get("seq", 0))
        if seq == int((start or {}).get("seq", 0)):
            return []
        batch = self._batches.get(seq)
        if batch is None or batch.offset != end:
            batch = self._replay(end)
        from pyspark.sql.pandas.types import to_arrow_schema

        schema = to_arrow_schema(self.schema, timezone="UTC")
        parts: list[InputPartition] = []
        n = self.opts.num_partitions
        for addr in sorted(batch.columns):
            cols = batch.columns[addr]
            size = len(cols[0])
            if size == 0:
                continue
            k = min(n, size)
            step = -(-size // k)
            for lo in range(0, size, step):
                parts.append(BeanstalkPartition(addr, arrow_batch(schema, addr, cols, lo, lo + step)))
        self._timing["partitions_ms"] += (time.perf_counter() - t0) * 1000
        return parts

    def read(self, partition: InputPartition) -> Iterator:
        """Yield the partition's record batch: it was built by ``partitions`` on the driver side."""
        assert isinstance(partition, BeanstalkPartition)
        if _TRACE:
            import sys as _sys
            print(f"SBTRACE read {partition.batch.num_rows} rows pid={os.getpid()}", file=_sys.stderr)
        yield partition.batch

    # --- internals: reserving ---------------------------------------------------------------
    def _broker(self, addr: str) -> _Broker:
        for b in self._brokers or []:
            if b.address == addr:
                return b
        raise KeyError(addr)

    def _reserve_from(self, b: _Broker, batch: _Batch, want: int) -> int:
        """Reserve up to `want` jobs from broker b without blocking; returns how many joined the batch."""
        got_total = 0
        idx = 0
        cap = self.opts.jobs_per_connection
        while got_total < want:
            idx, rc = self._res_conn_with_room(b, idx)
            window = min(b.probe, want - got_total, cap - len(rc.held), _PIPELINE_WINDOW)
            with rc.lock:
                try:
                    got, asked_for = self._reserve_window(rc, batch, window)
                except ConnectionLost as exc:
                    self._conn_lost(rc, exc)
                    raise BeanstalkSourceError(f"beanstalk source: lost broker {b.address} while reserving: {exc}") from None
            got_total += got
            if asked_for < window:
                # The tubes ran dry: next poll starts with a window the size of what came now.
                b.probe = max(1, min(_PIPELINE_WINDOW, got_total))
                break
            b.probe = min(b.probe * 2, _PIPELINE_WINDOW)
        return got_total

    def _reserve_window(self, rc: _ResConn, batch: _Batch, window: int) -> tuple[int, int]:
        """Pipeline `window` reserves on rc, then stats-job for what came. Returns (kept, reserved)."""
        ids, bodies, others = rc.conn.reserve_many(window)
        for line in others:
            if line not in (b"TIMED_OUT", b"DEADLINE_SOON"):
                raise BeanstalkSourceError(f"beanstalk source: {rc.broker.address} answered reserve with {line!r}")
        if not ids:
            return 0, 0
        return self._admit(rc, batch, ids, bodies), len(ids)

    def _admit(self, rc: _ResConn, batch: _Batch, ids: list[int], bodies: list[bytes],
               check_poison: bool = True) -> int:
        """stats-job the jobs just reserved on rc, bury poison, add the rest to the batch (caller holds rc.lock)."""
        t0 = time.perf_counter()
        b = rc.broker
        now_wall_us = int(time.time() * 1_000_000)
        now = time.monotonic()
        st = stats_jobs(rc.conn, ids)
        b.counters["reserved"] += len(ids)
        if st.missing:
            b.counters["lost"] += len(st.missing)     # vanished between reserve and stats (someone deleted it)
            gone = set(st.missing)
            bodies = [body for jid, body in zip(ids, bodies) if jid not in gone]
        columns = (st.ids, st.tubes, bodies, st.pris, st.ttrs, st.reserves)
        max_reserves = self.opts.max_reserves if check_poison else 0
        if max_reserves and st.reserves and max(st.reserves) > max_reserves:
            columns = self._bury_poison(rc, columns, max_reserves)
        kept = len(columns[0])
        batch.extend(rc, (*columns, [now_wall_us] * kept))
        rc.add_held(columns[0], columns[4], now)
        self._timing["stats_ms"] += (time.perf_counter() - t0) * 1000
        if kept and self._wake is not None:
            self._wake.set()
        return kept

    def _bury_poison(self, rc: _ResConn, columns: tuple[list, ...], max_reserves: int) -> tuple[list, ...]:
        """Bury the jobs reserved more than max_reserves times; returns the columns of the others."""
        b = rc.broker
        reserves = columns[5]
        poison = [i for i, r in enumerate(reserves) if r > max_reserves]
        ids, pris = columns[0], columns[3]
        failed = set(failed_commands(rc.conn, [b"bury %d %d\r\n" % (ids[i], pris[i]) for i in poison], b"BURIED"))
        for k, i in enumerate(poison):
            if k in failed:
                b.counters["lost"] += 1
            else:
                b.counters["buried"] += 1
                log.warning("beanstalk source: buried poison job %s on %s (reserved more than %d times)",
                            ids[i], b.address, max_reserves)
        keep = [i for i, r in enumerate(reserves) if r <= max_reserves]
        return tuple([col[i] for i in keep] for col in columns)

    def _reserve_blocking(self, b: _Broker, batch: _Batch, budget: int) -> None:
        """Wait up to reserveTimeout seconds for one job, so an idle query does not spin."""
        _, rc = self._res_conn_with_room(b, 0)
        with rc.lock:
            try:
                reply = rc.conn.call(f"reserve-with-timeout {self.opts.reserve_timeout}")
            except ConnectionLost as exc:
                self._conn_lost(rc, exc)
                raise BeanstalkSourceError(f"beanstalk source: lost broker {b.address} while reserving: {exc}") from None
            if reply.status == b"RESERVED":
                self._admit(rc, batch, [int(reply.args[0])], [reply.body or b""])
        # more may have come meanwhile: take them in the same batch
        if batch.count() and budget > 1:
            self._reserve_from(b, batch, budget - 1)

    # --- internals: replay after restart ------------------------------------------------------
    def _replay(self, end: dict) -> _Batch:
        """Rebuild a planned-but-uncommitted batch from its offset alone (restart from a checkpoint)."""
        brokers = self._ensure_started()
        seq = int(end.get("seq", 0))
        batch = _Batch(seq)
        deadline = time.monotonic() + self.opts.replay_wait_seconds
        for addr, (sid, ids) in sorted(offset_jobs(end).items()):
            b = next((x for x in brokers if x.address == addr), None)
            if b is None:
                log.warning("beanstalk source: batch %d names broker %s, which is not in 'hosts'; skipping its %d jobs",
                            seq, addr, len(ids))
                continue
            if sid and b.sid and sid != b.sid:
                log.warning("beanstalk source: broker %s restarted since batch %d was planned (server id %s -> %s); "
                            "its jobs will be read again as new jobs", addr, seq, sid, b.sid)
                continue
            todo = list(ids)
            while todo:
                waiting = self._replay_some(b, batch, todo)
                if not waiting or time.monotonic() > deadline:
                    if waiting:
                        log.warning("beanstalk source: %d jobs of batch %d on %s are still reserved elsewhere "
                                    "after %.0fs; replaying without them", len(waiting), seq, addr,
                                    self.opts.replay_wait_seconds)
                    break
                todo = waiting
                time.sleep(0.1)
        batch.offset = end
        self._batches[seq] = batch
        self._last_seq = max(self._last_seq, seq)
        return batch

    def _replay_some(self, b: _Broker, batch: _Batch, ids: list[int]) -> list[int]:
        """reserve-job each id; returns the ids held by someone else (worth waiting for)."""
        missing: list[int] = []
        idx = 0
        pos = 0
        cap = self.opts.jobs_per_connection
        while pos < len(ids):
            idx, rc = self._res_conn_with_room(b, idx)
            chunk = ids[pos:pos + min(cap - len(rc.held), _PIPELINE_WINDOW)]
            pos += len(chunk)
            with rc.lock:
                got, bodies = [], []
                for jid, (line, body) in zip(chunk, rc.conn.pipeline_replies([b"reserve-job %d\r\n" % j for j in chunk])):
                    if body is not None and line.startswith(b"RESERVED "):
                        got.append(jid)
                        bodies.append(body)
                    else:
                        missing.append(jid)
                if got:
                    # A replayed batch is replayed whole: no poison check (it was planned with these jobs).
                    self._admit(rc, batch, got, bodies, check_poison=False)
                    b.counters["replayed"] += len(got)
        if not missing:
            return []
        st = stats_jobs(b.control, missing)
        return [jid for jid, state in zip(st.ids, st.states) if state == "reserved"]

    # --- internals: deleting --------------------------------------------------------------------
    def _delete_committed(self, upto_seq: int, wake: bool = True) -> None:
        """Hand the committed batches to the background worker, which deletes their jobs."""
        for seq in sorted(s for s in self._batches if s <= upto_seq):
            self._delete_queue.append(self._batches.pop(seq))
        if wake and self._delete_queue and self._work is not None:
            self._work.set()

    def _flush_deletes(self) -> None:
        """Delete every committed batch queued; returns once they are all done (whoever started them)."""
        lock = self._delete_lock
        if lock is None:
            return
        with lock:
            while self._delete_queue:
                self._delete_batch(self._delete_queue.popleft())

    # --- internals: the background worker (deletes, then read-ahead) -------------------------------
    def _worker_loop(self) -> None:
        work = self._work
        assert work is not None and self._pool_lock is not None
        while not self._stopping:
            got = 0
            try:
                self._flush_deletes()
                brokers = self._brokers
                cap = self._prefetch_cap
                if brokers and cap > 0 and not self._stopping:
                    with self._pool_lock:
                        pool = self._pool
                        room = cap - pool.count()
                        if room > 0:
                            t0 = time.perf_counter()
                            got = self._fill_batch(brokers, pool, room)
                            self._timing["prefetch_ms"] += (time.perf_counter() - t0) * 1000
            except BaseException as exc:   # surfaced by the next latestOffset
                self._worker_error = exc
                self._prefetch_cap = 0
            if got:
                continue
            work.wait(self.opts.prefetch_poll_ms / 1000.0 if self._prefetch_cap else 1.0)
            work.clear()

    def _delete_batch(self, batch: _Batch) -> None:
        t0 = time.perf_counter()
        orphans: dict[_Broker, list[int]] = {}
        for rc, ids in batch.held.items():
            b = rc.broker
            with rc.lock:
                for jid in ids:
                    rc.held.pop(jid, None)
                if not rc.held:
                    rc.min_ttr = 0
                if rc.dead:
                    orphans.setdefault(b, []).extend(ids)
                    continue
                try:
                    ok = delete_jobs(rc.conn, ids)
                    b.counters["deleted"] += ok
                    b.counters["lost"] += len(ids) - ok
                except ConnectionLost as exc:
                    self._conn_lost(rc, exc)
                    orphans.setdefault(b, []).extend(ids)
        # Jobs whose connection died went back to ready: delete them from any connection.
        for b, ids in orphans.items():
            self._delete_anywhere(b, ids)
        self._timing["delete_ms"] += (time.perf_counter() - t0) * 1000

    def _delete_anywhere(self, b: _Broker, ids: list[int]) -> None:
        try:
            if b.control is None:
                b.control = self._connect(b.host, b.port)
            ok = delete_jobs(b.control, ids)
            b.counters["cleaned"] += ok
            b.counters["lost"] += len(ids) - ok
        except (ConnectionLost, BeanstalkSourceError) as exc:
            log.warning("beanstalk source: could not delete %d committed jobs on %s (%s); "
                        "they will be delivered again", len(ids), b.address, exc)
            b.counters["lost"] += len(ids)

    def _cleanup_unheld(self, start: dict) -> None:
        """After a restart, jobs of the committed batch `start` may be back in ready: delete them.

        The old process reserved them and died (or stopped) after Spark wrote the commit log
        but before it deleted them; a job that is ready again can be deleted by anyone.
        Done once per run, and only when the broker is the same server process.
        """
        for addr, (sid, ids) in offset_jobs(start).items():
            b = next((x for x in self._brokers or [] if x.address == addr), None)
            if b is None or not ids or (sid and b.sid and sid != b.sid):
                continue
            self._delete_anywhere_quiet(b, ids)

    def _delete_anywhere_quiet(self, b: _Broker, ids: list[int]) -> None:
        try:
            b.counters["cleaned"] += delete_jobs(b.control, ids)
        except ConnectionLost as exc:
            log.warning("beanstalk source: cleanup of committed jobs on %s failed: %s", b.address, exc)

    def _conn_lost(self, rc: _ResConn, exc: Exception) -> None:
        """A reservation connection failed: the broker releases what it held."""
        rc.dead = True
        rc.conn.close()
        lost = len(rc.held)
        if lost:
            log.warning("beanstalk source: connection to %s lost with %d held jobs (%s); they return to ready "
                        "and may be delivered again", rc.broker.address, lost, exc)
        b = rc.broker
        try:
            b.conns.remove(rc)
        except ValueError:
            pass

    def _raise_touch_error(self) -> None:
        if self._touch_error:
            err, self._touch_error = self._touch_error, None
            log.warning("beanstalk source: touch thread: %s", err)

    # --- internals: the touch thread ----------------------------------------------------------------
    def _touch_loop(self) -> None:
        fraction = self.opts.touch_fraction
        wake = self._wake
        assert wake is not None
        while not self._stopping:
            brokers = self._brokers
            if brokers is None:
                return
            now = time.monotonic()
            next_due = now + 1.0
            for b in list(brokers):
                for rc in list(b.conns):
                    if not rc.held or rc.dead:
                        continue
                    due = rc.touch_due(fraction)
                    if due <= now:
                        self._touch_conn(rc)
                        due = rc.touch_due(fraction)
                    next_due = min(next_due, due)
            delay = max(0.005, next_due - time.monotonic())
            wake.wait(delay)
            wake.clear()

    def _touch_conn(self, rc: _ResConn) -> None:
        t0 = time.perf_counter()
        b = rc.broker
        with rc.lock:
            if rc.dead or not rc.held:
                return
            ids = list(rc.held)
            started = time.monotonic()
            try:
                failed = failed_commands(rc.conn, [b"touch %d\r\n" % j for j in ids], b"TOUCHED")
                b.counters["touched"] += len(ids) - len(failed)
                for i in failed:
                    b.counters["lost"] += 1
                    rc.held.pop(ids[i], None)
                    self._touch_error = f"job {ids[i]} on {b.address} could not be touched"
                rc.last_touch = started
            except (ConnectionLost, OSError) as exc:
                self._touch_error = f"{b.address}: {exc}"
                self._conn_lost(rc, exc)
        self._timing["touch_ms"] += (time.perf_counter() - t0) * 1000
