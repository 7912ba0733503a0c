"""The queue state machine: jobs, tubes, clients and scheduling, as beanstalkd 1.12 does them.

No sockets, no asyncio: time comes from an injected clock (nanoseconds), replies are
returned as bytes, and replies that happen later (a blocked reserve served by another
client's put, a timeout) go to the client's ``deliver`` callback. That keeps every rule
unit-testable in microseconds.

Ordering details that clients can observe are reproduced on purpose: beanstalkd keeps
tubes, watch lists and waiting clients in small arrays that delete by moving the last
item into the hole (``SwapSet`` below), and hands a tube's waiting clients jobs in a
rotating order. ``list-tubes`` output and which of several blocked clients gets a job
follow from that, so we keep the same structure.

Durability is not done here: a :class:`QueueListener` (the binlog) is told of every
change that must survive a crash.
"""
from __future__ import annotations

import heapq
import os
import platform
import resource
import socket
from typing import Callable, Iterable

from broker import protocol as p
from broker.limits import Limits, Refusals
from broker.timers import CLIENT_TICK, DELAYED_READY, TTR_EXPIRY, TUBE_UNPAUSE, TimerHeap

NS = 1_000_000_000
URGENT_THRESHOLD = 1024
SAFETY_MARGIN = NS  # DEADLINE_SOON: one second before a reserved job's TTR runs out
VERSION = "1.12"

READY, DELAYED, RESERVED, BURIED, INVALID = range(5)
STATE_NAMES = ("ready", "delayed", "reserved", "buried", "invalid")


class StorageFull(Exception):
    """Raised by a listener that cannot make a put durable (disk full): answer OUT_OF_MEMORY."""


class QueueListener:
    """Receives the state changes that a durable log must record. Default: do nothing."""

    def job_put(self, job: "Job") -> None:
        """A new job is about to be queued (may raise StorageFull to refuse it).

        Called before the job enters a queue: ``job.delay`` > 0 means it will be delayed
        until ``job.created + job.delay``.
        """

    def job_updated(self, job: "Job") -> None:
        """A job's state, priority or delay changed (release, bury, kick, timeout)."""

    def job_deleted(self, job: "Job") -> None:
        """A job is gone for good."""

    def stats(self) -> dict[str, int]:
        """binlog-* stats values: oldest-index, current-index, records-migrated, records-written, max-size."""
        return {}

    def recover(self, queue: "Queue") -> None:
        """At start, before serving: put every logged job back (see Queue.restore_job)."""

    # True when sync_point is expensive on every call (an fsync: -f 0). The server then
    # holds the replies of one event-loop iteration and calls sync_point once for all of
    # them (group commit) instead of once per connection.
    syncs_every_reply = False

    def sync_point(self) -> None:
        """Called before replies that acknowledge changes are written (fsync here for -f 0)."""

    def close(self) -> None:
        """Clean shutdown: flush and fsync."""


class SwapSet:
    """beanstalkd's ``Ms``: an array whose delete moves the last item into the hole.

    ``take`` serves items in a rotating order (``last_use``), as beanstalkd does for the
    clients waiting on a tube.
    """

    __slots__ = ("items", "last_use")

    def __init__(self) -> None:
        self.items: list = []
        self.last_use = 0

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, item) -> bool:
        return item in self.items

    def append(self, item) -> None:
        self.items.append(item)

    def delete_at(self, index: int):
        items = self.items
        item = items[index]
        last = items.pop()
        if index < len(items):
            items[index] = last
        return item

    def remove(self, item) -> bool:
        try:
            index = self.items.index(item)
        except ValueError:
            return False
        self.delete_at(index)
        return True

    def take(self):
        if not self.items:
            return None
        self.last_use %= len(self.items)
        item = self.delete_at(self.last_use)
        self.last_use += 1
        return item


def _rare_counter(index: int) -> property:
    """A job counter kept in the shared ``Job.rare`` list, created on the first non-zero value."""

    def get(job: "Job") -> int:
        rare = job.rare
        return rare[index] if rare is not None else 0

    def set_(job: "Job", value: int) -> None:
        if job.rare is None:
            job.rare = [0, 0, 0, 0]
        job.rare[index] = value

    return property(get, set_)


class Job:
    """One job; no timer handle (see broker.timers).

    A broker holds millions of these, so they are lean: TTR in seconds, and the counters
    most jobs never use (timeouts, releases, buries, kicks) share one list that exists
    only once one of them is non-zero.
    """

    __slots__ = ("id", "tube", "pri", "delay", "ttr", "body", "state", "created", "deadline",
                 "reserver", "entry", "reserves", "rare", "file")
    timeouts = _rare_counter(0)
    releases = _rare_counter(1)
    buries = _rare_counter(2)
    kicks = _rare_counter(3)

    def __init__(self, job_id: int, tube: "Tube", pri: int, delay: int, ttr: int, body: bytes,
                 created: int) -> None:
        self.id = job_id
        self.tube = tube
        self.pri = pri
        self.delay = delay  # ns
        self.ttr = ttr  # seconds: small ints are shared, ns would cost an int object per job
        self.body = body
        self.state = INVALID
        self.created = created
        self.deadline = 0
        self.reserver: Client | None = None
        self.entry: tuple | None = None  # current ready/delay heap entry (identity = validity)
        self.reserves = 0
        self.rare: list[int] | None = None
        self.file = 0

    def __lt__(self, other: "Job") -> bool:
        """Heap entries ``(key, id, job)`` tie only when a job is queued again under the key of its
        own stale entry (replication apply moves jobs without reserving them): either order is right."""
        return False

    def set_counters(self, counters: tuple[int, int, int, int, int]) -> None:
        """(reserves, timeouts, releases, buries, kicks), as a recovered job had them."""
        self.reserves = counters[0]
        if counters[1] or counters[2] or counters[3] or counters[4]:
            self.rare = list(counters[1:])


