"""Binlog recovery: read every segment at start, then hand the live jobs to the queue.

Reading (:class:`Scanner`) goes segment by segment (:meth:`Scanner.scan_segment`) and
record by record (:meth:`Scanner.apply_record`), checking every CRC with
:func:`broker.binlog_format.check_record`. A bad record at the end of the newest segment
is a torn write from the crash: dropped with a warning naming the file and offset, and the
segment is truncated there. A bad record with valid records after it, or in an older
segment, is damage: :class:`BinlogError` (refuse to start) unless ``ignore_damage``.

Restoring (:func:`restore_records`) decodes only the latest record of each live job, as
:class:`RecoveredJob` records in log order (buried jobs last, in the order they were
buried), letting go of each segment's bytes once its jobs are out.
"""
from __future__ import annotations

import os
import time
from array import array
from dataclasses import dataclass, field
from typing import Final

from broker import binlog_format as fmt
from broker.binlog_file import BinlogDir, BinlogError, read_file, say, truncate_file
from broker.queue import BURIED, CREATED_GRAIN, DELAYED, READY
from broker.queue_restore import RecoveredJob, Restorer

LOC_BITS: Final = 40
LOC_MASK: Final = (1 << LOC_BITS) - 1


@dataclass
class ScanResult:
    """What the scan found, until the restore puts it in the queue.

    Kept compact for big logs: a job is the *location* of its latest K_JOB record,
    ``(n << 40) | offset`` with ``n`` the position of its segment in ``datas`` (locations
    grow in log order, so they double as sequence numbers); its fields are decoded once,
    when it is restored.
    """

    jobs: dict[int, int] = field(default_factory=dict)  # id -> location of its latest K_JOB record
    updates: dict[int, tuple[int, fmt.UpdateRecord]] = field(default_factory=dict)  # newer K_UPDATE
    datas: list[bytes | None] = field(default_factory=list)  # segment contents, by position
    full_ids: list[list[int] | None] = field(default_factory=list)  # by position: ids of its K_JOB records
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

    def __init__(self, directory: BinlogDir, ignore_damage: bool) -> None:
        self.dir = directory
        self.ignore_damage = ignore_damage
        self.result = ScanResult()
        self._last_report = 0.0

    def scan(self) -> ScanResult:
        t0 = self._last_report = time.monotonic()
        indexes = self._drop_unused_spare(self.dir.indexes())
        for n, idx in enumerate(indexes):
            self.scan_segment(n, len(indexes), idx)
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

    def scan_segment(self, n: int, total: int, idx: int) -> None:
        """Read segment ``idx`` (the n-th of ``total``): check its header, apply its records."""
        rec = self.result
        path = self.dir.segment(idx)
        newest = n == total - 1
        try:
            data = read_file(path)
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
                say(f"WARNING: {path}: torn segment header ({exc.reason}); the segment holds no record, removed")
                self.dir.remove(idx)
                return
            self._damage(path, idx, 0, exc.reason, None)
            return  # ignore_damage: the whole segment is unreadable
        rec.max_id = max(rec.max_id, hmax)
        base = len(rec.datas) << LOC_BITS
        rec.datas.append(data)
        rec.indexes.append(idx)
        seg_ids: list[int] = []
        rec.full_ids.append(seg_ids)
        valid_end = self._read_records(data, path, idx, newest, base, seg_ids, f"segment {n + 1}/{total}")
        rec.segments.append(idx)
        rec.sizes[idx] = valid_end
        if rec.torn and rec.torn[-1][0] == path:
            # a torn tail: cut it off so that this segment is clean for the next start
            truncate_file(path, rec.torn[-1][1])
        elif end > valid_end and idx not in rec.damaged:
            truncate_file(path, valid_end)  # only zeros there: allocated space never written

    def _read_records(self, data: bytes, path: str, idx: int, newest: bool, base: int, seg_ids: list[int],
                      where: str) -> int:
        """Apply every valid record of one segment; returns the end of its valid data."""
        end = len(data)
        pos = valid_end = fmt.HEADER_SIZE
        while True:
            try:
                stop, kind, jid = fmt.read_head(data, pos, end)
            except fmt.FormatError as exc:
                pos = self._bad(path, idx, data, pos, end, newest, exc.reason)
                if pos < 0:
                    break
                continue
            if stop == pos:
                break  # zeros: the end of the data
            self.apply_record(data, pos, kind, jid, base, seg_ids)
            pos = valid_end = stop
            if not self.result.records & 0xFFFF:
                self._progress(where, idx)
        return valid_end

    def apply_record(self, data: bytes, pos: int, kind: int, jid: int, base: int, seg_ids: list[int]) -> None:
        """One checked record (its kind and job id read already): the last K_JOB/K_UPDATE of a
        job wins until a K_DELETE removes it."""
        rec = self.result
        rec.records += 1
        if kind == fmt.K_JOB:
            rec.jobs[jid] = base | pos
            seg_ids.append(jid)  # the same int object as the key: a list costs 8 bytes an entry
        elif kind == fmt.K_DELETE:
            if jid in rec.jobs:
                del rec.jobs[jid]
        else:
            self._apply_update(fmt.decode_update(data, pos), base | pos)
            return
        if rec.updates and jid in rec.updates:
            del rec.updates[jid]
        if jid > rec.max_id:
            rec.max_id = jid

    def _apply_update(self, update: fmt.UpdateRecord, loc: int) -> None:
        rec = self.result
        jid = update.job_id
        full = rec.jobs.get(jid)
        if full is None:
            return  # its K_JOB is in a deleted segment
        if update.state != fmt.S_RESERVED:
            rec.updates[jid] = (loc, update)
            return
        # A reserve: only the counters move; the job comes back in the state it was
        # reserved from (that of the record before), at that record's place in the log.
        prev = rec.updates.get(jid)
        if prev is None:
            rec.updates[jid] = (full, update)
        else:
            rec.updates[jid] = (prev[0], prev[1]._replace(reserves=update.reserves, timeouts=update.timeouts,
                                                          releases=update.releases, buries=update.buries,
                                                          kicks=update.kicks))

    def _progress(self, where: str, idx: int) -> None:
        now = time.monotonic()
        if now - self._last_report >= 2.0:
            self._last_report = now
            say(f"recovering: {where} ({fmt.segment_name(idx)}), {self.result.records:,} records read, "
                f"{len(self.result.jobs):,} live jobs so far")

    def _bad(self, path: str, idx: int, data: bytes, pos: int, end: int, newest: bool, reason: str) -> int:
        """A record that does not decode at ``pos``. Returns where to go on, or -1 to stop reading this file."""
        nxt = fmt.find_next_valid(data, pos, end)
        if nxt is None and newest:
            self.result.torn.append((path, pos, reason))
            say(f"WARNING: torn record at the end of the log dropped: {path} offset {pos} ({reason}; "
                f"{end - pos} bytes cut off; it was being written when the broker stopped)")
            return -1
        return self._damage(path, idx, pos, reason, nxt)

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
_unpack_job: Final = fmt.JOB_FRAMED.unpack_from
_BURIED: Final = BURIED
_DELAYED: Final = DELAYED
_READY: Final = READY
_CREATED_GRAIN: Final = CREATED_GRAIN


