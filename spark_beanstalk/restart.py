"""After a query restart only the offsets are known: rebuild the uncommitted batch from its
offset (``replay_broker``) and delete what the committed one left behind (``cleanup_broker``),
each job first checked against the offset's block digests (``recovery.verify_offset_jobs``).

Every function expects the caller to hold the broker's lock.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from spark_beanstalk.batch import Batch
from spark_beanstalk.brokers import BrokerLink, ResConn
from spark_beanstalk.offsets import BrokerJobs, body_digest
from spark_beanstalk.recovery import rejected_warning, verify_offset_jobs
from spark_beanstalk.source_wire import (
    PIPELINE_WINDOW,
    Identity,
    delete_jobs,
    failed_commands,
)

log = logging.getLogger("spark_beanstalk.source")

# Adds jobs just reserved on a connection to a batch (stats-job, hold); returns how many joined.
Admit = Callable[[BrokerLink, ResConn, Batch, list[int], list[bytes]], int]


def cleanup_broker(b: BrokerLink, bj: BrokerJobs, what: str, wait_seconds: float) -> None:
    """Delete the jobs of a committed batch that are back in ready, once verified as ours."""
    deadline = time.monotonic() + wait_seconds
    todo = bj
    while True:
        ok, rejected, present = verify_offset_jobs(b, todo)
        rejected_warning(b, what, [j for j in rejected if j in present])  # vanished ones were deleted
        ready = [j for j, ident in ok.items() if ident.state != "reserved"]
        assert b.control is not None
        if ready:
            b.counters.cleaned += delete_jobs(b.control, sorted(ready))
        waiting = sorted(j for j, ident in ok.items() if ident.state == "reserved")
        if not waiting or time.monotonic() > deadline:
            if waiting:
                log.warning("beanstalk source: %d committed jobs on %s are still reserved elsewhere after "
                            "%.0fs; they may be delivered again", len(waiting), b.address,
                            wait_seconds)
            return
        time.sleep(0.1)
        # the same jobs, checked again (their digests are known now)
        todo = BrokerJobs(bj.sid, waiting, [])


def replay_broker(b: BrokerLink, batch: Batch, bj: BrokerJobs, wait_seconds: float, admit: Admit,
                  skip: frozenset[int] | set[int] = frozenset()) -> None:
    """Reserve again, with reserve-job, the jobs of a planned batch that pass the identity check
    (all but `skip`: those the batch holds already, from a try cut short by a lost connection)."""
    ok, rejected, _ = verify_offset_jobs(b, bj)
    rejected_warning(b, f"batch {batch.seq}", [j for j in rejected if j not in skip])
    deadline = time.monotonic() + wait_seconds
    todo = [j for j in bj.ids if j in ok and j not in skip]
    while todo:
        waiting = _replay_some(b, batch, todo, ok, admit)
        if not waiting or time.monotonic() > deadline:
            if waiting:
                log.warning("beanstalk source: %d jobs of batch %d on %s are still reserved elsewhere after "
                            "%.0fs; replaying without them", len(waiting), batch.seq, b.address,
                            wait_seconds)
            return
        todo = waiting
        time.sleep(0.1)

def _replay_some(b: BrokerLink, batch: Batch, ids: list[int], known: dict[int, Identity], admit: Admit) -> list[int]:
    """reserve-job each id; returns the ids held by someone else (worth waiting for)."""
    missing: list[int] = []
    idx, pos = 0, 0
    while pos < len(ids):
        idx, rc = b.conn_with_room(idx)
        chunk = ids[pos:pos + min(b.opts.jobs_per_connection - rc.count, PIPELINE_WINDOW)]
        pos += len(chunk)
        got, bodies, wrong = [], [], []
        replies = rc.conn.pipeline_replies([b"reserve-job %d\r\n" % j for j in chunk])
        for jid, (line, body) in zip(chunk, replies, strict=False):
            if body is None or not line.startswith(b"RESERVED "):
                missing.append(jid)
            elif body_digest(body) != known[jid].digest:
                wrong.append(jid)     # another job took the id between the check and now
            else:
                got.append(jid)
                bodies.append(body)
        if wrong:
            failed_commands(rc.conn, [b"release %d 0 0\r\n" % j for j in wrong], b"RELEASED")
            rejected_warning(b, f"batch {batch.seq}", wrong)
        if got:
            # A replayed batch is replayed whole: no poison check (it was planned with these jobs).
            admit(b, rc, batch, got, bodies)
            b.counters.replayed += len(got)
    if not missing:
        return []
    assert b.control is not None
    return [j for j, ident in verify_offset_jobs(b, BrokerJobs(b.sid, missing, [])).ok.items()
            if ident.state == "reserved"]
