"""What the queue is made of: jobs, tubes, clients, and the job states (beanstalkd's job.c, tube.c, ms.c).

Plain data with the few helpers that read it; the rules that move jobs between states
are :class:`broker.queue.Queue`. Ordering details that clients can observe are
reproduced on purpose: beanstalkd keeps tubes, watch lists and waiting clients in small
arrays that delete by moving the last item into the hole (:class:`SwapSet`), and hands a
tube's waiting clients jobs in a rotating order.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

from mypy_extensions import mypyc_attr

from broker._build import is_compiled_file
from broker.jobtable import JobTable

# Final: mypyc puts these values into the compiled code; a plain module global is a dict
# look-up and an unboxing at every use (a few hundred instructions on every command).
NS: Final = 1_000_000_000
URGENT_THRESHOLD: Final = 1024
SAFETY_MARGIN: Final = 1_000_000_000  # DEADLINE_SOON: one second (NS) before a reserved job's TTR runs out

READY: Final = 0
DELAYED: Final = 1
RESERVED: Final = 2
BURIED: Final = 3
INVALID: Final = 4
STATE_NAMES: Final = ("ready", "delayed", "reserved", "buried", "invalid")


T = TypeVar("T")
# A heap entry is one int, ``(key << ID_BITS) | id``: key = priority (ready heap) or deadline
# (delay heap). An int costs a third of a (key, id, job) tuple, and compiled (mypyc) it needs no
# boxed key and id beside it. The job is found by id; an entry is live while its job is still in
# that tube and state with that key (lazy deletion). Two live entries of one job can only be
# equal ints, served once: the first makes the job leave the state, the second is then stale.
ID_BITS: Final = 64
ID_MASK: Final = (1 << ID_BITS) - 1
# A tube's ready heap shifts the priority by only READY_BITS = 30 while every id in it is below
# 2**30 (the first billion jobs): with any 32-bit priority, ``(pri << 30) | id`` is below 2**62,
# which compiled (mypyc) stays a machine word (a tagged int), so the shift, the mask and the
# compares are a few C instructions where ``pri << 64`` goes through CPython's big-int code
# (~500 instructions a put); and for priorities below 2**30 it is a two-digit int, 32 bytes,
# where ``(pri << 64) | id`` takes three digits and 48 (16 bytes a ready job, issue 16 item 4).
# The first larger id widens that heap for good (:meth:`Tube.widen_ready`); the order of
# (priority, id) is the same either way.
READY_BITS: Final = 30


def heap_entry(key: int, job_id: int) -> int:
    """A delay-heap entry (the ready heap's narrower form is :meth:`Tube.push_ready`'s)."""
    return (key << ID_BITS) | job_id


# heapq's two hot functions, Final: compiled, a C static each (``heapq.heappush`` is a module
# attribute look-up on every call). Used by the queue and the timer heap too.
heappush: Final = heapq.heappush
heappop: Final = heapq.heappop

# Compiled (mypyc), a Job's int fields are machine words, not int objects: sharing equal ints
# between jobs (shared_int) saves nothing there and costs a boxing and a dict look-up per put.
COMPILED: Final = is_compiled_file(__file__)

INT_POOL_MAX: Final = 1024  # distinct values shared by shared_int; past that, new values stay per job


def shared_int(pool: dict[int, int], value: int) -> int:
    """``value``, as the one int object ``pool`` keeps for it: a priority or TTR above 256 (past
    CPython's small-int cache) would otherwise be an object of its own in every job (interpreted build)."""
    return pool.get(value, value) if len(pool) >= INT_POOL_MAX else pool.setdefault(value, value)


class SwapSet(Generic[T]):
    """beanstalkd's ``Ms``: an array whose delete moves the last item into the hole.

    ``take`` serves items in a rotating order (``last_use``), as beanstalkd does for the
    clients waiting on a tube.
    """

    __slots__ = ("items", "last_use")

    def __init__(self) -> None:
        self.items: list[T] = []
        self.last_use = 0

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, item: object) -> bool:
        return item in self.items

    def append(self, item: T) -> None:
        self.items.append(item)

    def delete_at(self, index: int) -> T:
        items = self.items
        item = items[index]
        last = items.pop()
        if index < len(items):
            items[index] = last
        return item

    def remove(self, item: T) -> bool:
        try:
            index = self.items.index(item)
        except ValueError:
            return False
        self.delete_at(index)
        return True

    def take(self) -> T | None:
        if not self.items:
            return None
        self.last_use %= len(self.items)
        item = self.delete_at(self.last_use)
        self.last_use += 1
        return item


