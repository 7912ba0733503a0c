"""The replica's side of the stream: connect, catch up, apply, acknowledge.

Records are applied through the queue's ``apply_*`` methods, so the replica's own binlog
logs them as it logs a command's changes; the acknowledgement for a batch is sent only
after the binlog's sync point (written; fsynced with ``-f 0``). Applying is idempotent per
job (a full record sets the job's state, an update or delete of an unknown job is a
no-op), so replaying records the replica already has is harmless: the position file may
lag behind the binlog, never run ahead of it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from broker import logs, queue_apply
from broker.protocol import UNKNOWN_COMMAND
from broker.queue import Queue
from broker.replication import wire

log = logging.getLogger("broker.replication")
STATE_FILE = "replication.json"
CONNECT_TIMEOUT = 3.0
SILENCE_TIMEOUT = 3.0  # the leader heartbeats every 0.1 s; this much silence means it is gone
TAIL_BYTES = 8 << 20  # the newest records a replica keeps, to serve replicas a little behind it if it is elected


@dataclass
class Position:
    """Where a member stands in the leaders' history: the last record it has."""

    epoch: int = 0
    seq: int = 0

    def key(self) -> tuple[int, int]:
        return (self.epoch, self.seq)


class SavedPosition(NamedTuple):
    """The position file: where the member stood, and whether a clean shutdown wrote it after its binlog
    closed (then the binlog holds exactly the state at ``pos``; otherwise it may hold more)."""

    pos: Position
    exact: bool


