"""One queue listener that feeds several: the binlog first, then the replication stream.

The queue has one listener; a member needs its changes in its own binlog and, while it
leads, in the stream to its replicas. The binlog goes first so that a put it refuses
(disk full) never reaches a replica.
"""
from __future__ import annotations

from collections.abc import Callable

from broker.queue import Job, Queue, QueueListener, Tube


class Fanout(QueueListener):
    def __init__(self, *listeners: QueueListener, before_close: Callable[[], None] | None = None,
                 after_close: Callable[[], None] | None = None) -> None:
        self.listeners = listeners
        self.before_close = before_close  # the member stops applying before the binlog closes
        self.after_close = after_close  # and records a clean shutdown once it has closed
        self.group_commit = any(item.group_commit for item in listeners)
        self.waits_for_disk = any(item.waits_for_disk for item in listeners)

    def job_put(self, job: Job) -> None:
        for item in self.listeners:
            item.job_put(job)

    def job_updated(self, job: Job) -> None:
        for item in self.listeners:
            item.job_updated(job)

    def job_reserved(self, job: Job) -> None:
        for item in self.listeners:
            item.job_reserved(job)

    def job_deleted(self, job: Job) -> None:
        for item in self.listeners:
            item.job_deleted(job)

    def tube_paused(self, tube: Tube) -> None:
        for item in self.listeners:
            item.tube_paused(tube)

    def stats(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for item in self.listeners:
            merged.update(item.stats())
        return merged

    def recover(self, queue: Queue) -> None:
        for item in self.listeners:
            item.recover(queue)

    def failing(self) -> bool:
        return any(item.failing() for item in self.listeners)

    def sync_point(self) -> bool:
        ok = True
        for item in self.listeners:
            if not item.sync_point():
                ok = False
        return ok

    def close(self) -> None:
        if self.before_close is not None:
            self.before_close()
        for item in self.listeners:
            item.close()
        if self.after_close is not None:
            self.after_close()
