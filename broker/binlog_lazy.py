"""Recovered ready jobs made on first use, from the segment bytes recovery read (interpreted build).

A recovery that makes a Python object per job cannot go below ~14,000 interpreted instructions
a job (bench/README.md, "The interpreted recovery"): most of it is the job object and its body.
So the interpreted recovery's batch loop (:meth:`broker.binlog_recovery._Decoder.segment_batch`)
makes no job for a plain ready one: it queues the job's heap entry, counts it, and stores in the
queue's :class:`broker.jobtable.JobTable` only the place of its K_JOB record, ``(n << 40) | offset``
with ``n`` the segment's position in the scan. :meth:`LazyJobs.make` decodes that record when
the job is first looked up (a reserve, peek, stats-job, delete, compaction...). The job comes out
as the per-record restore makes it. A segment's bytes are let go once none of its jobs is left
unmade.
"""
from __future__ import annotations

from typing import Final

from broker import binlog_format as fmt
from broker.model import NS, READY, Job, Tube, new_job, shared_int
from broker.queue_restore import recovered_created

LOC_BITS: Final = 40
LOC_MASK: Final = (1 << LOC_BITS) - 1


class LazyJobs:
    """The loader of the queue's lazy jobs: the segment bytes and tubes they are made from."""

    def __init__(self, pool: dict[int, int], wall_off: int) -> None:
        self.pool = pool  # the queue's shared ints (priorities, TTRs)
        self.wall_off = wall_off
        self.datas: dict[int, bytes] = {}  # segment position -> its bytes, while jobs there are unmade
        self.homes: dict[int, int] = {}  # segment position -> the segment index a made job's `file` is
        self.left: dict[int, int] = {}  # segment position -> jobs there not made yet
        self.tubes: dict[bytes, Tube] = {}  # tube name as in the log -> its tube
        self.filling = -1  # the segment being restored: kept even when all its jobs so far are made

    def hold(self, seg_no: int, data: bytes, home: int) -> None:
        """Segment ``seg_no`` (``home`` its index) may have lazy jobs: keep its bytes."""
        self.datas[seg_no] = data
        self.homes[seg_no] = home
        self.left[seg_no] = 0
        self.filling = seg_no

    def add(self, seg_no: int, count: int, tube_bytes: bytes, tube: Tube) -> None:
        """``count`` lazy jobs of tube ``tube`` (named ``tube_bytes`` in the log) in segment ``seg_no``."""
        self.left[seg_no] += count
        self.tubes[tube_bytes] = tube

    def release_unused(self, seg_no: int) -> None:
        """After the restore of segment ``seg_no``: let its bytes go if it has no lazy job."""
        self.filling = -1
        if not self.left.get(seg_no):
            self._drop(seg_no)

    def make(self, job_id: int, loc: int) -> Job:
        """The ready job whose K_JOB record is at ``loc``, as the per-record restore makes it."""
        seg_no = loc >> LOC_BITS
        pos = loc & LOC_MASK
        data = self.datas[seg_no]
        (length, _, _, pri, _, ttr, created, _, _, _, _, _, _, tube_len) = fmt.job_fields(data, pos)
        tstart = pos + fmt.JOB_RECORD_FIXED
        bstart = tstart + tube_len
        pool = self.pool  # as Restorer.add: an int past the small-int cache shared by every job
        if pri > 256:
            pri = shared_int(pool, pri)
        ttr //= NS
        if ttr > 256:
            ttr = shared_int(pool, ttr)
        job = new_job(job_id, self.tubes[data[tstart:bstart]], pri, ttr, data[bstart:pos + fmt.FRAME_SIZE + length],
                      recovered_created(created, self.wall_off), READY, self.homes[seg_no])
        left = self.left[seg_no] - 1
        self.left[seg_no] = left
        if not left and seg_no != self.filling:
            self._drop(seg_no)
        return job

    def _drop(self, seg_no: int) -> None:
        self.datas.pop(seg_no, None)
        self.homes.pop(seg_no, None)
        self.left.pop(seg_no, None)
