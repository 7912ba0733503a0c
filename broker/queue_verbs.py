"""The queue's verbs beside put / reserve / delete: reserve-job, release, bury, touch, peek*,
kick*, use / watch / ignore, pause-tube, list-*; and a connection's arrival and departure.

Functions over a :class:`broker.queue.Queue`, like :mod:`broker.stats`: the connection's
dispatch tables call every table verb as ``fn(queue, client, arg)``, so these cost no extra
hop, and :class:`Queue` keeps only the state machine and the put / reserve / delete path.
"""
from __future__ import annotations

from collections.abc import Callable

from broker import protocol as p
from broker.model import BURIED, DELAYED, INVALID, NS, READY, RESERVED, Client, Job, job_reply
from broker.queue import Queue
from broker.timers import TUBE_UNPAUSE


def connect(queue: Queue, deliver: Callable[[bytes], None], peer: str = "") -> Client:
    client = Client(deliver, peer)
    tube = queue.default_tube
    client.use = tube
    tube.using += 1
    client.watch_tube(tube)
    tube.watching += 1
    queue.cur_conns += 1
    queue.tot_conns += 1
    return client


def disconnect(queue: Queue, client: Client) -> None:
    """The connection closed: its reserved jobs go back to ready, its tubes are released."""
    if client.closed:
        return
    client.closed = True
    if client.producer:
        queue.producers -= 1
    if client.worker:
        queue.workers -= 1
    queue.cur_conns -= 1
    queue._stop_waiting(client)
    if client.held:
        now = queue.clock()
        for job in client.held_jobs():
            queue._unreserve(client, job)
            queue._enqueue(job, 0, now)
    for tube in client.drop_watches():
        tube.watching -= 1
        queue.drop_if_unused(tube)
    client.use.using -= 1
    queue.drop_if_unused(client.use)
    client.deadlines.clear()
    queue.compact_timers()


def reserve_job(queue: Queue, client: Client, job_id: int) -> bytes:
    job = queue.jobs.get(job_id)
    if job is None or job.state == RESERVED or job.state == INVALID:
        return p.NOT_FOUND
    if queue._reserve_refused(client):
        return p.OUT_OF_MEMORY
    if job.state == READY:
        queue._remove_ready(job)
    elif job.state == BURIED:
        queue._remove_buried(job)
    else:
        queue._remove_delayed(job)
    queue._set_worker(client)
    queue._reserve(client, job, queue.clock())
    return job_reply(b"RESERVED", job)


def release(queue: Queue, client: Client, job_id: int, pri: int, delay: int) -> bytes:
    job = client.holding(job_id)
    if job is None:
        return p.NOT_FOUND
    queue._unreserve(client, job)
    job.pri = pri
    job.delay = delay * NS
    job.releases += 1
    queue._enqueue(job, job.delay, queue.clock())
    queue.listener.job_updated(job)
    return p.RELEASED


def bury(queue: Queue, client: Client, job_id: int, pri: int) -> bytes:
    job = client.holding(job_id)
    if job is None:
        return p.NOT_FOUND
    queue._unreserve(client, job)
    job.pri = pri
    queue._bury(job)
    queue.listener.job_updated(job)
    return p.BURIED


def touch(queue: Queue, client: Client, job_id: int) -> bytes:
    job = client.holding(job_id)
    if job is None:
        return p.NOT_FOUND
    job.deadline = deadline = queue.clock() + job.ttr * NS
    client.retime(job)
    queue.arm_ttr(client, deadline)  # an earlier entry stands mostly: it finds this job not due and re-arms
    return p.TOUCHED


def _kick_one(queue: Queue, job: Job, now: int) -> None:
    if job.state == BURIED:
        queue._remove_buried(job)
    else:
        queue._remove_delayed(job)
    job.kicks += 1
    queue._enqueue(job, 0, now)
    queue.listener.job_updated(job)


def kick(queue: Queue, client: Client, bound: int) -> bytes:
    tube = client.use
    now = queue.clock()
    kicked = 0
    if tube.buried:
        while kicked < bound and tube.buried:
            _kick_one(queue, next(iter(tube.buried.values())), now)
            kicked += 1
    else:
        while kicked < bound and tube.delayed_count:
            job = tube.delayed_top()
            if job is None:
                break
            _kick_one(queue, job, now)
            kicked += 1
    return b"KICKED %d\r\n" % kicked


def kick_job(queue: Queue, client: Client, job_id: int) -> bytes:
    job = queue.jobs.get(job_id)
    if job is None or job.state not in (BURIED, DELAYED):
        return p.NOT_FOUND
    _kick_one(queue, job, queue.clock())
    return p.KICKED


def peek(queue: Queue, client: Client, job_id: int) -> bytes:
    job = queue.jobs.get(job_id)
    if job is None or job.state == INVALID:
        return p.NOT_FOUND
    return job_reply(b"FOUND", job)


def peek_ready(queue: Queue, client: Client) -> bytes:
    job = client.use.ready_top() if client.use.ready_count else None
    return job_reply(b"FOUND", job) if job else p.NOT_FOUND


def peek_delayed(queue: Queue, client: Client) -> bytes:
    job = client.use.delayed_top() if client.use.delayed_count else None
    return job_reply(b"FOUND", job) if job else p.NOT_FOUND


def peek_buried(queue: Queue, client: Client) -> bytes:
    buried = client.use.buried
    return job_reply(b"FOUND", next(iter(buried.values()))) if buried else p.NOT_FOUND


def use(queue: Queue, client: Client, name: str) -> bytes:
    tube = queue._tube_for_client(client, name)
    if tube is None:
        return p.OUT_OF_MEMORY
    old = client.use
    old.using -= 1
    client.use = tube
    tube.using += 1
    queue.drop_if_unused(old)
    return b"USING %s\r\n" % name.encode()


def watch(queue: Queue, client: Client, name: str) -> bytes:
    tube = queue._tube_for_client(client, name)
    if tube is None:
        return p.OUT_OF_MEMORY
    if client.watch_tube(tube):
        tube.watching += 1
    return b"WATCHING %d\r\n" % len(client.watching)


def ignore(queue: Queue, client: Client, name: str) -> bytes:
    for tube in client.watching:
        if tube.name == name:
            if len(client.watching) < 2:
                return p.NOT_IGNORED
            client.ignore_tube(tube)
            tube.watching -= 1
            queue.drop_if_unused(tube)
            break
    return b"WATCHING %d\r\n" % len(client.watching)


def pause_tube(queue: Queue, client: Client, name: str, delay: int) -> bytes:
    tube = queue.tube_by_name.get(name)
    if tube is None:
        return p.NOT_FOUND
    pause = delay * NS or 1
    tube.unpause_at = queue.clock() + pause
    tube.pause = pause
    tube.pause_count += 1
    queue.timers.push(tube.unpause_at, TUBE_UNPAUSE, tube)
    if queue.listening:
        queue.listener.tube_paused(tube)
    return p.PAUSED


def list_tubes(queue: Queue, client: Client) -> bytes:
    return p.yaml_list(t.name for t in queue.tubes.items)


def list_tube_used(queue: Queue, client: Client) -> bytes:
    return b"USING %s\r\n" % client.use.name.encode()


def list_tubes_watched(queue: Queue, client: Client) -> bytes:
    return p.yaml_list(t.name for t in client.watching)