def load_position(directory: str) -> SavedPosition:
    try:
        with open(os.path.join(directory, STATE_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
        return SavedPosition(Position(int(data["epoch"]), int(data["seq"])), data.get("exact") is True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return SavedPosition(Position(), False)


def save_position(directory: str, pos: Position, exact: bool = False) -> None:
    path = os.path.join(directory, STATE_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"epoch": pos.epoch, "seq": pos.seq, **({"exact": True} if exact else {})}, fh)
    os.replace(tmp, path)


class Applier:
    """Applies stream messages to the queue; tracks position and lag."""

    def __init__(self, queue: Queue, pos: Position, tail_bytes: int = TAIL_BYTES) -> None:
        self.queue = queue
        self.pos = pos
        self.snapshot: set[int] | None = None
        self.leader_head = pos.seq
        self.caught_up_at = time.monotonic()
        # The queue is exactly the state at ``pos``: true after a snapshot (or leading) in this process, false
        # after a restart (the binlog may hold records past a lagging position file) or mid-snapshot. Only an
        # exact member may take a new leader's epoch without a snapshot (wire.M_NEW_EPOCH).
        self.exact = False
        # After a snapshot: the leader's seq by the first heartbeat after its end (-1 until that
        # heartbeat; the leader sends one right behind the records that follow the end). Each
        # piece shows its jobs as they were when it was made, later than the snapshot's start, so
        # the queue is the state at its position only once it has applied the records up to
        # there; before, a new leader must not take it for exact (it would diverge).
        self.exact_at: int | None = None
        self.tail: deque[wire.StreamRecord] = deque()  # the records of pos.epoch up to pos.seq, newest last
        self.tail_bytes = 0
        self.tail_limit = tail_bytes

    def lag_records(self) -> int:
        return max(0, self.leader_head - self.pos.seq)

    def lag_seconds(self) -> float:
        return 0.0 if self.lag_records() == 0 else time.monotonic() - self.caught_up_at

    def apply(self, msgs: list[wire.Message]) -> bool:
        """Apply messages in order; True when the position moved (an ack is due)."""
        moved = False
        off = time.time_ns() - self.queue.clock()
        for m in msgs:
            if m.epoch < self.pos.epoch:
                raise wire.StreamError(f"message of epoch {m.epoch} after epoch {self.pos.epoch}: a deposed leader")
            if m.kind == wire.M_RECORD:
                moved |= self._record(m, off)
            elif m.kind == wire.M_SNAPSHOT_BEGIN:
                self.snapshot = set()
                self.exact = False
                self.exact_at = None
                self.clear_tail()
            elif m.kind == wire.M_SNAPSHOT_END:
                self._end_snapshot(m)
                moved = True
            elif m.kind == wire.M_NEW_EPOCH:
                self._new_epoch(m)
                moved = True
            else:
                self.leader_head = max(self.leader_head, m.seq) if m.epoch == self.pos.epoch else m.seq
                self._bump_next_id(m.payload)
                if self.exact_at == -1 and m.epoch == self.pos.epoch:
                    self.exact_at = m.seq
        if self.exact_at is not None and 0 <= self.exact_at <= self.pos.seq:
            self.exact = True
            self.exact_at = None
        if self.lag_records() == 0:
            self.caught_up_at = time.monotonic()
        return moved

    def _record(self, m: wire.Message, off: int) -> bool:
        if self.snapshot is not None:
            self.snapshot.add(self._apply_record(m.payload, off))
            return False
        if m.epoch != self.pos.epoch or m.seq != self.pos.seq + 1:
            if m.epoch == self.pos.epoch and m.seq <= self.pos.seq:
                return False  # already have it
            raise wire.StreamError(f"record ({m.epoch}, {m.seq}) does not follow ({self.pos.epoch}, {self.pos.seq})")
        self._apply_record(m.payload, off)
        self.pos = Position(m.epoch, m.seq)
        self.leader_head = max(self.leader_head, m.seq)
        self.tail.append(wire.new_tail_record(m.seq, m.wall_ns, m.payload))
        self.tail_bytes += len(m.payload)
        while self.tail_bytes > self.tail_limit:
            self.tail_bytes -= len(self.tail.popleft().record)
        return True

    def _new_epoch(self, m: wire.Message) -> None:
        if len(m.payload) != wire.EPOCH_START.size:
            raise wire.StreamError("bad new-epoch message")
        if not self.exact or wire.EPOCH_START.unpack(m.payload) != self.pos.key() or m.epoch <= self.pos.epoch:
            raise wire.StreamError(f"epoch {m.epoch} does not start at our position {self.pos.key()}")
        self.pos = Position(m.epoch, 0)
        self.leader_head = 0
        self.clear_tail()

    def clear_tail(self) -> None:
        self.tail.clear()
        self.tail_bytes = 0

    def _apply_record(self, record: bytes, off: int) -> int:
        fields = wire.decode_record(record)
        queue = self.queue
        if isinstance(fields, wire.JobFields):
            deadline = fields.deadline - off if fields.deadline else 0
            queue_apply.apply_job(queue, fields.id, fields.tube, fields.pri, fields.delay, fields.ttr, fields.body,
                                  fields.state, deadline, fields.created - off, fields.counters)
            return fields.id
        if isinstance(fields, wire.UpdateFields):
            deadline = fields.deadline - off if fields.deadline else 0
            queue_apply.apply_state(queue, fields.id, fields.state, fields.pri, fields.delay, deadline, fields.counters)
            return fields.id
        if isinstance(fields, wire.PauseFields):
            queue_apply.apply_pause(queue, fields.tube, fields.pause, fields.until - off)
            return 0  # names no job: a snapshot's end keeps or drops jobs, not pauses
        queue_apply.apply_delete(queue, fields)
        return fields

    def _end_snapshot(self, m: wire.Message) -> None:
        keep = self.snapshot or set()
        for job_id in [i for i in self.queue.jobs if i not in keep]:
            queue_apply.apply_delete(self.queue, job_id)
        self.snapshot = None
        self.pos = Position(m.epoch, m.seq)
        self.leader_head = m.seq
        self.exact_at = -1  # exact once level with the leader's seq of the next heartbeat
        self._bump_next_id(m.payload)

    def _bump_next_id(self, payload: bytes) -> None:
        if len(payload) == wire.NEXT_ID.size:
            next_id = wire.NEXT_ID.unpack(payload)[0]
            self.queue.next_id = max(self.queue.next_id, next_id)


@dataclass
class StreamTarget:
    host: str
    port: int
    token: bytes | None = None
    ssl_context: ssl.SSLContext | None = None


class Follower:
    """Follows one leader address until stopped, reconnecting after errors."""

    def __init__(self, target: StreamTarget, name: str, applier: Applier, after_batch: Callable[[], bool],
                 state_dir: str) -> None:
        self.target = target
        self.name = name
        self.applier = applier
        self.after_batch = after_batch  # the server's sync point and timer reschedule; False: not durable
        self.owed = False  # an ack held back because the binlog could not keep the records (yet)
        self.state_dir = state_dir
        self.connected = False
        self.last_error = ""
        self.stopped = False  # besides cancel(): asyncio.wait_for can swallow a cancellation (Python 3.11)
        self.closed = False  # the server is closing: the member writes the last position itself
        self.offers_exact = True  # cleared when the leader predates `exact` (a rolling upgrade: replicas first)
        self._saved_at = 0.0

    async def run(self) -> None:
        while not self.stopped:
            try:
                await self._session()
            except Exception as exc:  # noqa: BLE001  (any failure: log it, reconnect, ask again from our position)
                if str(exc) != self.last_error:
                    where = f"{self.target.host}:{self.target.port}"
                    logs.event(log, logging.WARNING, "replication-stream", f"{where}: {exc}")
                self.last_error = str(exc)
            finally:
                self.connected = False
                self.applier.snapshot = None
                if self.after_batch():  # what was applied is in the binlog before the position says so
                    self._save(force=True)
            await asyncio.sleep(0.2)

    async def _session(self) -> None:
        t = self.target
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(t.host, t.port, ssl=t.ssl_context,
                                    server_hostname=t.host if t.ssl_context is not None else None), CONNECT_TIMEOUT)
        nodelay(writer)
        try:
            await self._handshake(reader, writer)
            self.connected = True
            self.last_error = ""
            buf = bytearray()
            while True:
                data = await asyncio.wait_for(reader.read(1 << 20), SILENCE_TIMEOUT)
                if not data:
                    raise EOFError("the leader closed the stream")
                buf += data
                if self.stopped:
                    return
                if self.applier.apply(wire.split_messages(buf)) or self.owed:
                    # No ack for what the binlog could not keep (a failing disk): the leader's
                    # --sync-replicas replies wait. The next message (a heartbeat at least)
                    # tries again, once the binlog has rebuilt itself.
                    self.owed = not self.after_batch()
                    if not self.owed:
                        pos = self.applier.pos
                        writer.write(wire.ACK.pack(pos.epoch, pos.seq))
                        self._save()
        finally:
            writer.transport.abort()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.target.token is not None:
            writer.write(b"auth %s\r\n" % self.target.token)
            line = await asyncio.wait_for(reader.readline(), CONNECT_TIMEOUT)
            if line != b"OK\r\n":
                raise ValueError(f"replication auth refused: {line!r}")
        pos = self.applier.pos
        exact = b" exact" if self.applier.exact and self.offers_exact else b""
        writer.write(b"replicate %s %d %d%s\r\n" % (self.name.encode(), pos.epoch, pos.seq, exact))
        line = await asyncio.wait_for(reader.readline(), CONNECT_TIMEOUT)
        if exact and line == UNKNOWN_COMMAND:
            self.offers_exact = False
            raise ValueError("the leader does not know 'replicate ... exact' (an older version): asking without it")
        if not line.startswith(b"STREAMING "):
            raise ValueError(f"the member at {self.target.host}:{self.target.port} does not stream: {line!r}")

    def _save(self, force: bool = False) -> None:
        if self.closed:
            return
        now = time.monotonic()
        if force or now - self._saved_at >= 0.1:
            self._saved_at = now
            try:
                save_position(self.state_dir, self.applier.pos)
            except OSError as exc:
                logs.event(log, logging.ERROR, "replication-state", f"cannot save the position: {exc}")


def nodelay(writer: asyncio.StreamWriter) -> None:
    """Acks and records are small and latency-bound: no Nagle delay on the stream."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
