"""Put DataFrame rows into beanstalk tubes: ``foreachBatch(beanstalk_put)`` and the data source sinks.

Rows are put from the executors, one partition at a time, pipelined on one connection
per (partition, broker). Column mapping (names are case-insensitive):

- ``body``: string (sent as UTF-8) or binary. Without a ``body`` column each row is
  sent as a JSON object of its columns (minus the control columns below).
- ``tube``, ``priority``, ``delay``, ``ttr``: optional per-row overrides of the options
  of the same names; a null falls back to the option.

Every row of a partition is checked (body size against the servers' max-job-size,
tube name, priority/delay/ttr range, null body) before any row of that partition is
sent, so a bad row fails its task with nothing of the partition written, or, with
``deadLetterPath``, goes to a JSON-lines file there while the rest is put.

See docs/writer.md for the options and the precise delivery guarantee.
"""
from __future__ import annotations

import base64
import contextlib
import datetime
import decimal
import hashlib
import json
import logging
import os
import re
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    DataSourceStreamWriter,
    DataSourceWriter,
    WriterCommitMessage,
)

from beanstalk_rules.hosts import BrokerAddress, HostSpec
from beanstalk_rules.tubes import NAME_CHARS, tube_name_problem
from spark_beanstalk.client import REFUSED_FOR_NOW, BeanstalkError, Connection, ConnectionLost
from spark_beanstalk.leader import open_leader
from spark_beanstalk.options import (
    MAX_U32,
    RECONNECT_MAX,
    OptionError,
    WriterOptions,
)

log = logging.getLogger("spark_beanstalk.writer")

CONTROL_COLUMNS = ("tube", "priority", "delay", "ttr")
DEFAULT_MAX_JOB_SIZE = 65535          # beanstalkd's default, used when `stats` does not say
MARKER_PREFIX = "sbw."
PARTITION_MARK = re.compile(r"\.(?P<batch>\d+)p(?P<partition>\d+)$")   # the end of a PartitionMark's tube
MARKER_DELAY = 2**31 - 1              # markers are delayed jobs nobody will ever get
CHUNK_ROWS = 8192                     # rows per chunk for the Row-based writers
_INT_TYPES = ("byte", "short", "int", "integer", "long", "bigint", "tinyint", "smallint")


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------
class BeanstalkWriteError(RuntimeError):
    """Rows could not be put; the message names each row (partition, row number) and why."""


class BeanstalkUnavailableError(BeanstalkWriteError):
    """No broker in `hosts` accepted the rows (all unreachable, lost or draining)."""


# --------------------------------------------------------------------------------------
# Column mapping, decided once from the schema (on the driver)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColumnSpec:
    """Which input columns play which role; picklable, built from a Spark StructType."""

    names: tuple[str, ...]             # all field names, in order
    body: str | None                   # the body column's real name, or None: rows as JSON
    tube: str | None
    priority: str | None
    delay: str | None
    ttr: str | None
    key: str | None
    json_columns: tuple[str, ...] = ()  # columns of the JSON body when there is no body column

    @classmethod
    def from_schema(cls, schema: Any, opts: WriterOptions) -> ColumnSpec:
        fields = {f.name.lower(): f for f in schema.fields}

        def role(name: str, allowed: Sequence[str], what: str) -> str | None:
            f = fields.get(name)
            if f is None:
                return None
            tname = f.dataType.typeName()
            if tname not in allowed:
                raise OptionError(
                    f"column {f.name!r} ({what}) must be {' or '.join(sorted(set(allowed)))}, "
                    f"not {f.dataType.simpleString()}")
            return str(f.name)

        body = role("body", ("string", "binary"), "the job body")
        tube = role("tube", ("string",), "the tube")
        pri = role("priority", _INT_TYPES, "the priority")
        delay = role("delay", _INT_TYPES, "the delay in seconds")
        ttr = role("ttr", _INT_TYPES, "the time-to-run in seconds")
        key = None
        if opts.key_column:
            f = fields.get(opts.key_column.lower())
            if f is None:
                raise OptionError(f"option keyColumn={opts.key_column!r}: no such column; "
                                  f"columns are {', '.join(schema.fieldNames())}")
            key = f.name
        controls = {c for c in (tube, pri, delay, ttr) if c}
        json_columns = () if body else tuple(n for n in schema.fieldNames() if n not in controls)
        return cls(tuple(schema.fieldNames()), body, tube, pri, delay, ttr, key, json_columns)


@dataclass
class Chunk:
    """Up to a few thousand rows as Python lists, one per role (None: column absent)."""

    n: int
    bodies: list[Any]                  # bytes/str per row (None for null), or JSON-able dicts
    json_rows: bool
    tubes: list[Any] | None = None
    priorities: list[Any] | None = None
    delays: list[Any] | None = None
    ttrs: list[Any] | None = None
    keys: list[Any] | None = None


def _arrow_chunks(batches: Iterable[Any], spec: ColumnSpec) -> Iterator[Chunk]:
    """Arrow RecordBatches -> Chunks (column-wise conversion, the fast path)."""
    import pyarrow as pa

    for batch in batches:
        n = batch.num_rows
        if n == 0:
            continue

        def col(name: str | None, batch: Any = batch) -> Any:
            return None if name is None else batch.column(batch.schema.get_field_index(name))

        if spec.body is not None:
            arr = col(spec.body)
            if pa.types.is_string(arr.type):
                arr = arr.cast(pa.binary())
            elif pa.types.is_large_string(arr.type):
                arr = arr.cast(pa.large_binary())
            bodies, json_rows = arr.to_pylist(), False
        else:
            bodies, json_rows = batch.select(list(spec.json_columns)).to_pylist(), True

        def pylist(name: str | None) -> list[Any] | None:
            c = col(name)
            if c is None:
                return None
            values: list[Any] = c.to_pylist()
            return values

        yield Chunk(n, bodies, json_rows, pylist(spec.tube), pylist(spec.priority),
                    pylist(spec.delay), pylist(spec.ttr), pylist(spec.key))


def _row_chunks(rows: Iterable[Any], spec: ColumnSpec) -> Iterator[Chunk]:
    """Spark Rows -> Chunks (the Row-based writer variants)."""
    idx = {name: i for i, name in enumerate(spec.names)}
    buf: list[Any] = []

    def flush(buf: list[Any]) -> Chunk:
        def pick(name: str | None) -> list[Any] | None:
            if name is None:
                return None
            i = idx[name]
            return [r[i] for r in buf]

        if spec.body is not None:
            bodies, json_rows = [r[idx[spec.body]] for r in buf], False
        else:
            cols = [(c, idx[c]) for c in spec.json_columns]
            bodies, json_rows = [{c: r[i] for c, i in cols} for r in buf], True
        return Chunk(len(buf), bodies, json_rows, pick(spec.tube), pick(spec.priority),
                     pick(spec.delay), pick(spec.ttr), pick(spec.key))

    for row in rows:
        buf.append(row)
        if len(buf) >= CHUNK_ROWS:
            yield flush(buf)
            buf = []
    if buf:
        yield flush(buf)


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if hasattr(value, "asDict"):
        return value.asDict(recursive=True)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def row_json(row: Any) -> bytes:
    """The body of a row without a body column: compact JSON, UTF-8.

    Timestamps/dates as ISO 8601 strings, decimals as strings, binary as base64.
    """
    if hasattr(row, "asDict"):
        row = row.asDict(recursive=True)
    return json.dumps(row, separators=(",", ":"), ensure_ascii=False, default=_json_default,
                      allow_nan=True).encode("utf-8")