def restore_records(rec: ScanResult, wall_off: int, tally: RestoreTally, restorer: Restorer) -> None:
    """Hand ``restorer`` the latest state of every live job, in log order, buried jobs last
    (in burial order).

    Goes segment by segment and lets go of each segment's contents once its jobs are out,
    so that the log is not held in memory next to the restored jobs. ``wall_off`` turns
    the log's wall-clock times into the queue's clock.
    """
    decoder = _Decoder(wall_off, restorer)
    jobs = rec.jobs
    updates = rec.updates
    table_for = len(jobs)  # a dict keeps its table when emptied: copy it once it is half empty
    for seg_no, seg_ids in enumerate(rec.full_ids):
        data = rec.datas[seg_no]
        if data is None or seg_ids is None:
            continue
        home = rec.indexes[seg_no]
        here: list[int] = []
        nbytes = 0
        for jid in seg_ids:
            loc = jobs.get(jid, -1)
            if loc < 0 or loc >> LOC_BITS != seg_no:
                continue  # deleted, restored already, or a later K_JOB record of it exists
            del jobs[jid]
            newer = updates.pop(jid, None) if updates else None
            nbytes += decoder.job(data, loc, jid, home, newer)
            here.append(jid)
        tally.home_ids[home].fromlist(here)
        tally.live[home] += len(here)
        tally.jobs += len(here)
        tally.bytes += nbytes
        rec.datas[seg_no] = None  # the bodies were copied out: let the segment go
        rec.full_ids[seg_no] = None
        if 2 * len(jobs) < table_for:
            rec.jobs = jobs = dict(jobs)
            table_for = len(jobs)
    buried = decoder.buried
    tally.buried = len(buried)
    buried.sort(key=lambda entry: entry[0])  # buried jobs keep the order they were buried in
    for _, job in buried:
        restorer.add_record(job)


