"""Binlog recovery: read every segment at start, then hand the live jobs to the queue.

Reading (:class:`Scanner`) goes segment by segment (:meth:`Scanner.scan_segment`) and
record by record (:meth:`Scanner.apply_record`), checking every CRC with
:func:`broker.binlog_format.check_record`. A bad record at the end of the newest segment
is a torn write from the crash: dropped with a warning naming the file and offset, and the
segment is truncated there. A bad record with valid records after it, or in an older
segment, is damage: :class:`BinlogError` (refuse to start) unless ``ignore_damage``.

Restoring (:func:`restore_records`) decodes only the latest record of each live job, as
:class:`RecoveredJob` records in log order (buried jobs last, in the order they were
buried), letting go of each segment's bytes once its jobs are out. The interpreted build
leaves plain ready jobs unmade until first used (:mod:`broker.binlog_lazy`), keeping the
bytes of their segments until then.
"""
from __future__ import annotations

import os
import struct
import time
from array import array
from dataclasses import dataclass, field
from typing import Final

from broker import binlog_format as fmt
from broker.binlog_file import BinlogDir, BinlogError, read_file, say, truncate_file
from broker.binlog_lazy import LOC_BITS, LazyJobs
from broker.model import ID_BITS, URGENT_THRESHOLD
from broker.queue import BURIED, DELAYED, READY, Tube
from broker.queue_restore import RecoveredJob, Restorer, recovered_created

# The interpreted build reads the plain records (K_JOB, K_DELETE; ready jobs with nothing
# special about them at restore) in one tight loop per segment instead of a few calls per
# record: a Python call costs what the rest of a record's work does. Compiled, the calls
# are C calls and the per-record path stays. Tests run both ways in both builds.
BATCH: Final = not fmt.COMPILED
BATCH_RECORDS: Final = 0x10000  # records per batch call: the progress report runs between them


@dataclass
class ScanResult:
    """What the scan found, until the restore puts it in the queue.

    Nothing is kept per live job: the restore walks each segment's records again (their
    checksums checked already) and decodes every K_JOB record that is still current. To
    tell which are, the scan keeps only the exceptions, keyed by job id, as *locations*
    ``(n << 40) | offset`` with ``n`` the position of the segment in ``datas`` (locations
    grow in log order, so they double as sequence numbers): the last K_DELETE of an id,
    the last K_JOB of an id that was seen before (a compaction copy), the newest K_UPDATE.
    A log of a million fresh puts holds no exception at all.
    """

    dead: dict[int, int] = field(default_factory=dict)  # id -> location of its K_DELETE record
    latest: dict[int, int] = field(default_factory=dict)  # id -> location of its last K_JOB, if it has several
    # id -> (location, record) of the K_UPDATE after its last K_JOB; location -1: a reserve
    # only, the job keeps the state and place of its K_JOB record
    updates: dict[int, tuple[int, fmt.UpdateRecord]] = field(default_factory=dict)
    datas: list[bytes | None] = field(default_factory=list)  # segment contents, by position
    skips: dict[int, dict[int, int]] = field(default_factory=dict)  # by position: damage skipped, offset -> next
    indexes: list[int] = field(default_factory=list)  # segment index, by position
    max_id: int = 0
    records: int = 0
    segments: list[int] = field(default_factory=list)  # indexes kept, ascending
    sizes: dict[int, int] = field(default_factory=dict)  # index -> bytes of valid data
    damaged: list[int] = field(default_factory=list)  # indexes with damage skipped (ignore_damage)
    seconds: float = 0.0
    torn: list[tuple[str, int, str]] = field(default_factory=list)