def _key_bytes(key: Any) -> bytes:
    if key is None:
        return b""
    if isinstance(key, (bytes, bytearray)):
        return bytes(key)
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, bool):
        return b"true" if key else b"false"
    return str(key).encode("utf-8")


def key_host(key: Any, n_hosts: int) -> int:
    """Stable host index for a key: CRC-32 of its UTF-8 text modulo the number of hosts.

    The same in every process and run (unlike Python's salted hash()), so one key's jobs
    land on one broker as long as `hosts` lists the same brokers in the same order.
    """
    return zlib.crc32(_key_bytes(key)) % n_hosts


def _preview(body: Any) -> str:
    if body is None:
        return "null"
    data = body if isinstance(body, (bytes, bytearray)) else str(body).encode("utf-8", "replace")
    text = repr(bytes(data[:40]))
    return text + ("..." if len(data) > 40 else "")


# --------------------------------------------------------------------------------------
# One partition's puts
# --------------------------------------------------------------------------------------
# An entry is one row ready to send: (row number in partition, tube, encoded put, preferred
# host index, key for messages)
Entry = tuple[int, str, bytes, int, Any]


@dataclass
class RowFailure:
    row: int
    reason: str
    body: Any = None
    tube: str | None = None
    priority: Any = None
    delay: Any = None
    ttr: Any = None
    key: Any = None

    def describe(self, partition: int, key_column: str | None) -> str:
        key = f", {key_column}={self.key!r}" if key_column else ""
        return f"row {self.row} of partition {partition}{key} (body {_preview(self.body)}): {self.reason}"

    def record(self, ctx: Mapping[str, Any]) -> dict[str, Any]:
        body = self.body
        if isinstance(body, str):
            body = body.encode("utf-8")
        rec = {"reason": self.reason, "batch_id": ctx.get("batch_id"), "partition": ctx.get("partition"),
               "row": self.row, "tube": self.tube, "priority": self.priority, "delay": self.delay,
               "ttr": self.ttr, "key": self.key,
               "body_base64": None if body is None else base64.b64encode(bytes(body)).decode("ascii")}
        return rec


def _describe_failures(failures: list[RowFailure], ctx: Mapping[str, Any], key_column: str | None,
                       what: str) -> str:
    part = ctx.get("partition", 0)
    batch = ctx.get("batch_id")
    where = f"batch {batch}, " if batch is not None else ""
    lines = [(f"beanstalk write failed ({where}partition {part}): {len(failures)} row(s) {what}; "
             f"nothing was dropped silently (set deadLetterPath to put the other rows and keep these aside):")]
    for f in failures[:10]:
        lines.append("  " + f.describe(part, key_column))
    if len(failures) > 10:
        lines.append(f"  ... and {len(failures) - 10} more")
    return "\n".join(lines)


class _DeadLetter:
    """JSON-lines file of refused rows under deadLetterPath (local path or a pyarrow.fs URI)."""

    def __init__(self, path: str, ctx: Mapping[str, Any]) -> None:
        self.path = path
        self.ctx = ctx
        self.count = 0
        self._stream: Any = None
        self.file: str | None = None

    def add(self, failures: Iterable[RowFailure]) -> None:
        for f in failures:
            if self._stream is None:
                self._open()
            self._stream.write(json.dumps(f.record(self.ctx), default=_json_default).encode() + b"\n")
            self.count += 1

    def _open(self) -> None:
        from pyarrow import fs as pafs

        if "://" in self.path:
            filesystem, base = pafs.FileSystem.from_uri(self.path)
        else:
            filesystem, base = pafs.LocalFileSystem(), os.path.abspath(self.path)
        filesystem.create_dir(base, recursive=True)
        batch = self.ctx.get("batch_id")
        name = (f"batch-{batch}-" if batch is not None else "write-") + \
            f"part-{self.ctx.get('partition', 0):05d}-{uuid.uuid4().hex[:12]}.jsonl"
        self.file = base.rstrip("/") + "/" + name
        self._stream = filesystem.open_output_stream(self.file)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


_DESYNC_REPLIES = frozenset({b"BAD_FORMAT", b"EXPECTED_CRLF", b"UNKNOWN_COMMAND"})


class Outage:
    """Every broker is down (a restart, a partition): how long to pause before trying them all again,
    and when to give up. One rule for the rows and for the batch markers: the pause doubles from
    `retryInterval` up to RECONNECT_MAX, and the wait ends after `retries` rounds once
    `brokerRetrySeconds` have passed since the outage began (`rounds` counts every pause and
    `waited` their seconds, for the summary's `reconnect_rounds` and `reconnect_seconds`)."""

    def __init__(self, opts: WriterOptions) -> None:
        self.opts = opts
        self.since: float | None = None    # monotonic time every broker was first found down
        self.rounds = 0
        self.waited = 0.0

    def over(self) -> None:
        """A broker answered: the next outage starts its own clock."""
        self.since = None

    def elapsed(self) -> float:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        return now - self.since

    def exhausted(self) -> bool:
        return self.rounds >= self.opts.retries and self.elapsed() >= self.opts.broker_retry_seconds

    def pause(self) -> None:
        bound, elapsed = self.opts.broker_retry_seconds, self.elapsed()
        step = self.opts.retry_interval * (2 ** min(self.rounds, 6))
        self.rounds += 1
        seconds = min(max(step, 0.05), RECONNECT_MAX, max(bound - elapsed, self.opts.retry_interval))
        self.waited += seconds
        time.sleep(seconds)