class Job:
    """One job; no timer handle (see broker.timers).

    A broker holds millions of these, so they are lean: TTR in seconds, and what most jobs
    never have (timeouts, releases, buries, kicks, a delay) share one list that exists only
    once one of them is non-zero. 12 slots: one more costs 16 bytes a job (allocations are
    in 16-byte steps).
    """

    __slots__ = (
        "body",
        "created",
        "deadline",
        "file",
        "id",
        "pri",
        "rare",
        "reserver",
        "reserves",
        "state",
        "ttr",
        "tube",
    )
    def __init__(self, job_id: int, tube: Tube, pri: int, delay: int, ttr: int, body: bytes,
                 created: int) -> None:
        self.id = job_id
        self.tube = tube
        self.pri = pri
        self.ttr = ttr  # seconds: small ints are shared, ns would cost an int object per job
        self.body = body
        self.state = INVALID
        self.created = created
        self.deadline = 0
        self.reserver: Client | None = None
        self.reserves = 0
        self.rare: list[int] | None = None if not delay else [0, 0, 0, 0, delay]
        self.file = 0

    def __lt__(self, other: Job) -> bool:
        """Entries ``(deadline, id, job)`` of a client's TTR heap tie only for one job reserved twice
        with the same deadline (an injected clock that stands still): either order is right."""
        return False

    # The rarely used fields live in ``rare``, created on the first non-zero value. Plain
    # properties: mypyc compiles them (a property object built by a helper it cannot).
    def _rare_get(self, index: int) -> int:
        rare = self.rare
        return rare[index] if rare is not None else 0

    def _rare_set(self, index: int, value: int) -> None:
        if self.rare is None:
            if not value:
                return
            self.rare = [0, 0, 0, 0, 0]
        self.rare[index] = value

    @property
    def timeouts(self) -> int:
        return self._rare_get(0)

    @timeouts.setter
    def timeouts(self, value: int) -> None:
        self._rare_set(0, value)

    @property
    def releases(self) -> int:
        return self._rare_get(1)

    @releases.setter
    def releases(self, value: int) -> None:
        self._rare_set(1, value)

    @property
    def buries(self) -> int:
        return self._rare_get(2)

    @buries.setter
    def buries(self, value: int) -> None:
        self._rare_set(2, value)

    @property
    def kicks(self) -> int:
        return self._rare_get(3)

    @kicks.setter
    def kicks(self, value: int) -> None:
        self._rare_set(3, value)

    @property
    def delay(self) -> int:
        """ns: the delay of its last put or release."""
        return self._rare_get(4)

    @delay.setter
    def delay(self, value: int) -> None:
        self._rare_set(4, value)

    def set_counters(self, counters: tuple[int, int, int, int, int]) -> None:
        """(reserves, timeouts, releases, buries, kicks), as a recovered job had them."""
        self.reserves = counters[0]
        if counters[1] or counters[2] or counters[3] or counters[4]:
            self.rare = [counters[1], counters[2], counters[3], counters[4], self.delay]


_object_new: Final[Any] = object.__new__


def new_job(job_id: int, tube: Tube, pri: int, ttr: int, body: bytes, created: int, state: int, file: int) -> Job:
    """What ``Job(job_id, tube, pri, 0, ttr, body, created)`` gives, with ``state`` and ``file`` set
    (a delayed put sets ``delay`` after). Interpreted, without the class call: a class with an
    ``__init__`` is called through ``type.__call__`` and the ``__init__`` slot wrapper, ~330
    instructions more than this plain function setting every slot, and a put makes one job a
    command, recovery a million (tests/test_binlog_batch.py compares every slot with the
    constructor's). Compiled, the class call is a direct C call."""
    if COMPILED:
        made = Job(job_id, tube, pri, 0, ttr, body, created)
        made.state = state
        made.file = file
        return made
    job: Job = _object_new(Job)
    job.id = job_id
    job.tube = tube
    job.pri = pri
    job.ttr = ttr
    job.body = body
    job.state = state
    job.created = created
    job.deadline = 0
    job.reserver = None
    job.reserves = 0
    job.rare = None
    job.file = file
    return job


