"""Putting recovered jobs back into a queue at start (the binlog's recovery feeds this).

Kept apart from :class:`broker.queue.Queue`, which holds the live state machine: restoring
is bulk work done once, before the first connection, that builds the ready and delayed
heaps in one go (heapify is O(n); a million heappush calls are not).

:class:`Restorer` takes one job per :meth:`Restorer.add` call, with plain arguments: a
million jobs arrive at start, and a call with native arguments costs far less in the
compiled build than a record object (a NamedTuple's ``__new__`` runs as Python code) and
a generator step per job.
"""
from __future__ import annotations

import heapq
from typing import Final, NamedTuple

from broker import queue_apply
from broker.model import heap_entry, shared_int
from broker.queue import BURIED, CREATED_GRAIN, DELAYED, NS, READY, URGENT_THRESHOLD, Job, Queue, Tube
from broker.timers import DELAYED_READY

# Final copies of the queue's constants: mypyc keeps a Final name in a C variable, where a
# plain imported name is a dictionary lookup at every use (five per job in add()).
_BURIED: Final = BURIED
_DELAYED: Final = DELAYED
_READY: Final = READY
_NS: Final = NS
_URGENT: Final = URGENT_THRESHOLD
_DELAYED_READY: Final = DELAYED_READY
_CREATED_GRAIN: Final = CREATED_GRAIN
Counters = tuple[int, int, int, int, int]  # reserves, timeouts, releases, buries, kicks


def recovered_created(created: int, wall_off: int) -> int:
    """A recovered job's ``created`` (wall clock in the log) on the queue's clock: at most
    CREATED_GRAIN early, as after a put, so that jobs of one millisecond can share one int."""
    created -= wall_off
    return created - created % _CREATED_GRAIN


class RecoveredJob(NamedTuple):
    """One live job as the log last recorded it; times are on the queue's clock already."""

    job_id: int
    tube: str
    pri: int
    delay: int  # ns
    ttr: int  # ns
    body: bytes
    state: int  # READY, DELAYED or BURIED (a reserved job comes back ready)
    deadline: int  # when a delayed job becomes ready
    created: int
    counters: Counters
    file: int  # the segment holding its latest full record


class Restorer:
    """Puts recovered jobs back in their state, in the order of the :meth:`add` calls;
    :meth:`finish` builds the heaps and updates the queue's counts.

    Reserved jobs come back ready (as in beanstalkd); a delayed job whose time has passed
    comes back ready; buried jobs keep the order they are added in. ``total-jobs`` counts
    puts since start, as in beanstalkd, so it is not changed here.
    """

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        self.now = queue.clock()
        self.jobs = queue.jobs
        self.tubes: dict[str, Tube] = {}
        self.pool = queue.int_pool  # equal priorities and TTRs share one int object, as after a put
        self.count = 0
        self.held = 0
        self.max_id = queue.next_id - 1

    def add(self, job_id: int, tube_name: str, pri: int, delay_ns: int, ttr_ns: int, body: bytes, state: int,
            deadline: int, created: int, counters: Counters, file: int) -> None:
        """One live job (see :class:`RecoveredJob` for the fields)."""
        tube = self.tubes.get(tube_name)
        if tube is None:
            tube = self.tubes[tube_name] = queue_apply.tube(self.queue, tube_name)
        if pri > 256:
            pri = self.pool.get(pri) or shared_int(self.pool, pri)
        ttr = ttr_ns // _NS
        if ttr > 256:
            ttr = self.pool.get(ttr) or shared_int(self.pool, ttr)
        job = Job(job_id, tube, pri, delay_ns, ttr, body, created)
        if counters[0] or counters[1] or counters[2] or counters[3] or counters[4]:
            job.set_counters(counters)
        job.file = file
        self.jobs.put(job_id, job)
        self.held += len(body)
        self.count += 1
        if job_id > self.max_id:
            self.max_id = job_id
        if state == _BURIED:
            queue_apply.restore_buried(self.queue, job)
        elif state == _DELAYED and deadline > self.now:
            job.deadline = deadline
            tube.delayed.append(heap_entry(deadline, job_id))
            job.state = _DELAYED
            tube.delayed_count += 1
            self.queue.timers.push(deadline, _DELAYED_READY, job_id)
        else:
            tube.push_ready(pri, job_id)  # ids in order (the usual binlog) queue on the run: no heapify
            job.state = _READY
            tube.ready_count += 1
            if pri < _URGENT:
                tube.urgent_count += 1

    def tube(self, name: str) -> Tube:
        """The tube of that name, made if needed."""
        tube = self.tubes.get(name)
        if tube is None:
            tube = self.tubes[name] = queue_apply.tube(self.queue, name)
        return tube

    def add_lazy_run(self, tube: Tube, ids: list[int], locs: list[int], held: int, urgent: int) -> None:
        """Ready jobs not made yet (the interpreted recovery's batch loop: ``jobs.loader`` makes
        job ``ids[i]`` from ``locs[i]`` when first used), heap entries appended to ``tube.ready``
        by the caller: what :meth:`add` does for each of them, in the same order, with the
        counts added once."""
        self.jobs.put_lazy(ids, locs)
        count = len(ids)
        tube.ready_count += count
        tube.urgent_count += urgent
        self.held += held
        self.count += count
        top = max(ids) if count else 0
        if top > self.max_id:
            self.max_id = top

    def add_record(self, job: RecoveredJob) -> None:
        self.add(job.job_id, job.tube, job.pri, job.delay, job.ttr, job.body, job.state, job.deadline,
                 job.created, job.counters, job.file)

    def finish(self) -> int:
        """Heapify what was added, update the queue's counts, serve waiting clients; returns how many jobs."""
        queue = self.queue
        for tube in self.tubes.values():
            heapq.heapify(tube.ready)
            heapq.heapify(tube.delayed)
        queue.held_bytes += self.held
        queue.next_id = max(queue.next_id, self.max_id + 1)
        queue_apply.serve_waiting(queue)
        return self.count
