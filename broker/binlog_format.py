"""The on-disk record format of the binlog (``-b DIR``): segment header, record framing, record kinds.

A binlog directory holds *segment* files named ``binlog.<index>.sbl`` (index: a decimal,
strictly increasing integer; beanstalkd's own ``binlog.<n>`` files are never touched), a
``lock`` file (fcntl lock: one broker per directory, as beanstalkd does) and possibly
``*.damaged`` files set aside by ``--binlog-ignore-damage``, and for a moment a base being
written (``*.sbl.partial``) or committed (``*.sbl.base``): see ``BinlogDir.settle``.

All integers are little-endian. Times are wall-clock nanoseconds since the Unix epoch
(the broker's own clock is monotonic; it is converted on the way in and out, so delays and
ages keep counting across a restart, as in beanstalkd).

Segment file layout::

    header (40 bytes, SEGMENT_HEADER)
      magic      8s  b"SBKBLOG\\n"
      version    H   FORMAT_VERSION (1); a reader refuses versions it does not know
      hdr_size   H   40 (lets a later version grow the header)
      index      I   the segment's index (must match its file name)
      max_id     Q   highest job id ever issued when this segment became current: job ids
                     stay unique even after every segment that mentioned them is deleted
      created    q   wall-clock ns when the segment became current
      crc        I   zlib.crc32 of the 32 bytes above
      (4 zero bytes)
    record*
    zero bytes up to the end of the file (segments are preallocated with posix_fallocate,
    so a frame whose length is 0 marks the end of the data)

Record framing (FRAME, 8 bytes, then the payload)::

    length   I   payload length in bytes (>= 1)
    crc      I   zlib.crc32 of the payload

Payload, first byte = kind:

* ``K_JOB`` (1) - a job's full state; written at put, and again when compaction moves a live
  job forward out of an old segment::

      kind B, id Q, state B, pri I, delay q (ns), ttr q (ns), created q (wall ns),
      deadline q (wall ns; meaningful for delayed jobs, else 0),
      reserves I, timeouts I, releases I, buries I, kicks I, tube_len B,
      tube name (tube_len bytes, ASCII), body (the rest of the payload)

* ``K_UPDATE`` (2) - a state change of a job whose K_JOB record is earlier in the log
  (release, bury, kick, kick-job, TTR timeout), or a reserve (``state`` 2, reserved: only
  its counters count; the job comes back in the state of its record before, since a
  reserved job returns to where it was reserved from)::

      kind B, id Q, state B, pri I, delay q (ns), deadline q (wall ns),
      reserves I, timeouts I, releases I, buries I, kicks I

* ``K_DELETE`` (3) - the job is gone for good::

      kind B, id Q

``state`` uses the queue's numbering: 0 ready, 1 delayed, 2 reserved (written only by
compaction; it is recovered as ready, as beanstalkd does), 3 buried.

Recovery reads the segments in index order and, within a segment, in file order; that
order is the sequence of the records. For each job id the last K_JOB/K_UPDATE record wins,
unless a later K_DELETE removes it. A K_UPDATE or K_DELETE whose K_JOB is not in the log
(it lived in a segment that has been deleted) is ignored.
"""
from __future__ import annotations

import struct
import zlib
from typing import Final, NamedTuple, cast

from mypy_extensions import i64

from broker._build import is_compiled_file

MAGIC = b"SBKBLOG\n"
FORMAT_VERSION = 1
SEGMENT_PREFIX = "binlog."
SEGMENT_SUFFIX = ".sbl"
# A base (see broker.binlog_segments.rebase): every live job in one new segment, written as
# ``<segment>.partial``, then renamed ``<segment>.base``, which supersedes every lower index.
PARTIAL_SUFFIX = ".partial"
BASE_SUFFIX = ".base"

K_JOB: Final = 1
K_UPDATE: Final = 2
K_DELETE: Final = 3

S_READY, S_DELAYED, S_RESERVED, S_BURIED = 0, 1, 2, 3  # the queue's numbering (broker.queue)

SEGMENT_HEADER = struct.Struct("<8sHHIQq")  # + crc I + 4 pad bytes
HEADER_CRC = struct.Struct("<I4x")
HEADER_SIZE: Final = 40  # SEGMENT_HEADER.size + HEADER_CRC.size

