"""The binlog (``-b DIR``): a crash-safe write-ahead log of every job state change.

Like beanstalkd's walg.c beside file.c, the binlog is four modules: the record format
(:mod:`broker.binlog_format`, the one encoder/decoder, used by production and tests), the
files (:mod:`broker.binlog_file`: directory, lock, segment creation, fsync thread),
recovery (:mod:`broker.binlog_recovery`), and this one: the queue listener that writes
records, and the segments and space management (current segment, spare, rotation,
compaction). What it guarantees, and why:

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

import gc
import os
import threading
import time
from array import array
from typing import Any

from broker import binlog_format as fmt
from broker.binlog_file import (
    BinlogDir,
    BinlogError,
    CrashHook,
    FsyncThread,
    say,
    write_all,
)
from broker.binlog_recovery import RestoreTally, Scanner, ScanResult, restore_records
from broker.queue import DELAYED, INVALID, Job, Queue, QueueListener, StorageFull
from broker.queue_restore import restore_jobs

__all__ = ["Binlog", "BinlogError", "open_binlog"]

NS = 1_000_000_000
SLACK = 512  # room kept beyond the delete reserve: next segment header, fragmentation
CHUNK = 1 << 20  # a segment is allocated (posix_fallocate) 1 MiB at a time, up to -s bytes
MIGRATE_BUDGET = 256 * 1024  # bytes of records moved forward per reply batch at most
_DEL = fmt.DELETE_RECORD_SIZE
_FIXED = fmt.JOB_RECORD_FIXED
_append_job = fmt.append_job
_append_update = fmt.append_update
_append_delete = fmt.append_delete


class Binlog(QueueListener):
    """The queue listener behind ``-b DIR``: writes records, owns the segments and their space.

    ``crash`` is the test hook of :class:`broker.binlog_file.CrashHook`; by default it is
    read from the environment when the Binlog is built (never at import).
    """

    def __init__(self, directory: str, fsync_ms: int | None = 50, segment_size: int = 10485760,
                 ignore_damage: bool = False, crash: CrashHook | None = None) -> None:
        self.files = BinlogDir(directory, crash if crash is not None else CrashHook.from_env())
        self.dir = self.files.path
        self.fsync_ms = fsync_ms
        self.syncs_every_reply = fsync_ms == 0
        self.fsync_count = 0
        self.fsync_seconds = 0.0
        self.requested_size = int(segment_size)  # what -s said; stats shows it, as beanstalkd does
        self.seg_size = max(int(segment_size), fmt.HEADER_SIZE + 1024)
        self._chunk = min(self.seg_size, CHUNK)  # segments are allocated this much at a time
        self.ignore_damage = ignore_damage
        self.queue: Queue | None = None
        self._wall_off = time.time_ns() - time.monotonic_ns()
        # current segment
        self._fd = -1
        self._cur = 0
        self._pos = 0  # logical end of the current segment (written + buffered)
        self._alloc = 0  # bytes allocated for it
        self._buf = bytearray()
        # spare (next) segment, created only when the delete reserve needs it
        self._spare_fd = -1
        self._spare_room = 0  # allocated bytes usable for records (0: no spare)
        self._spare_alloc = 0
        self._spare_retry_at = 0.0
        # per-segment bookkeeping (every existing segment, the current one included)
        self._order: list[int] = []  # ascending
        self._live: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self._ids: dict[int, array[int]] = {}
        self._cur_ids: array[int] = array("Q")
        self._migrate_pos: dict[int, int] = {}
        self._nlive = 0
        self._live_bytes = 0
        self._disk_bytes = 0  # record bytes in all segments but the current one
        self._max_id = 0
        self._tube_bytes: dict[str, bytes] = {}
        self._maint = False
        # durability
        self._dirty = False  # written since the last fdatasync
        self._must_sync = False  # ...and among it a change that -f 0 must sync before replying
        self._fd_lock = threading.Lock()
        self._thread: FsyncThread | None = None
        self._write_error: str | None = None
        self._skipped_updates = 0
        # stats
        self.records_written = 0  # beanstalkd's count: reserve records are not in it
        self.reserves_written = 0
        self.records_migrated = 0
        self._recovered: ScanResult | None = None
        self._damaged: list[int] = []
        self._closed = False

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
            restore_jobs(queue, restore_records(rec, self._wall_off, tally))
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
            self._rewrite_all_forward(self._damaged)
        self._drop_empty_segments()
        self._maint = True
        self._maintain(full=True)

    def _drop_empty_segments(self) -> None:
        """Old segments holding no record at all (a start with no activity) can go in any order."""
        for idx in list(self._order):
            if idx != self._cur and self._size.get(idx) == fmt.HEADER_SIZE and not self._live.get(idx):
                self.files.remove(idx)
                self._forget(idx)

    def _rewrite_all_forward(self, damaged: list[int]) -> None:
        """After --binlog-ignore-damage: write every live job into the current segment, set damaged files aside."""
        assert self.queue is not None
        moved = 0
        for job in list(self.queue.jobs.values()):
            if job.file != self._cur:
                self._write_full(job, force=True)
                moved += 1
        self._flush()
        self._sync_now()
        for idx in damaged:
            aside = self.files.set_aside(idx)
            if idx in self._live:
                self._forget(idx)
            say(f"damaged segment set aside as {aside}")
        say(f"rewrote {moved:,} recovered jobs into {fmt.segment_name(self._cur)}")

    # ------------------------------------------------------------------ segments
    def _start_segment(self, idx: int) -> None:
        """Create, allocate and start writing segment ``idx`` (used at open)."""
        fd, alloc = self.files.create_segment(idx, self._chunk, fmt.HEADER_SIZE + SLACK)
        if fd < 0:
            raise BinlogError(f"cannot allocate a binlog segment in {self.dir}: disk full")
        self._activate(fd, idx, alloc)
        self._flush()
        self._sync_now()

    def _activate(self, fd: int, idx: int, alloc: int) -> None:
        """Make ``fd`` the current segment; its header (with the max id so far) goes first."""
        with self._fd_lock:
            self._fd = fd
        self._cur = idx
        self._alloc = alloc
        self._buf += fmt.encode_header(idx, self._max_id, time.time_ns())
        self._must_sync = True
        self._pos = fmt.HEADER_SIZE
        self._order.append(idx)
        self._live[idx] = 0
        self._cur_ids = self._ids[idx] = array("Q")

    def _rotate(self, need: int) -> bool:
        """Switch to the next segment, which must have room for a ``need``-byte record."""
        if (self._spare_fd < 0 or self._spare_room < need) and not self._make_spare(need):
            return False
        # finish the current segment: everything in it on disk before anything goes to the next
        self._flush()
        if self._buf:
            return False  # the old segment cannot be finished (write error): stay on it
        try:
            os.ftruncate(self._fd, self._pos)  # give back the allocated space it will not use
            self._sync_now()
        except OSError as exc:
            self._io_failed("finishing a segment", exc)
            return False
        self.files.crash_point("rotate-old-synced")
        old = self._fd
        self._size[self._cur] = self._pos
        self._disk_bytes += self._pos
        fd, alloc = self._spare_fd, self._spare_alloc
        self._spare_fd, self._spare_room, self._spare_alloc = -1, 0, 0
        self._activate(fd, self._cur + 1, alloc)
        os.close(old)
        self._maint = True
        return True

    def _make_spare(self, need: int) -> bool:
        """Allocate the next segment ahead of time (for the delete reserve, or for a rotation)."""
        if self._spare_fd >= 0:
            want = fmt.HEADER_SIZE + need + self._chunk  # headroom: not a fallocate per put
            try:
                os.posix_fallocate(self._spare_fd, 0, want)
            except OSError:
                return False
            self._spare_alloc = max(self._spare_alloc, want)
            self._spare_room = self._spare_alloc - fmt.HEADER_SIZE
            return True
        now = time.monotonic()
        if now < self._spare_retry_at:
            return False
        reserve = self._nlive * _DEL + SLACK
        want = max(self._chunk, fmt.HEADER_SIZE + need + reserve)
        fd, alloc = self.files.create_segment(self._cur + 1, want, fmt.HEADER_SIZE + need + reserve)
        if fd < 0:
            self._spare_retry_at = now + 0.5  # full disk: do not retry on every put
            return False
        self._spare_fd, self._spare_alloc, self._spare_room = fd, alloc, alloc - fmt.HEADER_SIZE
        return True

    def _grow(self, upto: int) -> None:
        """Allocate more of the current segment (a chunk at a time, never beyond -s bytes)."""
        target = min(self.seg_size, max(self._alloc + self._chunk, upto))
        if target > self._alloc:
            try:
                os.posix_fallocate(self._fd, 0, target)
                self._alloc = target
            except OSError:
                pass  # full disk: the caller rotates into the spare or refuses

    def _fit(self, size: int, reserve: int) -> bool:
        """Make room for a ``size``-byte record that leaves ``reserve`` allocated bytes; False: no room on disk."""
        if size > self._alloc - self._pos:
            self._grow(self._pos + size)
            if size > self._alloc - self._pos and not self._rotate(size):
                return False
        if reserve and self._room_after(size) < reserve:
            self._grow(self._pos + size + reserve)
            if self._room_after(size) < reserve:
                self._make_spare(reserve + size)
                if self._room_after(size) < reserve:
                    return False
        return True

    def _room_after(self, size: int) -> int:
        """Allocated room left for records after writing a ``size``-byte record (rotating if needed)."""
        rem = self._alloc - self._pos
        if size <= rem:
            return rem - size + self._spare_room
        return self._spare_room - size

    # ------------------------------------------------------------------ listener: writes
    def _tube_name(self, job: Job) -> bytes:
        name = job.tube.name
        tb = self._tube_bytes.get(name)
        if tb is None:
            tb = self._tube_bytes[name] = name.encode("latin-1")
        return tb

    def job_put(self, job: Job) -> None:
        name = job.tube.name
        tb = self._tube_bytes.get(name)
        if tb is None:
            tb = self._tube_bytes[name] = name.encode("latin-1")
        body = job.body
        size = _FIXED + len(tb) + len(body)
        rem = self._alloc - self._pos
        if size > rem or rem - size + self._spare_room < (self._nlive + 1) * _DEL + SLACK or self._write_error:
            self._make_room(size)
        created = job.created + self._wall_off
        delay = job.delay
        buf = self._buf
        if delay:
            _append_job(buf, job.id, DELAYED, job.pri, delay, job.ttr * NS, created, created + delay,
                        0, 0, 0, 0, 0, tb, body)
        else:
            _append_job(buf, job.id, 0, job.pri, 0, job.ttr * NS, created, 0, 0, 0, 0, 0, 0, tb, body)
        self._pos += size
        self._must_sync = True
        idx = self._cur
        job.file = idx
        self._live[idx] += 1
        self._cur_ids.append(job.id)
        self._nlive += 1
        self._live_bytes += size
        self.records_written += 1
        self._max_id = max(self._max_id, job.id)
        if len(buf) > 1048576:
            self._flush()

    def _make_room(self, size: int) -> None:
        """Slow path of job_put: rotate, allocate a spare, or refuse the job (StorageFull)."""
        if self._write_error:
            raise StorageFull(self._write_error)
        if not self._fit(size, (self._nlive + 1) * _DEL + SLACK):
            raise StorageFull("binlog: disk full")

    def _write_full(self, job: Job, force: bool = False) -> bool:
        """Append the job's complete current state (compaction / rewrite); the job moves to the current segment."""
        tb = self._tube_name(job)
        size = _FIXED + len(tb) + len(job.body)
        if not self._fit(size, 0 if force else self._nlive * _DEL + SLACK):
            return False
        state = job.state
        deadline = job.deadline + self._wall_off if state == DELAYED else 0
        _append_job(self._buf, job.id, state, job.pri, job.delay, job.ttr * NS, job.created + self._wall_off,
                    deadline, job.reserves, job.timeouts, job.releases, job.buries, job.kicks, tb, job.body)
        self._pos += size
        self._must_sync = True
        old = job.file
        idx = self._cur
        if old != idx:
            live = self._live
            if old in live:
                live[old] -= 1
            live[idx] += 1
            self._cur_ids.append(job.id)
            job.file = idx
        self.records_written += 1
        return True

    def job_updated(self, job: Job) -> None:
        if self._append_update(job):
            self._must_sync = True
            self.records_written += 1

    def job_reserved(self, job: Job) -> None:
        """Logged so that ``reserves`` survives a restart; -f 0 does not sync for it (see sync_point).

        Not counted in ``binlog-records-written``, which stays what beanstalkd (which does not
        log reserves) reports for the same commands.
        """
        if self._append_update(job):
            self.reserves_written += 1

    def _append_update(self, job: Job) -> bool:
        state = job.state
        if state == INVALID:
            return False
        size = fmt.UPDATE_RECORD_SIZE
        reserve = self._nlive * _DEL + SLACK
        if (size > self._alloc - self._pos or self._room_after(size) < reserve) and not self._fit(size, reserve):
            self._skipped_updates += 1
            if self._skipped_updates in (1, 10, 100, 1000) or not self._skipped_updates % 10000:
                say(f"WARNING: disk full: {self._skipped_updates} job state change(s) not logged "
                    f"(after a crash those jobs come back in their previous state)")
            return False
        deadline = job.deadline + self._wall_off if state == DELAYED else 0
        _append_update(self._buf, job.id, state, job.pri, job.delay, deadline,
                       job.reserves, job.timeouts, job.releases, job.buries, job.kicks)
        self._pos += size
        return True

    def job_deleted(self, job: Job) -> None:
        if _DEL > self._alloc - self._pos and not self._fit(_DEL, 0):
            say(f"ERROR: no room to log the delete of job {job.id}; it would come back after a crash")
            return
        _append_delete(self._buf, job.id)
        self._pos += _DEL
        self._must_sync = True
        self.records_written += 1
        self._nlive -= 1
        self._live_bytes -= _FIXED + len(job.tube.name) + len(job.body)
        home = job.file
        live = self._live
        n = live.get(home)
        if n is not None:
            live[home] = n - 1
            if n == 1 and home != self._cur and home == self._order[0]:
                self._maint = True

    # ------------------------------------------------------------------ durability
    def sync_point(self) -> None:
        """Before replies go out: every record reaches the kernel (one write); with -f 0, an
        fdatasync too when a record that must be durable (not a reserve) is among them."""
        if self._maint:
            self._maintain()
        if self._buf:
            self._flush()
        if self.fsync_ms == 0 and self._must_sync and self._dirty:
            try:
                self._sync_now()
            except OSError as exc:
                self._io_failed("fdatasync", exc)

    def _flush(self) -> None:
        """Write the buffer to the current segment (one os.write, normally)."""
        buf = self._buf
        if not buf:
            return
        try:
            write_all(self._fd, buf)
        except OSError as exc:
            self._dirty = True
            msg = f"binlog write failed: {exc.strerror}"
            if self._write_error is None:
                say(f"ERROR: {msg} ({self.files.segment(self._cur)}); new jobs are refused until writing works again")
            self._write_error = msg
            return
        self._write_error = None
        self._dirty = True
        if self._thread is not None:
            self._thread.wake()

    def _io_failed(self, what: str, exc: OSError) -> None:
        """An fsync or file operation failed: say so, refuse new jobs until a write works again."""
        msg = f"binlog {what} failed: {exc.strerror or exc}"
        if self._write_error != msg:
            say(f"ERROR: {msg} ({self.dir}); new jobs are refused until writing works again")
        self._write_error = msg

    def _sync_now(self, only_if_dirty: bool = False) -> None:
        """fdatasync the current segment (the fsync thread: only if written since the last one)."""
        with self._fd_lock:
            if self._fd >= 0 and (self._dirty or not only_if_dirty):
                self._dirty = False
                self._must_sync = False
                started = time.perf_counter()
                os.fdatasync(self._fd)
                self.fsync_seconds += time.perf_counter() - started
                self.fsync_count += 1

    def _sync_dirty(self) -> None:
        self._sync_now(only_if_dirty=True)

    def start_thread(self) -> None:
        if self.fsync_ms and self._thread is None:
            self._thread = FsyncThread(self.fsync_ms, self._sync_dirty)
            self._thread.start()

    # ------------------------------------------------------------------ space reclaim
    def _needs_compaction(self) -> bool:
        return len(self._order) > 1 and self._disk_bytes + self._pos > 2 * self._live_bytes + 2 * self.seg_size

    def _maintain(self, full: bool = False) -> None:
        """Delete dead old segments; move live jobs out of the oldest one when the log is mostly garbage."""
        self._maint = False
        while True:
            self._drop_dead_prefix()
            if self.queue is None or not self._needs_compaction():
                return
            oldest = self._order[0]
            if not self._migrate(self.queue, oldest, 1 << 62 if full else MIGRATE_BUDGET):
                self._maint = True  # more to move: go on at the next reply batch
                return
            if self._live.get(oldest):
                return  # no room to move everything
            if not full:
                self._drop_dead_prefix()
                self._maint = self._needs_compaction()
                return

    def _migrate(self, queue: Queue, idx: int, budget: int) -> bool:
        """Rewrite forward the live jobs of segment ``idx``; True when none is left there."""
        ids = self._ids.get(idx)
        if ids is None:
            return True
        jobs = queue.jobs
        pos = self._migrate_pos.get(idx, 0)
        written = 0
        while pos < len(ids):
            if written >= budget:
                self._migrate_pos[idx] = pos
                return False
            job = jobs.get(ids[pos])
            if job is not None and job.file == idx:
                if not self._write_full(job):
                    self._migrate_pos[idx] = pos
                    return False
                self.records_migrated += 1
                written += _FIXED + len(job.body) + len(job.tube.name)
            pos += 1
        self._migrate_pos[idx] = pos
        self.files.crash_point("compact-copied")
        return True

    def _drop_dead_prefix(self) -> None:
        order = self._order
        live = self._live
        if len(order) < 2 or live[order[0]]:
            return
        # the records that superseded those segments must be on disk before they go
        self._flush()
        if self._buf:
            return
        try:
            self._sync_now()
            self.files.crash_point("compact-synced")
            while len(order) > 1 and not live[order[0]]:
                idx = order[0]
                self.files.unlink(idx)
                self.files.crash_point("compact-unlinked")
                self.files.fsync()
                self._forget(idx)
        except OSError as exc:
            self._io_failed("deleting an old segment", exc)

    def _forget(self, idx: int) -> None:
        self._order.remove(idx)
        self._live.pop(idx, None)
        self._disk_bytes -= self._size.pop(idx, 0)
        self._ids.pop(idx, None)
        self._migrate_pos.pop(idx, None)
        self._spare_retry_at = 0.0  # room came back: a full disk may have space again

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
        if self._thread is not None:
            self._thread.stop()
        try:
            if self._fd >= 0:
                self._flush()
                os.ftruncate(self._fd, self._pos)
                self._sync_now()
                with self._fd_lock:
                    os.close(self._fd)
                    self._fd = -1
            if self._spare_fd >= 0:
                os.close(self._spare_fd)
                self._spare_fd = -1
                self.files.unlink(self._cur + 1)
        finally:
            self.files.close()

    def abandon(self) -> None:
        """For tests: drop everything the way SIGKILL does (what was buffered is lost, nothing
        is fsynced or trimmed)."""
        if self._thread is not None:
            self._thread.stopping = True
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