class Scanner:
    """Reads every segment of a binlog directory into a :class:`ScanResult`."""

    def __init__(self, directory: BinlogDir, ignore_damage: bool, batch: bool = BATCH) -> None:
        self.dir = directory
        self.ignore_damage = ignore_damage
        self.batch = batch
        self.result = ScanResult()
        self._last_report = 0.0
        self._read_ahead: dict[int, bytes] = {}  # segments _newest_with_records read: not read twice

    def scan(self) -> ScanResult:
        t0 = self._last_report = time.monotonic()
        indexes = self._drop_unused_spare(self.dir.indexes())
        last = self._newest_with_records(indexes)
        for n, idx in enumerate(indexes):
            self.scan_segment(n, len(indexes), idx, newest=n >= last)
        self.result.seconds = time.monotonic() - t0
        return self.result

    def _drop_unused_spare(self, indexes: list[int]) -> list[int]:
        """An unused spare (allocated, header never written) can only be the newest file."""
        while indexes:
            path = self.dir.segment(indexes[-1])
            with open(path, "rb") as fh:
                head = fh.read(fmt.HEADER_SIZE)
            if head.strip(b"\0") or not fmt.only_zeros(read_file(path), 0, os.path.getsize(path)):
                break
            self.dir.remove(indexes.pop())
        return indexes

    def _newest_with_records(self, indexes: list[int]) -> int:
        """The position of the last segment with anything after its header. A start that died
        after making its new segment (header only) and before rewriting a damaged one must not
        turn the damaged one into an older segment (see _unsynced_lost): the next start would
        refuse what the first one accepted."""
        pos = len(indexes) - 1
        while pos > 0:
            data = self._read_ahead[indexes[pos]] = self._read(indexes[pos])
            if not fmt.only_zeros(data, min(len(data), fmt.HEADER_SIZE), len(data)):
                break
            pos -= 1
        return pos

    def _read(self, idx: int) -> bytes:
        path = self.dir.segment(idx)
        try:
            return read_file(path)
        except OSError as exc:
            raise BinlogError(f"cannot read binlog segment {path}: {exc.strerror}") from None

    def scan_segment(self, n: int, total: int, idx: int, newest: bool | None = None) -> None:
        """Read segment ``idx`` (the n-th of ``total``): check its header, apply its records.
        ``newest``: it may hold records written since the last fsync (default: it is the last)."""
        rec = self.result
        path = self.dir.segment(idx)
        if newest is None:
            newest = n == total - 1
        data = self._read_ahead.pop(idx, None) or self._read(idx)
        end = len(data)
        try:
            _version, hidx, hmax, _created = fmt.decode_header(data)
            if hidx != idx:
                raise fmt.FormatError(0, f"header says segment {hidx}, file name says {idx}")
        except fmt.FormatError as exc:
            if newest and fmt.only_zeros(data, min(end, fmt.HEADER_SIZE), end):
                # the header of a brand-new segment was being written: nothing in it
                rec.torn.append((path, 0, exc.reason))
                say(f"WARNING: {path}: torn segment header ({exc.reason}); the segment holds no record, removed")
                self.dir.remove(idx)
                return
            if not newest:
                self._damage(path, idx, 0, exc.reason, None)
                return  # ignore_damage: the whole segment is unreadable
            self._unsynced_lost(path, idx, 0, exc.reason, fmt.HEADER_SIZE)  # its records may still be read
            hmax = 0
        rec.max_id = max(rec.max_id, hmax)
        seg_no = len(rec.datas)
        rec.datas.append(data)
        rec.indexes.append(idx)
        valid_end = self._read_records(data, path, idx, newest, seg_no, f"segment {n + 1}/{total}")
        rec.segments.append(idx)
        rec.sizes[idx] = valid_end
        if rec.torn and rec.torn[-1][0] == path:
            # a torn tail: cut it off so that this segment is clean for the next start
            truncate_file(path, rec.torn[-1][1])
        elif end > valid_end and idx not in rec.damaged:
            truncate_file(path, valid_end)  # only zeros there: allocated space never written

    def _read_records(self, data: bytes, path: str, idx: int, newest: bool, seg_no: int, where: str) -> int:
        """Apply every valid record of one segment; returns the end of its valid data."""
        end = len(data)
        base = seg_no << LOC_BITS
        pos = valid_end = fmt.HEADER_SIZE
        while True:
            if self.batch:
                stop = self._scan_batch(data, pos, end, base)
                if stop > pos:
                    pos = valid_end = stop
                    self._progress(where, idx)
                    continue
            try:
                stop, kind, jid = fmt.read_head(data, pos, end)
            except fmt.FormatError as exc:
                nxt = self._bad(path, idx, data, pos, end, newest, exc.reason)
                if nxt < 0:
                    break
                self.result.skips.setdefault(seg_no, {})[pos] = nxt  # the restore's walk skips it too
                pos = nxt
                continue
            if stop == pos:
                break  # zeros: the end of the data
            self.apply_record(data, pos, kind, jid, base)
            pos = valid_end = stop
            if not self.result.records & 0xFFFF:
                self._progress(where, idx)
        return valid_end

    def apply_record(self, data: bytes, pos: int, kind: int, jid: int, base: int) -> None:
        """One checked record (its kind and job id read already): the last K_JOB/K_UPDATE of a
        job wins until a K_DELETE removes it. Only the exceptions are noted (see ScanResult)."""
        rec = self.result
        rec.records += 1
        if kind == fmt.K_JOB:
            if jid > rec.max_id:
                rec.max_id = jid  # a new job: ids grow, so no earlier record of it exists
            else:
                rec.latest[jid] = base | pos  # maybe a copy of an earlier record: the last one counts
        elif kind == fmt.K_DELETE:
            rec.dead[jid] = base | pos
            if jid > rec.max_id:
                rec.max_id = jid
        else:
            self._apply_update(fmt.decode_update(data, pos), base | pos)
            return
        if rec.updates and jid in rec.updates:
            del rec.updates[jid]

    def _scan_batch(self, data: bytes, pos: int, end: int, base: int) -> int:
        """:meth:`apply_record` over the valid K_JOB and K_DELETE records from ``pos`` on, in one
        loop (the checks of :func:`broker.binlog_format.read_head`, inlined; sizes as locals: a
        module attribute is a dict lookup per use, interpreted); returns where it stopped: at
        anything else (an update, the end of the data, damage) or after BATCH_RECORDS."""
        rec = self.result
        unpack = fmt.HEAD.unpack_from
        crc32 = fmt.crc32
        latest, dead, updates = rec.latest, rec.dead, rec.updates
        k_job, k_delete, frame = fmt.K_JOB, fmt.K_DELETE, fmt.FRAME_SIZE
        fixed, delete_size = fmt.JOB_SIZE, fmt.DELETE_SIZE
        last = end - fmt.DELETE_RECORD_SIZE  # a record starting after this is too short for a head
        max_id = rec.max_id
        count = 0
        for count in range(BATCH_RECORDS):  # noqa: B007 (read after the loop; a for: no compare and add per record)
            if pos > last:
                break
            length, crc, kind, jid = unpack(data, pos)
            start = pos + frame
            stop = start + length
            if not length or stop > end or crc32(data[start:stop]) != crc:
                break
            if kind == k_job and fixed <= length and fixed + data[start + fixed - 1] <= length:
                if jid > max_id:
                    max_id = jid
                else:
                    latest[jid] = base | pos
            elif kind == k_delete and length == delete_size:
                dead[jid] = base | pos
                if jid > max_id:
                    max_id = jid
            else:
                break
            if updates and jid in updates:
                del updates[jid]
            pos = stop
        else:
            count = BATCH_RECORDS
        rec.max_id = max_id
        rec.records += count
        return pos

    def _apply_update(self, update: fmt.UpdateRecord, loc: int) -> None:
        rec = self.result
        jid = update.job_id
        if update.state != fmt.S_RESERVED:
            rec.updates[jid] = (loc, update)
            return
        # A reserve: only the counters move; the job comes back in the state it was
        # reserved from (that of the record before), at that record's place in the log.
        prev = rec.updates.get(jid)
        if prev is None:
            rec.updates[jid] = (-1, update)
        else:
            rec.updates[jid] = (prev[0], prev[1]._replace(reserves=update.reserves, timeouts=update.timeouts,
                                                          releases=update.releases, buries=update.buries,
                                                          kicks=update.kicks))

    def _progress(self, where: str, idx: int) -> None:
        now = time.monotonic()
        if now - self._last_report >= 2.0:
            self._last_report = now
            say(f"recovering: {where} ({fmt.segment_name(idx)}), {self.result.records:,} records read")

    def _bad(self, path: str, idx: int, data: bytes, pos: int, end: int, newest: bool, reason: str) -> int:
        """A record that does not decode at ``pos``. Returns where to go on, or -1 to stop reading this file."""
        nxt = fmt.find_next_valid(data, pos, end)
        if nxt is None and newest:
            self.result.torn.append((path, pos, reason))
            say(f"WARNING: torn record at the end of the log dropped: {path} offset {pos} ({reason}; "
                f"{end - pos} bytes cut off; it was being written when the broker stopped)")
            return -1
        if newest and nxt is not None:
            self._unsynced_lost(path, idx, pos, reason, nxt)
            return nxt
        return self._damage(path, idx, pos, reason, nxt)

    def _unsynced_lost(self, path: str, idx: int, pos: int, reason: str, nxt: int) -> None:
        """Damage in the newest segment with valid records after it: skipped without --binlog-ignore-damage.

        Only the newest segment holds records written since the last fsync (a segment is fsynced
        whole before the next one starts). A power cut can leave those pages on the disk in any
        order: some lost (zeros, or a record cut), later ones written. That is the -f window
        lost, not damage to refuse a start for: the broker must come back by itself. The
        stretch is skipped, the valid records after it are read, and the segment is then
        replaced by a base and kept as ``*.damaged`` (as --binlog-ignore-damage does).
        """
        say(f"WARNING: {path} at offset {pos}: {reason}, with valid records after it: {nxt - pos} bytes "
            f"skipped. In the newest segment this is what a power cut leaves of the writes after the last "
            f"fsync (-f MS, -F); jobs logged there are lost, jobs deleted there may come back. The segment is "
            f"kept as {os.path.basename(path)}.damaged")
        if idx not in self.result.damaged:
            self.result.damaged.append(idx)

    def _damage(self, path: str, idx: int, pos: int, reason: str, nxt: int | None) -> int:
        follows = "valid records follow it" if nxt is not None else "it is not in the newest segment"
        if not self.ignore_damage:
            raise BinlogError(
                f"binlog damaged: {path} at offset {pos}: {reason} ({follows}, so this is not a torn "
                f"write at the end of the log). Refusing to start rather than silently drop jobs. "
                f"To start anyway with every job that can still be read, run with --binlog-ignore-damage "
                f"(the damaged file is kept as {os.path.basename(path)}.damaged); or restore "
                f"{self.dir.path} from a backup.")
        then = f"skipping {nxt - pos} bytes to the next valid record" if nxt is not None else "rest of the file skipped"
        say(f"WARNING: damage ignored (--binlog-ignore-damage): {path} at offset {pos}: {reason}; {then}")
        if idx not in self.result.damaged:
            self.result.damaged.append(idx)
        return nxt if nxt is not None else -1