FRAME = struct.Struct("<II")
FRAME_SIZE: Final = 8  # FRAME.size; literals (checked below) let mypyc inline them
JOB = struct.Struct("<BQBIqqqqIIIIIB")
JOB_SIZE: Final = 67  # JOB.size: fixed part of a K_JOB payload; tube name and body follow
UPDATE = struct.Struct("<BQBIqqIIIII")
UPDATE_SIZE: Final = 50  # UPDATE.size
DELETE = struct.Struct("<BQ")
DELETE_SIZE: Final = 9  # DELETE.size
DELETE_RECORD_SIZE: Final = FRAME_SIZE + DELETE_SIZE  # 17 bytes on disk
UPDATE_RECORD_SIZE: Final = FRAME_SIZE + UPDATE_SIZE
JOB_RECORD_FIXED: Final = FRAME_SIZE + JOB_SIZE  # a K_JOB record is this plus its tube name and body
# Recovery reads a record's frame, kind and id in one call (every kind starts with kind and
# id; the shortest record, a K_DELETE, is exactly this long), and a K_JOB record's frame
# and fixed part in one call.
HEAD = struct.Struct("<IIBQ")
JOB_FIELDS = struct.Struct("<I5x" + JOB.format[2:])  # frame and fixed part, crc and kind skipped
# The interpreted recovery's batch loop: JOB_FIELDS without the deadline (a ready job has
# none) and with the five counters as one 20-byte string (zeros for nearly every job).
JOB_BATCH_FIELDS = struct.Struct("<I5xQBIqqq8x20sB")
# The put path's K_JOB payload of a job put ready: JOB with state, delay, deadline and the
# five counters as pad bytes (zeros), so the pack takes 6 values instead of 14.
READY_JOB = struct.Struct("<BQxI8xqq28xB")


def plain_job_fields(tube_len: int) -> struct.Struct:
    """The batch loop's look at a K_JOB record of a tube whose name is ``tube_len`` bytes:
    (length, id, state, pri, delay, tail), ``tail`` the five counters, the name's length and the
    name as one string: one compare tells a plain job of that tube (:func:`plain_job_tail`)."""
    return struct.Struct(f"<I5xQBIq24x{21 + tube_len}s")


def plain_job_tail(tube: bytes) -> bytes:
    """The ``tail`` of :func:`plain_job_fields` for a job of ``tube`` with no counters."""
    return NO_COUNTER_BYTES + bytes((len(tube),)) + tube


_STRUCT_SIZES = (SEGMENT_HEADER.size + HEADER_CRC.size, FRAME.size, JOB.size, UPDATE.size, DELETE.size,
                 HEAD.size, JOB_FIELDS.size, JOB_BATCH_FIELDS.size, READY_JOB.size)
if _STRUCT_SIZES != (HEADER_SIZE, FRAME_SIZE, JOB_SIZE, UPDATE_SIZE, DELETE_SIZE, DELETE_RECORD_SIZE,
                     JOB_RECORD_FIXED, JOB_RECORD_FIXED, JOB_SIZE):
    raise ImportError("binlog_format: a size constant does not match its struct")

crc32: Final = zlib.crc32  # Final: mypyc keeps it in a C variable, not a dict lookup per call
Buffer = bytes | bytearray | memoryview
_frame_pack: Final = FRAME.pack
_job_pack: Final = JOB.pack
_ready_job_pack: Final = READY_JOB.pack
_update_pack: Final = UPDATE.pack
_delete_pack: Final = DELETE.pack
_unpack_head: Final = HEAD.unpack_from
_unpack_job_fields: Final = JOB_FIELDS.unpack_from
# Recovery decodes a million records at start. Compiled, reading the bytes one by one is
# native code and ~3x faster than a struct call (which makes a tuple and an int object
# per field); interpreted, the struct call is faster. Both ways are tested in both builds.
COMPILED: Final = is_compiled_file(__file__)


