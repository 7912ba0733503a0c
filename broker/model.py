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
from typing import Any, Generic, TypeVar

from mypy_extensions import mypyc_attr

NS = 1_000_000_000
URGENT_THRESHOLD = 1024
SAFETY_MARGIN = NS  # DEADLINE_SOON: one second before a reserved job's TTR runs out

READY, DELAYED, RESERVED, BURIED, INVALID = range(5)
STATE_NAMES = ("ready", "delayed", "reserved", "buried", "invalid")


T = TypeVar("T")
# A ready-heap entry is (pri, id, job), a delay-heap entry (deadline, id, job); the entry a
# job points at is its live one (lazy deletion: identity = validity).
# (pri or deadline, id, job). Variable-length on purpose: mypyc keeps such a tuple one boxed
# object, where a tuple[int, int, Job] would be unboxed and boxed anew on each use, and the
# identity `job.entry is entry` is what marks an entry live.
HeapEntry = tuple[Any, ...]


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

    A broker holds millions of these, so they are lean: TTR in seconds, and the counters
    most jobs never use (timeouts, releases, buries, kicks) share one list that exists
    only once one of them is non-zero.
    """

    __slots__ = (
        "body",
        "created",
        "deadline",
        "delay",
        "entry",
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
        self.delay = delay  # ns
        self.ttr = ttr  # seconds: small ints are shared, ns would cost an int object per job
        self.body = body
        self.state = INVALID
        self.created = created
        self.deadline = 0
        self.reserver: Client | None = None
        self.entry: HeapEntry | None = None  # current ready/delay heap entry (identity = validity)
        self.reserves = 0
        self.rare: list[int] | None = None
        self.file = 0

    def __lt__(self, other: Job) -> bool:
        """Heap entries ``(key, id, job)`` tie only when a job is queued again under the key of its
        own stale entry (replication apply re-creating a job a replayed record names): either order is right."""
        return False

    # The rarely used counters live in ``rare``, created on the first non-zero value. Plain
    # properties: mypyc compiles them (a property object built by a helper it cannot).
    def _rare_get(self, index: int) -> int:
        rare = self.rare
        return rare[index] if rare is not None else 0

    def _rare_set(self, index: int, value: int) -> None:
        if self.rare is None:
            self.rare = [0, 0, 0, 0]
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

    def set_counters(self, counters: tuple[int, int, int, int, int]) -> None:
        """(reserves, timeouts, releases, buries, kicks), as a recovered job had them."""
        self.reserves = counters[0]
        if counters[1] or counters[2] or counters[3] or counters[4]:
            self.rare = list(counters[1:])


class Tube:
    """A named queue: ready heap, delay heap, buried FIFO, and who uses/watches/waits on it."""

    __slots__ = (
        "buried",
        "delayed",
        "delayed_count",
        "name",
        "pause",
        "pause_count",
        "ready",
        "ready_count",
        "refs",
        "reserved_count",
        "total_deletes",
        "total_jobs",
        "unpause_at",
        "urgent_count",
        "using",
        "waiting",
        "watching",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.ready: list[HeapEntry] = []  # heap of (pri, id, job); stale entries skipped
        self.ready_count = 0
        self.urgent_count = 0
        self.delayed: list[HeapEntry] = []  # heap of (deadline, id, job)
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
        self.refs = 0

    def ready_top(self) -> Job | None:
        return live_top(self.ready)

    def delayed_top(self) -> Job | None:
        return live_top(self.delayed)


def live_entry(heap: list[HeapEntry]) -> HeapEntry | None:
    """The first entry of a lazily-deleted job heap that is still its job's current entry
    (stale ones above it are dropped)."""
    while heap:
        entry = heap[0]
        job: Job = entry[2]
        if job.entry is entry:
            return entry
        heapq.heappop(heap)
    return None


def live_top(heap: list[HeapEntry]) -> Job | None:
    entry = live_entry(heap)
    if entry is None:
        return None
    job: Job = entry[2]
    return job


def pruned(heap: list[HeapEntry], live: int) -> list[HeapEntry]:
    """Rebuild a lazily-deleted job heap once stale entries outnumber live ones."""
    if len(heap) <= 2 * live + 64:
        return heap
    fresh = [e for e in heap if e[2].entry is e]
    heapq.heapify(fresh)
    return fresh


@mypyc_attr(allow_interpreted_subclasses=True)  # test doubles subclass it (tests/differential/harness.py)
class Client:
    """One connection's protocol state. ``deliver`` receives replies produced later."""

    __slots__ = (
        "closed",
        "deadlines",
        "deliver",
        "peer",
        "pending_put_id",
        "pending_timeout",
        "producer",
        "reserved",
        "tick_at",
        "use",
        "waiting",
        "watch",
        "worker",
    )

    def __init__(self, deliver: Callable[[bytes], None], peer: str = "") -> None:
        self.use: Tube
        self.watch: SwapSet[Tube] = SwapSet()
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