@dataclass
class RestoreTally:
    """What :func:`restore_records` handed out, and where each job lives now."""

    home_ids: dict[int, array[int]]  # segment index -> ids of the jobs whose full record is there
    live: dict[int, int]  # segment index -> live jobs there
    jobs: int = 0
    buried: int = 0
    bytes: int = 0


NO_COUNTERS: Final = (0, 0, 0, 0, 0)
# Final names: mypyc keeps them in C variables (a plain module name is a dict lookup per use)
_BURIED: Final = BURIED
_DELAYED: Final = DELAYED
_READY: Final = READY
_ID_BITS: Final = ID_BITS
_URGENT: Final = URGENT_THRESHOLD


def restore_records(rec: ScanResult, wall_off: int, tally: RestoreTally, restorer: Restorer,
                    batch: bool = BATCH) -> None:
    """Hand ``restorer`` the latest state of every live job, in log order, buried jobs last
    (in burial order).

    Walks each segment's records (checked by the scan) and lets go of the segment's
    contents once its jobs are out, so that the log is not held in memory next to the
    restored jobs. ``wall_off`` turns the log's wall-clock times into the queue's clock.
    """
    lazy = None
    if batch:
        lazy = LazyJobs(restorer.pool, wall_off)
        restorer.jobs.loader = lazy.make
    decoder = _Decoder(rec, wall_off, restorer, lazy)
    for seg_no, data in enumerate(rec.datas):
        if data is None:
            continue
        home = rec.indexes[seg_no]
        decoder.start_segment(seg_no, home)
        end = rec.sizes[home]  # the end of its valid records
        skips = rec.skips.get(seg_no)
        pos = fmt.HEADER_SIZE
        if lazy is not None and skips is None:
            lazy.hold(seg_no, data, home)
            decoder.segment_batch(data, end, lazy)
            lazy.release_unused(seg_no)
            pos = end
        while pos < end:
            if skips is not None and pos in skips:
                pos = skips[pos]
                continue
            kind = data[pos + fmt.FRAME_SIZE]
            if kind == fmt.K_JOB:
                pos += decoder.job(data, pos)
            elif kind == fmt.K_UPDATE:
                pos += fmt.UPDATE_RECORD_SIZE
            else:
                pos += fmt.DELETE_RECORD_SIZE
        here = decoder.here
        tally.home_ids[home].fromlist(here)
        tally.live[home] += len(here)
        tally.jobs += len(here)
        tally.bytes += decoder.nbytes
        rec.datas[seg_no] = None  # the bodies were copied out or `lazy` holds them: let the scan's reference go
    buried = decoder.buried
    tally.buried = len(buried)
    buried.sort(key=lambda entry: entry[0])  # buried jobs keep the order they were buried in
    for _, job in buried:
        restorer.add_record(job)


