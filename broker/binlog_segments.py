"""The binlog's segments and their space (beanstalkd's walg.c): the current segment and its
buffer, the spare, rotation, room checks, flush and fdatasync, compaction.

:class:`SegmentLog` is the base of :class:`broker.binlog.Binlog`, which adds the queue
listener (the records of put / update / reserve / delete), opening, recovery and stats.
A base class rather than a collaborator object: the write path reads and updates the
segment fields (``_pos``, ``_alloc``, ``_spare_room``, ``_live``) inline for every record,
and keeping them attributes of ``self`` costs nothing there. Nothing here calls up into
the listener. The guarantees (segment order, compaction order, the delete reserve) are
described in :mod:`broker.binlog`.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from array import array
from collections.abc import Sequence
from typing import Final

from broker import binlog_format as fmt
from broker.binlog_file import BinlogDir, BinlogError, FsyncThread, say, write_all
from broker.queue import DELAYED, Job, Queue, QueueListener

# Final: compiled, these are C constants, not a module dict lookup on every use
NS: Final = 1_000_000_000
SLACK: Final = 512  # room kept beyond the delete reserve: next segment header, fragmentation
CHUNK: Final = 1 << 20  # a segment is allocated (posix_fallocate) 1 MiB at a time, up to -s bytes
MIGRATE_BUDGET: Final = 256 * 1024  # bytes of records moved forward per reply batch at most
REBASE_RETRY: Final = 1.0  # seconds between two attempts to rebuild the log while the disk fails
DEL: Final = fmt.DELETE_RECORD_SIZE
FIXED: Final = fmt.JOB_RECORD_FIXED


class SegmentLog(QueueListener):
    """The segment files of one binlog directory and the space in them.

    A :class:`QueueListener` only so that :class:`broker.binlog.Binlog` has one base: compiled
    (mypyc), a class may extend only one other compiled class.
    """

    def __init__(self, files: BinlogDir, segment_size: int) -> None:
        self.files = files
        self.dir = files.path
        self.fsync_count = 0
        self.writes = 0  # os.write calls of records (one per reply batch, see Binlog.group_commit)
        self.fsync_seconds = 0.0
        self.seg_size = max(int(segment_size), fmt.HEADER_SIZE + 1024)
        self._chunk = min(self.seg_size, CHUNK)  # segments are allocated this much at a time
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
        self._maint = False
        # durability
        self._dirty = False  # written since the last fdatasync
        self._must_sync = False  # ...and among it a change that -f 0 must sync before replying
        self._fd_lock = threading.Lock()
        self._fsync_thread: FsyncThread | None = None  # not `_thread`: compiled, that is C's `__thread`
        self._write_error: str | None = None
        # An I/O error left the log untrustworthy (what reached the disk is unknown): new jobs
        # are refused and no change is acknowledged until _rebase has written a new base.
        self._suspect = False
        self._rebase_at = 0.0
        self._acked = 0  # records_written when sync_point last let replies go
        self._unlogged = False  # a change left unlogged since then (the log failing): no reply may go
        self._base_pending = 0  # a base still named *.base: the segments it replaces are not all gone
        self.io_errors = 0  # failed writes and fsyncs (the metrics endpoint)
        self.rebuilds = 0  # bases written after an I/O error
        self.records_written = 0  # beanstalkd's count: reserve records are not in it
        self.records_migrated = 0

    def _drop_empty_segments(self) -> None:
        """Old segments holding no record at all (a start with no activity) can go in any order."""
        for idx in list(self._order):
            if idx != self._cur and self._size.get(idx) == fmt.HEADER_SIZE and not self._live.get(idx):
                self.files.remove(idx)
                self._forget(idx)

    def _rebase(self, force: bool = False, damaged: Sequence[int] = ()) -> bool:
        """Write every live job into a new segment that replaces all the others; True once done.

        Why: after a failed write or fsync, which records reached the disk is unknown (the
        kernel drops the dirty pages of a failed writeback, and a retried fsync reports success
        over data that is not there): deletes as well as puts, acknowledged ones too with
        ``-f MS``. What is known is the state in memory. The base is written as
        ``*.partial`` and fsynced, renamed ``*.base`` (the commit: from then on a restart
        reads it alone, see BinlogDir.settle), then the older segments go (``damaged`` ones
        are set aside instead: --binlog-ignore-damage). Tried at most once a REBASE_RETRY
        while the disk keeps failing.
        """
        now = time.monotonic()
        if not force and now < self._rebase_at:
            return False
        self._rebase_at = now + REBASE_RETRY
        queue = self.queue
        assert queue is not None
        files = self.files
        need = fmt.HEADER_SIZE + self._live_bytes + self._nlive * DEL + SLACK
        try:
            idx = max(files.highest_index(), self._cur + 1) + 1
            fd, alloc = files.create_segment(idx, need + self._chunk, need, fmt.PARTIAL_SUFFIX)
        except OSError as exc:
            self._io_failed("creating a new segment", exc)
            return False
        if fd < 0:
            self._io_failed("creating a new segment", OSError(0, "disk full"))
            return False
        buf = bytearray(fmt.encode_header(idx, self._max_id, time.time_ns()))
        wall = self._wall_off
        ids: array[int] = array("Q")
        written = live_bytes = 0
        try:
            for job in queue.jobs.values():
                state = job.state
                tb = job.tube.name_bytes
                fmt.append_job(buf, job.id, state, job.pri, job.delay, job.ttr * NS, job.created + wall,
                               job.deadline + wall if state == DELAYED else 0, job.reserves, job.timeouts,
                               job.releases, job.buries, job.kicks, tb, job.body)
                ids.append(job.id)
                live_bytes += FIXED + len(tb) + len(job.body)
                if len(buf) >= CHUNK:
                    written += len(buf)
                    write_all(fd, buf)
            written += len(buf)
            write_all(fd, buf)
            os.fdatasync(fd)
            files.crash_point("base-written")
            files.commit_base(idx)
        except OSError as exc:  # not committed, or not durably: the older segments stand, this one goes
            os.close(fd)
            for suffix in (fmt.PARTIAL_SUFFIX, fmt.BASE_SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(files.segment(idx) + suffix)
            self._io_failed("writing a new base segment", exc)
            return False
        # Committed: the state is in the base; every older segment is garbage from here.
        spare = self._cur + 1 if self._spare_fd >= 0 else 0
        with self._fd_lock:
            old_fd, self._fd = self._fd, fd
            self._dirty = self._must_sync = False
        for stale in (old_fd, self._spare_fd):
            if stale >= 0:
                with contextlib.suppress(OSError):
                    os.close(stale)
        self._spare_fd, self._spare_room, self._spare_alloc = -1, 0, 0
        left = [*self._order, spare] if spare else list(self._order)
        failed: OSError | None = None
        try:
            while left:
                old = left[0]
                if old in damaged:
                    say(f"damaged segment set aside as {files.set_aside(old)}")
                else:
                    files.unlink(old)  # a base left from an earlier failed drop too
                    files.crash_point("base-unlinked")
                del left[0]
            files.fsync()
            files.finish_base(idx)
        except OSError as exc:
            failed = exc
        for job in queue.jobs.values():
            job.file = idx
        self._cur, self._alloc, self._pos = idx, alloc, written
        self._buf.clear()  # records not written yet: the base holds their changes
        # Segments the base replaces but that could not be removed stay listed (live 0, so
        # _drop_dead_prefix tries them again), and the base keeps its *.base name until they
        # are gone (a start in between removes them: BinlogDir.settle). Nothing is lost meanwhile:
        # the base is durable, and dropping it later removes it under either name.
        self._order = [*left, idx]
        self._live = {**dict.fromkeys(left, 0), idx: len(ids)}
        self._size = {}
        self._ids = {idx: ids}
        self._cur_ids = ids
        self._migrate_pos = {}
        self._nlive, self._live_bytes, self._disk_bytes = len(ids), live_bytes, 0
        self._maint = False
        self._spare_retry_at = 0.0
        self._base_pending = idx if failed is not None else 0
        if failed is not None:
            say(f"WARNING: could not remove the segments the new base {fmt.segment_name(idx)} replaces "
                f"({failed.strerror or failed}); tried again as old segments are dropped")
            self._maint = True
        if self._write_error is not None:
            self.rebuilds += 1
            say(f"the binlog works again: {len(ids):,} live jobs rewritten into {fmt.segment_name(idx)}, "
                f"which replaces the older segments; new jobs are accepted again")
        self._write_error = None
        self._suspect = False
        return True

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
        if self._suspect:
            return False  # nothing more goes to the old segments: the base replaces them
        if (self._spare_fd < 0 or self._spare_room < need) and not self._make_spare(need):
            return False
        # finish the current segment: everything in it on disk before anything goes to the next
        self._flush()
        if self._buf:
            return False  # the old segment cannot be finished (write error): stay on it
        try:
            os.ftruncate(self._fd, self._pos)  # give back the allocated space it will not use
        except OSError as exc:
            self._io_failed("finishing a segment", exc)
            return False
        try:
            self._sync_now()
        except OSError:
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
        reserve = self._nlive * DEL + SLACK
        want = max(self._chunk, fmt.HEADER_SIZE + need + reserve)
        try:
            fd, alloc = self.files.create_segment(self._cur + 1, want, fmt.HEADER_SIZE + need + reserve)
        except OSError as exc:  # not a full disk: an I/O error
            self._io_failed("creating the next segment", exc)
            return False
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

    def _write_full(self, job: Job, force: bool = False) -> bool:
        """Append the job's complete current state (compaction / rewrite); the job moves to the current segment."""
        tb = job.tube.name_bytes
        size = FIXED + len(tb) + len(job.body)
        if not self._fit(size, 0 if force else self._nlive * DEL + SLACK):
            return False
        state = job.state
        deadline = job.deadline + self._wall_off if state == DELAYED else 0
        fmt.append_job(self._buf, job.id, state, job.pri, job.delay, job.ttr * NS, job.created + self._wall_off,
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

    def _flush(self) -> None:
        """Write the buffer to the current segment (one os.write, normally); nothing while the log
        is failing (records written after a lost stretch would make it look damaged)."""
        buf = self._buf
        if not buf or self._suspect:
            return
        self.writes += 1
        try:
            write_all(self._fd, buf)
        except OSError as exc:
            self._dirty = True
            self._io_failed("write", exc)
            return
        self._dirty = True
        if self._fsync_thread is not None:
            self._fsync_thread.wake()

    def _io_failed(self, what: str, exc: OSError) -> None:
        """A write or fsync failed: refuse new jobs and acknowledge no change until _rebase succeeds."""
        msg = f"binlog {what} failed: {exc.strerror or exc}"
        self.io_errors += 1
        if self._write_error != msg:
            say(f"ERROR: {msg} ({self.dir}); new jobs are refused, and changes are not acknowledged, until "
                f"every live job is rewritten into a new segment (tried every {REBASE_RETRY:g}s)")
        self._write_error = msg
        self._suspect = True

    def _sync_now(self, only_if_dirty: bool = False) -> None:
        """fdatasync the current segment (the fsync thread: only if written since the last one).

        A failure marks the log failing before the lock is let go, then raises: the kernel
        reports a writeback error once, so another thread's fsync right after succeeds, and
        must find the flag set (see _drop_dead_prefix), as must a _rebase (it swaps the fd
        under this lock)."""
        with self._fd_lock:
            if self._fd >= 0 and (self._dirty or not only_if_dirty):
                self._dirty = False
                self._must_sync = False
                started = time.perf_counter()
                try:
                    os.fdatasync(self._fd)
                except OSError as exc:
                    self._io_failed("fdatasync", exc)
                    raise
                self.fsync_seconds += time.perf_counter() - started
                self.fsync_count += 1

    def _sync_dirty(self) -> None:
        """The -f MS thread's fsync (a failure is already recorded by _sync_now)."""
        with contextlib.suppress(OSError):
            self._sync_now(only_if_dirty=True)

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
                written += FIXED + len(job.body) + len(job.tube.name)
            pos += 1
        self._migrate_pos[idx] = pos
        self.files.crash_point("compact-copied")
        return True

    def _drop_dead_prefix(self) -> None:
        order = self._order
        live = self._live
        unfinished = self._base_pending and order and order[0] == self._base_pending
        if (len(order) < 2 or live[order[0]]) and not unfinished:
            return
        # the records that superseded those segments must be on disk before they go
        self._flush()
        if self._buf:
            return
        try:
            self._sync_now()
        except OSError:
            return
        if self._suspect:
            return  # an fsync failed meanwhile (the fsync thread's): this success proves nothing
        self.files.crash_point("compact-synced")
        try:
            while len(order) > 1 and not live[order[0]]:
                idx = order[0]
                self.files.unlink(idx)
                self.files.crash_point("compact-unlinked")
                self.files.fsync()
                self._forget(idx)
            if self._base_pending and order[0] == self._base_pending:
                self.files.finish_base(self._base_pending)  # every segment it replaces is gone
                self._base_pending = 0
        except OSError as exc:  # nothing is lost: the segment stays, and is tried again later
            say(f"WARNING: could not delete an old segment: {exc.strerror or exc}")

    def _forget(self, idx: int) -> None:
        self._order.remove(idx)
        self._live.pop(idx, None)
        self._disk_bytes -= self._size.pop(idx, 0)
        self._ids.pop(idx, None)
        self._migrate_pos.pop(idx, None)
        self._spare_retry_at = 0.0  # room came back: a full disk may have space again