class _HostPool:
    """Connections of one partition to the brokers in `hosts`, with failover."""

    def __init__(self, opts: WriterOptions) -> None:
        self.opts = opts
        self.links = opts.links()
        self.addresses = [b.name for b in self.links]
        self.conns: dict[int, Connection] = {}
        self.used: dict[int, str] = {}
        self.down: dict[int, str] = {}
        self.max_job_size: dict[int, int] = {}
        self.outage = Outage(opts)

    def connect(self, h: int) -> Connection | None:
        existing = self.conns.get(h)
        if existing is not None:
            return existing
        if h in self.down:
            return None
        try:
            # a cluster: broker is whichever member leads now (asked again after every drop)
            conn, _, stats = open_leader(self.links[h], partial(_connect_member, self.opts))
        except (ConnectionLost, OSError) as exc:
            self.down[h] = f"cannot connect: {exc.__cause__ or exc}"
            return None
        size = stats.get("max-job-size") if isinstance(stats, dict) else None
        self.max_job_size[h] = int(size) if isinstance(size, int) and size > 0 else DEFAULT_MAX_JOB_SIZE
        if isinstance(stats, dict) and stats.get("draining") in ("true", True):
            conn.close()
            self.down[h] = "DRAINING (the server is in drain mode)"
            return None
        self.conns[h] = conn
        self.used[h] = "default"
        return conn

    def drop(self, h: int, reason: str) -> None:
        conn = self.conns.pop(h, None)
        if conn is not None:
            conn.close()
        self.used.pop(h, None)
        self.down[h] = reason

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

    def alive(self) -> list[int]:
        return [h for h in range(len(self.addresses)) if h not in self.down]

    def unavailable_message(self) -> str:
        parts = [f"{self.addresses[h]} ({self.down.get(h, 'unknown')})" for h in range(len(self.addresses))]
        return "; ".join(parts)


@dataclass
class _Tally:
    """What the replies of one pipelined run said (PartitionWriter._read_replies)."""

    retry: list[Entry] = field(default_factory=list)
    wrong_tube_ids: list[int] = field(default_factory=list)
    put_here: int = 0
    draining: bool = False
    lost: str | None = None