class _Decoder:
    """Decodes K_JOB records for a :class:`Restorer`; equal tube names and creation times
    (to the millisecond, as a put keeps them) come out as one shared object. Buried jobs
    wait in ``buried`` (with their place in the log), to be restored last."""

    def __init__(self, wall_off: int, restorer: Restorer) -> None:
        self.wall_off = wall_off
        self.restorer = restorer
        self.tube_names: dict[bytes, str] = {}
        self.recent_created = 0
        self.buried: list[tuple[int, RecoveredJob]] = []

    def job(self, data: bytes, loc: int, job_id: int, home: int, newer: tuple[int, fmt.UpdateRecord] | None) -> int:
        """One job's K_JOB record at location ``loc`` (in ``data``), with its newest K_UPDATE
        (``newer``) applied; returns the record's size on disk."""
        pos = loc & LOC_MASK
        length: int
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
        (length, _crc, _kind, _id, state, pri, delay, ttr, created, deadline, reserves, timeouts, releases, buries,
         kicks, tube_len) = _unpack_job(data, pos)
        tstart = pos + fmt.JOB_RECORD_FIXED
        bstart = tstart + tube_len
        size = fmt.FRAME_SIZE + length
        tb = data[tstart:bstart]
        name = self.tube_names.get(tb)
        if name is None:
            name = self.tube_names[tb] = tb.decode("latin-1")
        body = data[bstart:pos + size]
        if newer is not None:
            u = newer[1]
            reserves, timeouts, releases, buries, kicks = u.reserves, u.timeouts, u.releases, u.buries, u.kicks
            if u.state != fmt.S_RESERVED:
                state, pri, delay, deadline = u.state, u.pri, u.delay, u.deadline
            # else only reserves since the K_JOB record: its state stands
        counters = ((reserves, timeouts, releases, buries, kicks)
                    if reserves or timeouts or releases or buries or kicks else NO_COUNTERS)
        if state == _BURIED:
            deadline = 0
        elif state == _DELAYED:
            deadline -= self.wall_off
        else:
            state = _READY
        created -= self.wall_off
        if 0 <= created - self.recent_created < _CREATED_GRAIN:
            created = self.recent_created
        else:
            self.recent_created = created
        if state == _BURIED:
            job = RecoveredJob(job_id, name, pri, delay, ttr, body, state, deadline, created, counters, home)
            self.buried.append((loc if newer is None else newer[0], job))
        else:
            self.restorer.add(job_id, name, pri, delay, ttr, body, state, deadline, created, counters, home)
        return size
