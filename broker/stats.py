"""The ``stats``, ``stats-tube`` and ``stats-job`` replies, byte for byte as beanstalkd 1.12 writes them.

Rendering only: the numbers are the queue's own counters, read when a client asks. Host
facts (``id``, ``hostname``, ``os``, ``platform``) are taken once per process.
"""
from __future__ import annotations

import os
import platform
import resource
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from broker import protocol as p
from broker.model import DELAYED, INVALID, NS, RESERVED, STATE_NAMES

if TYPE_CHECKING:
    from broker.model import Client
    from broker.queue import Queue

VERSION: Final = "1.12"
# The cmd-* keys of `stats`, in beanstalkd's order.
OP_STAT_ORDER: Final = ("put", "peek", "peek-ready", "peek-delayed", "peek-buried", "reserve",
                 "reserve-with-timeout", "delete", "release", "use", "watch", "ignore", "bury",
                 "kick", "touch", "stats", "stats-job", "stats-tube", "list-tubes", "list-tube-used",
                 "list-tubes-watched", "pause-tube")


@dataclass(frozen=True)
class HostFacts:
    """What `stats` says about this broker process and its host."""

    instance_id: str
    hostname: str
    os_version: str
    machine: str

    @classmethod
    def of_this_host(cls) -> HostFacts:
        uname = platform.uname()
        return cls(os.urandom(8).hex(), socket.gethostname(), uname.version, uname.machine)


def stats_job(queue: Queue, client: Client, job_id: int) -> bytes:
    job = queue.jobs.get(job_id)
    if job is None or job.state == INVALID:
        return p.NOT_FOUND
    now = queue.clock()
    time_left = _trunc_div(job.deadline - now, NS) if job.state in (RESERVED, DELAYED) else 0
    return p.yaml_ok(
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


def stats_tube(queue: Queue, client: Client, name: str) -> bytes:
    tube = queue.tube_by_name.get(name)
    if tube is None:
        return p.NOT_FOUND
    time_left = _trunc_div(tube.unpause_at - queue.clock(), NS) if tube.pause else 0
    return p.yaml_ok(
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


def stats(queue: Queue, client: Client) -> bytes:
    """The server-wide `stats`: beanstalkd's keys in its order, then ours (--extended-stats)."""
    lines = ["---", *_job_counts(queue)]
    counts = queue.counted_ops()
    lines += [f"cmd-{op}: {counts[op]}" for op in OP_STAT_ORDER]
    lines += _server_lines(queue)
    if queue.extra_stats is not None:
        lines += [f"{key}: {value}" for key, value in queue.extra_stats().items()]
    return p.yaml_ok("\n".join(lines) + "\n")


def _job_counts(queue: Queue) -> list[str]:
    urgent, ready, reserved, delayed, buried = queue.job_counts()
    return [
        f"current-jobs-urgent: {urgent}",
        f"current-jobs-ready: {ready}",
        f"current-jobs-reserved: {reserved}",
        f"current-jobs-delayed: {delayed}",
        f"current-jobs-buried: {buried}",
    ]


def _server_lines(queue: Queue) -> list[str]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    binlog = queue.listener.stats()
    host = queue.host
    return [
        f"job-timeouts: {queue.timeout_ct}",
        f"total-jobs: {queue.jobs_created()}",
        f"max-job-size: {queue.max_job_size}",
        f"current-tubes: {len(queue.tubes)}",
        f"current-connections: {queue.cur_conns}",
        f"current-producers: {queue.producers}",
        f"current-workers: {queue.workers}",
        f"current-waiting: {queue.waiting_ct}",
        f"total-connections: {queue.tot_conns}",
        f"pid: {os.getpid()}",
        f'version: "{VERSION}"',
        f"rusage-utime: {_rusage(ru.ru_utime)}",
        f"rusage-stime: {_rusage(ru.ru_stime)}",
        f"uptime: {(queue.clock() - queue.started) // NS}",
        f"binlog-oldest-index: {binlog.get('oldest-index', 0)}",
        f"binlog-current-index: {binlog.get('current-index', 0)}",
        f"binlog-records-migrated: {binlog.get('records-migrated', 0)}",
        f"binlog-records-written: {binlog.get('records-written', 0)}",
        f"binlog-max-size: {binlog.get('max-size', queue.binlog_max_size)}",
        f"draining: {'true' if queue.draining else 'false'}",
        f"id: {host.instance_id}",
        f"hostname: {host.hostname}",
        f"os: {host.os_version}",
        f"platform: {host.machine}",
    ]


def _trunc_div(a: int, b: int) -> int:
    """C integer division (truncates toward zero)."""
    q = abs(a) // b
    return q if a >= 0 else -q


def _rusage(seconds: float) -> str:
    whole = int(seconds)
    micros = round((seconds - whole) * 1_000_000)
    if micros >= 1_000_000:
        whole, micros = whole + 1, micros - 1_000_000
    return f"{whole}.{micros:06d}"