class Tube:
    """A named queue: ready heap, delay heap, buried FIFO, and who uses/watches/waits on it."""

    __slots__ = ("name", "ready", "ready_count", "urgent_count", "delayed", "delayed_count",
                 "buried", "reserved_count", "total_jobs", "using", "watching", "waiting",
                 "total_deletes", "pause_count", "pause", "unpause_at", "refs")

    def __init__(self, name: str) -> None:
        self.name = name
        self.ready: list[tuple] = []  # heap of (pri, id, job); stale entries skipped
        self.ready_count = 0
        self.urgent_count = 0
        self.delayed: list[tuple] = []  # heap of (deadline, id, job)
        self.delayed_count = 0
        self.buried: dict[int, Job] = {}  # FIFO by insertion
        self.reserved_count = 0
        self.total_jobs = 0
        self.using = 0
        self.watching = 0
        self.waiting = SwapSet()
        self.total_deletes = 0
        self.pause_count = 0
        self.pause = 0  # ns; 0 = not paused
        self.unpause_at = 0
        self.refs = 0

    def ready_top(self) -> Job | None:
        return _live_top(self.ready)

    def delayed_top(self) -> Job | None:
        return _live_top(self.delayed)


def _live_entry(heap: list[tuple]) -> tuple | None:
    """The first entry of a lazily-deleted job heap that is still its job's current entry
    (stale ones above it are dropped)."""
    while heap:
        entry = heap[0]
        if entry[2].entry is entry:
            return entry
        heapq.heappop(heap)
    return None


def _live_top(heap: list[tuple]) -> Job | None:
    entry = _live_entry(heap)
    return entry[2] if entry is not None else None


def _pruned(heap: list[tuple], live: int) -> list[tuple]:
    """Rebuild a lazily-deleted job heap once stale entries outnumber live ones."""
    if len(heap) <= 2 * live + 64:
        return heap
    fresh = [e for e in heap if e[2].entry is e]
    heapq.heapify(fresh)
    return fresh


class Client:
    """One connection's protocol state. ``deliver`` receives replies produced later."""

    __slots__ = ("use", "watch", "reserved", "deadlines", "waiting", "pending_timeout", "tick_at",
                 "producer", "worker", "deliver", "closed", "pending_put_id", "peer")

    def __init__(self, deliver: Callable[[bytes], None], peer: str = "") -> None:
        self.use: Tube
        self.watch = SwapSet()
        self.reserved: dict[int, Job] = {}
        self.deadlines: list[tuple[int, int, Job]] = []  # heap of (deadline, id, job), lazy
        self.waiting = False
        self.pending_timeout = -1
        self.tick_at = 0
        self.producer = False
        self.worker = False
        self.deliver = deliver
        self.closed = False
        self.pending_put_id = 0
        self.peer = peer

    def soonest_deadline(self) -> int | None:
        heap = self.deadlines
        while heap:
            deadline, _, job = heap[0]
            if job.reserver is self and job.state == RESERVED and job.deadline == deadline:
                return deadline
            heapq.heappop(heap)
        return None


def job_reply(word: bytes, job: Job) -> bytes:
    return b"%s %d %d\r\n%s\r\n" % (word, job.id, len(job.body), job.body)


def yaml_list(names: Iterable[str]) -> bytes:
    body = "---\n" + "".join(f"- {n}\n" for n in names)
    data = body.encode()
    return b"OK %d\r\n%s\r\n" % (len(data), data)


def yaml_ok(text: str) -> bytes:
    data = text.encode()
    return b"OK %d\r\n%s\r\n" % (len(data), data)


