"""The binlog (``-b DIR``): a crash-safe write-ahead log of every job state change.

Like beanstalkd's walg.c beside file.c, the binlog is five modules: the record format
(:mod:`broker.binlog_format`, the one encoder/decoder, used by production and tests), the
files (:mod:`broker.binlog_file`: directory, lock, segment creation, fsync thread),
recovery (:mod:`broker.binlog_recovery`), the segments and their space
(:mod:`broker.binlog_segments`: current segment, spare, rotation, room checks, flush and
fsync, compaction), and this one: the queue listener that writes the records, opening,
stats and shutdown. What it guarantees, and why:

Writing. Every put, delete, release, bury, kick and TTR timeout appends one record to an
in-memory buffer (``struct.pack`` + ``zlib.crc32``; no system call). So does every
reserve (its counters survive a restart), but a reserve acknowledges nothing that must be
durable: its record never makes a reply wait for an fsync. The server calls
:meth:`Binlog.sync_point` before it writes any batch of replies: the buffer goes to the
current segment with one ``os.write``, so a reply never leaves before its record is in the
kernel (a SIGKILL loses nothing that was acknowledged, whatever the fsync mode). Then:

* ``-f 0``: ``fdatasync`` in ``sync_point`` when a change that must be durable (anything
  but a reserve) was written since the last one (group commit: one fsync per reply batch,
  before the batch is sent);
* ``-f MS``: a background thread ``fdatasync``\\ s at most every MS ms while there is
  unsynced data (``os.fdatasync`` releases the GIL);
* ``-F``: never on the write path.

Segments. Records go to ``binlog.<index>.sbl`` files of ``-s`` bytes, allocated ahead of the
writes with ``posix_fallocate``, 1 MiB at a time (a write into allocated space cannot fail
for lack of space). A live
job belongs to the segment that holds its latest full (K_JOB) record; ``job.file`` is that
index (``stats-job`` shows it, as beanstalkd does). Per-segment live counts decide when a
segment can go: segments are deleted oldest first, and only while the oldest one holds no
live job. Deleting only a prefix is what makes deletes safe: a delete record can only
disappear together with every older record of the job it deletes.

Compaction. When the log holds much more than the live jobs (more than twice the live
bytes plus two segments), the live jobs of the oldest segment are rewritten forward
(their current full state, as a K_JOB record, at the end of the current segment), a bounded
amount per reply batch so that no request stalls; once the oldest segment holds no live job
it is deleted. The order of operations keeps every instant recoverable (a kill -9 anywhere
loses nothing and resurrects nothing):

1. copies are appended to the current segment (the originals are untouched);
2. the current segment is written and ``fdatasync``\\ ed;
3. old segments are unlinked one at a time, oldest first, with an ``fsync`` of the directory
   after each unlink, so that after a power loss the surviving segments are always a
   contiguous suffix of the log (never an old put without the newer delete that killed it).

A crash before 3 leaves the originals and maybe some copies: recovery takes, for each job,
its last record in log order, and a copy is always later than the original. A new segment
is created and allocated first, the directory is fsynced, and only then is it written; its
header carries the highest job id ever issued, so ids continue above every id ever issued
even after all segments that mentioned them are gone. Unlike a snapshot-and-replay design
(small-stalk), no record is ever overwritten in place, no snapshot can be half written, and
there is no replay of old logs on top of a newer snapshot.

Space. ``job_put`` keeps enough allocated room for a delete record of every live job (as
beanstalkd reserves binlog space); when the disk is full a put raises
:class:`broker.queue.StorageFull` (the client gets OUT_OF_MEMORY) while reads, deletes and
state changes keep working. Room comes back when deletes empty old segments.

Recovery. Segments are read whole, in index order, and every record's CRC is checked. A bad
record at the end of the newest segment is a torn write from the crash: it is dropped with
a warning naming the file and offset, and the segment is truncated there. A bad record with
valid records after it, or in an older segment, is damage: the broker refuses to start and
says where; ``--binlog-ignore-damage`` starts anyway with whatever can be read (skipping to
the next valid record), writes every recovered job forward into a fresh segment and sets
the damaged files aside as ``*.damaged``. Reserved jobs come back ready. Delays and ages
keep running while the broker is down (times are stored as wall-clock time).
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from array import array
from typing import Any

from broker import binlog_format as fmt
from broker.binlog_file import BinlogDir, BinlogError, CrashHook, FsyncThread, say
from broker.binlog_recovery import RestoreTally, Scanner, ScanResult, restore_records
from broker.binlog_segments import DEL, FIXED, NS, SLACK, SegmentLog
from broker.queue import DELAYED, INVALID, Job, Queue, StorageFull
from broker.queue_restore import Restorer

__all__ = ["Binlog", "BinlogError", "open_binlog"]


class Binlog(SegmentLog):
    """The queue listener behind ``-b DIR``: writes the records; the segments and their space
    are its base, :class:`broker.binlog_segments.SegmentLog`.

    ``crash`` is the test hook of :class:`broker.binlog_file.CrashHook`; by default it is
    read from the environment when the Binlog is built (never at import).
    """

    # Every -f mode: sync_point is an os.write at least, so the replies of one loop iteration
    # share it (and its fdatasync with -f 0); beanstalkd writes once per command.
    group_commit = True

    def __init__(self, directory: str, fsync_ms: int | None = 50, segment_size: int = 10485760,
                 ignore_damage: bool = False, crash: CrashHook | None = None) -> None:
        super().__init__(BinlogDir(directory, crash if crash is not None else CrashHook.from_env()), segment_size)
        self.fsync_ms = fsync_ms
        self.waits_for_disk = fsync_ms == 0
        self.requested_size = int(segment_size)  # what -s said; stats shows it, as beanstalkd does
        self.ignore_damage = ignore_damage
        self._skipped_updates = 0
        self._recovered: ScanResult | None = None
        self._damaged: list[int] = []
        self._closed = False
        self.intact = True  # every record read back at start: no damage skipped, no torn tail (replication trusts it)

    # ------------------------------------------------------------------ opening and recovery
    def open(self) -> None:
        """Lock the directory, read and check every segment, start a new current segment."""
        self.files.open()
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            rec = Scanner(self.files, self.ignore_damage).scan()
        finally:
            if gc_was_on:
                gc.enable()
        self._recovered = rec
        self._damaged = list(rec.damaged)
        self.intact = not (rec.damaged or rec.torn)
        self._max_id = rec.max_id
        for idx in rec.segments:
            self._order.append(idx)
            self._live[idx] = 0
            self._size[idx] = rec.sizes[idx]
            self._ids[idx] = array("Q")
            self._disk_bytes += rec.sizes[idx]
        start = (max(rec.segments) + 1) if rec.segments else 1
        self._start_segment(max(start, self.files.highest_index() + 1))

    def recover(self, queue: Queue) -> None:
        """Put every recovered job back into ``queue`` (reserved jobs come back ready)."""
        self.queue = queue
        t0 = time.monotonic()
        self._wall_off = time.time_ns() - queue.clock()
        rec = self._recovered
        self._recovered = None
        if rec is None:
            return
        tally = RestoreTally(home_ids=self._ids, live=self._live)
        gc_was_on = gc.isenabled()
        gc.disable()  # a million new objects and no garbage: collections would cost more than the restore
        try:
            restorer = Restorer(queue)
            restore_records(rec, self._wall_off, tally, restorer)
            restorer.finish()
        finally:
            if gc_was_on:
                gc.enable()
        self._nlive = tally.jobs
        self._live_bytes = tally.bytes
        queue.next_id = max(queue.next_id, rec.max_id + 1)
        restore_s = time.monotonic() - t0
        if rec.segments or rec.damaged or rec.torn:
            say(f"recovered {tally.jobs:,} jobs ({tally.buried:,} buried) from {len(rec.segments)} segment(s), "
                f"{rec.records:,} records in {rec.seconds + restore_s:.2f}s "
                f"(read {rec.seconds:.2f}s, restore {restore_s:.2f}s); next job id {queue.next_id}")
        del rec
        if self._damaged:
            if not self._rebase(force=True, damaged=self._damaged):
                raise BinlogError(f"cannot rewrite the jobs recovered around damage into a new segment "
                                  f"({self._write_error})")
            say(f"rewrote {self._nlive:,} recovered jobs into {fmt.segment_name(self._cur)}")
        self._drop_empty_segments()
        self._maint = True
        self._maintain(full=True)
        # Room to log the delete of every recovered job, taken now: once the broker serves, another
        # process may take the free space, and a delete that cannot be logged comes back after a crash.
        if self._nlive and not self._fit(0, self._nlive * DEL + SLACK):
            say(f"WARNING: disk full at start: no room set aside to log the deletes of the {self._nlive:,} "
                f"recovered jobs; free some space (deleted jobs may come back after a crash until then)")

    # ------------------------------------------------------------------ listener: writes
    @property
    def write_error(self) -> str | None:
        """The last failed write or fsync, until one succeeds again: /readyz reports it."""
        return self._write_error

    def job_put(self, job: Job) -> None:
        tb = job.tube.name_bytes
        body = job.body
        size = FIXED + len(tb) + len(body)
        rem = self._alloc - self._pos
        if size > rem or rem - size + self._spare_room < (self._nlive + 1) * DEL + SLACK or self._write_error:
            self._make_room(size)
        created = job.created + self._wall_off
        delay = job.delay
        buf = self._buf
        if delay:
            fmt.append_job(buf, job.id, DELAYED, job.pri, delay, job.ttr * NS, created, created + delay,
                           0, 0, 0, 0, 0, tb, body)
        else:
            fmt.append_ready_job(buf, job.id, job.pri, job.ttr * NS, created, tb, body)
        self._pos += size
        self._must_sync = True
        idx = self._cur
        job.file = idx
        self._live[idx] += 1
        self._cur_ids.append(job.id)
        self._nlive += 1
        self._live_bytes += size
        self.records_written += 1
        if job.id > self._max_id:  # noqa: PLR1730 - a compare, not a call to max(), on the put path
            self._max_id = job.id
        if len(buf) > 1048576:
            self._flush()

    def _make_room(self, size: int) -> None:
        """Slow path of job_put: rotate, allocate a spare, or refuse the job (StorageFull)."""
        if self._write_error and not (self._suspect and self._rebase()):  # the job is not in the queue yet
            raise StorageFull(self._write_error)
        if not self._fit(size, (self._nlive + 1) * DEL + SLACK):
            raise StorageFull("binlog: disk full")

    def job_updated(self, job: Job) -> None:
        if self._suspect:
            self._unlogged = True  # the base to come holds it; no reply may acknowledge it before
            return
        if self._append_update(job):
            self._must_sync = True
            self.records_written += 1

    def job_reserved(self, job: Job) -> None:
        """Logged so that ``reserves`` survives a restart; -f 0 does not sync for it (see sync_point).

        Not counted in ``binlog-records-written``, which stays what beanstalkd (which does not
        log reserves) reports for the same commands.
        """
        if not self._suspect:
            self._append_update(job)

    def _append_update(self, job: Job) -> bool:
        state = job.state
        if state == INVALID:
            return False
        size = fmt.UPDATE_RECORD_SIZE
        reserve = self._nlive * DEL + SLACK
        if (size > self._alloc - self._pos or self._room_after(size) < reserve) and not self._fit(size, reserve):
            self._skipped_updates += 1
            if self._skipped_updates in (1, 10, 100, 1000) or not self._skipped_updates % 10000:
                say(f"WARNING: disk full: {self._skipped_updates} job state change(s) not logged "
                    f"(after a crash those jobs come back in their previous state)")
            return False
        deadline = job.deadline + self._wall_off if state == DELAYED else 0
        fmt.append_update(self._buf, job.id, state, job.pri, job.delay, deadline,
                          job.reserves, job.timeouts, job.releases, job.buries, job.kicks)
        self._pos += size
        return True

    def job_deleted(self, job: Job) -> None:
        if self._suspect:
            self._unlogged = True  # as in job_updated
        elif self._alloc - self._pos < DEL and not self._fit(DEL, 0):
            say(f"ERROR: no room to log the delete of job {job.id}; it comes back after a crash until the "
                f"segment holding it is dropped")
        else:
            fmt.append_delete(self._buf, job.id)
            self._pos += DEL
            self._must_sync = True
            self.records_written += 1
        # Counted gone either way: a segment pinned by a job nobody holds would never be dropped
        # (and dropping it is what finally keeps an unlogged delete from coming back).
        self._nlive -= 1
        self._live_bytes -= FIXED + len(job.tube.name) + len(job.body)
        home = job.file
        live = self._live
        n = live.get(home)
        if n is not None:
            live[home] = n - 1
            if n == 1 and home != self._cur and home == self._order[0]:
                self._maint = True

    # ------------------------------------------------------------------ durability
    def failing(self) -> bool:
        return self._suspect

    def sync_point(self) -> bool:
        """Before replies go out: every record reaches the kernel (one write); with -f 0, an
        fdatasync too when a record that must be durable (not a reserve) is among them.

        False when a change among them could not be made that durable (an I/O error, and the
        new base that ends one could not be written yet): the server then sends none of the
        held replies and closes their connections, so that no client takes such a change
        for done (its outcome is unknown to the client, as after a crash).
        """
        if not self._suspect:
            if self._maint:
                self._maintain()
            if self._buf:
                self._flush()
            if self.fsync_ms == 0 and self._must_sync and self._dirty and not self._suspect:
                with contextlib.suppress(OSError):  # recorded by _sync_now
                    self._sync_now()
        changed = self.records_written != self._acked or self._unlogged
        self._acked = self.records_written
        self._unlogged = False
        if not self._suspect or self._rebase():
            return True
        self._pos -= len(self._buf)  # never written: the base that ends the failure holds their changes
        self._buf.clear()
        return not changed

    def start_thread(self) -> None:
        if self.fsync_ms and self._fsync_thread is None:
            self._fsync_thread = FsyncThread(self.fsync_ms, self._sync_dirty)
            self._fsync_thread.start()

    # ------------------------------------------------------------------ stats, shutdown
    def stats(self) -> dict[str, Any]:
        return {
            "oldest-index": self._order[0] if self._order else 0,
            "current-index": self._cur,
            "records-migrated": self.records_migrated,
            "records-written": self.records_written,
            "max-size": self.requested_size,
            "bytes": self._disk_bytes + self._pos,  # for the metrics endpoint, not `stats`
            "fsync-count": self.fsync_count,
            "io-errors": self.io_errors,
            "rebuilds": self.rebuilds,
            "writes": self.writes,
            "fsync-seconds": self.fsync_seconds,
        }

    def disk_usage(self) -> dict[str, int]:
        """For tests and benchmarks: segments, bytes of data, live jobs."""
        return {"segments": len(self._order), "bytes": self._disk_bytes + self._pos,
                "live_jobs": self._nlive, "live_bytes": self._live_bytes}

    def close(self) -> None:
        """Graceful shutdown: write, fsync, trim the current segment, drop the spare, unlock."""
        if self._closed:
            return
        self._closed = True
        if self._fsync_thread is not None:
            self._fsync_thread.stop()
        try:
            if self._suspect and self.queue is not None and not self._rebase(force=True):
                say("ERROR: shutting down with a binlog that could not be rewritten after an I/O error; "
                    "the next start reads what reached the disk")
            if self._fd >= 0:
                try:
                    if not self._suspect:
                        self._flush()
                        os.ftruncate(self._fd, self._pos)
                        self._sync_now()
                finally:
                    with self._fd_lock:
                        os.close(self._fd)
                        self._fd = -1
            if self._spare_fd >= 0:
                os.close(self._spare_fd)
                self._spare_fd = -1
                self.files.unlink(self._cur + 1)
            self.files.close()
        except OSError as exc:  # a failing disk at shutdown: say so, as the rest of the run did
            say(f"ERROR: the binlog could not be closed cleanly: {exc.strerror or exc}; "
                f"the next start reads what reached the disk")
            self.files.abandon()

    def abandon(self) -> None:
        """For tests: drop everything the way SIGKILL does (what was buffered is lost, nothing
        is fsynced or trimmed)."""
        if self._fsync_thread is not None:
            self._fsync_thread.stopping = True
        for fd in (self._fd, self._spare_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._spare_fd = -1
        self.files.abandon()
        self._closed = True


def open_binlog(directory: str, fsync_ms: int | None = 50, segment_size: int = 10485760,
                ignore_damage: bool = False, crash: CrashHook | None = None) -> Binlog:
    """Open (and scan) the binlog in ``directory``; raises BinlogError with a clear message if it cannot."""
    log = Binlog(directory, fsync_ms=fsync_ms, segment_size=segment_size, ignore_damage=ignore_damage, crash=crash)
    try:
        log.open()
    except BaseException:
        log.close()
        raise
    log.start_thread()
    return log
