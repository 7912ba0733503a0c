"""Jobs put into a queue from a log: replication apply, and the helpers recovery uses.

A replica changes its queue only through the apply functions, from the leader's log; each
tells the queue's listener (the replica's own binlog) as a command would. Used by
:mod:`broker.replication.follower` and :mod:`broker.queue_restore`; functions over a
:class:`broker.queue.Queue` (like :mod:`broker.stats`), kept out of it because no client
command reaches them.
"""
from __future__ import annotations

from broker.model import BURIED, DELAYED, INVALID, NS, READY, RESERVED, Job, Tube
from broker.queue import Queue
from broker.timers import TUBE_UNPAUSE


def apply_job(queue: Queue, job_id: int, tube_name: str, pri: int, delay_ns: int, ttr_ns: int, body: bytes,
              state: int, deadline: int, created: int, counters: tuple[int, int, int, int, int]) -> None:
    """A full job record: create the job, or (a compaction or snapshot copy) set its state."""
    if job_id in queue.jobs:
        apply_state(queue, job_id, state, pri, delay_ns, deadline, counters)
        return
    tube = queue._tube(tube_name)
    job = Job(job_id, tube, pri, delay_ns, ttr_ns // NS, body, created)
    job.set_counters(counters)
    queue.listener.job_put(job)  # may raise StorageFull: nothing was changed yet
    queue.jobs.put(job_id, job)
    queue.held_bytes += len(body)
    if job_id >= queue.next_id:
        queue.next_id = job_id + 1
    _place(queue, job, state, deadline)
    if job.state == BURIED or job.reserves or counters[1] or counters[2] or counters[3] or counters[4]:
        queue.listener.job_updated(job)


def apply_state(queue: Queue, job_id: int, state: int, pri: int, delay_ns: int, deadline: int,
                counters: tuple[int, int, int, int, int]) -> None:
    """A job's new state (release, bury, kick, timeout, reserve on the leader); unknown ids are ignored."""
    job = queue.jobs.get(job_id)
    if job is None:
        return
    _detach(queue, job)
    job.pri = pri
    job.rare = None  # counters and delay, set anew
    job.delay = delay_ns
    job.set_counters(counters)
    _place(queue, job, state, deadline)
    queue.listener.job_updated(job)


def apply_delete(queue: Queue, job_id: int) -> None:
    job = queue.jobs.get(job_id)
    if job is None:
        return
    _detach(queue, job)
    tube = job.tube
    tube.total_deletes += 1
    queue.deletes_made += 1  # not a delete command (Queue.counted_ops)
    job.state = INVALID
    del queue.jobs[job_id]
    queue.held_bytes -= len(job.body)
    queue.listener.job_deleted(job)
    queue.drop_if_unused(tube)


def _place(queue: Queue, job: Job, state: int, deadline: int) -> None:
    """Queue an applied job in its state; reserved on the leader is ready here (as after a restart)."""
    now = queue.clock()
    if state == BURIED:
        restore_buried(queue, job)  # the record's count already includes this bury
    elif state == DELAYED and deadline > now:
        queue._enqueue(job, deadline - now, now)
    else:
        queue._enqueue(job, 0, now)


def _detach(queue: Queue, job: Job) -> None:
    """Take a job out of whatever structure holds it (its state says which)."""
    state = job.state
    if state == READY:
        queue._remove_ready(job)
    elif state == DELAYED:
        queue._remove_delayed(job)
    elif state == BURIED:
        queue._remove_buried(job)
    elif state == RESERVED and job.reserver is not None:
        queue._unreserve(job.reserver, job)


def tube(queue: Queue, name: str) -> Tube:
    """The tube of that name, made if needed (no client reference taken)."""
    return queue._tube(name)


def restore_buried(queue: Queue, job: Job) -> None:
    """A recovered buried job goes to the end of its tube's buried list (not a new bury)."""
    queue._bury(job)
    job.buries -= 1


def serve_waiting(queue: Queue) -> None:
    """Hand ready jobs to clients blocked in reserve, if any (after a bulk restore)."""
    if queue.waiting_ct:
        queue._process_queue(queue.clock())


def apply_pause(queue: Queue, tube_name: str, pause_ns: int, unpause_at: int) -> None:
    """The leader paused a tube until ``unpause_at`` (this queue's clock): pause it here too, so a failover
    keeps the pause. A tube this member does not have (no jobs, no clients here) is left alone, as the
    leader's pause would end with its last client."""
    tube = queue.tube_by_name.get(tube_name)
    if tube is None:
        return
    tube.pause = pause_ns or 1
    tube.unpause_at = unpause_at
    tube.pause_count += 1
    queue.timers.push(unpause_at, TUBE_UNPAUSE, tube)
    queue.listener.tube_paused(tube)