class Queue:
    """All broker state. Command methods take the client and parsed arguments, return a reply."""

    def __init__(self, clock: Callable[[], int], max_job_size: int = p.DEFAULT_MAX_JOB_SIZE,
                 listener: QueueListener | None = None, binlog_max_size: int = 10485760,
                 limits: Limits | None = None) -> None:
        self.clock = clock
        self.limits = limits or Limits()
        self.refusals = Refusals()
        self.held_bytes = 0  # total size of the bodies held
        self.max_job_size = max_job_size
        self.listener = listener or QueueListener()
        self.listening = listener is not None  # skip the no-op calls on the hot paths
        self.binlog_max_size = binlog_max_size
        self.started = clock()
        self.tubes = SwapSet()
        self.tube_by_name: dict[str, Tube] = {}
        self.jobs: dict[int, Job] = {}
        self.next_id = 1
        self.timers = TimerHeap(self._timer_is_current)
        self.waited_tubes: dict[Tube, None] = {}
        self.draining = False
        self.instance_id = os.urandom(8).hex()
        uname = platform.uname()
        self.hostname = socket.gethostname()
        self.os_version = uname.version
        self.machine = uname.machine
        # counters
        self.op_counts: dict[str, int] = dict.fromkeys(_OP_STAT_ORDER + ("reserve-job", "kick-job", "quit"), 0)
        self.ready_ct = 0
        self.urgent_ct = 0
        self.reserved_ct = 0
        self.delayed_ct = 0
        self.buried_ct = 0
        self.timeout_ct = 0
        self.total_jobs = 0
        self.waiting_ct = 0
        self.cur_conns = 0
        self.tot_conns = 0
        self.producers = 0
        self.workers = 0
        self.extra_stats: Callable[[], dict[str, int]] | None = None
        self.default_tube = self._tube("default")
        self.default_tube.refs += 1  # the server's own reference: default never goes away

    # -- tubes -------------------------------------------------------------------
    def _tube_for_client(self, client: Client, name: str) -> Tube | None:
        """use/watch: find or make the tube, unless that would pass --max-tubes."""
        tube = self.tube_by_name.get(name)
        if tube is None:
            cap = self.limits.max_tubes
            if cap and len(self.tubes) >= cap:
                self.refusals.refuse("tubes", client.peer, f"{len(self.tubes)} tubes exist")
                return None
            tube = self._tube(name)
        return tube

    def _tube(self, name: str) -> Tube:
        tube = self.tube_by_name.get(name)
        if tube is None:
            tube = Tube(name)
            self.tube_by_name[name] = tube
            self.tubes.append(tube)
        return tube

    def _unref(self, tube: Tube) -> None:
        tube.refs -= 1
        if tube.refs <= 0:  # the last job, user and watcher are gone: so is the tube, as in beanstalkd
            del self.tube_by_name[tube.name]
            self.tubes.remove(tube)
            self.waited_tubes.pop(tube, None)

    # -- clients -----------------------------------------------------------------
    def connect(self, deliver: Callable[[bytes], None], peer: str = "") -> Client:
        client = Client(deliver, peer)
        tube = self.default_tube
        client.use = tube
        tube.refs += 1
        tube.using += 1
        client.watch.append(tube)
        tube.refs += 1
        tube.watching += 1
        self.cur_conns += 1
        self.tot_conns += 1
        return client

    def disconnect(self, client: Client) -> None:
        """The connection closed: its reserved jobs go back to ready, its tubes are released."""
        if client.closed:
            return
        client.closed = True
        if client.producer:
            self.producers -= 1
        if client.worker:
            self.workers -= 1
        self.cur_conns -= 1
        self._stop_waiting(client)
        if client.reserved:
            now = self.clock()
            for job in list(client.reserved.values()):
                self._unreserve(client, job)
                self._enqueue(job, 0, now)
        for tube in list(client.watch.items):
            tube.watching -= 1
            self._unref(tube)
        client.watch.items.clear()
        client.use.using -= 1
        self._unref(client.use)
        client.deadlines.clear()

    def _set_producer(self, client: Client) -> None:
        if not client.producer:
            client.producer = True
            self.producers += 1

    def _set_worker(self, client: Client) -> None:
        if not client.worker:
            client.worker = True
            self.workers += 1

    # -- job movement --------------------------------------------------------------
    def _enqueue(self, job: Job, delay: int, now: int) -> None:
        job.reserver = None
        tube = job.tube
        if delay:
            job.deadline = now + delay
            entry = (job.deadline, job.id, job)
            job.entry = entry
            heapq.heappush(tube.delayed, entry)
            job.state = DELAYED
            tube.delayed_count += 1
            self.delayed_ct += 1
            self.timers.push(job.deadline, DELAYED_READY, job)
        else:
            entry = (job.pri, job.id, job)
            job.entry = entry
            heapq.heappush(tube.ready, entry)
            job.state = READY
            tube.ready_count += 1
            self.ready_ct += 1
            if job.pri < URGENT_THRESHOLD:
                tube.urgent_count += 1
                self.urgent_ct += 1
        if self.waiting_ct:
            self._process_queue(now)

    def _remove_ready(self, job: Job) -> None:
        job.entry = None
        tube = job.tube
        tube.ready_count -= 1
        self.ready_ct -= 1
        if job.pri < URGENT_THRESHOLD:
            tube.urgent_count -= 1
            self.urgent_ct -= 1
        tube.ready = _pruned(tube.ready, tube.ready_count)

    def _remove_delayed(self, job: Job) -> None:
        job.entry = None
        tube = job.tube
        tube.delayed_count -= 1
        self.delayed_ct -= 1
        tube.delayed = _pruned(tube.delayed, tube.delayed_count)

    def _remove_buried(self, job: Job) -> None:
        del job.tube.buried[job.id]
        self.buried_ct -= 1

    def _bury(self, job: Job) -> None:
        job.tube.buried[job.id] = job
        self.buried_ct += 1
        job.state = BURIED
        job.reserver = None
        job.buries += 1

    def _reserve(self, client: Client, job: Job, now: int) -> None:
        job.state = RESERVED
        job.reserver = client
        job.reserves += 1
        job.deadline = deadline = now + job.ttr * NS
        client.reserved[job.id] = job
        heapq.heappush(client.deadlines, (deadline, job.id, job))
        job.tube.reserved_count += 1
        self.reserved_ct += 1
        client.pending_timeout = -1
        self.timers.push(deadline, TTR_EXPIRY, job)

    def _unreserve(self, client: Client, job: Job) -> None:
        reserved = client.reserved
        del reserved[job.id]
        job.reserver = None
        job.tube.reserved_count -= 1
        self.reserved_ct -= 1
        if not reserved:
            client.deadlines.clear()  # every entry left is stale
        elif len(client.deadlines) > 2 * len(reserved) + 64:
            client.deadlines = [e for e in client.deadlines if e[2].reserver is client and e[2].state == RESERVED]
            heapq.heapify(client.deadlines)

    # -- waiting clients -------------------------------------------------------------
    def _start_waiting(self, client: Client) -> None:
        client.waiting = True
        self.waiting_ct += 1
        waited = self.waited_tubes
        for tube in client.watch.items:
            tube.waiting.append(client)
            waited[tube] = None

    def _stop_waiting(self, client: Client) -> None:
        if not client.waiting:
            return
        client.waiting = False
        self.waiting_ct -= 1
        for tube in client.watch.items:
            tube.waiting.remove(client)
            if not tube.waiting.items:
                self.waited_tubes.pop(tube, None)

    def _process_queue(self, now: int) -> None:
        """Hand ready jobs to waiting clients: best (priority, id) first, across tubes."""
        while self.waiting_ct:
            best: Job | None = None
            for tube in self.waited_tubes:
                if tube.pause:
                    if tube.unpause_at > now:
                        continue
                    tube.pause = 0
                if tube.ready_count:
                    job = tube.ready_top()
                    if best is None or job.pri < best.pri or (job.pri == best.pri and job.id < best.id):
                        best = job
            if best is None:
                return
            tube = best.tube
            self._remove_ready(best)
            client = tube.waiting.take()
            self._stop_waiting(client)
            self._reserve(client, best, now)
            client.deliver(job_reply(b"RESERVED", best))

    def _deadline_soon(self, client: Client, now: int) -> bool:
        soonest = client.soonest_deadline() if client.reserved else None
        return soonest is not None and now >= soonest - SAFETY_MARGIN

    def _schedule_tick(self, client: Client, now: int) -> None:
        when = None
        if client.reserved:
            soonest = client.soonest_deadline()
            if soonest is not None:
                when = soonest - SAFETY_MARGIN
        if client.pending_timeout >= 0:
            t = now + client.pending_timeout * NS
            when = t if when is None else min(when, t)
        client.tick_at = when or 0
        if when is not None:
            self.timers.push(when, CLIENT_TICK, client)

    # -- timers ------------------------------------------------------------------------
    def _timer_is_current(self, when: int, kind: int, owner) -> bool:
        if kind == TTR_EXPIRY:
            return owner.state == RESERVED and owner.deadline == when
        if kind == DELAYED_READY:
            return owner.state == DELAYED and owner.deadline == when
        if kind == CLIENT_TICK:
            return owner.waiting and owner.tick_at == when and not owner.closed
        return owner.pause != 0 and owner.unpause_at == when  # TUBE_UNPAUSE

    def next_deadline(self) -> int | None:
        """When :meth:`tick` next has work to do (clock nanoseconds), or None."""
        return self.timers.next_deadline()

    def tick(self) -> None:
        """Do everything that has come due: delayed jobs, TTR expiries, reserve timeouts, unpauses."""
        now = self.clock()
        for _when, kind, owner in self.timers.pop_due(now):
            if kind == DELAYED_READY:
                self._remove_delayed(owner)
                self._enqueue(owner, 0, now)
            elif kind == TTR_EXPIRY:
                client = owner.reserver
                self.timeout_ct += 1
                owner.timeouts += 1
                self._unreserve(client, owner)
                self._enqueue(owner, 0, now)
                self.listener.job_updated(owner)
            elif kind == CLIENT_TICK:
                self._client_tick(owner, now)
            else:
                owner.pause = 0
                if self.waiting_ct:
                    self._process_queue(now)
        self.timers.compact(len(self.jobs) + self.cur_conns + len(self.tubes))

    def _client_tick(self, client: Client, now: int) -> None:
        if self._deadline_soon(client, now):
            self._stop_waiting(client)
            client.deliver(p.DEADLINE_SOON)
        elif client.pending_timeout >= 0:
            client.pending_timeout = -1
            self._stop_waiting(client)
            client.deliver(p.TIMED_OUT)

    def hangup(self, client: Client) -> None:
        """The client half-closed while blocked in reserve: beanstalkd answers TIMED_OUT."""
        if client.waiting:
            client.pending_timeout = -1
            self._stop_waiting(client)
            client.deliver(p.TIMED_OUT)

    # -- commands ------------------------------------------------------------------------
    def count(self, op: str) -> None:
        self.op_counts[op] += 1

    def allocate_id(self) -> int:
        job_id = self.next_id
        self.next_id = job_id + 1
        return job_id

    def put_header(self, client: Client) -> None:
        """A put line was parsed but its body has not arrived: beanstalkd assigns the id now."""
        self.op_counts["put"] += 1
        self._set_producer(client)
        client.pending_put_id = self.allocate_id()

    def put(self, client: Client, pri: int, delay: int, ttr: int, body: bytes | None,
            header_seen: bool = False) -> bytes:
        if header_seen:
            job_id = client.pending_put_id
            client.pending_put_id = 0
        else:
            self.op_counts["put"] += 1
            if not client.producer:
                self._set_producer(client)
            job_id = self.next_id
            self.next_id = job_id + 1
        if body is None:
            return p.EXPECTED_CRLF
        if self.draining:
            return p.DRAINING
        limits = self.limits
        if limits.max_jobs and len(self.jobs) >= limits.max_jobs:
            self.refusals.refuse("jobs", client.peer, f"{len(self.jobs)} jobs held")
            return p.OUT_OF_MEMORY
        if limits.max_job_bytes and self.held_bytes + len(body) > limits.max_job_bytes:
            self.refusals.refuse("job_bytes", client.peer, f"{self.held_bytes} body bytes held")
            return p.OUT_OF_MEMORY
        now = self.clock()
        tube = client.use
        job = Job(job_id, tube, pri, delay * NS, ttr or 1, body, now)  # TTR 0 means 1 s
        if self.listening:
            try:
                self.listener.job_put(job)
            except StorageFull:
                return p.OUT_OF_MEMORY
        tube.refs += 1
        self.jobs[job_id] = job
        self.held_bytes += len(body)
        self.total_jobs += 1
        tube.total_jobs += 1
        self._enqueue(job, job.delay, now)
        return b"INSERTED %d\r\n" % job_id

    def reserve(self, client: Client, timeout: int = -1) -> bytes | None:
        """Reserve for this client; None means it now waits (the reply comes via deliver)."""
        if not client.worker:
            self._set_worker(client)
        now = self.clock()
        if client.reserved:
            if self._reserve_refused(client):
                return p.OUT_OF_MEMORY
            if self._deadline_soon(client, now) and not self._client_ready(client):
                return p.DEADLINE_SOON
        fast = self._fast_reserve(client, now)
        if fast is not None:
            return fast
        self._start_waiting(client)
        client.pending_timeout = timeout
        self._process_queue(now)
        if not client.waiting:
            return None  # served synchronously through deliver()
        if timeout == 0:
            self._client_tick(client, now)
            return None
        self._schedule_tick(client, now)
        return None

    def _reserve_refused(self, client: Client) -> bool:
        cap = self.limits.max_reserved_per_connection
        if cap and len(client.reserved) >= cap:
            self.refusals.refuse("reserves", client.peer, f"holds {len(client.reserved)} jobs")
            return True
        return False

    def _client_ready(self, client: Client) -> bool:
        for tube in client.watch.items:
            if tube.ready_count:
                return True
        return False

    def _fast_reserve(self, client: Client, now: int) -> bytes | None:
        """Serve a reserve at once when a watched, unpaused tube has a ready job.

        Equivalent to beanstalkd's wait-then-process_queue: no other client can be
        waiting on a tube that has ready jobs and is not paused, so this client is the
        one served; only the rotation counter of that tube's wait list moves.
        """
        best: tuple | None = None  # the (pri, id, job) heap entry to serve
        for tube in client.watch.items:
            if tube.ready_count and not tube.waiting.items:
                if tube.pause:
                    if tube.unpause_at > now:
                        continue
                    tube.pause = 0
                entry = _live_entry(tube.ready)
                if best is None or entry < best:  # by (pri, id): ids are unique
                    best = entry
        if best is None:
            return None
        if self.waiting_ct:
            # Another waiting client could be owed a better job elsewhere; do it the slow way.
            for tube in self.waited_tubes:
                if tube.ready_count and (not tube.pause or tube.unpause_at <= now):
                    return None
        job = best[2]
        tube = job.tube
        tube.waiting.last_use = 1
        heapq.heappop(tube.ready)  # best is its tube's top entry: no stale entry is left behind
        self._remove_ready(job)
        self._reserve(client, job, now)
        return job_reply(b"RESERVED", job)

    def reserve_job(self, client: Client, job_id: int) -> bytes:
        job = self.jobs.get(job_id)
        if job is None or job.state == RESERVED or job.state == INVALID:
            return p.NOT_FOUND
        if self._reserve_refused(client):
            return p.OUT_OF_MEMORY
        if job.state == READY:
            self._remove_ready(job)
        elif job.state == BURIED:
            self._remove_buried(job)
        else:
            self._remove_delayed(job)
        self._set_worker(client)
        self._reserve(client, job, self.clock())
        return job_reply(b"RESERVED", job)

    def delete(self, client: Client, job_id: int) -> bytes:
        job = self.jobs.get(job_id)
        if job is None:
            return p.NOT_FOUND
        state = job.state
        if state == RESERVED:
            if job.reserver is not client:
                return p.NOT_FOUND
            self._unreserve(client, job)
        elif state == READY:
            self._remove_ready(job)
        elif state == BURIED:
            self._remove_buried(job)
        elif state == DELAYED:
            self._remove_delayed(job)
        else:
            return p.NOT_FOUND
        tube = job.tube
        tube.total_deletes += 1
        job.state = INVALID
        del self.jobs[job_id]
        self.held_bytes -= len(job.body)
        if self.listening:
            self.listener.job_deleted(job)
        self._unref(tube)
        return p.DELETED

    def release(self, client: Client, job_id: int, pri: int, delay: int) -> bytes:
        job = client.reserved.get(job_id)
        if job is None:
            return p.NOT_FOUND
        self._unreserve(client, job)
        job.pri = pri
        job.delay = delay * NS
        job.releases += 1
        self._enqueue(job, job.delay, self.clock())
        self.listener.job_updated(job)
        return p.RELEASED

    def bury(self, client: Client, job_id: int, pri: int) -> bytes:
        job = client.reserved.get(job_id)
        if job is None:
            return p.NOT_FOUND
        self._unreserve(client, job)
        job.pri = pri
        self._bury(job)
        self.listener.job_updated(job)
        return p.BURIED

    def touch(self, client: Client, job_id: int) -> bytes:
        job = client.reserved.get(job_id)
        if job is None:
            return p.NOT_FOUND
        job.deadline = deadline = self.clock() + job.ttr * NS
        heapq.heappush(client.deadlines, (deadline, job_id, job))
        self.timers.push(deadline, TTR_EXPIRY, job)
        return p.TOUCHED

    def _kick_one(self, job: Job, now: int) -> None:
        if job.state == BURIED:
            self._remove_buried(job)
        else:
            self._remove_delayed(job)
        job.kicks += 1
        self._enqueue(job, 0, now)
        self.listener.job_updated(job)

    def kick(self, client: Client, bound: int) -> bytes:
        tube = client.use
        now = self.clock()
        kicked = 0
        if tube.buried:
            while kicked < bound and tube.buried:
                self._kick_one(next(iter(tube.buried.values())), now)
                kicked += 1
        else:
            while kicked < bound and tube.delayed_count:
                self._kick_one(tube.delayed_top(), now)
                kicked += 1
        return b"KICKED %d\r\n" % kicked

    def kick_job(self, client: Client, job_id: int) -> bytes:
        job = self.jobs.get(job_id)
        if job is None or job.state not in (BURIED, DELAYED):
            return p.NOT_FOUND
        self._kick_one(job, self.clock())
        return p.KICKED

    def peek(self, client: Client, job_id: int) -> bytes:
        job = self.jobs.get(job_id)
        if job is None or job.state == INVALID:
            return p.NOT_FOUND
        return job_reply(b"FOUND", job)

    def peek_ready(self, client: Client) -> bytes:
        job = client.use.ready_top() if client.use.ready_count else None
        return job_reply(b"FOUND", job) if job else p.NOT_FOUND

    def peek_delayed(self, client: Client) -> bytes:
        job = client.use.delayed_top() if client.use.delayed_count else None
        return job_reply(b"FOUND", job) if job else p.NOT_FOUND

    def peek_buried(self, client: Client) -> bytes:
        buried = client.use.buried
        return job_reply(b"FOUND", next(iter(buried.values()))) if buried else p.NOT_FOUND

    def use(self, client: Client, name: str) -> bytes:
        tube = self._tube_for_client(client, name)
        if tube is None:
            return p.OUT_OF_MEMORY
        tube.refs += 1
        old = client.use
        old.using -= 1
        client.use = tube
        tube.using += 1
        self._unref(old)
        return b"USING %s\r\n" % name.encode()

    def watch(self, client: Client, name: str) -> bytes:
        tube = self._tube_for_client(client, name)
        if tube is None:
            return p.OUT_OF_MEMORY
        if tube not in client.watch:
            client.watch.append(tube)
            tube.refs += 1
            tube.watching += 1
        return b"WATCHING %d\r\n" % len(client.watch)

    def ignore(self, client: Client, name: str) -> bytes:
        watch = client.watch
        for tube in watch.items:
            if tube.name == name:
                if len(watch) < 2:
                    return p.NOT_IGNORED
                watch.remove(tube)
                tube.watching -= 1
                self._unref(tube)
                break
        return b"WATCHING %d\r\n" % len(watch)

    def pause_tube(self, client: Client, name: str, delay: int) -> bytes:
        tube = self.tube_by_name.get(name)
        if tube is None:
            return p.NOT_FOUND
        pause = delay * NS or 1
        tube.unpause_at = self.clock() + pause
        tube.pause = pause
        tube.pause_count += 1
        self.timers.push(tube.unpause_at, TUBE_UNPAUSE, tube)
        return p.PAUSED

    def list_tubes(self, client: Client) -> bytes:
        return yaml_list(t.name for t in self.tubes.items)

    def list_tube_used(self, client: Client) -> bytes:
        return b"USING %s\r\n" % client.use.name.encode()

    def list_tubes_watched(self, client: Client) -> bytes:
        return yaml_list(t.name for t in client.watch.items)

    # -- stats ------------------------------------------------------------------------------
    def stats_job(self, client: Client, job_id: int) -> bytes:
        job = self.jobs.get(job_id)
        if job is None or job.state == INVALID:
            return p.NOT_FOUND
        now = self.clock()
        time_left = _trunc_div(job.deadline - now, NS) if job.state in (RESERVED, DELAYED) else 0
        return yaml_ok(
            "---\n"
            f"id: {job.id}\n"
            f"tube: {job.tube.name}\n"
            f"state: {STATE_NAMES[job.state]}\n"
            f"pri: {job.pri}\n"
            f"age: {_trunc_div(now - job.created, NS)}\n"
            f"delay: {job.delay // NS}\n"
            f"ttr: {job.ttr}\n"
            f"time-left: {time_left}\n"
            f"file: {job.file}\n"
            f"reserves: {job.reserves}\n"
            f"timeouts: {job.timeouts}\n"
            f"releases: {job.releases}\n"
            f"buries: {job.buries}\n"
            f"kicks: {job.kicks}\n"
        )

    def stats_tube(self, client: Client, name: str) -> bytes:
        tube = self.tube_by_name.get(name)
        if tube is None:
            return p.NOT_FOUND
        time_left = _trunc_div(tube.unpause_at - self.clock(), NS) if tube.pause else 0
        return yaml_ok(
            "---\n"
            f"name: {tube.name}\n"
            f"current-jobs-urgent: {tube.urgent_count}\n"
            f"current-jobs-ready: {tube.ready_count}\n"
            f"current-jobs-reserved: {tube.reserved_count}\n"
            f"current-jobs-delayed: {tube.delayed_count}\n"
            f"current-jobs-buried: {len(tube.buried)}\n"
            f"total-jobs: {tube.total_jobs}\n"
            f"current-using: {tube.using}\n"
            f"current-watching: {tube.watching}\n"
            f"current-waiting: {len(tube.waiting)}\n"
            f"cmd-delete: {tube.total_deletes}\n"
            f"cmd-pause-tube: {tube.pause_count}\n"
            f"pause: {tube.pause // NS}\n"
            f"pause-time-left: {time_left}\n"
        )

    def stats(self, client: Client) -> bytes:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        binlog = self.listener.stats()
        ops = self.op_counts
        lines = [
            "---",
            f"current-jobs-urgent: {self.urgent_ct}",
            f"current-jobs-ready: {self.ready_ct}",
            f"current-jobs-reserved: {self.reserved_ct}",
            f"current-jobs-delayed: {self.delayed_ct}",
            f"current-jobs-buried: {self.buried_ct}",
        ]
        lines += [f"cmd-{op}: {ops[op]}" for op in _OP_STAT_ORDER]
        lines += [
            f"job-timeouts: {self.timeout_ct}",
            f"total-jobs: {self.total_jobs}",
            f"max-job-size: {self.max_job_size}",
            f"current-tubes: {len(self.tubes)}",
            f"current-connections: {self.cur_conns}",
            f"current-producers: {self.producers}",
            f"current-workers: {self.workers}",
            f"current-waiting: {self.waiting_ct}",
            f"total-connections: {self.tot_conns}",
            f"pid: {os.getpid()}",
            f'version: "{VERSION}"',
            f"rusage-utime: {_rusage(ru.ru_utime)}",
            f"rusage-stime: {_rusage(ru.ru_stime)}",
            f"uptime: {(self.clock() - self.started) // NS}",
            f"binlog-oldest-index: {binlog.get('oldest-index', 0)}",
            f"binlog-current-index: {binlog.get('current-index', 0)}",
            f"binlog-records-migrated: {binlog.get('records-migrated', 0)}",
            f"binlog-records-written: {binlog.get('records-written', 0)}",
            f"binlog-max-size: {binlog.get('max-size', self.binlog_max_size)}",
            f"draining: {'true' if self.draining else 'false'}",
            f"id: {self.instance_id}",
            f"hostname: {self.hostname}",
            f"os: {self.os_version}",
            f"platform: {self.machine}",
        ]
        if self.extra_stats is not None:
            lines += [f"{key}: {value}" for key, value in self.extra_stats().items()]
        return yaml_ok("\n".join(lines) + "\n")

    # -- recovery (used by the binlog) ------------------------------------------------------------
    def restore_job(self, job_id: int, tube_name: str, pri: int, delay_ns: int, ttr_ns: int, body: bytes,
                    state: int, deadline: int, created: int, counters: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0),
                    file: int = 0) -> Job:
        """Put a recovered job back in its state (reserved comes back ready)."""
        tube = self._tube(tube_name)
        job = Job(job_id, tube, pri, delay_ns, ttr_ns // NS, body, created)
        job.set_counters(counters)
        job.file = file
        tube.refs += 1
        self.jobs[job_id] = job
        self.held_bytes += len(body)  # total-jobs counts puts since start, as in beanstalkd: not here
        if job_id >= self.next_id:
            self.next_id = job_id + 1
        now = self.clock()
        if state == BURIED:
            self._bury(job)
            job.buries -= 1  # restoring, not burying again
        elif state == DELAYED and deadline > now:
            self._enqueue(job, deadline - now, now)
        else:
            self._enqueue(job, 0, now)
        return job

    def restore_jobs(self, records: Iterable[tuple]) -> int:
        """Bulk :meth:`restore_job` for large logs (binlog recovery); returns how many.

        Each record is restore_job's arguments as a tuple: (job_id, tube_name, pri, delay_ns,
        ttr_ns, body, state, deadline, created, counters, file). Same result as calling
        restore_job for each in order, but the ready and delayed heaps are built once at the
        end (heapify is O(n); a million heappush calls are not).
        """
        now = self.clock()
        jobs = self.jobs
        tubes: dict[str, Tube] = {}
        timers = self.timers
        n = held = ready = urgent = delayed = 0
        max_id = self.next_id - 1
        for job_id, tube_name, pri, delay_ns, ttr_ns, body, state, deadline, created, counters, file in records:
            tube = tubes.get(tube_name)
            if tube is None:
                tube = tubes[tube_name] = self._tube(tube_name)
            job = Job(job_id, tube, pri, delay_ns, ttr_ns // NS, body, created)
            job.set_counters(counters)
            job.file = file
            tube.refs += 1
            jobs[job_id] = job
            held += len(body)
            n += 1
            if job_id > max_id:
                max_id = job_id
            if state == BURIED:
                self._bury(job)
                job.buries -= 1  # restoring, not burying again
            elif state == DELAYED and deadline > now:
                job.deadline = deadline
                job.entry = entry = (deadline, job_id, job)
                tube.delayed.append(entry)
                job.state = DELAYED
                tube.delayed_count += 1
                delayed += 1
                timers.push(deadline, DELAYED_READY, job)
            else:
                job.entry = entry = (pri, job_id, job)
                tube.ready.append(entry)
                job.state = READY
                tube.ready_count += 1
                ready += 1
                if pri < URGENT_THRESHOLD:
                    tube.urgent_count += 1
                    urgent += 1
        for tube in tubes.values():
            heapq.heapify(tube.ready)
            heapq.heapify(tube.delayed)
        self.held_bytes += held
        self.ready_ct += ready
        self.urgent_ct += urgent
        self.delayed_ct += delayed
        if max_id >= self.next_id:
            self.next_id = max_id + 1
        if self.waiting_ct:
            self._process_queue(now)
        return n


    # -- replication apply (used by broker.replication.follower) -----------------------------------
    # A replica changes its queue only through these, from the leader's log records; each tells
    # the listener (the replica's own binlog) as a command would.
    def apply_job(self, job_id: int, tube_name: str, pri: int, delay_ns: int, ttr_ns: int, body: bytes,
                  state: int, deadline: int, created: int, counters: tuple[int, int, int, int, int]) -> None:
        """A full job record: create the job, or (a compaction or snapshot copy) set its state."""
        job = self.jobs.get(job_id)
        if job is not None:
            self.apply_state(job_id, state, pri, delay_ns, deadline, counters)
            return
        job = self.restore_job(job_id, tube_name, pri, delay_ns, ttr_ns, body, state, deadline, created, counters)
        if self.listening:
            try:
                self.listener.job_put(job)
            except StorageFull:
                self._detach(job)
                self._forget_job(job)
                self._unref(job.tube)
                raise
            if job.state == BURIED or job.reserves or job.rare is not None:
                self.listener.job_updated(job)

    def apply_state(self, job_id: int, state: int, pri: int, delay_ns: int, deadline: int,
                    counters: tuple[int, int, int, int, int]) -> None:
        """A job's new state (release, bury, kick, timeout on the leader); unknown ids are ignored."""
        job = self.jobs.get(job_id)
        if job is None:
            return
        self._detach(job)
        job.pri = pri
        job.delay = delay_ns
        job.rare = None
        job.set_counters(counters)
        now = self.clock()
        if state == BURIED:
            self._bury(job)
            job.buries -= 1  # the record's count already includes this bury
        elif state == DELAYED and deadline > now:
            self._enqueue(job, deadline - now, now)
        else:
            self._enqueue(job, 0, now)
        self.listener.job_updated(job)

    def apply_delete(self, job_id: int) -> None:
        job = self.jobs.get(job_id)
        if job is None:
            return
        self._detach(job)
        job.tube.total_deletes += 1
        self._forget_job(job)
        self.listener.job_deleted(job)
        self._unref(job.tube)

    def _detach(self, job: Job) -> None:
        """Take a job out of whatever structure holds it (its state says which)."""
        state = job.state
        if state == READY:
            self._remove_ready(job)
        elif state == DELAYED:
            self._remove_delayed(job)
        elif state == BURIED:
            self._remove_buried(job)
        elif state == RESERVED and job.reserver is not None:
            self._unreserve(job.reserver, job)

    def _forget_job(self, job: Job) -> None:
        job.state = INVALID
        del self.jobs[job.id]
        self.held_bytes -= len(job.body)


_OP_STAT_ORDER = ("put", "peek", "peek-ready", "peek-delayed", "peek-buried", "reserve",
                  "reserve-with-timeout", "delete", "release", "use", "watch", "ignore", "bury",
                  "kick", "touch", "stats", "stats-job", "stats-tube", "list-tubes", "list-tube-used",
                  "list-tubes-watched", "pause-tube")


def _trunc_div(a: int, b: int) -> int:
    """C integer division (truncates toward zero)."""
    q = abs(a) // b
    return q if a >= 0 else -q


def _rusage(seconds: float) -> str:
    whole = int(seconds)
    micros = int(round((seconds - whole) * 1_000_000))
    if micros >= 1_000_000:
        whole, micros = whole + 1, micros - 1_000_000
    return f"{whole}.{micros:06d}"