class PartitionWriter:
    """Validates then puts the rows of one partition. Returns a summary dict."""

    def __init__(self, spec: ColumnSpec, opts: WriterOptions, ctx: Mapping[str, Any]) -> None:
        self.spec = spec
        self.opts = opts
        self.ctx = dict(ctx)
        self.partition = int(self.ctx.get("partition", 0))
        self.pool = _HostPool(opts)
        self.n_hosts = len(opts.hosts)
        self.put = 0
        self.buried = 0
        self.failovers = 0
        self.per_host: dict[str, int] = {}
        self.per_tube: dict[str, int] = {}
        self.failures: list[RowFailure] = []      # refused at send time
        self._resync: list[Entry] = []            # rows to send again after a desynchronised reply stream
        self.resyncs = 0

    # -- phase 1: validate and encode every row of the partition -------------------------
    def prepare(self, chunks: Iterable[Chunk], max_job_size: int) -> tuple[list[list[Entry]], list[RowFailure], int]:
        opts = self.opts
        n_hosts = self.n_hosts
        by_host: list[list[Entry]] = [[] for _ in range(n_hosts)]
        bad: list[RowFailure] = []
        good_tubes: set[str] = {opts.tube}
        d_pri, d_delay, d_ttr, d_tube = opts.priority, opts.delay, opts.ttr, opts.tube
        hashing = opts.distribution == "hash"
        rr = self.partition % n_hosts
        row_no = 0
        for chunk in chunks:
            bodies = chunk.bodies
            tubes, pris, delays, ttrs, keys = chunk.tubes, chunk.priorities, chunk.delays, chunk.ttrs, chunk.keys
            for i in range(chunk.n):
                body = bodies[i]
                reason = None
                if chunk.json_rows:
                    body = row_json(body)
                elif body is None:
                    reason = "body is null"
                elif isinstance(body, str):
                    body = body.encode("utf-8")
                elif not isinstance(body, bytes):
                    body = bytes(body)
                tube = d_tube if tubes is None or tubes[i] is None else tubes[i]
                pri = d_pri if pris is None or pris[i] is None else pris[i]
                delay = d_delay if delays is None or delays[i] is None else delays[i]
                ttr = d_ttr if ttrs is None or ttrs[i] is None else ttrs[i]
                if reason is None:
                    if len(body) > max_job_size:
                        reason = (f"JOB_TOO_BIG: body is {len(body)} bytes, the server's max-job-size "
                                  f"is {max_job_size}")
                    elif tube not in good_tubes:
                        reason = tube_name_problem(tube)
                        if reason is None:
                            good_tubes.add(tube)
                    if reason is None:
                        if not 0 <= pri <= MAX_U32:
                            reason = f"priority {pri} out of range 0..{MAX_U32}"
                        elif not 0 <= delay <= MAX_U32:
                            reason = f"delay {delay} out of range 0..{MAX_U32} seconds"
                        elif not 0 <= ttr <= MAX_U32:
                            reason = f"ttr {ttr} out of range 0..{MAX_U32} seconds"
                key = keys[i] if keys is not None else None
                if reason is not None:
                    bad.append(RowFailure(row_no, reason, body, tube, pri, delay, ttr, key))
                else:
                    if hashing:
                        h = zlib.crc32(_key_bytes(key)) % n_hosts
                    else:
                        h = rr
                        rr = rr + 1 if rr + 1 < n_hosts else 0
                    by_host[h].append((row_no, tube, b"put %d %d %d %d\r\n%s\r\n" % (pri, delay, ttr, len(body), body),
                                       h, key))
                row_no += 1
        return by_host, bad, row_no

    # -- phase 2: send, with failover --------------------------------------------------
    def _reassign(self, entries: list[Entry], pending: dict[int, list[Entry]]) -> None:
        alive = self.pool.alive()
        if not alive:
            self._wait_for_brokers(len(entries) + sum(len(v) for v in pending.values()))
            alive = list(range(self.n_hosts))
        self.failovers += len(entries)
        alive_set = set(alive)
        if self.opts.distribution == "hash":
            for e in entries:
                h0 = e[3]
                for k in range(self.n_hosts):  # its own broker first: back after a wait, or still down
                    h = (h0 + k) % self.n_hosts
                    if h in alive_set:
                        break
                pending.setdefault(h, []).append(e)
        else:
            for j, e in enumerate(entries):
                pending.setdefault(alive[j % len(alive)], []).append(e)

    def _wait_for_brokers(self, unsent: int) -> None:
        """Every broker is down: wait with backoff and let them all be tried again.

        Gives up (BeanstalkUnavailableError naming each broker) after `retries` rounds
        once `brokerRetrySeconds` have passed since the outage began, so a broker
        restart is ridden through and a broker that stays down fails the task.
        """
        outage = self.pool.outage
        if outage.exhausted():
            raise BeanstalkUnavailableError(
                f"beanstalk write failed (partition {self.partition}"
                + (f", batch {self.ctx['batch_id']}" if self.ctx.get("batch_id") is not None else "")
                + f"): no broker accepted the rows after {outage.rounds + 1} attempt(s) over {outage.elapsed():.0f}s "
                f"(brokerRetrySeconds={self.opts.broker_retry_seconds:g}): {self.pool.unavailable_message()}. "
                + (f"{self.put} row(s) of this partition were put, {unsent} were not." if unsent >= 0 else
                   "No row of this partition was sent (none could be checked against a broker's max-job-size)."))
        if outage.rounds == 0 or outage.rounds % 10 == 0:
            log.warning("beanstalk writer (partition %s): every broker is down (%s); retrying for up to %gs",
                        self.partition, self.pool.unavailable_message(), self.opts.broker_retry_seconds)
        outage.pause()
        self.pool.down.clear()

    def send(self, by_host: list[list[Entry]]) -> None:
        pending: dict[int, list[Entry]] = {h: rows for h, rows in enumerate(by_host) if rows}
        while pending:
            h = next(iter(pending))
            entries = pending.pop(h)
            if not entries:
                continue
            conn = self.pool.connect(h)
            if conn is None:
                self._reassign(entries, pending)
                continue
            answered = self.put + self.buried
            retry = self._send_to(h, conn, entries)
            if self.put + self.buried > answered:
                self.pool.outage.over()  # a broker took rows; connecting alone ends no outage (one that
                # accepts connections and refuses or loses every put must not be retried for ever)
            if self._resync:
                # the reply stream went out of step: the rows after the refused put are
                # unknown; send them again on a fresh connection to the same broker
                again, self._resync = self._resync, []
                self.resyncs += 1
                if self.resyncs > 3:
                    raise BeanstalkWriteError(_describe_failures(
                        self.failures, self.ctx, self.spec.key,
                        f"made {self.pool.addresses[h]} answer out of step more than 3 times; giving up"))
                pending.setdefault(h, []).extend(again)
            if retry:
                self._reassign(retry, pending)

    def _send_to(self, h: int, conn: Connection, entries: list[Entry]) -> list[Entry]:
        """Pipeline the rows' puts on one connection; returns the rows to send again elsewhere."""
        cmds, owners = self._commands(h, entries)
        lost = None
        try:
            replies = conn.pipeline_lines(cmds, window=self.opts.window)
        except ConnectionLost as exc:
            replies = exc.replies
            lost = f"connection lost: {exc}"
        address = self.pool.addresses[h]
        tally = self._read_replies(h, address, owners, replies)
        lost = lost or tally.lost
        self.put += tally.put_here
        if tally.put_here:
            self.per_host[address] = self.per_host.get(address, 0) + tally.put_here
        if tally.wrong_tube_ids and h in self.pool.conns:
            # undo jobs that landed in the previously used tube
            with contextlib.suppress(ConnectionLost):
                conn.pipeline_lines([b"delete %d\r\n" % j for j in tally.wrong_tube_ids], window=self.opts.window)
        if tally.draining:
            self.pool.drop(h, "DRAINING (the server is in drain mode)")
        elif lost:
            self.pool.drop(h, lost)
        if self._resync:
            self.pool.down.pop(h, None)           # not down: only this connection is unusable
        return tally.retry

    def _commands(self, h: int, entries: list[Entry]) -> tuple[list[bytes], list[Entry | str]]:
        """The put lines, with a `use` before each change of tube; `owners` says what each line is."""
        entries.sort(key=lambda e: e[1])           # stable: row order kept within a tube
        cmds: list[bytes] = []
        owners: list[Entry | str] = []
        cur = self.pool.used.get(h, "default")
        for e in entries:
            if e[1] != cur:
                cur = e[1]
                cmds.append(b"use %s\r\n" % cur.encode())
                owners.append(cur)
            cmds.append(e[2])
            owners.append(e)
        return cmds, owners

    def _read_replies(self, h: int, address: str, owners: list[Entry | str], replies: list[bytes]) -> _Tally:
        """Match each reply to its line: count puts, collect rows to retry and rows that failed."""
        tally = _Tally()
        bad_use = None                           # rows after a refused `use` went to the wrong tube
        n_replies = len(replies)
        for i, owner in enumerate(owners):
            if i >= n_replies:
                if isinstance(owner, tuple):
                    tally.retry.append(owner)
                continue
            line = replies[i]
            if not isinstance(owner, tuple):     # a `use` line
                if line.startswith(b"USING"):
                    self.pool.used[h] = owner
                    bad_use = None
                else:
                    bad_use = f"{address} refused 'use {owner}': {line.decode('latin-1')}"
                continue
            if line.startswith((b"INSERTED", b"BURIED")):
                if bad_use is not None:
                    tally.wrong_tube_ids.append(int(line.split()[1]))
                    self.failures.append(self._failure(owner, bad_use))
                    continue
                tally.put_here += 1
                if line[0:1] == b"B":
                    self.buried += 1
                self.per_tube[owner[1]] = self.per_tube.get(owner[1], 0) + 1
            elif line == b"DRAINING":
                tally.draining = True
                tally.retry.append(owner)
            elif line == b"OUT_OF_MEMORY":
                tally.retry.append(owner)
                tally.lost = tally.lost or f"OUT_OF_MEMORY from {address}"
            else:
                self.failures.append(self._failure(owner, f"{address} answered {line.decode('latin-1')}"))
                if line in _DESYNC_REPLIES:
                    # after BAD_FORMAT / EXPECTED_CRLF the server reads the body as a command, so
                    # the following replies no longer match our commands: stop reading them
                    self._resync = [o for o in owners[i + 1:] if isinstance(o, tuple)]
                    tally.lost = tally.lost or f"{address} answered {line.decode('latin-1')} (reply stream out of step)"
                    break
        return tally

    def _failure(self, entry: Entry, reason: str) -> RowFailure:
        cmd = entry[2]
        head_end = cmd.index(b"\r\n")
        _, pri, delay, ttr, _size = cmd[:head_end].split(b" ")
        return RowFailure(entry[0], reason, cmd[head_end + 2:-2], entry[1], int(pri), int(delay), int(ttr), entry[4])

    # -- the whole partition ------------------------------------------------------------
    def run(self, chunks: Iterable[Chunk], dry_run: bool = False) -> dict[str, Any]:
        opts = self.opts
        try:
            # connect to every broker first: their max-job-size bounds validation; with none up (a
            # restart) wait for one as the rows would, rather than judge the rows by a guessed limit
            while True:
                for h in range(self.n_hosts):
                    self.pool.connect(h)
                if opts.max_job_size or self.pool.conns:
                    break
                self._wait_for_brokers(-1)
            sizes = [self.pool.max_job_size[h] for h in self.pool.conns]
            max_job_size = opts.max_job_size or (min(sizes) if sizes else DEFAULT_MAX_JOB_SIZE)
            by_host, bad, rows = self.prepare(chunks, max_job_size)
            dead = _DeadLetter(opts.dead_letter_path, self.ctx) if opts.dead_letter_path else None
            if bad and dead is None:
                raise BeanstalkWriteError(_describe_failures(bad, self.ctx, self.spec.key, "refused before sending"))
            if dry_run:
                return self.summary(rows, 0, len(bad))
            # an empty partition has nothing to protect: no check, no mark (a batch may have 200 of them)
            mark = PartitionMark.of(self.ctx) if any(by_host) else None
            digest = rows_digest(by_host) if mark is not None else ""
            if mark is not None and mark.already_put(opts, digest):
                log.warning("beanstalk writer: partition %s of batch %s was put by an earlier attempt of the batch "
                            "(same rows); not putting it again", mark.partition, mark.batch_id)
                return dict(self.summary(rows, 0, len(bad)), resumed=True)
            try:
                if dead is not None and bad:
                    dead.add(bad)
                self.send(by_host)
                if self.failures:
                    if dead is None:
                        raise BeanstalkWriteError(_describe_failures(
                            self.failures, self.ctx, self.spec.key,
                            f"refused by the server (the other {self.put} row(s) of this partition were put)"))
                    dead.add(self.failures)
            finally:
                if dead is not None:
                    dead.close()
            if mark is not None:
                mark.record(opts, digest, self.put)
            return self.summary(rows, dead.count if dead else 0, 0, dead.file if dead else None)
        finally:
            self.pool.close()

    def summary(self, rows: int, dead: int, invalid: int, dead_file: str | None = None) -> dict[str, Any]:
        return {"partition": self.partition, "rows": rows, "put": self.put, "buried": self.buried,
                "dead_lettered": dead, "invalid": invalid, "failovers": self.failovers,
                "reconnect_rounds": self.pool.outage.rounds, "reconnect_seconds": self.pool.outage.waited,
                "hosts": self.per_host, "tubes": self.per_tube, "skipped": False, "resumed": False,
                "dead_letter_files": [dead_file] if dead_file else []}


