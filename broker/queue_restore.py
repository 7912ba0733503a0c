"""Putting recovered jobs back into a queue at start (the binlog's recovery feeds this).

Kept apart from :class:`broker.queue.Queue`, which holds the live state machine: restoring
is bulk work done once, before the first connection, that builds the ready and delayed
heaps in one go (heapify is O(n); a million heappush calls are not).
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import NamedTuple

from broker import queue_apply
from broker.model import ID_BITS, shared_int
from broker.queue import BURIED, DELAYED, NS, READY, URGENT_THRESHOLD, Job, Queue, Tube
from broker.timers import DELAYED_READY


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
    counters: tuple[int, int, int, int, int]  # reserves, timeouts, releases, buries, kicks
    file: int  # the segment holding its latest full record


def restore_jobs(queue: Queue, records: Iterable[RecoveredJob]) -> int:
    """Put recovered jobs back in their state, in the order given; returns how many.

    Reserved jobs come back ready (as in beanstalkd); a delayed job whose time has passed
    comes back ready; buried jobs keep their FIFO order. ``total-jobs`` counts puts since
    start, as in beanstalkd, so it is not changed here.
    """
    now = queue.clock()
    jobs = queue.jobs
    tubes: dict[str, Tube] = {}
    timers = queue.timers
    n = held = ready = urgent = delayed = 0
    max_id = queue.next_id - 1
    pool = queue.int_pool  # equal priorities and TTRs share one int object, as after a put
    for job_id, tube_name, pri, delay_ns, ttr_ns, body, state, deadline, created, counters, file in records:
        tube = tubes.get(tube_name)
        if tube is None:
            tube = tubes[tube_name] = queue_apply.tube(queue, tube_name)
        if pri > 256:
            pri = pool.get(pri) or shared_int(pool, pri)
        ttr = ttr_ns // NS
        if ttr > 256:
            ttr = pool.get(ttr) or shared_int(pool, ttr)
        job = Job(job_id, tube, pri, delay_ns, ttr, body, created)
        if counters[0] or counters[1] or counters[2] or counters[3] or counters[4]:
            job.set_counters(counters)
        job.file = file
        tube.refs += 1
        jobs[job_id] = job
        held += len(body)
        n += 1
        if job_id > max_id:
            max_id = job_id
        if state == BURIED:
            queue_apply.restore_buried(queue, job)
        elif state == DELAYED and deadline > now:
            job.deadline = deadline
            tube.delayed.append((deadline << ID_BITS) | job_id)  # heap_entry, inlined
            job.state = DELAYED
            tube.delayed_count += 1
            delayed += 1
            timers.push(deadline, DELAYED_READY, job)
        else:
            tube.ready.append((pri << ID_BITS) | job_id)  # heap_entry, inlined
            job.state = READY
            tube.ready_count += 1
            ready += 1
            if pri < URGENT_THRESHOLD:
                tube.urgent_count += 1
                urgent += 1
    for tube in tubes.values():
        heapq.heapify(tube.ready)
        heapq.heapify(tube.delayed)
    queue.held_bytes += held
    queue.ready_ct += ready
    queue.urgent_ct += urgent
    queue.delayed_ct += delayed
    queue.next_id = max(queue.next_id, max_id + 1)
    queue_apply.serve_waiting(queue)
    return n
