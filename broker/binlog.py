"""The binlog (``-b DIR``): a crash-safe write-ahead log of every job state change.

The record format is in :mod:`broker.binlog_format`. This module is the queue listener that
writes it, recovers from it at start, and reclaims space. What it guarantees, and why:

Writing. Every put, delete, release, bury, kick and TTR timeout appends one record to an
in-memory buffer (``struct.pack`` + ``zlib.crc32``; no system call). The server calls
:meth:`Binlog.sync_point` before it writes any batch of replies: the buffer goes to the
current segment with one ``os.write``, so a reply never leaves before its record is in the
kernel (a SIGKILL loses nothing that was acknowledged, whatever the fsync mode). Then:

* ``-f 0``: ``fdatasync`` in ``sync_point`` when anything was written since the last one
  (group commit: one fsync per reply batch, before the batch is sent);
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

import errno
import fcntl
import gc
import os
import signal
import sys
import threading
import time
import zlib
from array import array

from broker import binlog_format as fmt
from broker.queue import BURIED, DELAYED, INVALID, READY, Queue, QueueListener, StorageFull

NS = 1_000_000_000
SLACK = 512  # room kept beyond the delete reserve: next segment header, fragmentation
CHUNK = 1 << 20  # a segment is allocated (posix_fallocate) 1 MiB at a time, up to -s bytes
MIGRATE_BUDGET = 256 * 1024  # bytes of records moved forward per reply batch at most
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DEL = fmt.DELETE_RECORD_SIZE
_FRAME = fmt.FRAME
_JOB = fmt.JOB
_JOB_SIZE = fmt.JOB_SIZE
_FIXED = fmt.FRAME_SIZE + fmt.JOB_SIZE
_UPDATE = fmt.UPDATE
_DELETE = fmt.DELETE
_crc32 = zlib.crc32

# Test hook: SPARK_BEANSTALK_BINLOG_CRASH="point:n" kills this process (SIGKILL) the n-th
# time it reaches ``point`` (see _crash_point calls). Used by tests/test_binlog_crash.py to
# crash at every step of a segment switch and of compaction.
_CRASH: tuple[str, int] | None = None
_crash_env = os.environ.get("SPARK_BEANSTALK_BINLOG_CRASH")
if _crash_env:
    _name, _, _count = _crash_env.partition(":")
    _CRASH = (_name, int(_count or 1))
_crash_hits: dict[str, int] = {}


def _crash_point(name: str) -> None:
    if _CRASH is not None and _CRASH[0] == name:
        n = _crash_hits.get(name, 0) + 1
        _crash_hits[name] = n
        if n >= _CRASH[1]:
            os.kill(os.getpid(), signal.SIGKILL)


def _say(message: str) -> None:
    """Recovery reports and warnings: always on stderr, whatever the log level."""
    try:
        sys.stderr.write(f"binlog: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class BinlogError(Exception):
    """The binlog cannot be opened as it is (damage, lock held, unreadable): do not start."""


class _Recovered:
    """What the scan of the existing segments found, until recover() puts it in the queue.

    Kept compact for big logs: a job is the *location* of its latest K_JOB record,
    ``(n << 40) | offset`` with ``n`` the position of its segment in ``datas`` (locations
    grow in log order, so they double as sequence numbers); its fields are decoded once,
    when it is restored.
    """

    def __init__(self) -> None:
        self.jobs: dict[int, int] = {}  # id -> location of its latest K_JOB record
        self.updates: dict[int, tuple[int, tuple]] = {}  # id -> (location, K_UPDATE fields) newer than it
        self.datas: list[bytes | None] = []  # segment contents, by position
        self.full_ids: list[array] = []  # by position: ids of the K_JOB records in that segment
        self.indexes: list[int] = []  # segment index, by position
        self.max_id = 0
        self.records = 0
        self.segments: list[int] = []  # indexes kept, ascending
        self.sizes: dict[int, int] = {}  # index -> bytes of valid data
        self.damaged: list[int] = []  # indexes with damage skipped (ignore_damage)
        self.seconds = 0.0
        self.torn: list[tuple[str, int, str]] = []


_LOC_BITS = 40
_LOC_MASK = (1 << _LOC_BITS) - 1
_ID = __import__("struct").Struct("<Q")


class Binlog(QueueListener):
    """The queue listener behind ``-b DIR``."""

    def __init__(self, directory: str, fsync_ms: int | None = 50, segment_size: int = 10485760,
                 ignore_damage: bool = False) -> None:
        self.dir = os.path.abspath(directory)
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
        self._dirfd = -1
        self._lockfd = -1
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
        self._ids: dict[int, array] = {}
        self._cur_ids: array = array("Q")
        self._migrate_pos: dict[int, int] = {}
        self._nlive = 0
        self._live_bytes = 0
        self._disk_bytes = 0  # record bytes in all segments but the current one
        self._max_id = 0
        self._tube_bytes: dict[str, bytes] = {}
        self._maint = False
        # durability
        self._dirty = False
        self._fd_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._write_error: str | None = None
        self._skipped_updates = 0
        # stats
        self.records_written = 0
        self.records_migrated = 0
        self._recovered: _Recovered | None = None
        self._damaged: list[int] = []
        self._closed = False

    # ------------------------------------------------------------------ opening
    def open(self) -> None:
        """Lock the directory, read and check every segment, start a new current segment."""
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise BinlogError(f"cannot create binlog directory {self.dir}: {exc.strerror}") from None
        if not os.path.isdir(self.dir):
            raise BinlogError(f"binlog path {self.dir} is not a directory")
        self._lock()
        self._dirfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            rec = self._scan()
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
        start = max(start, self._highest_index_on_disk() + 1)
        self._start_segment(start)

    def _lock(self) -> None:
        path = os.path.join(self.dir, "lock")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise BinlogError(f"cannot open {path}: {exc.strerror}") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise BinlogError(f"binlog directory {self.dir} is in use by another process (lock {path} is held)") from None
        self._lockfd = fd

    def _highest_index_on_disk(self) -> int:
        best = 0
        for name in os.listdir(self.dir):
            base = name[:-len(".damaged")] if name.endswith(".damaged") else name
            idx = fmt.parse_segment_name(base)
            if idx is not None and idx > best:
                best = idx
        return best

    def _path(self, idx: int) -> str:
        return os.path.join(self.dir, fmt.segment_name(idx))

    # ------------------------------------------------------------------ recovery: scan
    def _scan(self) -> _Recovered:
        t0 = time.monotonic()
        rec = _Recovered()
        indexes = sorted(i for i in (fmt.parse_segment_name(n) for n in os.listdir(self.dir)) if i is not None)
        # An unused spare (allocated, header never written) can only be the newest file.
        while indexes:
            path = self._path(indexes[-1])
            with open(path, "rb") as fh:
                head = fh.read(fmt.HEADER_SIZE)
            if head.strip(b"\0"):
                break
            if not fmt.only_zeros(_read_file(path), 0, os.path.getsize(path)):
                break
            os.unlink(path)
            indexes.pop()
            self._fsync_dir()
        total = len(indexes)
        jobs = rec.jobs
        updates = rec.updates
        seq = 0
        max_id = 0
        last_report = t0
        frame_unpack = _FRAME.unpack_from
        id_unpack = _ID.unpack_from
        update_unpack = _UPDATE.unpack_from
        crc32 = _crc32
        K_JOB, K_UPDATE, K_DELETE = fmt.K_JOB, fmt.K_UPDATE, fmt.K_DELETE
        JOB_SIZE, UPDATE_SIZE, DELETE_SIZE = fmt.JOB_SIZE, fmt.UPDATE_SIZE, fmt.DELETE_SIZE
        for n, idx in enumerate(indexes):
            path = self._path(idx)
            newest = n == total - 1
            try:
                data = _read_file(path)
            except OSError as exc:
                raise BinlogError(f"cannot read binlog segment {path}: {exc.strerror}") from None
            end = len(data)
            try:
                _version, hidx, hmax, _created = fmt.decode_header(data)
                if hidx != idx:
                    raise fmt.FormatError(0, f"header says segment {hidx}, file name says {idx}")
            except fmt.FormatError as exc:
                if newest and fmt.only_zeros(data, min(end, fmt.HEADER_SIZE), end):
                    # the header of a brand-new segment was being written: nothing in it
                    rec.torn.append((path, 0, exc.reason))
                    _say(f"WARNING: {path}: torn segment header ({exc.reason}); the segment holds no record, removed")
                    os.unlink(path)
                    self._fsync_dir()
                    continue
                self._damage(rec, path, idx, 0, exc.reason, None)
                continue  # ignore_damage: the whole segment is unreadable
            if hmax > max_id:
                max_id = hmax
            base = len(rec.datas) << _LOC_BITS
            rec.datas.append(data)
            rec.indexes.append(idx)
            seg_ids = array("Q")
            rec.full_ids.append(seg_ids)
            add_id = seg_ids.append
            mv = memoryview(data)
            pos = fmt.HEADER_SIZE
            valid_end = pos
            while True:
                if pos + 8 > end:
                    if pos < end and not fmt.only_zeros(data, pos, end):
                        pos = self._bad(rec, path, idx, data, pos, end, newest, "truncated record frame")
                        if pos < 0:
                            break
                        continue
                    break
                length, crc = frame_unpack(data, pos)
                start = pos + 8
                stop = start + length
                if length == 0:
                    if crc or not fmt.only_zeros(data, pos, end):
                        pos = self._bad(rec, path, idx, data, pos, end, newest,
                                        "zero bytes (unwritten space) followed by data")
                        if pos < 0:
                            break
                        continue
                    break
                if stop > end or crc32(mv[start:stop]) != crc:
                    pos = self._bad(rec, path, idx, data, pos, end, newest,
                                    "record length runs past the end of the file" if stop > end
                                    else "record checksum mismatch")
                    if pos < 0:
                        break
                    continue
                kind = data[start]
                if kind == K_JOB:
                    if length < JOB_SIZE or JOB_SIZE + data[start + JOB_SIZE - 1] > length:
                        pos = self._bad(rec, path, idx, data, pos, end, newest, "job record too short")
                        if pos < 0:
                            break
                        continue
                    jid = id_unpack(data, start + 1)[0]
                    jobs[jid] = base | pos
                    add_id(jid)
                    if updates:
                        updates.pop(jid, None)
                    if jid > max_id:
                        max_id = jid
                elif kind == K_UPDATE and length == UPDATE_SIZE:
                    u = update_unpack(data, start)
                    if u[1] in jobs:
                        updates[u[1]] = (base | pos, u)
                elif kind == K_DELETE and length == DELETE_SIZE:
                    jid = id_unpack(data, start + 1)[0]
                    jobs.pop(jid, None)
                    if updates:
                        updates.pop(jid, None)
                    if jid > max_id:
                        max_id = jid
                else:
                    pos = self._bad(rec, path, idx, data, pos, end, newest, f"unknown record kind {kind} or wrong length")
                    if pos < 0:
                        break
                    continue
                seq += 1
                pos = stop
                valid_end = pos
                if not seq & 0xFFFF:
                    now = time.monotonic()
                    if now - last_report >= 2.0:
                        last_report = now
                        _say(f"recovering: segment {n + 1}/{total} ({fmt.segment_name(idx)}), "
                             f"{seq:,} records read, {len(jobs):,} live jobs so far")
            del mv
            rec.segments.append(idx)
            rec.sizes[idx] = valid_end
            if rec.torn and rec.torn[-1][0] == path:
                # a torn tail: cut it off so that this segment is clean for the next start
                self._truncate(path, rec.torn[-1][1])
            elif end > valid_end and idx not in rec.damaged:
                self._truncate(path, valid_end)  # only zeros there: allocated space never written
        rec.max_id = max_id
        rec.records = seq
        rec.seconds = time.monotonic() - t0
        return rec

    def _bad(self, rec: _Recovered, path: str, idx: int, data, pos: int, end: int, newest: bool, reason: str) -> int:
        """A record that does not decode at ``pos``. Returns where to go on, or -1 to stop reading this file."""
        nxt = fmt.find_next_valid(data, pos, end)
        if nxt is None and newest:
            rec.torn.append((path, pos, reason))
            _say(f"WARNING: torn record at the end of the log dropped: {path} offset {pos} ({reason}; "
                 f"{end - pos} bytes cut off; it was being written when the broker stopped)")
            return -1
        return self._damage(rec, path, idx, pos, reason, nxt)

    def _damage(self, rec: _Recovered, path: str, idx: int, pos: int, reason: str, nxt: int | None) -> int:
        follows = "valid records follow it" if nxt is not None else "it is not in the newest segment"
        if not self.ignore_damage:
            raise BinlogError(
                f"binlog damaged: {path} at offset {pos}: {reason} ({follows}, so this is not a torn "
                f"write at the end of the log). Refusing to start rather than silently drop jobs. "
                f"To start anyway with every job that can still be read, run with --binlog-ignore-damage "
                f"(the damaged file is kept as {os.path.basename(path)}.damaged); or restore {self.dir} from a backup.")
        _say(f"WARNING: damage ignored (--binlog-ignore-damage): {path} at offset {pos}: {reason}; "
             + (f"skipping {nxt - pos} bytes to the next valid record" if nxt is not None else "rest of the file skipped"))
        if idx not in rec.damaged:
            rec.damaged.append(idx)
        return nxt if nxt is not None else -1

    def _truncate(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ recovery: restore
    def recover(self, queue: Queue) -> None:
        """Put every recovered job back into ``queue`` (reserved jobs come back ready)."""
        self.queue = queue
        t0 = time.monotonic()
        self._wall_off = time.time_ns() - queue.clock()
        rec = self._recovered
        self._recovered = None
        if rec is None:
            return
        self._restored = 0
        self._restored_buried = 0
        self._restored_bytes = 0
        bulk = getattr(queue, "restore_jobs", None)
        gc_was_on = gc.isenabled()
        gc.disable()  # a million new objects and no garbage: collections would cost more than the restore
        try:
            if bulk is not None:
                bulk(self._restore_records(rec))
            else:  # an older Queue without the bulk path
                for args in self._restore_records(rec):
                    queue.restore_job(*args)
        finally:
            if gc_was_on:
                gc.enable()
        self._nlive = self._restored
        self._live_bytes = self._restored_bytes
        if queue.next_id <= rec.max_id:
            queue.next_id = rec.max_id + 1
        restore_s = time.monotonic() - t0
        kept = len(rec.segments)
        if kept or rec.damaged or rec.torn:
            _say(f"recovered {self._restored:,} jobs ({self._restored_buried:,} buried) from {kept} segment(s), "
                 f"{rec.records:,} records in {rec.seconds + restore_s:.2f}s "
                 f"(read {rec.seconds:.2f}s, restore {restore_s:.2f}s); next job id {queue.next_id}")
        del rec
        if self._damaged:
            self._rewrite_all_forward(self._damaged)
        self._drop_empty_segments()
        self._maint = True
        self._maintain(full=True)

    def _restore_records(self, rec: _Recovered):
        """Decode the latest record of every live job: restore_job argument tuples, buried jobs last.

        Goes segment by segment in log order and lets go of each segment's contents once its
        jobs are restored, so that the log is not held in memory next to the restored jobs.
        """
        off = self._wall_off
        jobs = rec.jobs
        updates = rec.updates
        datas = rec.datas
        job_unpack = _JOB.unpack_from
        frame_unpack = _FRAME.unpack_from
        tube_names: dict[bytes, str] = {}
        live = self._live
        ids = self._ids
        JOB_SIZE = fmt.JOB_SIZE
        buried = []
        n = 0
        nbytes = 0
        for seg_no, seg_ids in enumerate(rec.full_ids):
            data = datas[seg_no]
            home = rec.indexes[seg_no]
            home_ids = ids[home]
            restored_here = 0
            get = jobs.get
            for jid in seg_ids:
                loc = get(jid)
                if loc is None or loc >> _LOC_BITS != seg_no:
                    continue  # deleted, or a later K_JOB record of it exists
                del jobs[jid]
                pos = loc & _LOC_MASK
                length = frame_unpack(data, pos)[0]
                f = job_unpack(data, pos + 8)
                tstart = pos + 8 + JOB_SIZE
                bstart = tstart + f[13]
                tb = data[tstart:bstart]
                name = tube_names.get(tb)
                if name is None:
                    name = tube_names[tb] = tb.decode("latin-1")
                home_ids.append(jid)
                restored_here += 1
                nbytes += length + 8
                u = updates.pop(jid, None) if updates else None
                if u is not None:
                    seq, (_, _, state, pri, delay, deadline, r1, r2, r3, r4, r5) = u
                else:
                    seq = loc
                    _, _, state, pri, delay, _ttr, _created, deadline, r1, r2, r3, r4, r5, _ = f
                if state == BURIED:
                    buried.append((seq, (jid, name, pri, delay, f[5], data[bstart:pos + 8 + length], BURIED, 0,
                                         f[6] - off, (r1, r2, r3, r4, r5), home)))
                    continue
                if state == DELAYED:
                    deadline -= off
                else:
                    state = READY
                yield (jid, name, pri, delay, f[5], data[bstart:pos + 8 + length], state, deadline, f[6] - off,
                       (r1, r2, r3, r4, r5), home)
            live[home] += restored_here
            n += restored_here
            datas[seg_no] = None  # the bodies were copied out: let the segment go
            rec.full_ids[seg_no] = None
            data = None
        self._restored = n
        self._restored_bytes = nbytes
        self._restored_buried = len(buried)
        buried.sort(key=lambda e: e[0])  # buried jobs keep the order they were buried in
        for _, args in buried:
            yield args

    def _drop_empty_segments(self) -> None:
        """Old segments holding no record at all (a start with no activity) can go in any order."""
        for idx in list(self._order):
            if idx != self._cur and self._size.get(idx) == fmt.HEADER_SIZE and not self._live.get(idx):
                os.unlink(self._path(idx))
                self._fsync_dir()
                self._forget(idx)

    def _rewrite_all_forward(self, damaged: list[int]) -> None:
        """After --binlog-ignore-damage: write every live job into the current segment, set damaged files aside."""
        jobs = self.queue.jobs
        moved = 0
        for job in list(jobs.values()):
            if job.file != self._cur:
                self._write_full(job, force=True)
                moved += 1
        self._flush()
        self._sync_now()
        for idx in damaged:
            path = self._path(idx)
            if os.path.exists(path):
                os.replace(path, path + ".damaged")
                self._fsync_dir()
            if idx in self._live:
                self._forget(idx)
            _say(f"damaged segment set aside as {path}.damaged")
        _say(f"rewrote {moved:,} recovered jobs into {fmt.segment_name(self._cur)}")

    # ------------------------------------------------------------------ segments
    def _start_segment(self, idx: int) -> None:
        """Create, allocate and start writing segment ``idx`` (used at open)."""
        fd, alloc = self._create_segment(idx, self._chunk, fmt.HEADER_SIZE + SLACK)
        if fd < 0:
            raise BinlogError(f"cannot allocate a binlog segment in {self.dir}: disk full")
        self._activate(fd, idx, alloc)
        self._flush()
        self._sync_now()

    def _create_segment(self, idx: int, want: int, minimum: int) -> tuple[int, int]:
        """Create segment file ``idx`` with ``want`` bytes allocated (or at least ``minimum``).

        Returns (fd, allocated) or (-1, 0) when the disk has no room. The file and its
        directory entry are made durable before anything is written into it.
        """
        path = self._path(idx)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno in FULL_ERRNOS:
                return -1, 0
            raise
        alloc = 0
        for size in (want, minimum) if minimum < want else (want,):
            try:
                os.posix_fallocate(fd, 0, size)
                alloc = size
                break
            except OSError as exc:
                if exc.errno not in FULL_ERRNOS:
                    os.close(fd)
                    raise
        if not alloc:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            return -1, 0
        os.fsync(fd)
        self._fsync_dir()
        _crash_point("segment-created")
        return fd, alloc

    def _activate(self, fd: int, idx: int, alloc: int) -> None:
        """Make ``fd`` the current segment; its header (with the max id so far) goes first."""
        with self._fd_lock:
            self._fd = fd
        self._cur = idx
        self._alloc = alloc
        self._buf += fmt.encode_header(idx, self._max_id, time.time_ns())
        self._pos = fmt.HEADER_SIZE
        self._order.append(idx)
        self._live[idx] = 0
        self._cur_ids = self._ids[idx] = array("Q")

    def _rotate(self, need: int) -> bool:
        """Switch to the next segment, which must have room for a ``need``-byte record."""
        if self._spare_fd < 0 or self._spare_room < need:
            if not self._make_spare(need):
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
        _crash_point("rotate-old-synced")
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
        fd, alloc = self._create_segment(self._cur + 1, want, fmt.HEADER_SIZE + need + reserve)
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
    def job_put(self, job) -> None:
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
        if delay:
            head = _JOB.pack(1, job.id, 1, job.pri, delay, job.ttr * NS, created, created + delay, 0, 0, 0, 0, 0, len(tb))
        else:
            head = _JOB.pack(1, job.id, 0, job.pri, 0, job.ttr * NS, created, 0, 0, 0, 0, 0, 0, len(tb))
        buf = self._buf
        buf += _FRAME.pack(size - 8, _crc32(body, _crc32(tb, _crc32(head))))
        buf += head
        buf += tb
        buf += body
        self._pos += size
        idx = self._cur
        job.file = idx
        self._live[idx] += 1
        self._cur_ids.append(job.id)
        self._nlive += 1
        self._live_bytes += size
        self.records_written += 1
        if job.id > self._max_id:
            self._max_id = job.id
        if len(buf) > 1048576:
            self._flush()

    def _make_room(self, size: int) -> None:
        """Slow path of job_put: rotate, allocate a spare, or refuse the job (StorageFull)."""
        if self._write_error:
            raise StorageFull(self._write_error)
        if not self._fit(size, (self._nlive + 1) * _DEL + SLACK):
            raise StorageFull("binlog: disk full")

    def _write_full(self, job, force: bool = False) -> bool:
        """Append the job's complete current state (compaction / rewrite); the job moves to the current segment."""
        name = job.tube.name
        tb = self._tube_bytes.get(name)
        if tb is None:
            tb = self._tube_bytes[name] = name.encode("latin-1")
        body = job.body
        size = _FIXED + len(tb) + len(body)
        if not self._fit(size, 0 if force else self._nlive * _DEL + SLACK):
            return False
        state = job.state
        deadline = job.deadline + self._wall_off if state == DELAYED else 0
        head = _JOB.pack(1, job.id, state, job.pri, job.delay, job.ttr * NS, job.created + self._wall_off, deadline,
                         job.reserves, job.timeouts, job.releases, job.buries, job.kicks, len(tb))
        buf = self._buf
        buf += _FRAME.pack(size - 8, _crc32(body, _crc32(tb, _crc32(head))))
        buf += head
        buf += tb
        buf += body
        self._pos += size
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

    def job_updated(self, job) -> None:
        state = job.state
        if state == INVALID:
            return
        size = fmt.UPDATE_RECORD_SIZE
        reserve = self._nlive * _DEL + SLACK
        if size > self._alloc - self._pos or self._room_after(size) < reserve:
            if not self._fit(size, reserve):
                self._skipped_updates += 1
                if self._skipped_updates in (1, 10, 100, 1000) or not self._skipped_updates % 10000:
                    _say(f"WARNING: disk full: {self._skipped_updates} job state change(s) not logged "
                         f"(after a crash those jobs come back in their previous state)")
                return
        deadline = job.deadline + self._wall_off if state == DELAYED else 0
        payload = _UPDATE.pack(2, job.id, state, job.pri, job.delay, deadline,
                               job.reserves, job.timeouts, job.releases, job.buries, job.kicks)
        buf = self._buf
        buf += _FRAME.pack(fmt.UPDATE_SIZE, _crc32(payload))
        buf += payload
        self._pos += size
        self.records_written += 1

    def job_deleted(self, job) -> None:
        if _DEL > self._alloc - self._pos and not self._fit(_DEL, 0):
            _say(f"ERROR: no room to log the delete of job {job.id}; it would come back after a crash")
            return
        payload = _DELETE.pack(3, job.id)
        buf = self._buf
        buf += _FRAME.pack(9, _crc32(payload))
        buf += payload
        self._pos += _DEL
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
        if self._maint:
            self._maintain()
        if self._buf:
            self._flush()
        if self.fsync_ms == 0 and self._dirty:
            try:
                self._sync_now()
            except OSError as exc:
                self._io_failed("fdatasync", exc)

    def _flush(self) -> None:
        """Write the buffer to the current segment (one os.write, normally)."""
        buf = self._buf
        if not buf:
            return
        n = len(buf)
        done = 0
        try:
            done = os.write(self._fd, buf)
            if done < n:
                with memoryview(buf) as mv:
                    while done < n:
                        done += os.write(self._fd, mv[done:])
        except OSError as exc:
            if done:
                del buf[:done]
                self._dirty = True
            msg = f"binlog write failed: {exc.strerror}"
            if self._write_error is None:
                _say(f"ERROR: {msg} ({self._path(self._cur)}); new jobs are refused until writing works again")
            self._write_error = msg
            return
        buf.clear()
        self._write_error = None
        self._dirty = True
        if self._thread is not None and not self._wake.is_set():
            self._wake.set()

    def _io_failed(self, what: str, exc: OSError) -> None:
        """An fsync or file operation failed: say so, refuse new jobs until a write works again."""
        msg = f"binlog {what} failed: {exc.strerror or exc}"
        if self._write_error != msg:
            _say(f"ERROR: {msg} ({self.dir}); new jobs are refused until writing works again")
        self._write_error = msg

    def _sync_now(self) -> None:
        with self._fd_lock:
            if self._fd >= 0:
                self._dirty = False
                self._timed_fdatasync()

    def _timed_fdatasync(self) -> None:
        """fdatasync the current segment (caller holds _fd_lock), counting it for the metrics."""
        started = time.perf_counter()
        os.fdatasync(self._fd)
        self.fsync_seconds += time.perf_counter() - started
        self.fsync_count += 1

    def _fsync_dir(self) -> None:
        if self._dirfd >= 0:
            os.fsync(self._dirfd)
        else:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _fsync_loop(self) -> None:
        interval = (self.fsync_ms or 0) / 1000.0
        last = 0.0
        wake = self._wake
        while True:
            wake.wait()
            if self._stopping:
                return
            wait = last + interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            wake.clear()
            if self._stopping:  # close() may have set the event just before clear(): it syncs itself
                return
            with self._fd_lock:
                if self._fd >= 0 and self._dirty:
                    self._dirty = False
                    try:
                        self._timed_fdatasync()
                    except OSError as exc:
                        _say(f"ERROR: fdatasync failed: {exc.strerror}")
            last = time.monotonic()

    def start_thread(self) -> None:
        if self.fsync_ms and self._thread is None:
            self._thread = threading.Thread(target=self._fsync_loop, name="binlog-fsync", daemon=True)
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
            if not self._migrate(oldest, 1 << 62 if full else MIGRATE_BUDGET):
                self._maint = True  # more to move: go on at the next reply batch
                return
            if self._live.get(oldest):
                return  # no room to move everything
            if not full:
                self._drop_dead_prefix()
                self._maint = self._needs_compaction()
                return

    def _migrate(self, idx: int, budget: int) -> bool:
        """Rewrite forward the live jobs of segment ``idx``; True when none is left there."""
        ids = self._ids.get(idx)
        if ids is None:
            return True
        jobs = self.queue.jobs
        pos = self._migrate_pos.get(idx, 0)
        n = len(ids)
        written = 0
        while pos < n:
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
        _crash_point("compact-copied")
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
            _crash_point("compact-synced")
            while len(order) > 1 and not live[order[0]]:
                idx = order[0]
                try:
                    os.unlink(self._path(idx))
                except FileNotFoundError:
                    pass
                _crash_point("compact-unlinked")
                self._fsync_dir()
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
    def stats(self) -> dict[str, int]:
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
        self._stopping = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join(5)
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
                try:
                    os.unlink(self._path(self._cur + 1))
                except FileNotFoundError:
                    pass
            if self._dirfd >= 0:
                os.fsync(self._dirfd)
        finally:
            if self._dirfd >= 0:
                os.close(self._dirfd)
                self._dirfd = -1
            if self._lockfd >= 0:
                os.close(self._lockfd)
                self._lockfd = -1


def _read_file(path: str) -> bytes:
    with open(path, "rb", buffering=0) as fh:
        return fh.read()


def open_binlog(directory: str, fsync_ms: int | None = 50, segment_size: int = 10485760,
                ignore_damage: bool = False) -> Binlog:
    """Open (and scan) the binlog in ``directory``; raises BinlogError with a clear message if it cannot."""
    log = Binlog(directory, fsync_ms=fsync_ms, segment_size=segment_size, ignore_damage=ignore_damage)
    try:
        log.open()
    except BaseException:
        log.close()
        raise
    log.start_thread()
    return log
