"""The replication stream's format: binlog records, each with its epoch and sequence number.

After a line-based handshake (``auth <token>`` when the broker has a token, then
``replicate <name> <epoch> <seq> [exact]``; the leader answers ``STREAMING <epoch>``), the leader
sends messages, each a fixed header then a payload::

    kind B, epoch Q, seq Q, wall_ns q, length I, payload (length bytes)

* ``M_RECORD``: payload is one binlog record exactly as it is framed on disk
  (``broker.binlog_format``: length, crc32, payload); ``seq`` numbers the records of an
  epoch from 1 without gaps; ``wall_ns`` is when the leader logged it.
* ``M_SNAPSHOT_BEGIN`` / ``M_SNAPSHOT_END``: between them, one K_JOB record per live job
  (sent as ``M_RECORD`` with ``seq`` 0); the replica then drops every job the snapshot did not
  name and stands at ``seq`` of the end message. END's payload is the leader's next job id (Q).
* ``M_HEARTBEAT``: ``seq`` is the leader's newest record, payload its next job id (Q).

Besides the binlog's records, an ``M_RECORD`` may carry a stream-only ``K_PAUSE`` record (framed
the same way): ``pause-tube`` on the leader (kind B, pause ns Q, wall-clock end q, tube name), which
the binlog does not keep (beanstalkd's does not either) but a failover should.
* ``M_NEW_EPOCH``: the replica's history is the leader's up to the start of ``epoch``: the
  leader had exactly the records the replica has, (epoch Q, seq Q) in the payload, when it was
  elected. The replica stands at (``epoch``, 0) and the records of the new epoch follow. Sent
  instead of a snapshot to a replica that asked with ``exact`` (see the handshake) for the
  leader's position at its election, or for an earlier one of that epoch that the leader still
  has the records after (sent first, as ``M_RECORD`` of the old epoch).

The handshake's optional fifth word, ``exact``, says the replica's queue is exactly the state
at its position (it has applied every change since its last snapshot in this process, so no
binlog written past a lagging position file can hold more).

The replica answers with ``ACK`` messages (epoch Q, seq Q): every record up to ``seq`` is in
its queue and written to its own binlog.
"""
from __future__ import annotations

import struct
import zlib
from typing import Final, NamedTuple

from broker import binlog_format as fmt

HEADER = struct.Struct("<BQQqI")
ACK = struct.Struct("<QQ")
EPOCH_START = ACK  # M_NEW_EPOCH's payload: the (epoch, seq) the leader stood at when elected
NEXT_ID = struct.Struct("<Q")
M_RECORD, M_SNAPSHOT_BEGIN, M_SNAPSHOT_END, M_HEARTBEAT, M_NEW_EPOCH = 1, 2, 3, 4, 5
KINDS = frozenset((M_RECORD, M_SNAPSHOT_BEGIN, M_SNAPSHOT_END, M_HEARTBEAT, M_NEW_EPOCH))
MAX_MESSAGE = 1 << 31
K_PAUSE = 100  # a stream-only record kind, beyond the binlog's (binlog_format.K_*)
PAUSE = struct.Struct("<BQq")


# Records are built with tuple.__new__: a NamedTuple's own constructor is a Python-level function,
# an interpreted call per message even in the compiled build (see broker.protocol).
_new: Final = tuple.__new__


class StreamError(Exception):
    """The stream does not decode (a bug or a corrupted connection): drop it and reconnect."""


class Message(NamedTuple):
    kind: int
    epoch: int
    seq: int
    wall_ns: int
    payload: bytes


class StreamRecord(NamedTuple):
    """One M_RECORD as a replica keeps it after applying it (``Applier.tail``), to send it on if elected."""

    seq: int
    wall_ns: int
    record: bytes


def new_tail_record(seq: int, wall_ns: int, record: bytes) -> StreamRecord:
    return _new(StreamRecord, (seq, wall_ns, record))


class JobFields(NamedTuple):
    """A decoded K_JOB record (times in wall-clock ns, as in the binlog)."""

    id: int
    state: int
    pri: int
    delay: int
    ttr: int
    created: int
    deadline: int
    counters: tuple[int, int, int, int, int]
    tube: str
    body: bytes


class PauseFields(NamedTuple):
    """A decoded K_PAUSE record: the tube, its pause, and when it ends (wall-clock ns)."""

    tube: str
    pause: int
    until: int


class UpdateFields(NamedTuple):
    id: int
    state: int
    pri: int
    delay: int
    deadline: int
    counters: tuple[int, int, int, int, int]


def message(kind: int, epoch: int, seq: int, wall_ns: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, epoch, seq, wall_ns, len(payload)) + payload


def split_messages(buf: bytearray) -> list[Message]:
    """Take every complete message off the front of ``buf``."""
    out: list[Message] = []
    pos = 0
    size = HEADER.size
    while len(buf) - pos >= size:
        kind, epoch, seq, wall, length = HEADER.unpack_from(buf, pos)
        if kind not in KINDS or length >= MAX_MESSAGE:
            raise StreamError(f"bad message header (kind {kind}, length {length})")
        if len(buf) - pos - size < length:
            break
        start = pos + size
        out.append(_new(Message, (kind, epoch, seq, wall, bytes(buf[start:start + length]))))
        pos = start + length
    del buf[:pos]
    return out


def encode_pause(tube: bytes, pause_ns: int, until_wall_ns: int) -> bytes:
    """A framed K_PAUSE record (the framing of a binlog record: length, crc32, payload)."""
    payload = PAUSE.pack(K_PAUSE, pause_ns, until_wall_ns) + tube
    return fmt.FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def decode_record(record: bytes) -> JobFields | UpdateFields | PauseFields | int:
    """One framed record: the job's fields, an update's, a pause's, or a deleted job's id."""
    if len(record) < fmt.FRAME_SIZE + 1:
        raise StreamError("record too short")
    length, crc = fmt.FRAME.unpack_from(record, 0)
    payload = record[fmt.FRAME_SIZE:]
    if length != len(payload) or zlib.crc32(payload) != crc:
        raise StreamError("record checksum or length mismatch")
    kind = payload[0]
    if kind == fmt.K_JOB and len(payload) >= fmt.JOB_SIZE:
        f = fmt.JOB.unpack_from(payload, 0)
        tube_end = fmt.JOB_SIZE + f[13]
        tube = payload[fmt.JOB_SIZE:tube_end].decode("latin-1")
        return _new(JobFields, (f[1], f[2], f[3], f[4], f[5], f[6], f[7], (f[8], f[9], f[10], f[11], f[12]), tube,
                                payload[tube_end:]))
    if kind == fmt.K_UPDATE and len(payload) == fmt.UPDATE_SIZE:
        u = fmt.UPDATE.unpack_from(payload, 0)
        return _new(UpdateFields, (u[1], u[2], u[3], u[4], u[5], (u[6], u[7], u[8], u[9], u[10])))
    if kind == fmt.K_DELETE and len(payload) == fmt.DELETE_SIZE:
        return int(fmt.DELETE.unpack_from(payload, 0)[1])
    if kind == K_PAUSE and len(payload) > PAUSE.size:
        _, pause, until = PAUSE.unpack_from(payload, 0)
        return _new(PauseFields, (payload[PAUSE.size:].decode("latin-1"), pause, until))
    raise StreamError(f"unknown record kind {kind} or wrong length")
