"""What comes due on the queue's one timer heap: delayed jobs, TTR expiries, reserve
timeouts and deadline-soon, tube unpauses; and a reserve ended by a half-close.

Functions over a :class:`broker.queue.Queue` (like :mod:`broker.stats`): the server's timer
calls :func:`tick`; the per-command paths stay in :class:`Queue`.
"""
from __future__ import annotations

from typing import cast

from broker import protocol as p
from broker.model import Client, Job, Tube
from broker.queue import Queue
from broker.timers import CLIENT_TICK, DELAYED_READY, TTR_EXPIRY


def next_deadline(queue: Queue) -> int | None:
    """When :meth:`tick` next has work to do (clock nanoseconds), or None."""
    return queue.timers.next_deadline()


def tick(queue: Queue) -> None:
    """Do everything that has come due: delayed jobs, TTR expiries, reserve timeouts, unpauses."""
    now = queue.clock()
    for _when, kind, owner in queue.timers.pop_due(now):
        if kind == DELAYED_READY:
            job = cast(Job, queue.jobs.get(cast(int, owner)))  # current (pop_due checked): the job is there
            queue._remove_delayed(job)
            queue._enqueue(job, 0, now)
        elif kind == TTR_EXPIRY:
            queue.expire_reserved(cast(Client, owner), now)
        elif kind == CLIENT_TICK:
            queue._client_tick(cast(Client, owner), now)
        else:
            cast(Tube, owner).pause = 0
            if queue.waiting_ct:
                queue._process_queue(now)
    queue.compact_timers()


def hangup(queue: Queue, client: Client) -> None:
    """The client half-closed while blocked in reserve: beanstalkd answers TIMED_OUT."""
    if client.waiting:
        client.pending_timeout = -1
        queue._stop_waiting(client)
        client.deliver(p.TIMED_OUT)