class UpdateRecord(NamedTuple):
    """A decoded K_UPDATE payload."""

    kind: int
    job_id: int
    state: int
    pri: int
    delay: int
    deadline: int
    reserves: int
    timeouts: int
    releases: int
    buries: int
    kicks: int


class FormatError(Exception):
    """A segment or record does not decode; ``offset`` is where, ``reason`` says why."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"{reason} at offset {offset}")
        self.offset = offset
        self.reason = reason


def segment_name(index: int) -> str:
    return f"{SEGMENT_PREFIX}{index}{SEGMENT_SUFFIX}"


def parse_state_name(name: str, suffix: str) -> int | None:
    """The index of ``binlog.<index>.sbl<suffix>`` (a base being written or committed), or None."""
    return parse_segment_name(name.removesuffix(suffix)) if name.endswith(suffix) else None


def parse_segment_name(name: str) -> int | None:
    """The index of a segment file name, or None if the name is not one of ours."""
    if not (name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX)):
        return None
    digits = name[len(SEGMENT_PREFIX):-len(SEGMENT_SUFFIX)]
    if not digits.isdigit() or (len(digits) > 1 and digits[0] == "0"):
        return None
    return int(digits)


def encode_header(index: int, max_id: int, created_wall_ns: int) -> bytes:
    head = SEGMENT_HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, index, max_id, created_wall_ns)
    return head + HEADER_CRC.pack(crc32(head))


def decode_header(data: Buffer) -> tuple[int, int, int, int]:
    """(version, index, max_id, created) of a segment; raises FormatError if it is not valid."""
    if len(data) < HEADER_SIZE:
        raise FormatError(0, f"file too short for a segment header ({len(data)} bytes)")
    magic, version, hdr_size, index, max_id, created = SEGMENT_HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        if bytes(data[:8]) == b"\0" * 8:
            raise FormatError(0, "segment header is missing (zero bytes)")
        raise FormatError(0, f"not a spark-beanstalk binlog segment (magic {bytes(magic)!r})")
    (crc,) = HEADER_CRC.unpack_from(data, SEGMENT_HEADER.size)
    if crc != crc32(data[:SEGMENT_HEADER.size]):
        raise FormatError(0, "segment header checksum mismatch")
    if version != FORMAT_VERSION:
        raise FormatError(0, f"unsupported binlog format version {version} "
                             f"(this broker reads version {FORMAT_VERSION})")
    if hdr_size < HEADER_SIZE:
        raise FormatError(0, f"bad header size {hdr_size}")
    return version, index, max_id, created


def append_job(buf: bytearray, job_id: int, state: int, pri: int, delay: int, ttr: int, created: int,
               deadline: int, reserves: int, timeouts: int, releases: int, buries: int, kicks: int,
               tube: bytes, body: bytes) -> int:
    """Append a complete K_JOB record (frame included) to ``buf``; returns its size.

    The broker's put path: one struct pack, three crc32 calls over the parts, no copies
    of the body beyond the one into ``buf``.
    """
    head = _job_pack(K_JOB, job_id, state, pri, delay, ttr, created, deadline,
                     reserves, timeouts, releases, buries, kicks, len(tube))
    return _append_framed_job(buf, head, tube, body)


def append_ready_job(buf: bytearray, job_id: int, pri: int, ttr: int, created: int, tube: bytes, body: bytes) -> int:
    """:func:`append_job` of a job put ready (state, delay, deadline and counters 0): the same
    bytes, packed from 6 values instead of 14 (the broker's put path)."""
    head = _ready_job_pack(K_JOB, job_id, pri, ttr, created, len(tube))
    return _append_framed_job(buf, head, tube, body)


def _append_framed_job(buf: bytearray, head: bytes, tube: bytes, body: bytes) -> int:
    """The frame (length, crc of the three parts) and the parts of a K_JOB record whose fixed part is ``head``."""
    length = JOB_SIZE + len(tube) + len(body)
    buf += _frame_pack(length, crc32(body, crc32(tube, crc32(head))))
    buf += head
    buf += tube
    buf += body
    return FRAME_SIZE + length


def append_update(buf: bytearray, job_id: int, state: int, pri: int, delay: int, deadline: int,
                  reserves: int, timeouts: int, releases: int, buries: int, kicks: int) -> int:
    """Append a K_UPDATE record to ``buf``; returns its size (UPDATE_RECORD_SIZE)."""
    payload = _update_pack(K_UPDATE, job_id, state, pri, delay, deadline, reserves, timeouts, releases, buries, kicks)
    buf += _frame_pack(UPDATE_SIZE, crc32(payload))
    buf += payload
    return UPDATE_RECORD_SIZE


def append_delete(buf: bytearray, job_id: int) -> int:
    """Append a K_DELETE record to ``buf``; returns its size (DELETE_RECORD_SIZE)."""
    payload = _delete_pack(K_DELETE, job_id)
    buf += _frame_pack(DELETE_SIZE, crc32(payload))
    buf += payload
    return DELETE_RECORD_SIZE


def encode_job(job_id: int, state: int, pri: int, delay: int, ttr: int, created: int, deadline: int,
               counters: tuple[int, int, int, int, int], tube: bytes, body: bytes) -> bytes:
    """A complete K_JOB record as bytes (what :func:`append_job` appends)."""
    buf = bytearray()
    reserves, timeouts, releases, buries, kicks = counters  # unpacked: compiled, a `*counters` call is a Python call
    append_job(buf, job_id, state, pri, delay, ttr, created, deadline, reserves, timeouts, releases, buries, kicks,
               tube, body)
    return bytes(buf)


def encode_ready_job(job_id: int, pri: int, ttr: int, created: int, tube: bytes, body: bytes) -> bytes:
    """:func:`encode_job` of a job put ready (what :func:`append_ready_job` appends)."""
    buf = bytearray()
    append_ready_job(buf, job_id, pri, ttr, created, tube, body)
    return bytes(buf)


def encode_update(job_id: int, state: int, pri: int, delay: int, deadline: int,
                  counters: tuple[int, int, int, int, int]) -> bytes:
    buf = bytearray()
    reserves, timeouts, releases, buries, kicks = counters
    append_update(buf, job_id, state, pri, delay, deadline, reserves, timeouts, releases, buries, kicks)
    return bytes(buf)


def encode_delete(job_id: int) -> bytes:
    buf = bytearray()
    append_delete(buf, job_id)
    return bytes(buf)


def decode_update(data: Buffer, pos: int) -> UpdateRecord:
    """The K_UPDATE record whose frame starts at ``pos`` (already checked)."""
    return UpdateRecord._make(UPDATE.unpack_from(data, pos + FRAME_SIZE))


def check_record(data: bytes, pos: int, end: int) -> int:
    """Validate the record at ``pos``; return the offset after it. Raises FormatError.

    Returns ``pos`` unchanged at the end of the data (a zero length field followed by zeros
    only, or fewer than 8 bytes left that are all zero).
    """
    return read_head(data, pos, end)[0]


def read_head(data: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """:func:`check_record`, plus what recovery needs next: ``(offset after it, kind, job id)``.

    Recovery calls this for every record: one struct call reads the frame, the kind and
    the id; the checksum reads a copy of the payload (cheaper than a memoryview slice for
    records of a few hundred bytes).
    """
    if pos + FRAME_SIZE > end:
        if not only_zeros(data, pos, end):
            raise FormatError(pos, "truncated record frame")
        return pos, 0, 0
    length: int
    crc: int
    kind: int
    job_id = 0
    if pos + DELETE_RECORD_SIZE <= end:
        if COMPILED:
            length, crc, kind, job_id = head_bytes(data, pos)
        else:
            length, crc, kind, job_id = _unpack_head(data, pos)
    else:  # too short for any valid record: read the frame alone, for the right error
        length, crc = FRAME.unpack_from(data, pos)
        kind = -1
    if length == 0:
        if crc or not only_zeros(data, pos, end):
            raise FormatError(pos, "zero bytes (unwritten space) followed by data")
        return pos, 0, 0
    start = pos + FRAME_SIZE
    stop = start + length
    if stop > end:
        raise FormatError(pos, f"record length {length} runs past the end of the file")
    computed: int = crc32(data[start:stop])  # typed: mypyc compares two ints, not two objects
    if computed != crc:
        raise FormatError(pos, "record checksum mismatch")
    if kind < 0:
        kind = data[start]
    if kind == K_JOB:
        if length < JOB_SIZE or length < JOB_SIZE + data[start + JOB_SIZE - 1]:
            raise FormatError(pos, "job record too short")
    elif kind == K_UPDATE:
        if length != UPDATE_SIZE:
            raise FormatError(pos, "update record has the wrong length")
    elif kind == K_DELETE:
        if length != DELETE_SIZE:
            raise FormatError(pos, "delete record has the wrong length")
    else:
        raise FormatError(pos, f"unknown record kind {kind}")
    return stop, kind, job_id


JobFields = tuple[int, int, int, int, int, int, int, int, int, int, int, int, int, int]


def job_fields(data: bytes, pos: int) -> JobFields:
    """The K_JOB record at ``pos`` (checked already): (payload length, id, state, pri, delay,
    ttr, created, deadline, reserves, timeouts, releases, buries, kicks, tube name length)."""
    if COMPILED:
        return job_fields_bytes(data, pos)
    return cast(JobFields, _unpack_job_fields(data, pos))


def job_fields_struct(data: bytes, pos: int) -> JobFields:
    """:func:`job_fields` with a struct call (what the interpreted build runs)."""
    return cast(JobFields, _unpack_job_fields(data, pos))


def job_fields_bytes(data: bytes, pos: int) -> JobFields:
    """:func:`job_fields` byte by byte (what the compiled build runs)."""
    p = pos + FRAME_SIZE
    if data[p + 46:p + 66] == NO_COUNTER_BYTES:
        reserves = timeouts = releases = buries = kicks = 0
    else:
        reserves, timeouts = u32(data, p + 46), u32(data, p + 50)
        releases, buries, kicks = u32(data, p + 54), u32(data, p + 58), u32(data, p + 62)
    return (u32(data, pos), u64(data, p + 1), data[p + 9], u32(data, p + 10), s64(data, p + 14),
            s64(data, p + 22), s64(data, p + 30), s64(data, p + 38), reserves, timeouts, releases, buries, kicks,
            data[p + 66])


NO_COUNTER_BYTES: Final = bytes(20)


def head_bytes(data: bytes, pos: int) -> tuple[int, int, int, int]:
    """(length, crc, kind, job id) of the record at ``pos``, as ``HEAD.unpack_from`` reads them."""
    return u32(data, pos), u32(data, pos + 4), data[pos + 8], u64(data, pos + 9)


# Little-endian integers read with mypyc's native 64-bit ints (i64): plain C shifts and ors
# when compiled, where tagged Python ints cost a call and an overflow check per operation.
def u32(data: bytes, pos: i64) -> i64:
    return i64(data[pos]) | i64(data[pos + 1]) << 8 | i64(data[pos + 2]) << 16 | i64(data[pos + 3]) << 24


def u64(data: bytes, pos: i64) -> int:
    return int(u32(data, pos)) | int(u32(data, pos + 4)) << 32


def s64(data: bytes, pos: i64) -> i64:
    high = u32(data, pos + 4)
    if high >> 31:
        high -= 1 << 32  # a negative value: stays in range, where a shift into the sign bit would not
    return high << 32 | u32(data, pos)


def find_next_valid(data: bytes, pos: int, end: int) -> int | None:
    """The offset of the first valid record after ``pos`` (slow: used only on damage)."""
    unpack = FRAME.unpack_from
    p = pos + 1
    while p + FRAME_SIZE < end:
        length, _crc = unpack(data, p)
        if 1 <= length <= end - p - FRAME_SIZE and data[p + FRAME_SIZE] in (K_JOB, K_UPDATE, K_DELETE):
            try:
                if check_record(data, p, end) > p:
                    return p
            except FormatError:
                pass
        p += 1
    return None


def only_zeros(data: Buffer, start: int, end: int) -> bool:
    """True when ``data[start:end]`` is all zero bytes (preallocated, never written), read 1 MiB at a time."""
    chunk = 1 << 20
    return not any(bytes(data[p:min(end, p + chunk)]).strip(b"\0") for p in range(start, end, chunk))
