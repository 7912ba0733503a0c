"""The leader's side of the stream: records, backlog, snapshots, replica sessions, sync holds.

While this member leads, every queue change becomes one binlog record (the same bytes the
binlog writes) numbered ``seq`` within the leader's ``epoch``. Records are kept in a bounded
in-memory backlog and sent to every replica at the server's sync point (once per reply
batch). A replica that asks for a position in this epoch that the backlog still holds gets
the records after it. A replica that was in step with this member when it was elected (the
same position in the previous epoch, or an earlier one this member still has the records
after, and a queue exactly at it) gets those records, ``M_NEW_EPOCH`` and the new epoch's
records: a failover costs the replicas no snapshot. Any other position (an older epoch, older
than the backlogs, a fresh or restarted replica) gets a snapshot of the live jobs first.
``SyncHold`` keeps replies that acknowledge changes until ``--sync-replicas`` replicas have
acknowledged their records.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from broker import binlog_format as fmt
from broker.queue import DELAYED, INVALID, Job, Queue, QueueListener, Tube
from broker.replication import wire

if TYPE_CHECKING:
    from broker.connection import BrokerConnection

NS = 1_000_000_000
BACKLOG_BYTES = 64 << 20
# What one backlog entry costs beyond its message bytes: the tuple, the seq int, the bytes
# header, the deque slot. Counted, so that the limit bounds memory, not payload: small records
# made a 64 MiB backlog cost ~190 MB.
BACKLOG_ENTRY_OVERHEAD = 128
MAX_UNSENT = 256 << 20  # a replica this far behind on the socket is dropped; it catches up by snapshot
SNAPSHOT_CHUNK = 2_000  # jobs per piece of a snapshot at most: the leader serves its clients between pieces
SNAPSHOT_PIECE_BYTES = 4 << 20  # and bytes per piece at most (2,000 jobs of 64 KiB would be 128 MiB)


class ReplicaSession:
    """One connected replica: where it is, what it acknowledged."""

    def __init__(self, name: str, writer: asyncio.StreamWriter) -> None:
        self.name = name
        self.writer = writer
        self.acked = 0
        self.closed = False

    def send(self, data: bytes) -> None:
        """Never raises: it runs inside the commit of a group of client replies, and an exception
        there lost every reply of the group (the changes applied, the clients never answered)."""
        if self.closed:
            return
        transport = self.writer.transport
        if transport.is_closing():  # the replica went away (a reset): uvloop raises on a write
            self.close()
            return
        try:
            self.writer.write(data)
        except (RuntimeError, OSError):
            self.close()
            return
        if transport.get_write_buffer_size() > MAX_UNSENT:
            self.close()

    async def drain(self) -> None:
        """Wait until the socket takes what was sent (a snapshot goes out a piece at a time)."""
        try:
            await self.writer.drain()
        except (ConnectionError, OSError):
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.transport.abort()


class Predecessor(NamedTuple):
    """Where this member stood in the previous leader's epoch when it was elected, and the newest
    records of that epoch it applied (``Applier.tail``, contiguous, the last one ``seq``)."""

    epoch: int
    seq: int
    tail: tuple[wire.StreamRecord, ...]


class ReplicationSource(QueueListener):
    """Queue listener active while this member leads."""

    def __init__(self, backlog_bytes: int = BACKLOG_BYTES) -> None:
        self.active = False
        self.epoch = 0
        self.seq = 0
        self.backlog: deque[tuple[int, bytes]] = deque()
        self.backlog_bytes = 0
        self.backlog_limit = backlog_bytes
        self.pending: list[bytes] = []
        self.sessions: list[ReplicaSession] = []
        self.queue: Queue | None = None
        self.on_ack: Callable[[], None] = _nothing
        self.catch_ups = {"backlog": 0, "snapshot": 0}  # how replicas joined, for stats
        self.predecessor: Predecessor | None = None

    # -- leading ---------------------------------------------------------------------------
    def start(self, epoch: int, predecessor: Predecessor | None = None) -> None:
        """Lead ``epoch``; ``predecessor`` when this member's queue is exactly the state at its position
        in the previous epoch (replicas in step with it then need no snapshot)."""
        self.active = True
        self.epoch = epoch
        self.predecessor = predecessor
        self.seq = 0
        self.backlog.clear()
        self.backlog_bytes = 0
        self.pending.clear()

    def stop(self) -> None:
        """No longer the leader: record nothing, drop every replica."""
        self.active = False
        self.pending.clear()
        for session in self.sessions:
            session.close()
        self.sessions.clear()

    # -- queue listener --------------------------------------------------------------------
    def recover(self, queue: Queue) -> None:
        self.queue = queue

    def job_put(self, job: Job) -> None:
        if self.active:
            created = job.created + self._wall_offset()
            delay = job.delay
            if delay:
                self._emit(fmt.encode_job(job.id, DELAYED, job.pri, delay, job.ttr * NS, created, created + delay,
                                          (0, 0, 0, 0, 0), job.tube.name_bytes, job.body))
            else:
                self._emit(fmt.encode_ready_job(job.id, job.pri, job.ttr * NS, created, job.tube.name_bytes, job.body))

    def job_updated(self, job: Job) -> None:
        if self.active and job.state != INVALID:
            deadline = job.deadline + self._wall_offset() if job.state == DELAYED else 0
            self._emit(fmt.encode_update(job.id, job.state, job.pri, job.delay, deadline, _counters(job)))

    def job_reserved(self, job: Job) -> None:
        self.job_updated(job)  # state reserved, reserves+1: a replica keeps the count (it holds the job ready)

    def job_deleted(self, job: Job) -> None:
        if self.active:
            self._emit(fmt.encode_delete(job.id))

    def tube_paused(self, tube: Tube) -> None:
        if self.active:
            self._emit(self._pause_record(tube))

    def _pause_record(self, tube: Tube) -> bytes:
        return wire.encode_pause(tube.name_bytes, tube.pause, tube.unpause_at + self._wall_offset())

    def sync_point(self) -> bool:
        """Sends what the last commands logged to every replica; it cannot fail (a replica that
        does not get it is disconnected and catches up)."""
        if self.pending:
            data = b"".join(self.pending)
            self.pending.clear()
            for session in self.sessions:
                session.send(data)
        return True

    def close(self) -> None:
        self.stop()

    # -- records ---------------------------------------------------------------------------
    def _emit(self, record: bytes) -> None:
        self.seq += 1
        msg = wire.message(wire.M_RECORD, self.epoch, self.seq, time.time_ns(), record)
        self.pending.append(msg)
        self.backlog.append((self.seq, msg))
        self.backlog_bytes += len(msg) + BACKLOG_ENTRY_OVERHEAD
        while self.backlog_bytes > self.backlog_limit and len(self.backlog) > 1:
            self.backlog_bytes -= len(self.backlog.popleft()[1]) + BACKLOG_ENTRY_OVERHEAD

    def _wall_offset(self) -> int:
        assert self.queue is not None
        return time.time_ns() - self.queue.clock()

    def full_record(self, job: Job) -> bytes:
        off = self._wall_offset()
        deadline = job.deadline + off if job.state == DELAYED else 0
        return fmt.encode_job(job.id, job.state, job.pri, job.delay, job.ttr * NS, job.created + off, deadline,
                              _counters(job), job.tube.name_bytes, job.body)

    # -- replicas --------------------------------------------------------------------------
    def attach(self, session: ReplicaSession, epoch: int, seq: int, exact: bool = False) -> bool:
        """Catch a replica at (epoch, seq) up from the backlogs and join it to the live stream; False
        when it needs a snapshot instead (``send_snapshot``).

        ``exact``: the replica's queue is exactly the state at its position (wire.M_NEW_EPOCH).
        Synchronous on purpose: nothing can change the queue between the catch-up data and
        the session joining the live stream.
        """
        self.sync_point()  # records not yet sent belong to the live stream of the others
        first = self._first_held()
        older = self._previous_epoch_after(epoch, seq) if exact and first == 1 else None
        if epoch == self.epoch and first - 1 <= seq <= self.seq:
            parts = [msg for s, msg in self.backlog if s > seq]
        elif older is not None:
            assert self.predecessor is not None
            start = wire.EPOCH_START.pack(self.predecessor.epoch, self.predecessor.seq)
            parts = [*older, wire.message(wire.M_NEW_EPOCH, self.epoch, 0, time.time_ns(), start)]
            parts += [msg for _, msg in self.backlog]
        else:
            return False
        session.send(b"".join(parts))
        self.sessions.append(session)
        self.catch_ups["backlog"] += 1
        return True

    async def send_snapshot(self, session: ReplicaSession, chunk: int = SNAPSHOT_CHUNK,
                            piece_bytes: int = SNAPSHOT_PIECE_BYTES) -> bool:
        """Every live job as a full record, in pieces of at most ``chunk`` jobs or ``piece_bytes`` bytes
        with the event loop free between them; then the records logged meanwhile, from the backlog, and
        the session joins the live stream. False (the session closed) when it cannot finish: leadership
        lost, the replica gone, or the backlog no longer reaching back to where the snapshot began.

        A job is sent as it is when its piece is made, so it may already show changes logged after the
        snapshot began; those records follow the end message and set the same state again (applying is
        idempotent). A job deleted before its piece is not named, and the end message drops it.
        """
        assert self.queue is not None
        self.sync_point()
        epoch, start = self.epoch, self.seq
        jobs = self.queue.jobs.values()  # a list of the live jobs when the snapshot begins
        session.send(wire.message(wire.M_SNAPSHOT_BEGIN, epoch, start, time.time_ns()))
        i = 0
        while i < len(jobs):
            now = time.time_ns()
            piece: list[bytes] = []
            size = 0
            for job in jobs[i:i + chunk]:
                i += 1
                if job.state != INVALID:
                    piece.append(wire.message(wire.M_RECORD, epoch, 0, now, self.full_record(job)))
                    size += len(piece[-1])
                    if size >= piece_bytes:
                        break
            session.send(b"".join(piece))
            await session.drain()
            # drain() returns at once while the transport holds less than its high-water mark, which
            # a loopback socket's large send buffer keeps it under for megabytes: without a turn of
            # the loop here, the pieces went out back to back and clients waited ~0.3 s (300,000 jobs)
            await asyncio.sleep(0)
            if session.closed or not self.active or self.epoch != epoch:
                session.close()
                return False
        now = time.time_ns()
        clock = self.queue.clock()
        session.send(b"".join([wire.message(wire.M_RECORD, epoch, 0, now, self._pause_record(tube))
                               for tube in self.queue.tube_by_name.values() if tube.pause and tube.unpause_at > clock]))
        self.sync_point()
        if self._first_held() - 1 > start:  # more was logged meanwhile than the backlog holds
            session.close()
            return False
        now = time.time_ns()
        next_id = wire.NEXT_ID.pack(self.queue.next_id)
        end = wire.message(wire.M_SNAPSHOT_END, epoch, start, now, next_id)
        # then the records logged meanwhile, and a heartbeat naming the newest: the replica's queue
        # is exactly the state at its position once it has applied up to there (the pieces show
        # jobs as they were when each was made, later than `start`)
        head = wire.message(wire.M_HEARTBEAT, epoch, self.seq, now, next_id)
        session.send(b"".join([end, *(msg for s, msg in self.backlog if s > start), head]))
        self.sessions.append(session)
        self.catch_ups["snapshot"] += 1
        return True

    def _first_held(self) -> int:
        """The oldest seq the backlog still holds (the next one when it is empty)."""
        return self.backlog[0][0] if self.backlog else self.seq + 1

    def _previous_epoch_after(self, epoch: int, seq: int) -> list[bytes] | None:
        """The previous epoch's records after (epoch, seq) up to where this member was elected, or None
        when that position is not one this member passed through with the records still at hand."""
        pred = self.predecessor
        if pred is None or epoch != pred.epoch or seq > pred.seq:
            return None
        tail = [r for r in pred.tail if r.seq > seq]
        if seq < pred.seq and (not tail or tail[0].seq != seq + 1):
            return None
        return [wire.message(wire.M_RECORD, pred.epoch, r.seq, r.wall_ns, r.record) for r in tail]

    def detach(self, session: ReplicaSession) -> None:
        session.close()
        if session in self.sessions:
            self.sessions.remove(session)

    def acknowledged(self, session: ReplicaSession, epoch: int, seq: int) -> None:
        if epoch == self.epoch and seq > session.acked:
            session.acked = min(seq, self.seq)  # never more than was sent
            self.on_ack()

    def heartbeat(self) -> None:
        """Every tick while leading. Also gives held replies another chance (``on_ack``): an ack that
        came while the lease was in doubt released nothing, and no later ack may ever come (one
        client, waiting for that very reply)."""
        if self.active and self.queue is not None and self.sessions:
            self.sync_point()
            msg = wire.message(wire.M_HEARTBEAT, self.epoch, self.seq, time.time_ns(),
                               wire.NEXT_ID.pack(self.queue.next_id))
            for session in self.sessions:
                session.send(msg)
            self.on_ack()

    def acked_by(self, n: int) -> int:
        """The newest seq that at least ``n`` connected replicas have."""
        acks = sorted((s.acked for s in self.sessions if not s.closed), reverse=True)
        return acks[n - 1] if len(acks) >= n else 0


class SyncHold:
    """--sync-replicas N: replies wait, in order, until N replicas have their records.

    Installed as the server's ``replication_hold``: ``commit_group`` hands it each group of
    replies after the binlog's sync point. A group made while records were logged waits
    until ``acked_by(N)`` reaches the newest of them; a group that logged nothing (reads,
    reserves) goes out at once, except the replies of connections that already have replies
    waiting (each connection's replies stay in order). Replies go out only while
    ``may_ack()`` (the leader's lease is valid); on step-down held replies are dropped and
    their connections closed.
    """

    def __init__(self, source: ReplicationSource, needed: int, may_ack: Callable[[], bool]) -> None:
        self.source = source
        self.needed = needed
        self.may_ack = may_ack
        self.waiting: deque[tuple[int, list[tuple[BrokerConnection, bytes]]]] = deque()
        self.held: dict[BrokerConnection, int] = {}  # connection -> groups of it waiting
        # (epoch, seq) after the last group: seq starts again at 0 in every term, so a seq alone
        # could match the previous term's and pass a group that logged records as one that did not
        self.last_mark = (0, 0)
        source.on_ack = self.release

    def hold(self, replies: list[tuple[BrokerConnection, bytes]]) -> bool:
        source = self.source
        if not source.active:
            return False  # not leading: nothing here acknowledges a change (the gate refused them)
        target = source.seq
        mark = (source.epoch, target)
        logged = mark != self.last_mark
        self.last_mark = mark
        if not self.waiting and source.acked_by(self.needed) >= target and self.may_ack():
            return False
        if not logged:
            later = [(conn, data) for conn, data in replies if conn in self.held]
            for conn, data in replies:
                if conn not in self.held:
                    conn.send(data)
            if later:
                self._wait(self.waiting[-1][0] if self.waiting else target, later)
            return True
        self._wait(target, replies)
        return True

    def _wait(self, target: int, replies: list[tuple[BrokerConnection, bytes]]) -> None:
        self.waiting.append((target, replies))
        held = self.held
        for conn in {conn for conn, _ in replies}:
            held[conn] = held.get(conn, 0) + 1

    def _done(self, replies: list[tuple[BrokerConnection, bytes]]) -> None:
        held = self.held
        for conn in {conn for conn, _ in replies}:
            n = held.get(conn, 0) - 1
            if n > 0:
                held[conn] = n
            else:
                held.pop(conn, None)

    def release(self) -> None:
        if not self.waiting or not self.may_ack():
            return
        done = self.source.acked_by(self.needed)
        while self.waiting and self.waiting[0][0] <= done:
            replies = self.waiting.popleft()[1]
            self._done(replies)
            for conn, data in replies:
                conn.send(data)

    def abort(self) -> None:
        """Stepping down: these replies may never say their changes were accepted."""
        while self.waiting:
            for conn, _data in self.waiting.popleft()[1]:
                if conn.transport is not None:
                    conn.mark_closing()
                    conn.transport.abort()
        self.held.clear()


def _counters(job: Job) -> tuple[int, int, int, int, int]:
    return (job.reserves, job.timeouts, job.releases, job.buries, job.kicks)


def _nothing() -> None:
    pass