def put_partition(chunks: Iterable[Chunk], spec: ColumnSpec, opts: WriterOptions, ctx: Mapping[str, Any],
                  dry_run: bool = False) -> dict[str, Any]:
    """Validate and put one partition's rows; raises BeanstalkWriteError naming bad rows."""
    return PartitionWriter(spec, opts, ctx).run(chunks, dry_run)


# --------------------------------------------------------------------------------------
# Batch markers: the last completed batch id, kept in the brokers themselves
# --------------------------------------------------------------------------------------
# A streaming query completes its micro-batches in order (batch N+1 starts only after N
# is committed), and on restart Spark re-runs only the last planned, uncommitted batch.
# So "batch N is complete" is "N <= the last completed batch id": one marker job per
# writer namespace, in one tube, replaced at every batch, is enough.
def marker_namespace(writer_id: str, opts: WriterOptions, explicit: bool) -> str:
    """Marker namespace: the writerId option as given, else the query id plus a digest of the target."""
    if explicit:
        base = writer_id
    else:
        target = ",".join(opts.host_names()) + "|" + opts.tube
        base = f"{writer_id}.{zlib.crc32(target.encode()):08x}"
    if len(base) > 150 or set(base) - NAME_CHARS:
        base = hashlib.sha1(base.encode()).hexdigest()
    return base


def marker_tube(namespace: str) -> str:
    """The one tube holding a namespace's marker job."""
    return f"{MARKER_PREFIX}{namespace}"


def legacy_marker_tube(namespace: str, batch_id: int) -> str:
    """Where versions up to 0.1 kept one marker per batch (still honoured, and cleaned up)."""
    return f"{MARKER_PREFIX}{namespace}.{batch_id}"


def _connect_member(opts: WriterOptions, member: HostSpec) -> Connection:
    return Connection(member.host, member.port, timeout=opts.timeout, connect_timeout=opts.connect_timeout,
                      **opts.security.connect_kwargs())


def _connect(opts: WriterOptions, broker: BrokerAddress) -> Connection:
    """A connection to the broker (a cluster's leader: markers are changes)."""
    return open_leader(broker, partial(_connect_member, opts)).conn


def _last_completed(conn: Connection, namespace: str) -> int | None:
    """The batch id of the marker in the namespace's tube on this broker, or None."""
    conn.use(marker_tube(namespace))
    job = conn.peek_delayed() or conn.peek_ready() or conn.peek_buried()
    if job is None:
        return None
    try:
        return int(json.loads(job.body)["batch_id"])
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a malformed marker job %s in %s", job.id, marker_tube(namespace))
        return None


def _holds_legacy_marker(conn: Connection, namespace: str, batch_id: int) -> bool:
    st = conn.stats_tube(legacy_marker_tube(namespace, batch_id)) or {}
    return sum(int(st.get(k, 0) or 0) for k in
               ("current-jobs-delayed", "current-jobs-ready", "current-jobs-buried")) > 0


def _ask_brokers(opts: WriterOptions, question: Callable[[Connection], bool], what: str) -> str | None:
    """The first broker for which `question` holds (its address), or None when every reachable broker says no.

    While no broker can be asked (every one down: a restart), it asks again as the rows would be sent
    again (`Outage`): answering "no" then would put completed rows a second time."""
    outage = Outage(opts)
    while True:
        asked = False
        for broker in opts.links():
            try:
                with _connect(opts, broker) as conn:
                    if question(conn):
                        return broker.name
                asked = True
            except (ConnectionLost, OSError):
                continue
            except Exception as exc:  # noqa: BLE001 - a failed check only weakens replay detection
                log.warning("%s: asking %s failed: %s", what, broker.name, exc)
                asked = True
        if asked or outage.exhausted():
            return None
        if outage.rounds == 0:
            log.warning("%s: no broker can be asked; asking again for up to %gs", what, opts.broker_retry_seconds)
        outage.pause()


def marker_exists(opts: WriterOptions, namespace: str, batch_id: int) -> str | None:
    """The address of a broker on which this batch is recorded as completed, or None.

    Completed: the last completed batch id. A streaming query re-runs only its last batch, so a
    batch id below that one is not a replay: the writer id is being reused by a query started
    from a new checkpoint (its batch ids start again at 0). Skipping those batches lost their
    rows; they are put, with a warning.
    """
    def completed(conn: Connection) -> bool:
        last = _last_completed(conn, namespace)
        if last is not None and batch_id == last:
            return True
        if last is not None and batch_id < last:
            log.warning("batch %d is below the last completed batch %d of writer id %s on %s: not a replay (a "
                        "query started from a new checkpoint with a reused writerId?); putting it",
                        batch_id, last, namespace, conn.host)
        return _holds_legacy_marker(conn, namespace, batch_id)

    return _ask_brokers(opts, completed, f"whether batch {batch_id} completed ({marker_tube(namespace)})")


