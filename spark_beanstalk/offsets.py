"""The source's offsets: which jobs of which broker make up a micro-batch.

Spark stores an offset as ``json.dumps`` of what ``latestOffset`` returns, compares
offsets as strings and copies them into every progress event, so an offset is built in
sorted key order, names ids as compact ranges (ids from a FIFO tube come in runs), and
carries per block of ``DIGEST_BLOCK`` ids a digest of the jobs' tubes and bodies: after a
restart the source can tell the jobs it planned from other jobs that reuse their ids (a
broker restarted without its binlog numbers jobs from 1 again).

Version 3 adds per broker "rt": the wall-clock second before the batch's first reservation.
A block some of whose jobs were deleted fails its digest, so its other jobs are then judged
one by one (``recovery.verify_offset_jobs``): a broker can only reuse an id in a later
incarnation, and every job of that incarnation was put after it started, so after "rt".

Version 1 offsets (no digests) are still read; their jobs are taken on trust. Version 2
offsets (no "rt") accept only whole blocks.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

OFFSET_VERSION = 3
DIGEST_BLOCK = 64
_DIGEST_WIDTH = 8    # hex characters per block digest

Offset = dict[str, Any]


class BrokerJobs(NamedTuple):
    """One broker's part of an offset: its server id, the job ids (sorted) and their block digests."""

    sid: str
    ids: list[int]
    digests: list[str]   # one per DIGEST_BLOCK ids in `ids` order; [] = not known (version 1)
    reserved_s: int = 0  # wall-clock second at or before the first reservation of these jobs; 0 = unknown


def encode_ranges(ids: Sequence[int]) -> str:
    """[1,2,3,7,9,10] -> '1-3,7,9-10' (ids sorted first)."""
    out: list[str] = []
    it = iter(sorted(ids))
    try:
        lo = hi = next(it)
    except StopIteration:
        return ""
    for i in it:
        if i == hi + 1:
            hi = i
            continue
        out.append(str(lo) if lo == hi else f"{lo}-{hi}")
        lo = hi = i
    out.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return ",".join(out)


def decode_ranges(text: str) -> list[int]:
    ids: list[int] = []
    for part in text.split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            ids.extend(range(int(lo), int(hi) + 1))
        else:
            ids.append(int(lo))
    return ids


def body_digest(body: bytes) -> int:
    """What the source remembers of a body to recognise its job later (CRC-32: cheap, C speed)."""
    return zlib.crc32(body)


def reserved_second(reserved_at_us: Sequence[int]) -> int:
    """The "rt" of jobs reserved at these wall-clock times: one second early, because a time
    is taken after the reserve's reply and must not be later than the reservation itself."""
    return max(0, min(reserved_at_us) // 1_000_000 - 1) if reserved_at_us else 0


def block_digests(ids: Sequence[int], tubes: Sequence[str], digests: Sequence[int]) -> list[str]:
    """Digests of (id, tube, body digest) per DIGEST_BLOCK jobs, in ascending id order."""
    order = sorted(range(len(ids)), key=ids.__getitem__)
    out: list[str] = []
    for lo in range(0, len(order), DIGEST_BLOCK):
        parts = [b"%d %s %d\n" % (ids[i], tubes[i].encode(), digests[i]) for i in order[lo:lo + DIGEST_BLOCK]]
        out.append(f"{zlib.crc32(b''.join(parts)):08x}")
    return out


def make_offset(seq: int, jobs: Mapping[str, tuple[str, Sequence[int]] | BrokerJobs],
                pending: Mapping[str, BrokerJobs] | None = None) -> Offset:
    """The offset of batch `seq`:
    {"jobs": {"host:port": {"dg": "<8 hex per 64 ids>", "ids": "1-9,12", "rt": second, "sid": server id}},
     "seq": n, "v": 3}.

    `pending`: jobs of earlier, committed batches whose delete is still owed (their broker was
    down), as "del"/"ddg" beside a broker's "ids"/"dg": a query restarted from this offset
    deletes them. Every key of an entry is always present and dicts are built in sorted key
    order (Spark compares offsets as strings).
    """
    out: dict[str, dict[str, Any]] = {}
    pending = pending or {}
    for addr in sorted(set(jobs) | set(pending)):
        entry = jobs.get(addr)
        owed = pending.get(addr)
        if (entry is None or not entry[1]) and (owed is None or not owed.ids):
            continue
        ids = entry[1] if entry is not None else []
        dg = "".join(entry.digests) if isinstance(entry, BrokerJobs) else ""
        sid = entry[0] if entry is not None else (owed.sid if owed is not None else "")
        item: dict[str, Any] = {"dg": dg, "ids": encode_ranges(ids), "sid": sid}
        if isinstance(entry, BrokerJobs) and entry.reserved_s:
            item["rt"] = entry.reserved_s
        if owed is not None and owed.ids:
            item.update({"ddg": "".join(owed.digests), "del": encode_ranges(owed.ids)})
            if owed.reserved_s:
                item["drt"] = owed.reserved_s
        out[addr] = dict(sorted(item.items()))
    return {"jobs": out, "seq": int(seq), "v": OFFSET_VERSION}


def offset_seq(offset: Offset | None) -> int:
    return int((offset or {}).get("seq", 0))


def _split_digests(dg: str) -> list[str]:
    return [dg[i:i + _DIGEST_WIDTH] for i in range(0, len(dg), _DIGEST_WIDTH)]


def offset_jobs(offset: Offset | None) -> dict[str, BrokerJobs]:
    """The per-broker jobs of an offset's batch (any version)."""
    result: dict[str, BrokerJobs] = {}
    for addr, entry in (offset or {}).get("jobs", {}).items():
        ids = decode_ranges(entry.get("ids", ""))
        if ids:
            result[addr] = BrokerJobs(str(entry.get("sid", "")), ids, _split_digests(str(entry.get("dg", ""))),
                                      int(entry.get("rt", 0)))
    return result


def offset_pending(offset: Offset | None) -> dict[str, BrokerJobs]:
    """The per-broker jobs of earlier committed batches still to delete ("del")."""
    result: dict[str, BrokerJobs] = {}
    for addr, entry in (offset or {}).get("jobs", {}).items():
        ids = decode_ranges(entry.get("del", ""))
        if ids:
            result[addr] = BrokerJobs(str(entry.get("sid", "")), ids, _split_digests(str(entry.get("ddg", ""))),
                                      int(entry.get("drt", 0)))
    return result
