"""What the server shares with its connections: configuration, the loop timer, group commit.

uvicorn gives each protocol instance a small ``ServerState``; we do the same, so that a
:class:`broker.connection.BrokerConnection` never reaches into the server object or the
queue's timer heap, and the server never needs a connection's internals.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from broker import protocol as p
from broker import queue_timers, security
from broker.busypoll import DEFAULT_WINDOW_US, BusyPoll
from broker.limits import OUTPUT_HIGH_WATER, Limits
from broker.queue import Queue
from broker.timers import NEVER

if TYPE_CHECKING:
    from broker.connection import BrokerConnection


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1"
    port: int = 11300
    max_job_size: int = p.DEFAULT_MAX_JOB_SIZE
    verbose: int = 0
    limits: Limits = field(default_factory=Limits)
    tls: security.TlsConfig | None = None
    auth_token: bytes | None = None
    metrics: str | None = None  # "addr:port" of the HTTP listener (served by broker/http.py, not here)
    extended_stats: bool = False  # our extra stats keys (beanstalkd's own stay byte-exact without it)
    binlog_max_size: int = 10485760  # -s: shown in stats even without -b, as beanstalkd does
    busy_poll_us: int = DEFAULT_WINDOW_US  # 0: sleep as soon as no input is ready (see broker.busypoll)


class LoopTimer:
    """The one event-loop timer, pointed at the queue's earliest deadline.

    Every timed thing (delays, TTRs, reserve timeouts, unpauses) is an entry of the queue's
    one heap; the loop only ever holds a single timer handle for its earliest entry.
    """

    __slots__ = ("_handle", "clock", "heap", "queue", "when")

    def __init__(self, queue: Queue, clock: Callable[[], int]) -> None:
        self.queue = queue
        self.heap = queue.timers
        self.clock = clock
        self.when = NEVER  # what the loop timer is set for (NEVER: not set)
        self._handle: asyncio.TimerHandle | None = None

    def check(self) -> None:
        """After commands ran: reschedule only when they pushed something earlier than the timer."""
        if self.heap.earliest_pushed < self.when:
            self.reschedule()

    def reschedule(self) -> None:
        """Point the loop timer at the earliest deadline, if something earlier than the current
        timer was pushed. Stale entries at the top of the heap are left for the timer to skip."""
        timers = self.queue.timers
        if timers.earliest_pushed >= self.when:
            timers.earliest_pushed = NEVER
            return
        timers.earliest_pushed = NEVER
        when = queue_timers.next_deadline(self.queue)
        if when is None or when >= self.when:
            return
        if self._handle is not None:
            self._handle.cancel()
        delay = max(0.0, (when - self.clock()) / 1e9)
        self.when = when
        self._handle = asyncio.get_running_loop().call_later(delay + 0.0005, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self.when = NEVER
        queue_timers.tick(self.queue)
        self.queue.timers.earliest_pushed = 0  # whatever is left is due later: look again
        self.reschedule()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class ServerState:
    """Given to every connection: the queue, the config, the timer, and the reply gate.

    The reply gate: a reply that acknowledges a change leaves only after the change is as
    durable as ``-f`` asks (``sync_point``). With a binlog (``group_commit``, any ``-f``) the
    replies of one event-loop iteration wait for one shared write of their records, and with
    ``-f 0`` one shared fsync (:meth:`hold_for_commit`).
    """

    __slots__ = (
        "_held",
        "_held_bytes",
        "busy_poll",
        "config",
        "connections",
        "descriptor_cap",
        "group_commit",
        "internal_conns",
        "lane_puts",
        "lane_reserves",
        "line_cache",
        "loop",
        "queue",
        "replication_hold",
        "sync_point",
        "timer",
        "write_gate",
    )

    def __init__(self, config: ServerConfig, queue: Queue, timer: LoopTimer,
                 sync_point: Callable[[], bool] | None, group_commit: bool, descriptor_cap: int) -> None:
        self.config = config
        self.queue = queue
        self.timer = timer
        self.connections: set[BrokerConnection] = set()
        self.internal_conns = 0  # of those, the broker's own (the dashboard's in-process connection)
        self.line_cache: p.LineCache = {}
        # broker.lane: put lines it may serve -> (the line as kept, priority, TTR as the job holds them, body size);
        # reserve packets it may serve -> (the packet as kept, reserve-with-timeout?). A connection compares each
        # packet with the kept one, shared by every connection, not a copy of its own that went cold meanwhile.
        self.lane_puts: dict[bytes, tuple[bytes, int, int, int]] = {}
        self.lane_reserves: dict[bytes, tuple[bytes, bool]] = {}
        self.descriptor_cap = descriptor_cap  # connections beyond this are refused (EMFILE ahead)
        self.sync_point = sync_point  # None: nothing to do before replies leave
        self.group_commit = group_commit
        self._held: list[tuple[BrokerConnection, bytes]] = []
        self._held_bytes = 0
        # Replication hooks (broker.replication): refuse changes on a member that is not the
        # leader; hold acknowledging replies until enough replicas have their records.
        self.write_gate: WriteGate | None = None
        self.replication_hold: ReplicationHold | None = None
        self.busy_poll: BusyPoll | None = None  # set by the server once its loop runs (--busy-poll-us)
        # set by the server once its loop runs: asyncio.get_running_loop() makes a getpid system
        # call (it checks for a fork), once per held group of replies otherwise
        self.loop: asyncio.AbstractEventLoop | None = None

    def new_decoder(self, auth_enabled: bool) -> p.Decoder:
        return p.Decoder(self.config.max_job_size, auth_enabled=auth_enabled, line_cache=self.line_cache)

    def hold_for_commit(self, conn: BrokerConnection, data: bytes) -> None:
        """Group commit: keep a reply until the end of this event-loop iteration.

        Every connection served in one iteration shares one write of the binlog's records
        (and with -f 0 one fsync), where beanstalkd pays one of each per command. Replies
        still leave only after it (nothing is acknowledged before it is as durable as -f
        asks), and in order, since every reply of every connection goes through here while
        group commit is on.
        """
        if not self._held:
            (self.loop or asyncio.get_running_loop()).call_soon(self.commit_group)
        self._held.append((conn, data))
        self._held_bytes += len(data)
        if self._held_bytes > OUTPUT_HIGH_WATER:
            self.commit_group()  # big replies (peek floods): write now, so back-pressure can act

    def commit_group(self) -> None:
        """Sync once, then send every held reply (a closing connection calls this for its last ones)."""
        held = self._held
        if not held:
            return
        self._held = []
        self._held_bytes = 0
        if self.sync_point is not None and not self.sync_point():
            for conn, _ in held:
                conn.drop_unacknowledged()
            return
        if self.replication_hold is not None and self.replication_hold.hold(held):
            return  # sent by the hold once enough replicas have the records (--sync-replicas)
        for conn, data in held:
            conn.send(data)
        if self.busy_poll is not None:
            self.busy_poll.replied()

    def drop_held(self) -> None:
        """A replicated member stepping down: replies not sent yet must never acknowledge their changes."""
        self._held = []
        self._held_bytes = 0


class WriteGate(Protocol):
    """Refuses the commands in ``commands`` while this member may not change the queue."""

    commands: frozenset[str]

    def refuse(self, name: str) -> bytes | None: ...

    def is_leader(self) -> bool: ...


class ReplicationHold(Protocol):
    """Takes a group of replies that must wait for replicas; False: send them now."""

    def hold(self, replies: list[tuple[BrokerConnection, bytes]]) -> bool: ...