# Partition markers: a batch that failed or was stopped after some of its partitions were put
# (a driver crash, query.stop() in the middle of a batch) is run again in full. Spark gives a
# replayed micro-batch's partition the same rows (its (partition, batch) contract for sinks), so
# each partition, once put, records a digest of its rows; a replay skips a partition only if it
# holds the very same rows. The batch's marker then clears them.
@dataclass(frozen=True)
class PartitionMark:
    """Where one partition of one batch records that it was put (the tube is emptied, hence gone, once the
    batch completes)."""

    namespace: str
    batch_id: int
    partition: int

    @classmethod
    def of(cls, ctx: Mapping[str, Any]) -> PartitionMark | None:
        """The partition's mark, when its write has a batch id and replay detection is on."""
        namespace, batch_id = ctx.get("namespace"), ctx.get("batch_id")
        if namespace is None or batch_id is None:
            return None
        return cls(str(namespace), int(batch_id), int(ctx.get("partition", 0)))

    @property
    def tube(self) -> str:
        """``sbw.<namespace>.<batch>p<partition>`` (PARTITION_MARK matches its end)."""
        return f"{MARKER_PREFIX}{self.namespace}.{self.batch_id}p{self.partition}"

    def already_put(self, opts: WriterOptions, digest: str) -> str | None:
        """The broker recording this partition of this batch as put with the same rows, or None."""
        def recorded(conn: Connection) -> bool:
            if not conn.stats_tube(self.tube):
                return False
            conn.use(self.tube)
            job = conn.peek_delayed()
            try:
                return job is not None and json.loads(job.body).get("digest") == digest
            except (ValueError, AttributeError):
                return False

        return _ask_brokers(opts, recorded, f"whether partition {self.partition} of batch {self.batch_id} was put")

    def record(self, opts: WriterOptions, digest: str, put: int) -> int:
        """Record the partition as put on every reachable broker, waiting through an outage as the rows
        would; returns how many brokers hold it. Without it a replay of the batch puts the partition
        again (a duplicate, never a loss), so in the end this logs instead of raising."""
        body = json.dumps({"batch_id": self.batch_id, "partition": self.partition, "digest": digest,
                           "put": put}).encode()

        def put_mark(conn: Connection) -> None:
            conn.use(self.tube)
            conn.put(body, priority=MAX_U32, delay=MARKER_DELAY, ttr=1)

        return _on_every_broker(opts, put_mark, f"partition {self.partition} of batch {self.batch_id} was put")


def rows_digest(by_host: Iterable[Iterable[Entry]]) -> str:
    """An order-independent digest of a partition's encoded rows (tube and put command, whichever broker
    each goes to): equal for the same rows in any order, different as soon as one row differs."""
    count, a, b = 0, 0, 0
    for entries in by_host:
        for entry in entries:
            tube = entry[1].encode()
            count += 1
            a += zlib.crc32(entry[2], zlib.crc32(tube))
            b += zlib.adler32(entry[2], zlib.adler32(tube))
    return f"{count}:{a & 0xFFFFFFFFFFFF:x}:{b & 0xFFFFFFFFFFFF:x}"


def _delete_all(conn: Connection, tube: str, keep: int | None = None) -> int:
    """Delete the jobs of a tube (but `keep`); markers are never reserved, so peek finds them all."""
    conn.use(tube)
    deleted = 0
    for peek in (conn.peek_delayed, conn.peek_ready, conn.peek_buried):
        while True:
            job = peek()
            if job is None or job.id == keep or not conn.delete(job.id):
                break
            deleted += 1
    return deleted


def _drop_legacy_markers(conn: Connection, namespace: str, batch_id: int) -> None:
    """Delete the old scheme's per-batch marker tubes, and the partition markers of batches up to `batch_id`."""
    prefix = marker_tube(namespace) + "."
    for tube in conn.list_tubes():
        if not tube.startswith(prefix):
            continue
        rest = tube[len(prefix):]
        mark = PARTITION_MARK.fullmatch("." + rest)
        if rest.isdigit() or (mark is not None and int(mark["batch"]) <= batch_id):
            _delete_all(conn, tube)


def write_marker(opts: WriterOptions, namespace: str, batch_id: int, summary: Mapping[str, Any]) -> int:
    """Record batch completion on every reachable broker, replacing the namespace's previous marker.

    The new marker is put before the old one is deleted, so a crash in between leaves
    two (the older one is read first: at worst the batch is put again, never lost).
    While no broker takes it (every one down: a restart) it is tried again as the rows
    would be (`Outage`): a batch without its marker is put again if Spark replays it.
    Returns how many brokers hold the marker. Failing to write it only weakens replay
    detection (the batch itself is complete), so in the end this logs instead of raising.
    """
    tube = marker_tube(namespace)
    body = json.dumps({"batch_id": batch_id, "put": summary.get("put"), "time": time.time()}).encode()

    def put_marker(conn: Connection) -> None:
        conn.use(tube)
        new_id = conn.put(body, priority=MAX_U32, delay=MARKER_DELAY, ttr=1)
        _delete_all(conn, tube, keep=new_id)
        _drop_legacy_markers(conn, namespace, batch_id)

    return _on_every_broker(opts, put_marker, f"batch {batch_id} was put (its completion marker)")


def _on_every_broker(opts: WriterOptions, action: Callable[[Connection], None], what: str) -> int:
    """Run a marker's `action` on every reachable broker; returns on how many it succeeded.

    While every broker is down (a restart, a partition) or answers only for now (DRAINING, a leader
    handing over or fenced; OUT_OF_MEMORY, full) it tries again as the rows would (`Outage`); a
    broker that refused for good ends the wait (trying again would not help). A marker that no
    broker takes is logged, not raised: the rows it records are put, only replay detection weakens."""
    outage = Outage(opts)
    while True:
        done, errors, refused = 0, [], False
        for broker in opts.links():
            try:
                with _connect(opts, broker) as conn:
                    action(conn)
                done += 1
            except Exception as exc:  # noqa: BLE001 - logged: the rows are put
                errors.append(f"{broker.name}: {exc}")
                for_now = isinstance(exc, (ConnectionLost, OSError)) or (
                    isinstance(exc, BeanstalkError) and exc.status.encode("latin-1") in REFUSED_FOR_NOW)
                refused = refused or not for_now
        if done or refused or outage.exhausted():
            break
        if outage.rounds == 0:
            log.warning("%s, but no broker took the record yet (%s); trying again for up to %gs", what,
                        "; ".join(errors), opts.broker_retry_seconds)
        outage.pause()
    if errors:
        log.warning("%s, but %s brokers did not record it (%s)%s", what, len(errors), "; ".join(errors),
                    "" if done else ": a replay would put it again")
    return done