class Tube:
    """A named queue: ready heap, delay heap, buried FIFO, and who uses/watches/waits on it."""

    __slots__ = (
        "buried",
        "delayed",
        "delayed_count",
        "jobs",
        "name",
        "name_bytes",
        "pause",
        "pause_count",
        "ready",
        "ready_clean",
        "ready_count",
        "ready_mask",
        "ready_run",
        "ready_run_at",
        "ready_shift",
        "reserved_count",
        "top_in_run",
        "total_deletes",
        "total_jobs",
        "unpause_at",
        "urgent_count",
        "using",
        "waiting",
        "watching",
    )

    def __init__(self, name: str, jobs: JobTable[Job]) -> None:
        self.name = name
        self.name_bytes = name.encode("latin-1")  # as the binlog and the replication stream write it
        self.jobs = jobs  # the queue's jobs by id: heap entries name their job by id
        self.ready: list[int] = []  # heap of (pri << ready_shift) | id; stale entries skipped
        # Entries pushed in ascending order skip the heap: they queue in ``ready_run`` from index
        # ``ready_run_at`` on, a sorted run whose head is compared with the heap's top. A backlog put
        # at one priority (ids only grow) is then served in O(1) a job, not two log2(n) compares.
        self.ready_run: list[int] = []
        self.ready_run_at = 0
        self.top_in_run = False  # where ready_top found its entry: what drop_ready_top removes
        self.ready_shift = READY_BITS  # ID_BITS once an id of 2**READY_BITS or more came in
        self.ready_mask = (1 << READY_BITS) - 1
        self.ready_count = 0
        # No stale entry in the heap or the run: each entry is a ready job's, once. Stale entries come
        # only from a ready job taken out of the middle (Queue._remove_ready) and go with the rebuild or
        # when the lists empty; while there are none, the stale bound (prune_ready) cannot be passed, and
        # a reserve of the top skips its test (on a backlog, four int allocations and ~14 bytecodes).
        self.ready_clean = True
        self.urgent_count = 0
        self.delayed: list[int] = []  # heap of heap_entry(deadline, id)
        self.delayed_count = 0
        self.buried: dict[int, Job] = {}  # FIFO by insertion
        self.reserved_count = 0
        self.total_jobs = 0
        self.using = 0
        self.watching = 0
        self.waiting: SwapSet[Client] = SwapSet()
        self.total_deletes = 0
        self.pause_count = 0
        self.pause = 0  # ns; 0 = not paused
        self.unpause_at = 0

    def widen_ready(self) -> None:
        """Re-encode the ready heap with ID_BITS for the id: the map keeps the order, so the
        list stays a heap."""
        if self.ready_shift != ID_BITS:
            narrow, mask = self.ready_shift, self.ready_mask
            self.ready = [((entry >> narrow) << ID_BITS) | (entry & mask) for entry in self.ready]
            self.ready_run = [((entry >> narrow) << ID_BITS) | (entry & mask)
                              for entry in self.run_entries()]
            self.ready_run_at = 0
            self.ready_shift = ID_BITS
            self.ready_mask = ID_MASK

    def ready_live(self, entry: int) -> bool:
        job = self.jobs.get(entry & self.ready_mask)
        return job is not None and job.state == READY and job.tube is self and job.pri == entry >> self.ready_shift

    def delayed_live(self, entry: int) -> bool:
        job = self.jobs.get(entry & ID_MASK)
        return job is not None and job.state == DELAYED and job.tube is self and job.deadline == entry >> ID_BITS

    def push_ready(self, pri: int, job_id: int) -> None:
        """Queue a ready job's entry ``(pri << ready_shift) | job_id`` (an id too wide for the
        shift widens the heap first): on the run if it sorts after the run's last entry, else on
        the heap."""
        shift = self.ready_shift
        if job_id >> shift:
            self.widen_ready()
            shift = ID_BITS
        entry = (pri << shift) | job_id
        run = self.ready_run
        if not run or entry > run[-1]:
            run.append(entry)
        else:
            heappush(self.ready, entry)

    def drop_ready_top(self) -> None:
        """Remove the entry :meth:`ready_top` returned last (it says whether that was the run's head)."""
        if not self.top_in_run:
            heappop(self.ready)
            return
        at = self.ready_run_at + 1
        run = self.ready_run
        if at == len(run):
            run.clear()
            at = 0
        elif at >= 1024 and 2 * at >= len(run):  # amortized O(1): the served prefix goes in one move
            del run[:at]
            at = 0
        self.ready_run_at = at

    def run_entries(self) -> list[int]:
        """The run's entries not served yet, in order (a copy)."""
        return self.ready_run[self.ready_run_at:]

    def ready_entries(self) -> int:
        """Heap and run entries, stale ones included."""
        return len(self.ready) + len(self.ready_run) - self.ready_run_at

    def ready_top(self) -> Job | None:
        """The job of the least live entry of the ready heap and run (stale ones before it are dropped)."""
        jobs = self.jobs
        heap, run = self.ready, self.ready_run
        shift, mask = self.ready_shift, self.ready_mask
        while True:
            at = self.ready_run_at
            if at < len(run) and (not heap or run[at] < heap[0]):
                entry = run[at]
                self.top_in_run = True
            elif heap:
                entry = heap[0]
                self.top_in_run = False
            else:
                return None
            job = jobs.get(entry & mask)  # ready_live, inlined: this is the reserve path
            if job is not None and job.state == READY and job.tube is self and job.pri == entry >> shift:
                return job
            self.drop_ready_top()

    def delayed_top(self) -> Job | None:
        heap = self.delayed
        while heap:
            entry = heap[0]
            if self.delayed_live(entry):
                return self.jobs[entry & ID_MASK]
            heappop(heap)
        return None

    def prune_ready(self) -> None:
        """Rebuild the ready heap and run once stale entries outnumber live ones (then, as when the
        lists are empty, none is left: ``ready_clean``)."""
        entries = self.ready_entries()
        if entries > 2 * self.ready_count + 64:
            run = [e for e in self.run_entries() if self.ready_live(e)]  # still sorted
            in_run = set(run)
            self.ready = _rebuilt([e for e in self.ready if e not in in_run and self.ready_live(e)])
            self.ready_run = run
            self.ready_run_at = 0
            self.ready_clean = True
        elif not entries:
            self.ready_clean = True

    def prune_delayed(self) -> None:
        heap = self.delayed
        if len(heap) > 2 * self.delayed_count + 64:
            self.delayed = _rebuilt([e for e in heap if self.delayed_live(e)])


