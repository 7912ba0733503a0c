"""Getting held jobs back after a connection died, a broker restarted, or the query restarted.

beanstalkd releases a connection's reservations when it closes, and a broker restarted
without its binlog numbers new jobs from 1 again. So before the source re-acquires or
deletes a job it no longer holds, it checks on the broker that the job is still the one
it reserved (same tube, same body digest); a job that changed identity or vanished is
counted as lost to its batch and left alone, never deleted.

Every function expects the caller to hold the broker's lock.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

from spark_beanstalk.batch import Batch, JobColumns
from spark_beanstalk.brokers import BrokerLink, ResConn
from spark_beanstalk.client import REFUSED_FOR_NOW, Connection, ConnectionLost
from spark_beanstalk.offsets import DIGEST_BLOCK, BrokerJobs, block_digests, body_digest
from spark_beanstalk.source_wire import (
    PIPELINE_WINDOW,
    Identity,
    delete_jobs,
    inspect_jobs,
    not_leading,
)

log = logging.getLogger("spark_beanstalk.source")


def reacquire(b: BrokerLink, wait_seconds: float) -> bool:
    """Re-acquire the held jobs whose connection died, on new connections.

    Jobs of planned or read-ahead batches that are back in ready are reserved again with
    ``reserve-job`` into the same batch; jobs of committed batches are deleted. Returns
    True when the broker is connected and may be read (jobs still reserved by someone
    else are retried on the next call, up to `wait_seconds`).
    """
    if not b.connected() and not b.open():
        return False
    if not b.dirty:
        return True
    try:
        for batch, ids in b.orphans().items():
            _settle(b, batch, sorted(ids), wait_seconds)
    except ConnectionLost as exc:
        b.reset(exc)
        b.mark_down(exc)
        return False
    b.dirty = any(lot.rc.dead for lot in b.held.values())
    return True


def _settle(b: BrokerLink, batch: Batch, ids: list[int], wait_seconds: float) -> None:
    cols = batch.jobs.get(b.address) or JobColumns.empty()
    index = cols.rows_by_id()
    if batch.committed:
        assert b.control is not None
        same = _check(b, b.control, ids, cols, index, batch, wait_seconds)
        failed = len(same) - delete_jobs(b.control, same) if same else 0
        b.counters.cleaned += len(same) - failed
        b.counters.lost += failed
        b.unhold(same)
        return
    pos, idx = 0, 0
    while pos < len(ids):
        idx, rc = b.conn_with_room(idx)
        chunk = ids[pos:pos + min(b.opts.jobs_per_connection - rc.count, PIPELINE_WINDOW)]
        pos += len(chunk)
        same = _check(b, rc.conn, chunk, cols, index, batch, wait_seconds)
        if same:
            _reserve_again(b, rc, batch, same, cols, index)


def _check(b: BrokerLink, conn: Connection, ids: list[int], cols: JobColumns, index: dict[int, int], batch: Batch,
           wait_seconds: float) -> list[int]:
    """The ids that are still our jobs and not reserved by anyone; the changed or vanished are
    counted lost and forgotten, the ones reserved elsewhere are kept for a later try."""
    found = inspect_jobs(conn, ids)
    now = time.monotonic()
    same: list[int] = []
    lost: list[int] = []
    for jid in ids:
        got, i = found.get(jid), index.get(jid)
        if got is None and batch.committed:
            b.unhold([jid])         # a committed job that is gone: deleted before the connection died
        elif got is None or i is None or got.tube != cols.tubes[i] or got.digest != cols.digests[i]:
            lost.append(jid)
        elif got.state != "reserved":
            same.append(jid)
        elif now - b.waiting_since.setdefault(jid, now) > wait_seconds:
            lost.append(jid)    # reserved by someone else all along: not ours any more
    if lost:
        log.warning("beanstalk source: %d jobs of %s on %s changed or vanished since they were reserved "
                    "(a broker restart without its binlog?); counted lost, left alone",
                    len(lost), f"batch {batch.seq}" if batch.seq >= 0 else "the read-ahead", b.address)
        b.counters.lost_to_restart += len(lost)
        b.unhold(lost)
        if batch.offset is None:
            batch.drop(b.address, set(lost))   # not planned yet: it never reaches Spark
    return same


def _reserve_again(b: BrokerLink, rc: ResConn, batch: Batch, ids: list[int], cols: JobColumns,
                   index: dict[int, int]) -> None:
    got: list[int] = []
    lost: list[int] = []
    for jid, (line, body) in zip(ids, rc.conn.pipeline_replies([b"reserve-job %d\r\n" % j for j in ids]), strict=False):
        if line.startswith(b"RESERVED ") and body is not None and body_digest(body) == cols.digests[index[jid]]:
            got.append(jid)
        elif line in REFUSED_FOR_NOW:
            raise not_leading(rc.conn, line, "reserve-job")  # not gone: asked of a member that does not lead
        else:
            lost.append(jid)
    b.hold(rc, batch, got, [cols.ttrs[index[j]] for j in got], time.monotonic())
    b.counters.reacquired += len(got)
    if lost:
        b.counters.lost_to_restart += len(lost)
        b.unhold(lost)
        if batch.offset is None:
            batch.drop(b.address, set(lost))


# --- after a query restart: only the offset is known --------------------------------------------

class Verified(NamedTuple):
    """Jobs an offset names, as found on the broker."""

    ok: dict[int, Identity]     # passed the digest check: ours
    rejected: list[int]         # in a block that failed it (vanished, or another job now)
    present: set[int]           # every id that exists on the broker


def verify_offset_jobs(b: BrokerLink, bj: BrokerJobs) -> Verified:
    """Inspect the jobs an offset names (on the control connection) and check them against its
    block digests. Version 1 offsets (no digests): every job present passes. A block that fails
    (some of its jobs were deleted) is judged job by job when the offset has "rt"
    (``_still_ours``)."""
    assert b.control is not None
    found: dict[int, Identity] = {}
    for lo in range(0, len(bj.ids), PIPELINE_WINDOW):
        found.update(inspect_jobs(b.control, bj.ids[lo:lo + PIPELINE_WINDOW]))
    if not bj.digests:
        return Verified(found, [j for j in bj.ids if j not in found], set(found))
    ok: dict[int, Identity] = {}
    rejected: list[int] = []
    partial: list[int] = []
    for k, lo in enumerate(range(0, len(bj.ids), DIGEST_BLOCK)):
        block = bj.ids[lo:lo + DIGEST_BLOCK]
        idents = [found[j] for j in block if j in found]
        good = k < len(bj.digests) and len(idents) == len(block) and block_digests(
            block, [i.tube for i in idents], [i.digest for i in idents]) == [bj.digests[k]]
        if good:
            ok.update(zip(block, idents, strict=True))
        else:
            partial.extend(j for j in block if j in found)
            rejected.extend(j for j in block if j not in found)
    if partial:
        mine = _still_ours(b, bj.reserved_s, {j: found[j] for j in partial})
        ok.update((j, found[j]) for j in partial if j in mine)
        rejected.extend(j for j in partial if j not in mine)
    return Verified(ok, rejected, set(found))


def _still_ours(b: BrokerLink, reserved_s: int, jobs: dict[int, Identity]) -> set[int]:
    """The jobs, of a block that failed its digest, that are still the ones the offset named.

    A broker reuses an id only in a later incarnation (restarted without its binlog), which
    started after we reserved the id, and each of its jobs was put after it started. So a job
    is ours when it is in one of our tubes and either the broker has been up since before
    `reserved_s` (no restart since: ids are unique) or the job was put before `reserved_s`
    (its stats-job age says so: a reused id is younger). Ages and uptimes are whole seconds,
    rounded so as to reject when in doubt; 0 (offsets before version 3) rejects all.
    """
    if reserved_s <= 0 or not jobs:
        return set()
    assert b.control is not None
    uptime = int(b.control.stats().get("uptime", 0))
    now = time.time()                    # after the replies: errs towards "too young"
    same_incarnation = now - uptime <= reserved_s
    return {j for j, ident in jobs.items() if ident.tube in b.opts.tubes
            and (same_incarnation or ident.age >= 0 and now - ident.age <= reserved_s)}


def rejected_warning(b: BrokerLink, what: str, rejected: Sequence[int]) -> None:
    if rejected:
        b.counters.lost_to_restart += len(rejected)
        log.warning("beanstalk source: %d jobs of %s on %s are gone or are other jobs now (a broker restart "
                    "without its binlog?); left alone", len(rejected), what, b.address)


def settle_already_held(b: BrokerLink, rc: ResConn, cols: JobColumns) -> JobColumns:
    """Reserved a job we hold for another batch: its connection died unnoticed and the broker
    released it. The same job goes back to its batch (or is deleted, if that batch committed);
    a different job under a reused id is new, and the old one is lost."""
    keep: list[int] = []
    for i, jid in enumerate(cols.ids):
        lot = b.held.get(jid)
        if lot is None:
            keep.append(i)
            continue
        if not lot.rc.dead:
            lot.rc.dead = True          # the broker released its jobs: that connection is gone
            lot.rc.conn.close()
            b.conns = [c for c in b.conns if c is not lot.rc]
            b.dirty = True
        old = lot.batch.jobs.get(b.address)
        row = old.ids.index(jid) if old is not None else -1
        if old is None or old.tubes[row] != cols.tubes[i] or old.digests[row] != cols.digests[i]:
            b.unhold([jid])
            b.counters.lost_to_restart += 1
            if lot.batch.offset is None:
                lot.batch.drop(b.address, {jid})
            keep.append(i)
        elif lot.batch.committed:
            b.unhold([jid])
            b.counters.cleaned += delete_jobs(rc.conn, [jid])
        else:
            b.hold(rc, lot.batch, [jid], [cols.ttrs[i]], time.monotonic())
            b.counters.reacquired += 1
    return cols.keep(keep)