# --------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------
@dataclass
class WriteSummary:
    """What one write did, summed over partitions."""

    batch_id: int | None = None
    rows: int = 0
    put: int = 0
    buried: int = 0
    dead_lettered: int = 0
    failovers: int = 0                # rows sent to another broker, or again after a wait (each time counted)
    reconnect_rounds: int = 0         # waits for a broker to come back (every broker was down)
    reconnect_seconds: float = 0.0    # their length, summed over partitions
    partitions: int = 0
    partitions_resumed: int = 0       # found put by an earlier attempt of the batch (same rows): not put again
    skipped: bool = False
    skipped_reason: str | None = None
    hosts: dict[str, int] = field(default_factory=dict)
    tubes: dict[str, int] = field(default_factory=dict)
    dead_letter_files: list[str] = field(default_factory=list)

    @classmethod
    def combine(cls, parts: Iterable[Mapping[str, Any] | None], batch_id: int | None = None) -> WriteSummary:
        s = cls(batch_id=batch_id)
        for p in parts:
            if p is None:
                continue
            s.partitions += 1
            s.rows += p.get("rows", 0)
            s.put += p.get("put", 0)
            s.buried += p.get("buried", 0)
            s.dead_lettered += p.get("dead_lettered", 0)
            s.failovers += p.get("failovers", 0)
            s.reconnect_rounds += p.get("reconnect_rounds", 0)
            s.reconnect_seconds += p.get("reconnect_seconds", 0.0)
            for k, v in (p.get("hosts") or {}).items():
                s.hosts[k] = s.hosts.get(k, 0) + v
            for k, v in (p.get("tubes") or {}).items():
                s.tubes[k] = s.tubes.get(k, 0) + v
            s.dead_letter_files.extend(p.get("dead_letter_files") or [])
            if p.get("skipped"):
                s.skipped = True
            if p.get("resumed"):
                s.partitions_resumed += 1
        return s


# --------------------------------------------------------------------------------------
# foreachBatch: beanstalk_put
# --------------------------------------------------------------------------------------
def _spark_conf(spark: Any) -> dict[str, str]:
    """The session's conf; works on classic and Spark Connect sessions (no SparkContext there)."""
    try:
        conf = spark.conf.getAll
        return dict(conf() if callable(conf) else conf)
    except Exception as exc:  # noqa: BLE001 - any failure: fall back to the SparkContext
        log.debug("spark.conf.getAll failed (%s); using the SparkContext's conf", exc)
    if _is_connect(spark):
        return {}
    return dict(spark.sparkContext.getConf().getAll())


def _is_connect(spark: Any) -> bool:
    """A Spark Connect session has no SparkContext (touching it raises JVM_ATTRIBUTE_NOT_SUPPORTED)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def _streaming_query_id(spark: Any) -> str | None:
    """The id of the streaming query running this foreachBatch call, when Spark exposes it.

    Classic sessions carry it as the ``sql.streaming.queryId`` local property (stable
    across restarts from the same checkpoint). Spark Connect (4.3) passes the
    foreachBatch function only the DataFrame and the batch id, with no way to reach the
    query, so there the writerId option is the identity.
    """
    if _is_connect(spark):
        return None
    try:
        value = spark.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception as exc:  # noqa: BLE001 - no id is a normal case, not an error
        log.debug("no local property sql.streaming.queryId: %s", exc)
        return None
    return str(value) if value else None


def _mapper(spec: ColumnSpec, opts: WriterOptions, ctx: Mapping[str, Any], dry_run: bool) -> Any:
    def put_arrow_partition(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        tc = TaskContext.get()
        pctx = dict(ctx, partition=tc.partitionId() if tc is not None else 0)
        summary = put_partition(_arrow_chunks(batches, spec), spec, opts, pctx, dry_run)
        yield pa.RecordBatch.from_pydict({"summary": [json.dumps(summary)]})

    return put_arrow_partition


class BeanstalkPut:
    """A foreachBatch function that puts each micro-batch into beanstalk tubes.

    ``df.writeStream.foreachBatch(beanstalk_put)`` takes its settings from Spark conf
    (``spark.beanstalk.hosts``, ``spark.beanstalk.tube``, ...);
    ``beanstalk_put.options(hosts="h1:11300,h2:11300", tube="out")`` returns a copy
    with options that override the conf. Also usable on a batch DataFrame:
    ``beanstalk_put.options(...).write(df)``. Each call returns a :class:`WriteSummary`
    (also kept as ``.last_summary``).
    """

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self._options = {str(k): _option_text(v) for k, v in (options or {}).items()}
        self.last_summary: WriteSummary | None = None
        self._warned_no_identity = False

    def options(self, **options: Any) -> BeanstalkPut:
        merged = dict(self._options)
        merged.update({k: _option_text(v) for k, v in options.items()})
        WriterOptions.parse(merged)            # fail fast on a typo or a bad value
        return BeanstalkPut(merged)

    def option(self, key: str, value: Any) -> BeanstalkPut:
        return self.options(**{key: value})

    def __repr__(self) -> str:
        return f"beanstalk_put.options({', '.join(f'{k}={v!r}' for k, v in self._options.items())})"

    def write(self, df: Any) -> WriteSummary:
        """Put a (batch) DataFrame once; no batch id, so no replay detection."""
        return self(df, None)

    def __call__(self, df: Any, batch_id: int | None = None) -> WriteSummary:
        spark = df.sparkSession
        opts = WriterOptions.parse(self._options, _spark_conf(spark))
        spec = ColumnSpec.from_schema(df.schema, opts)
        namespace = None
        if batch_id is not None and opts.dedup:
            writer_id = opts.writer_id or _streaming_query_id(spark)
            if writer_id:
                namespace = marker_namespace(writer_id, opts, explicit=bool(opts.writer_id))
                holder = marker_exists(opts, namespace, batch_id)
                if holder:
                    log.warning("beanstalk_put: batch %s already completed (marker in %s on %s); not putting it again",
                                batch_id, marker_tube(namespace), holder)
                    summary = WriteSummary(batch_id=batch_id, skipped=True,
                                           skipped_reason=f"marker in {marker_tube(namespace)} on {holder}")
                    self.last_summary = summary
                    return summary
            elif not self._warned_no_identity:
                self._warned_no_identity = True
                log.warning("beanstalk_put: no streaming query id is visible here (Spark Connect runs "
                            "foreachBatch in a server-side session); batch replay detection is off "
                            "unless you give the writerId option")
        ctx = {"batch_id": batch_id, "namespace": namespace}
        cached = False
        try:
            if opts.validate == "batch":
                # validate every partition before any is put (costs a second pass; the input is cached)
                df = df.persist()
                cached = True
                df.mapInArrow(_mapper(spec, opts, ctx, True), "summary string").collect()
            rows = df.mapInArrow(_mapper(spec, opts, ctx, False), "summary string").collect()
        except Exception as exc:
            raise _clean_error(exc) from exc
        finally:
            if cached:
                df.unpersist()
        summary = WriteSummary.combine((json.loads(r[0]) for r in rows), batch_id)
        if namespace is not None and batch_id is not None:
            write_marker(opts, namespace, batch_id, {"put": summary.put})
        self.last_summary = summary
        return summary


def _clean_error(exc: Exception) -> Exception:
    """Surface our message from a PythonException's traceback text, keeping the original chained."""
    text = str(exc)
    for cls in (BeanstalkUnavailableError, BeanstalkWriteError):
        qualified = f"{cls.__module__}.{cls.__name__}: "
        marker = qualified if qualified in text else f"{cls.__name__}: "
        pos = text.rfind(marker)
        if pos >= 0:
            message = text[pos + len(marker):].strip()
            for stop in ("\n\n\tat ", "\n\tat ", "\nJVM stacktrace"):
                cut = message.find(stop)
                if cut >= 0:
                    message = message[:cut].rstrip()
            return cls(message)
    return exc


