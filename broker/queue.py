"""The queue state machine: jobs, tubes, clients and scheduling, as beanstalkd 1.12 does them.

No sockets, no asyncio: time comes from an injected clock (nanoseconds), replies are
returned as bytes, and replies that happen later (a blocked reserve served by another
client's put, a timeout) go to the client's ``deliver`` callback. That keeps every rule
unit-testable in microseconds.

The jobs, tubes and clients it moves are in :mod:`broker.model`; ``stats`` replies are
rendered by :mod:`broker.stats`; recovered jobs come back through :mod:`broker.queue_restore`.

Durability is not done here: a :class:`QueueListener` (the binlog) is told of every
change that must survive a crash.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, cast

from mypy_extensions import mypyc_attr

from broker import protocol as p
from broker.jobtable import JobTable
from broker.limits import Limits, Refusals
from broker.model import (
    BURIED,
    COMPILED,
    DELAYED,
    INVALID,
    NS,
    READY,
    RESERVED,
    SAFETY_MARGIN,
    STATE_NAMES,
    URGENT_THRESHOLD,
    Client,
    Job,
    SwapSet,
    Tube,
    heap_entry,
    heappush,
    job_reply,
    new_job,
    shared_int,
)
from broker.stats import OP_STAT_ORDER, HostFacts
from broker.timers import (
    CLIENT_TICK,
    DELAYED_READY,
    TTR_EXPIRY,
    TimerHeap,
)

__all__ = ["BURIED", "DELAYED", "INVALID", "NS", "READY", "RESERVED", "STATE_NAMES", "URGENT_THRESHOLD",
           "Client", "Job", "Queue", "QueueListener", "StorageFull", "Tube"]

CREATED_GRAIN: Final = 1_000_000  # ns: `created` may be this much early (ages are reported in whole seconds)


class StorageFull(Exception):
    """Raised by a listener that cannot make a put durable (disk full): answer OUT_OF_MEMORY."""


@mypyc_attr(allow_interpreted_subclasses=True)  # broker.binlog.Binlog (interpreted) subclasses it
class QueueListener:
    """Receives the state changes that a durable log must record. Default: do nothing."""

    def job_put(self, job: Job) -> None:
        """A new job is about to be queued (may raise StorageFull to refuse it).

        Called before the job enters a queue: ``job.delay`` > 0 means it will be delayed
        until ``job.created + job.delay``.
        """

    def job_updated(self, job: Job) -> None:
        """A job's state, priority or delay changed (release, bury, kick, timeout)."""

    def job_deleted(self, job: Job) -> None:
        """A job is gone for good."""

    def job_reserved(self, job: Job) -> None:
        """A job was reserved (its ``reserves`` counter moved); need not be durable before the reply."""

    def tube_paused(self, tube: Tube) -> None:
        """``pause-tube``: not logged (beanstalkd's binlog does not keep pauses either); a replica set
        streams it, so a failover keeps the pause."""

    def stats(self) -> dict[str, int]:
        """binlog-* stats values: oldest-index, current-index, records-migrated, records-written, max-size."""
        return {}

    def recover(self, queue: Queue) -> None:
        """At start, before serving: put every logged job back (see broker.queue_restore)."""

    # True when sync_point costs a system call or more (a binlog's write, and with -f 0 an
    # fsync). The server then holds the replies of one event-loop iteration and calls
    # sync_point once for all of them (group commit) instead of once per connection.
    group_commit = False
    # True when sync_point waits for the disk (an fsync: -f 0). A round trip then takes an
    # fsync, longer than a busy poll's window: the server does not poll (broker.busypoll).
    waits_for_disk = False

    def sync_point(self) -> bool:
        """Called before replies that acknowledge changes are written (fsync here for -f 0).

        False: those changes could not be made durable, and the replies must not go."""
        return True

    def failing(self) -> bool:
        """True while changes cannot be made durable at all (a binlog after an I/O error)."""
        return False

    def close(self) -> None:
        """Clean shutdown: flush and fsync."""