def _rebuilt(live: list[int]) -> list[int]:
    """A heap of the live entries, each once (a job queued again under its stale entry's key has two)."""
    fresh = list(set(live))
    heapq.heapify(fresh)
    return fresh


@mypyc_attr(allow_interpreted_subclasses=True)  # test doubles subclass it (tests/differential/harness.py)
class Client:
    """One connection's protocol state. ``deliver`` receives replies produced later."""

    __slots__ = (
        "closed",
        "deadlines",
        "deliver",
        "first",
        "held",
        "more",
        "peer",
        "pending_put_id",
        "pending_timeout",
        "producer",
        "tick_at",
        "ttr_armed",
        "use",
        "waiting",
        "watch",
        "watching",
        "worker",
    )

    def __init__(self, deliver: Callable[[bytes], None], peer: str = "") -> None:
        # Compiled (mypyc), the fields lie in the order of their first assignment here: the four flags side by
        # side (one word), then what a put, reserve and delete read, the rest last, so that with hundreds of
        # connections a command misses on fewer of the object's 64-byte lines (bench/instructions.py --cache-sim).
        self.waiting = False
        self.worker = False
        self.producer = False
        self.closed = False
        self.use: Tube
        # The watch set as a tuple, for the reserve path: one object to read where the SwapSet took three
        # (itself, its list, the list's array), and with hundreds of connections each of them was out of the
        # CPU cache by the client's next reserve (bench/instructions.py --cache-sim). ``watch`` keeps the
        # order (beanstalkd's, for list-tubes-watched); both change only through the three methods below.
        self.watching: tuple[Tube, ...] = ()
        # The jobs this client holds (reserved): ``held`` of them; ``first``, the job reserved while it held none,
        # until it goes (else None); ``more`` the others by id, in the order they were reserved. Most workers hold
        # one job at a time: it is ``first``, and a reserve and delete touch no dict (with hundreds of connections
        # a dict and its table were two more objects out of the CPU cache by the client's next command). So
        # held_jobs() lists them in the order they were reserved, as beanstalkd gives a closed connection's jobs
        # back. Only hold and drop_hold change them; holding() and held_jobs() read them.
        self.held = 0
        self.first: Job | None = None
        # The deadline of this client's one live TTR timer entry (0: none). Like beanstalkd, the
        # timer heap holds a connection's soonest deadline, not an entry per reserved job.
        self.ttr_armed = 0
        self.pending_timeout = -1
        self.more: dict[int, Job] = {}
        # A heap of (deadline, job id), lazy: an entry is live while the client holds its job with that deadline.
        # Ids, not jobs: the entry of a job deleted (or released, buried, touched) stays until it reaches the top
        # or the heap is pruned, and must not keep the job's body until then. While the client holds one job, that
        # job may have no live entry (its deadline is on the job): most workers hold one job at a time, and with
        # hundreds of connections the heap's list, its array and a tuple an entry were out of the CPU cache by the
        # client's next command (bench/instructions.py --cache-sim). Only hold, drop_hold and retime change it.
        self.deadlines: list[tuple[int, int]] = []
        self.watch: SwapSet[Tube] = SwapSet()
        self.tick_at = 0
        self.deliver = deliver
        self.pending_put_id = 0
        self.peer = peer

    def watch_tube(self, tube: Tube) -> bool:
        """Add ``tube`` to the watch set; False when it is there already."""
        if tube in self.watching:
            return False
        self.watch.append(tube)
        self.watching = tuple(self.watch.items)
        return True

    def ignore_tube(self, tube: Tube) -> None:
        self.watch.remove(tube)
        self.watching = tuple(self.watch.items)

    def drop_watches(self) -> tuple[Tube, ...]:
        """Empty the watch set (the connection closed); the tubes it held."""
        held = self.watching
        self.watch.items.clear()
        self.watching = ()
        return held

    def holding(self, job_id: int) -> Job | None:
        """The job with this id if this client holds it."""
        first = self.first
        if first is not None:
            if first.id == job_id:
                return first
            if self.held == 1:
                return None
        elif not self.held:
            return None
        return self.more.get(job_id)

    def held_jobs(self) -> list[Job]:
        """In the order they were reserved (``first``, if still held, before any of ``more``)."""
        first = self.first
        more = list(self.more.values()) if self.held > (first is not None) else []
        return more if first is None else [first, *more]

    def hold(self, job: Job) -> None:
        """Note a job just reserved, its deadline set. Two or more held: each has a live entry in the heap."""
        held = self.held = self.held + 1
        if held == 1:
            self.first = job
            return
        self.more[job.id] = job
        heap = self.deadlines
        if held == 2:  # the job held before may have no entry (a duplicate of a live one is harmless)
            for other in self.held_jobs():
                if other is not job:
                    heappush(heap, (other.deadline, other.id))
        heappush(heap, (job.deadline, job.id))

    def drop_hold(self, job: Job) -> None:
        """The client no longer holds ``job``: its entries go stale. With none held the heap is left as it
        is (stale entries only, bounded by the last prune): emptying it touched the list on every delete."""
        if self.first is job:
            self.first = None
        else:
            del self.more[job.id]
        self.held -= 1
        if self.held:
            self.prune_deadlines()

    def retime(self, job: Job) -> None:
        """A held job's deadline moved (touch): its old entry goes stale."""
        if self.held > 1:
            heappush(self.deadlines, (job.deadline, job.id))
            self.prune_deadlines()

    def prune_deadlines(self) -> None:
        """Drop stale entries once they outnumber the live ones: a job released, deleted or
        touched leaves its old entry behind, and a worker that touches a long-TTR job every
        second would otherwise grow the heap by an entry a touch until the TTR comes round.
        Duplicates of a live entry go too (``hold`` may push one)."""
        heap = self.deadlines
        if len(heap) > 2 * self.held + 64:
            live = list({e for e in heap if (job := self.holding(e[1])) is not None and job.deadline == e[0]})
            heapq.heapify(live)
            self.deadlines = live

    def soonest_held(self) -> Job | None:
        """The held job due first, None when none is held; drops the stale entries on top of the heap, so
        that its top, if any, is the answer's live entry."""
        heap = self.deadlines
        while heap:
            deadline, job_id = heap[0]
            job = self.holding(job_id)
            if job is not None and job.deadline == deadline:
                return job
            heappop(heap)
        if self.held == 1:  # one held, without an entry (see __init__)
            return self.held_jobs()[0]
        return None

    def soonest_deadline(self) -> int | None:
        job = self.soonest_held()
        return None if job is None else job.deadline


def job_reply(word: bytes, job: Job) -> bytes:
    return b"%s %d %d\r\n%s\r\n" % (word, job.id, len(job.body), job.body)