class _Decoder:
    """Decodes the current K_JOB records for a :class:`Restorer`; equal tube names and
    creation times (to the millisecond, as a put keeps them) come out as one shared object.
    Buried jobs wait in ``buried`` (with their place in the log), to be restored last."""

    def __init__(self, rec: ScanResult, wall_off: int, restorer: Restorer, lazy: LazyJobs | None) -> None:
        self.wall_off = wall_off
        self.restorer = restorer
        self.lazy = lazy
        self.dead = rec.dead
        self.latest = rec.latest
        self.updates = rec.updates
        self.tube_names: dict[bytes, str] = {}
        self.structs: dict[int, struct.Struct] = {}
        self.recent_created = 0
        self.buried: list[tuple[int, RecoveredJob]] = []
        self.seg_no = 0
        self.base = 0
        self.home = 0
        self.here: list[int] = []  # ids of the jobs restored from the current segment
        self.nbytes = 0  # ...and their bytes on disk

    def start_segment(self, seg_no: int, home: int) -> None:
        self.seg_no = seg_no
        self.base = seg_no << LOC_BITS
        self.home = home
        self.here = []
        self.nbytes = 0

    def current(self, job_id: int, loc: int) -> bool:
        """Is the K_JOB record at ``loc`` the job's latest, and the job not deleted after it?"""
        gone = self.dead.get(job_id)
        if gone is not None and gone > loc:
            return False
        last = self.latest.get(job_id)
        return last is None or last == loc

    def segment_batch(self, data: bytes, end: int, lazy: LazyJobs) -> None:
        """What restore_records' walk of one segment without skips does, in one loop: a ready
        job with no counters, delay or newer update (the bulk of any log) is queued here,
        unmade (:mod:`broker.binlog_lazy`), and handed to the restorer in runs of one tube;
        every other K_JOB record goes through :meth:`job` in its turn (the run before it handed
        over first, so the order of everything the restorer sees is that of the per-record walk).

        A record of the run's tube is read by the run's own struct, whose last field covers the
        counters and the tube name: one compare with the run's ``tail`` tells a plain job of that
        tube. Anything else takes the general look, which also starts a run."""
        unpack, no_counters = fmt.JOB_BATCH_FIELDS.unpack_from, fmt.NO_COUNTER_BYTES
        check = bool(self.dead or self.latest)
        updates, base = self.updates, self.base
        frame, k_job, fixed, other_size = fmt.FRAME_SIZE, fmt.K_JOB, fmt.JOB_RECORD_FIXED, fmt.DELETE_RECORD_SIZE
        k_update, update_size, urgent_pri = fmt.K_UPDATE, fmt.UPDATE_RECORD_SIZE, _URGENT
        run = _Run(self, lazy, None)
        ids, locs, ready, tail, run_unpack, fast_end = run.ids, run.locs, run.ready, run.tail, run.unpack, -1
        shift = _ID_BITS  # tube.ready_shift once a run starts (no id is as wide before)
        nbytes = urgent = 0  # of the jobs in ``run``
        pos = fmt.HEADER_SIZE
        while pos < end:
            kind = data[pos + frame]
            if kind != k_job:
                pos += update_size if kind == k_update else other_size
                continue
            if pos <= fast_end:  # the run's struct reads no further than the data
                length, job_id, state, pri, delay, job_tail = run_unpack(data, pos)
                if (job_tail == tail and not (state or delay or job_id >> shift or (updates and job_id in updates))
                        and (not check or self.current(job_id, base | pos))):
                    ids.append(job_id)
                    locs.append(base | pos)
                    ready.append((pri << shift) | job_id)
                    if pri < urgent_pri:
                        urgent += 1
                    size = frame + length
                    nbytes += size
                    pos += size
                    continue
            length, job_id, state, pri, delay, _, _, counters, tube_len = unpack(data, pos)
            size = frame + length
            if check and not self.current(job_id, base | pos):
                pos += size
                continue
            if state or delay or counters != no_counters or (updates and job_id in updates) or job_id >> shift:
                run.hand_over(nbytes, urgent)
                nbytes = urgent = 0
                pos += self.job(data, pos)
                run = _Run(self, lazy, None)  # the next job starts a run afresh: job() may have widened a ready heap
                ids, locs, ready, tail, run_unpack, fast_end = run.ids, run.locs, run.ready, run.tail, run.unpack, -1
                shift = _ID_BITS
                continue
            # a plain job of another tube: a new run (its first job is queued by the run's struct)
            run.hand_over(nbytes, urgent)
            nbytes = urgent = 0
            tstart = pos + fixed
            run = _Run(self, lazy, data[tstart:tstart + tube_len])
            ids, locs, ready, tail, run_unpack = run.ids, run.locs, run.ready, run.tail, run.unpack
            fast_end = len(data) - fixed - tube_len
            shift = run.shift
            if job_id >> shift:  # an id too wide for this heap: the per-record path widens it
                fast_end = -1  # (the loop comes back to this record by the general look, with shift set)
        run.hand_over(nbytes, urgent)

    def plain_struct(self, tube_len: int) -> struct.Struct:
        """:func:`broker.binlog_format.plain_job_fields`, one per name length (a log may switch tubes often)."""
        made = self.structs.get(tube_len)
        if made is None:
            made = self.structs[tube_len] = fmt.plain_job_fields(tube_len)
        return made

    def tube_name(self, raw: bytes) -> str:
        """A tube name as read from the log, one str object per name."""
        name = self.tube_names.get(raw)
        if name is None:
            name = self.tube_names[raw] = raw.decode("latin-1")
        return name

    def job(self, data: bytes, pos: int) -> int:
        """The K_JOB record at ``pos``: restore it if it is current, with its newest K_UPDATE
        applied; returns the record's size on disk."""
        length: int
        job_id: int
        state: int
        pri: int
        delay: int
        ttr: int
        created: int
        deadline: int
        reserves: int
        timeouts: int
        releases: int
        buries: int
        kicks: int
        tube_len: int
        (length, job_id, state, pri, delay, ttr, created, deadline, reserves, timeouts, releases, buries, kicks,
         tube_len) = fmt.job_fields(data, pos)
        size = fmt.FRAME_SIZE + length
        loc = self.base | pos
        if (self.dead or self.latest) and not self.current(job_id, loc):
            return size
        tstart = pos + fmt.JOB_RECORD_FIXED
        bstart = tstart + tube_len
        tb = data[tstart:bstart]
        name = self.tube_names.get(tb)  # tube_name(), inlined: compiled, a call per job costs ~30 instructions
        if name is None:
            name = self.tube_names[tb] = tb.decode("latin-1")
        body = data[bstart:pos + size]
        newer = self.updates.pop(job_id, None) if self.updates else None
        place = loc
        if newer is not None:
            u = newer[1]
            reserves, timeouts, releases, buries, kicks = u.reserves, u.timeouts, u.releases, u.buries, u.kicks
            if newer[0] >= 0:
                state, pri, delay, deadline = u.state, u.pri, u.delay, u.deadline
                place = newer[0]
            # else only reserves since the K_JOB record: its state and place stand
        counters = ((reserves, timeouts, releases, buries, kicks)
                    if reserves or timeouts or releases or buries or kicks else NO_COUNTERS)
        if state == _BURIED:
            deadline = 0
        elif state == _DELAYED:
            deadline -= self.wall_off
        else:
            state = _READY
        created = recovered_created(created, self.wall_off)
        if created == self.recent_created:
            created = self.recent_created  # the same int object as the job before: memory
        else:
            self.recent_created = created
        home = self.home
        if state == _BURIED:
            job = RecoveredJob(job_id, name, pri, delay, ttr, body, state, deadline, created, counters, home)
            self.buried.append((place, job))
        else:
            self.restorer.add(job_id, name, pri, delay, ttr, body, state, deadline, created, counters, home)
        self.here.append(job_id)
        self.nbytes += size
        return size