def _option_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(f"{v[0]}:{v[1]}" if isinstance(v, tuple) else str(v) for v in value)
    return str(value)


beanstalk_put = BeanstalkPut()


# --------------------------------------------------------------------------------------
# Python Data Source writers (called by spark_beanstalk/datasource.py)
# --------------------------------------------------------------------------------------


@dataclass
class BeanstalkCommitMessage(WriterCommitMessage):
    summary: dict[str, Any]
    writer_id: str | None = None
    batch_id: int | None = None


def _ours(messages: list[WriterCommitMessage | None]) -> list[BeanstalkCommitMessage]:
    return [m for m in messages if isinstance(m, BeanstalkCommitMessage)]


def _task_context() -> tuple[int, str | None, int | None]:
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:
        return 0, None, None
    batch = tc.getLocalProperty("streaming.sql.batchId")
    return tc.partitionId(), tc.getLocalProperty("sql.streaming.queryId"), int(batch) if batch else None


class _BatchWriterBase:
    def __init__(self, opts: WriterOptions, spec: ColumnSpec) -> None:
        self.opts = opts
        self.spec = spec

    def _write(self, chunks: Iterator[Chunk]) -> BeanstalkCommitMessage:
        partition, _, _ = _task_context()
        summary = put_partition(chunks, self.spec, self.opts, {"partition": partition})
        return BeanstalkCommitMessage(summary)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        s = WriteSummary.combine(m.summary for m in _ours(messages))
        log.info("beanstalk write committed: %s rows put, %s dead-lettered", s.put, s.dead_lettered)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        s = WriteSummary.combine(m.summary for m in _ours(messages))
        log.warning("beanstalk write aborted: %s rows had been put by the partitions that succeeded "
                    "(puts cannot be taken back)", s.put)


class BeanstalkArrowWriter(_BatchWriterBase, DataSourceArrowWriter):
    """``df.write.format("beanstalk")``: Arrow batches in (the faster variant)."""

    def write(self, iterator: Iterator[Any]) -> BeanstalkCommitMessage:
        return self._write(_arrow_chunks(iterator, self.spec))


class BeanstalkRowWriter(_BatchWriterBase, DataSourceWriter):
    """``df.write.format("beanstalk").option("arrow", "false")``: Spark Rows in."""

    def write(self, iterator: Iterator[Any]) -> BeanstalkCommitMessage:
        return self._write(_row_chunks(iterator, self.spec))


class _StreamWriterBase:
    def __init__(self, opts: WriterOptions, spec: ColumnSpec) -> None:
        self.opts = opts
        self.spec = spec

    def _namespace(self, query_id: str | None) -> str | None:
        if not self.opts.dedup:
            return None
        wid = self.opts.writer_id or query_id
        return marker_namespace(wid, self.opts, explicit=bool(self.opts.writer_id)) if wid else None

    def _write(self, make_chunks: Callable[[], Iterator[Chunk]]) -> BeanstalkCommitMessage:
        partition, query_id, batch_id = _task_context()
        namespace = self._namespace(query_id)
        if namespace is not None and batch_id is not None:
            holder = marker_exists(self.opts, namespace, batch_id)
            if holder:
                log.warning("beanstalk sink: batch %s already completed (marker on %s); partition %s not put again",
                            batch_id, holder, partition)
                return BeanstalkCommitMessage({"partition": partition, "skipped": True}, query_id, batch_id)
        summary = put_partition(make_chunks(), self.spec, self.opts,
                                {"partition": partition, "batch_id": batch_id, "namespace": namespace})
        return BeanstalkCommitMessage(summary, query_id, batch_id)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        msgs = _ours(messages)
        s = WriteSummary.combine((m.summary for m in msgs), batchId)
        query_id = next((m.writer_id for m in msgs if m.writer_id), None)
        namespace = self._namespace(query_id)
        if namespace is not None and not s.skipped:
            write_marker(self.opts, namespace, batchId, {"put": s.put})
        log.info("beanstalk sink batch %s committed: %s rows put", batchId, s.put)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        s = WriteSummary.combine(m.summary for m in _ours(messages))
        log.warning("beanstalk sink batch %s aborted: %s rows had been put by the partitions that succeeded; "
                    "Spark will run the batch again (at-least-once)", batchId, s.put)


class BeanstalkStreamArrowWriter(_StreamWriterBase, DataSourceStreamArrowWriter):
    """``df.writeStream.format("beanstalk")``: Arrow batches in (the faster variant)."""

    def write(self, iterator: Iterator[Any]) -> BeanstalkCommitMessage:
        return self._write(lambda: _arrow_chunks(iterator, self.spec))


class BeanstalkStreamRowWriter(_StreamWriterBase, DataSourceStreamWriter):
    """``df.writeStream.format("beanstalk").option("arrow", "false")``: Spark Rows in."""

    def write(self, iterator: Iterator[Any]) -> BeanstalkCommitMessage:
        return self._write(lambda: _row_chunks(iterator, self.spec))


def make_batch_writer(options: Mapping[str, str], schema: Any, overwrite: bool) -> DataSourceWriter:
    """The writer for ``df.write.format("beanstalk")``; ``overwrite`` is ignored (tubes are appended to)."""
    opts = WriterOptions.parse(options, _active_conf())
    spec = ColumnSpec.from_schema(schema, opts)
    return (BeanstalkArrowWriter if opts.arrow else BeanstalkRowWriter)(opts, spec)


def make_stream_writer(options: Mapping[str, str], schema: Any, overwrite: bool) -> DataSourceStreamWriter:
    """The writer for ``df.writeStream.format("beanstalk")``."""
    opts = WriterOptions.parse(options, _active_conf())
    spec = ColumnSpec.from_schema(schema, opts)
    return (BeanstalkStreamArrowWriter if opts.arrow else BeanstalkStreamRowWriter)(opts, spec)


def _active_conf() -> dict[str, str]:
    """``spark.beanstalk.*`` defaults, when a SparkSession is reachable from this process.

    The data source's writer() runs in a Python worker with no SparkSession; there Spark
    conf is not visible and only the explicit options (and defaults) apply.
    """
    try:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
        return _spark_conf(spark) if spark is not None else {}
    except Exception:  # noqa: BLE001 - no session reachable: options and defaults only
        return {}