class Queue:
    """All broker state. Command methods take the client and parsed arguments, return a reply."""

    def __init__(self, clock: Callable[[], int], max_job_size: int = p.DEFAULT_MAX_JOB_SIZE,
                 listener: QueueListener | None = None, binlog_max_size: int = 10485760,
                 limits: Limits | None = None) -> None:
        self.clock = clock
        self.limits = limits or Limits()
        # What put and reserve test on every command, as native fields (Limits is frozen): compiled,
        # an attribute of the interpreted Limits dataclass is a generic look-up by name.
        self.puts_capped = self.limits.max_jobs > 0 or self.limits.max_job_bytes > 0
        self.reserve_cap = self.limits.max_reserved_per_connection
        self.refusals = Refusals()
        self.held_bytes = 0  # total size of the bodies held
        self.max_job_size = max_job_size
        self.listener = listener or QueueListener()
        self.listening = listener is not None  # skip the no-op calls on the hot paths
        self.binlog_max_size = binlog_max_size
        self.started = clock()
        self.tubes: SwapSet[Tube] = SwapSet()
        self.tube_by_name: dict[str, Tube] = {}
        self.jobs: JobTable[Job] = JobTable()  # by id, in pages: ids are handed out in order
        # Memory per job (interpreted build): equal ints shared, not one object per job each
        self.recent_now = 0
        # recent_now + CREATED_GRAIN, kept with it: the test below is two compares, not a subtraction too
        # (interpreted, that is a new int object on every put)
        self.recent_until = 0
        self.int_pool: dict[int, int] = {}
        self.next_id = 1
        self.timers = TimerHeap(self._timer_is_current)
        self.waited_tubes: dict[Tube, None] = {}
        self.draining = False
        self.host = HostFacts.of_this_host()  # stats: id, hostname, os, platform
        # counters
        self.op_counts: dict[str, int] = dict.fromkeys(OP_STAT_ORDER + ("reserve-job", "kick-job", "quit"), 0)
        # cmd-put/-reserve/-delete/-reserve-with-timeout as counted by the connection's hot path: native
        # ints (a dict entry costs a look-up, a boxed add and a store per command); see counted_ops()
        self.cmd_put = 0
        self.cmd_reserve = 0
        self.cmd_delete = 0
        self.cmd_reserve_timeout = 0
        # Jobs created in the tubes forgotten since (drop_if_unused): with the live tubes' total_jobs, stats'
        # total-jobs. The interpreted lane counts a put in its tube only (an int add less a put): its puts are
        # what that sum holds beyond total_jobs, the general path's count (jobs_created, counted_ops).
        self.dropped_jobs = 0
        # The same for deletes: the tubes' total_deletes (and the forgotten tubes') beyond those the queue made
        # itself (delete, a replica's apply_delete) are the lane's, each a delete command too (counted_ops).
        self.dropped_deletes = 0
        self.deletes_made = 0
        self.timeout_ct = 0
        self.total_jobs = 0
        self.waiting_ct = 0
        self.cur_conns = 0
        self.tot_conns = 0
        self.producers = 0
        self.workers = 0
        # --extended-stats counters and, on a replica set, the member's role and position (strings too)
        self.extra_stats: Callable[[], Mapping[str, object]] | None = None
        self.default_tube = self._tube("default")  # never goes away (drop_if_unused)

    def job_counts(self) -> tuple[int, int, int, int, int]:
        """(urgent, ready, reserved, delayed, buried) jobs of the whole server: the sums of the tubes'
        counts (a job keeps its tube alive), kept once rather than also server-wide on every move."""
        urgent = ready = reserved = delayed = buried = 0
        for tube in self.tubes.items:
            urgent += tube.urgent_count
            ready += tube.ready_count
            reserved += tube.reserved_count
            delayed += tube.delayed_count
            buried += len(tube.buried)
        return urgent, ready, reserved, delayed, buried

    def counted_ops(self) -> dict[str, int]:
        """The cmd-* counters by command name: op_counts with the hot path's native counters added, and the
        interpreted lane's puts and deletes, which it counts in their tubes only (see dropped_jobs)."""
        counts = dict(self.op_counts)
        created, deleted = self.tube_totals()
        counts["put"] += self.cmd_put + created - self.total_jobs  # the lane's puts: see dropped_jobs
        counts["reserve"] += self.cmd_reserve
        counts["delete"] += self.cmd_delete + deleted - self.deletes_made
        counts["reserve-with-timeout"] += self.cmd_reserve_timeout
        return counts

    def jobs_created(self) -> int:
        """stats' total-jobs: the jobs put since start, counted in their tubes (the lane's puts too)."""
        return self.tube_totals()[0]

    def tube_totals(self) -> tuple[int, int]:
        """(jobs created, jobs deleted) over every tube since start, the forgotten ones included: one pass."""
        created, deleted = self.dropped_jobs, self.dropped_deletes
        for tube in self.tubes.items:
            created += tube.total_jobs
            deleted += tube.total_deletes
        return created, deleted

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
            tube = Tube(name, self.jobs)
            self.tube_by_name[name] = tube
            self.tubes.append(tube)
        return tube

    def drop_if_unused(self, tube: Tube) -> None:
        """Forget a tube that no client uses or watches and that holds no job, as beanstalkd frees it
        when its last reference goes (the default tube stays). Asked after each of those can have gone:
        a client's use, ignore or disconnect, and a job's delete. No reference count: the tube's own
        counts say it, and a put need not count anything for it (broker.lane)."""
        if not (tube.using or tube.watching or tube.ready_count or tube.reserved_count or tube.delayed_count
                or tube.buried or tube is self.default_tube):
            del self.tube_by_name[tube.name]
            self.tubes.remove(tube)
            self.dropped_jobs += tube.total_jobs
            self.dropped_deletes += tube.total_deletes
            self.waited_tubes.pop(tube, None)
            tube.pause = 0  # its unpause timer entry is stale now: compaction may drop it (and the tube)

    # -- clients -----------------------------------------------------------------


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
            heappush(tube.delayed, heap_entry(job.deadline, job.id))
            job.state = DELAYED
            tube.delayed_count += 1
            self.timers.push(job.deadline, DELAYED_READY, job.id)  # the id: a stale entry must not keep the job
        else:
            tube.push_ready(job.pri, job.id)
            job.state = READY
            tube.ready_count += 1
            if job.pri < URGENT_THRESHOLD:
                tube.urgent_count += 1
        if self.waiting_ct:
            self._process_queue(now)

    def _remove_ready(self, job: Job) -> None:
        """The caller moves the job out of READY next: its heap entry is stale from then on."""
        job.tube.ready_clean = False
        self._remove_ready_top(job)

    def _remove_ready_top(self, job: Job) -> None:
        """The caller moves the job out of READY next, having dropped its entry (its tube's top): no stale
        entry is left, so the stale bound can only be passed if some were there already."""
        tube = job.tube
        tube.ready_count -= 1
        if job.pri < URGENT_THRESHOLD:
            tube.urgent_count -= 1
        if not tube.ready_clean:
            tube.prune_ready()

    def _remove_delayed(self, job: Job) -> None:
        """The caller moves the job out of DELAYED (or re-queues it) next."""
        tube = job.tube
        tube.delayed_count -= 1
        tube.prune_delayed()

    def _remove_buried(self, job: Job) -> None:
        del job.tube.buried[job.id]

    def _bury(self, job: Job) -> None:
        job.tube.buried[job.id] = job
        job.state = BURIED
        job.reserver = None
        job.buries += 1

    def _reserve(self, client: Client, job: Job, now: int) -> None:
        job.state = RESERVED
        job.reserver = client
        job.reserves += 1
        job.deadline = deadline = now + job.ttr * NS
        client.hold(job)
        job.tube.reserved_count += 1
        client.pending_timeout = -1
        armed = client.ttr_armed
        if not armed or deadline < armed:  # arm_ttr's test: a reserve rarely needs the call
            self.arm_ttr(client, deadline)
        if self.listening:
            self.listener.job_reserved(job)

    def _unreserve(self, client: Client, job: Job) -> None:
        client.drop_hold(job)
        job.reserver = None
        job.tube.reserved_count -= 1

    def arm_ttr(self, client: Client, deadline: int) -> None:
        """Make ``deadline`` the client's TTR timer unless an earlier one stands (an entry that
        comes due early finds nothing expired and arms the next deadline)."""
        armed = client.ttr_armed
        if not armed or deadline < armed:
            client.ttr_armed = deadline
            self.timers.push(deadline, TTR_EXPIRY, client)

    def expire_reserved(self, client: Client, now: int) -> None:
        """The client's TTR timer came due: every job it holds past its deadline goes back to
        ready (oldest deadline first, as beanstalkd's conntimeout), then the next deadline is armed."""
        client.ttr_armed = 0
        while True:
            job = client.soonest_held()  # drops stale entries
            if job is None:
                return
            if job.deadline > now:
                self.arm_ttr(client, job.deadline)
                return
            self.timeout_ct += 1
            job.timeouts += 1
            self._unreserve(client, job)
            self._enqueue(job, 0, now)
            self.listener.job_updated(job)

    # -- waiting clients -------------------------------------------------------------
    def _start_waiting(self, client: Client) -> None:
        client.waiting = True
        self.waiting_ct += 1
        waited = self.waited_tubes
        for tube in client.watching:
            tube.waiting.append(client)
            waited[tube] = None

    def _stop_waiting(self, client: Client) -> None:
        if not client.waiting:
            return
        client.waiting = False
        self.waiting_ct -= 1
        for tube in client.watching:
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
                    if job is not None and (best is None or job.pri < best.pri
                                            or (job.pri == best.pri and job.id < best.id)):
                        best = job
            if best is None:
                return
            tube = best.tube
            tube.drop_ready_top()  # ready_top's last answer for this tube: no stale entry is left behind
            self._remove_ready_top(best)
            client = tube.waiting.take()
            if client is None:  # cannot happen: only tubes with waiting clients are in waited_tubes
                return
            self._stop_waiting(client)
            self._reserve(client, best, now)
            client.deliver(job_reply(b"RESERVED", best))

    def _deadline_soon(self, client: Client, now: int) -> bool:
        soonest = client.soonest_deadline() if client.held else None
        return soonest is not None and now >= soonest - SAFETY_MARGIN

    def _schedule_tick(self, client: Client, now: int) -> None:
        when = None
        if client.held:
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
    def compact_timers(self) -> None:
        """Drop stale timer entries once they dominate. Called after every tick and every
        disconnect: a closed connection's entries (its TTR, its reserve timeout) hold it, its
        tube and its deadline heap until they come due, which may be hours away."""
        self.timers.compact(len(self.jobs) + self.cur_conns + len(self.tubes))

    def _timer_is_current(self, when: int, kind: int, owner: object) -> bool:
        """Whether a timer entry still stands (its owner: a job's id, a Client or a Tube, by kind).

        A delayed job's entry names its id, not the job: a job deleted or kicked before its time leaves its
        entry behind until it comes due or the heap is rebuilt, and the job's body with it would be memory
        held for nothing (cancelled delayed jobs: up to twice the live jobs' bodies)."""
        if kind == TTR_EXPIRY:
            client = cast(Client, owner)
            return client.ttr_armed == when and not client.closed
        if kind == DELAYED_READY:
            job = self.jobs.get(cast(int, owner))
            return job is not None and job.state == DELAYED and job.deadline == when
        if kind == CLIENT_TICK:
            client = cast(Client, owner)
            return client.waiting and client.tick_at == when and not client.closed
        tube = cast(Tube, owner)
        return tube.pause != 0 and tube.unpause_at == when  # TUBE_UNPAUSE



    def _client_tick(self, client: Client, now: int) -> None:
        if self._deadline_soon(client, now):
            self._stop_waiting(client)
            client.deliver(p.DEADLINE_SOON)
        elif client.pending_timeout >= 0:
            client.pending_timeout = -1
            self._stop_waiting(client)
            client.deliver(p.TIMED_OUT)


    # -- commands ------------------------------------------------------------------------
    def allocate_id(self) -> int:
        job_id = self.next_id
        self.next_id = job_id + 1
        return job_id

    def put_header(self, client: Client) -> None:
        """A put line was parsed but its body has not arrived: beanstalkd assigns the id now."""
        self._set_producer(client)
        client.pending_put_id = self.allocate_id()

    def put(self, client: Client, pri: int, delay: int, ttr: int, body: bytes | None,
            header_seen: bool = False) -> bytes:
        if header_seen:
            job_id = client.pending_put_id
            client.pending_put_id = 0
        else:
            if not client.producer:
                self._set_producer(client)
            job_id = self.next_id
            self.next_id = job_id + 1
        if body is None:
            return p.EXPECTED_CRLF
        if self.draining:
            return p.DRAINING
        if self.puts_capped and self._put_refused(client, len(body)):
            return p.OUT_OF_MEMORY
        now = self.clock()
        tube = client.use
        created = now
        if not delay:  # jobs put within a millisecond share one `created` int (a delayed job's deadline is exact)
            created = self.recent_now
            if now >= self.recent_until or now < created:
                created = self.recent_now = now
                self.recent_until = now + CREATED_GRAIN
        delay_ns = delay * NS
        if COMPILED:  # Job() is a direct C call
            job = Job(job_id, tube, pri, delay_ns, ttr or 1, body, created)  # TTR 0 means 1 s
        else:  # a priority or TTR above 256 would be a new int object per job; new_job skips the class call
            pool = self.int_pool
            if pri > 256:
                pri = pool.get(pri) or shared_int(pool, pri)
            if ttr > 256:
                ttr = pool.get(ttr) or shared_int(pool, ttr)
            job = new_job(job_id, tube, pri, ttr or 1, body, created, INVALID, 0)
            if delay_ns:
                job.delay = delay_ns
        if self.listening:
            try:
                self.listener.job_put(job)
            except StorageFull:
                return p.OUT_OF_MEMORY
        self.jobs.put(job_id, job)
        self.held_bytes += len(body)
        self.total_jobs += 1
        tube.total_jobs += 1
        self._enqueue(job, delay_ns, now)
        return b"INSERTED %d\r\n" % job_id

    def _put_refused(self, client: Client, size: int) -> bool:
        limits = self.limits
        if limits.max_jobs and len(self.jobs) >= limits.max_jobs:
            self.refusals.refuse("jobs", client.peer, f"{len(self.jobs)} jobs held")
            return True
        if limits.max_job_bytes and self.held_bytes + size > limits.max_job_bytes:
            self.refusals.refuse("job_bytes", client.peer, f"{self.held_bytes} body bytes held")
            return True
        return False

    def reserve(self, client: Client, timeout: int = -1) -> bytes | None:
        """Reserve for this client; None means it now waits (the reply comes via deliver)."""
        if not client.worker:
            self._set_worker(client)
        now = self.clock()
        if client.held:
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
        cap = self.reserve_cap
        if cap and client.held >= cap:
            self.refusals.refuse("reserves", client.peer, f"holds {client.held} jobs")
            return True
        return False

    def _client_ready(self, client: Client) -> bool:
        for tube in client.watching:  # noqa: SIM110 - a loop, not a generator, on the reserve path
            if tube.ready_count:
                return True
        return False

    def _fast_reserve(self, client: Client, now: int) -> bytes | None:
        """Serve a reserve at once when a watched, unpaused tube has a ready job.

        Equivalent to beanstalkd's wait-then-process_queue: no other client can be
        waiting on a tube that has ready jobs and is not paused, so this client is the
        one served; only the rotation counter of that tube's wait list moves.
        """
        best: Job | None = None  # the job to serve: the least (pri, id)
        for tube in client.watching:
            if tube.ready_count and not tube.waiting.items:
                if tube.pause:
                    if tube.unpause_at > now:
                        continue
                    tube.pause = 0
                job = tube.ready_top()
                if job is not None and (best is None or job.pri < best.pri
                                        or (job.pri == best.pri and job.id < best.id)):
                    best = job
        if best is None:
            return None
        if self.waiting_ct:
            # Another waiting client could be owed a better job elsewhere; do it the slow way.
            for tube in self.waited_tubes:
                if tube.ready_count and (not tube.pause or tube.unpause_at <= now):
                    return None
        job = best
        tube = job.tube
        tube.waiting.last_use = 1
        tube.drop_ready_top()  # best is its tube's least entry: no stale entry is left behind
        self._remove_ready_top(job)
        self._reserve(client, job, now)
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
        self.deletes_made += 1
        job.state = INVALID
        self.jobs.pop(job_id)
        self.held_bytes -= len(job.body)
        if self.listening:
            self.listener.job_deleted(job)
        self.drop_if_unused(tube)
        return p.DELETED