class _Run:
    """Lazy ready jobs of one tube queued by :meth:`_Decoder.segment_batch`, not yet handed to the restorer."""

    def __init__(self, decoder: _Decoder, lazy: LazyJobs, tube_bytes: bytes | None) -> None:
        self.decoder = decoder
        self.lazy = lazy
        self.tube_bytes = tube_bytes if tube_bytes is not None else b""
        self.tube: Tube | None = None
        self.ready: list[int] = []
        self.shift = _ID_BITS
        self.tail = b""  # fmt.plain_job_tail of the tube: no record matches before the first job
        self.unpack = fmt.JOB_BATCH_FIELDS.unpack_from  # (never used with an empty tail)
        if tube_bytes is not None:
            self.tube = decoder.restorer.tube(decoder.tube_name(tube_bytes))
            self.ready = self.tube.ready
            self.shift = self.tube.ready_shift
            self.tail = fmt.plain_job_tail(tube_bytes)
            self.unpack = decoder.plain_struct(len(tube_bytes)).unpack_from
        self.ids: list[int] = []
        self.locs: list[int] = []  # where each job's K_JOB record is: (segment position << 40) | offset

    def hand_over(self, nbytes: int, urgent: int) -> None:
        """Give the jobs queued so far (``nbytes`` of records, ``urgent`` of them urgent) to the
        restorer and start afresh (same tube)."""
        if not self.ids or self.tube is None:
            return
        decoder = self.decoder
        held = nbytes - len(self.ids) * (fmt.JOB_RECORD_FIXED + len(self.tube_bytes))  # the bodies' bytes
        self.lazy.add(decoder.seg_no, len(self.ids), self.tube_bytes, self.tube)
        decoder.restorer.add_lazy_run(self.tube, self.ids, self.locs, held, urgent)
        decoder.here.extend(self.ids)
        decoder.nbytes += nbytes
        self.ids.clear()
        self.locs.clear()
