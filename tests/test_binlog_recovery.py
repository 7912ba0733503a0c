"""Recovery against a direct replay of the log's rules (hypothesis), on logs written record by record.

The broker's own writes never produce some orders that recovery must still get right
(several K_JOB copies of one job in one segment, updates and deletes of jobs whose K_JOB
is gone, a job written again after its delete), and recovery keeps only the exceptions
of a log in memory (see ``broker.binlog_recovery.ScanResult``). So these logs are made
of random K_JOB / K_UPDATE / K_DELETE records over a few ids, split into segments, and
the recovered queue must equal a plain replay of the rules in ``broker.binlog_format``:
for each id the last K_JOB or K_UPDATE wins until a later K_DELETE removes it; a reserve
update moves only the counters; a reserved job comes back ready; buried jobs come back in
the order of the records that buried them; a job's file is the segment of its last K_JOB.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import binlog_format as fmt
from broker.binlog import open_binlog
from broker.queue import BURIED, DELAYED, READY, Queue

TUBES = ("default", "t1")
HOUR = 3600 * 10**9
IDS = st.integers(1, 8)
COUNTERS = st.tuples(*(st.integers(0, 3) for _ in range(5)))
STATES = st.sampled_from([fmt.S_READY, fmt.S_DELAYED, fmt.S_RESERVED, fmt.S_BURIED])

record = st.one_of(
    st.tuples(st.just("job"), IDS, STATES, st.integers(0, 2000), st.integers(0, 1), COUNTERS),
    st.tuples(st.just("update"), IDS, STATES, st.integers(0, 2000), COUNTERS),
    st.tuples(st.just("delete"), IDS),
    st.tuples(st.just("segment")),
)


@dataclass
class Expected:
    tube: str
    body: bytes
    state: int
    pri: int
    delay: int
    counters: tuple[int, int, int, int, int]
    file: int
    place: int  # position of the record that set its state (buried order)


def _write_log(directory: str, records: list[tuple]) -> dict[int, Expected]:
    """Write the records as segments 1, 2, ... and replay them; returns the expected live jobs."""
    now = time.time_ns()
    live: dict[int, Expected] = {}
    segments: list[bytearray] = []
    max_id = 0
    for place, rec in enumerate(records):
        if rec[0] == "segment" or not segments:
            segments.append(bytearray(fmt.encode_header(len(segments) + 1, max_id, now)))
            if rec[0] == "segment":
                continue
        seg, jid = segments[-1], rec[1]
        if rec[0] == "job":
            _, _, state, pri, t, counters = rec
            body = f"job {jid} record {place}".encode()
            delay = 10**9 if state == fmt.S_DELAYED else 0
            seg += fmt.encode_job(jid, state, pri, delay, 60 * 10**9, now, now + HOUR if delay else 0, counters,
                                  TUBES[t].encode(), body)
            live[jid] = Expected(TUBES[t], body, state, pri, delay, counters, len(segments), place)
            max_id = max(max_id, jid)
        elif rec[0] == "update":
            _, _, state, pri, counters = rec
            delay = 2 * 10**9 if state == fmt.S_DELAYED else 0
            seg += fmt.encode_update(jid, state, pri, delay, now + HOUR if delay else 0, counters)
            job = live.get(jid)
            if job is not None:
                job.counters = counters
                if state != fmt.S_RESERVED:  # a reserve: the state and place of the record before stand
                    job.state, job.pri, job.delay, job.place = state, pri, delay, place
        else:
            seg += fmt.encode_delete(jid)
            live.pop(jid, None)
            max_id = max(max_id, jid)
    for idx, seg in enumerate(segments, 1):
        with open(os.path.join(directory, fmt.segment_name(idx)), "wb") as fh:
            fh.write(seg)
    return live


def _recovered(directory: str) -> tuple[Queue, dict[int, Expected]]:
    log = open_binlog(directory, fsync_ms=None)
    queue = Queue(time.monotonic_ns, listener=log)
    try:
        log.recover(queue)
    finally:
        log.close()
    got = {}
    for job in queue.jobs.values():
        counters = (job.reserves, job.timeouts, job.releases, job.buries, job.kicks)
        got[job.id] = Expected(job.tube.name, job.body, job.state, job.pri, job.delay, counters, job.file, 0)
    return queue, got


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(record, min_size=1, max_size=40))
def test_recovery_equals_a_replay_of_the_records(records):
    directory = tempfile.mkdtemp(prefix="recovery-replay-")
    try:
        expected = _write_log(directory, records)
        queue, got = _recovered(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    states = {fmt.S_READY: READY, fmt.S_RESERVED: READY, fmt.S_DELAYED: DELAYED, fmt.S_BURIED: BURIED}
    want = {jid: Expected(e.tube, e.body, states[e.state], e.pri, e.delay, e.counters, e.file, 0)
            for jid, e in expected.items()}
    assert got == want
    for name in TUBES:
        buried = sorted((e.place, jid) for jid, e in expected.items() if e.state == fmt.S_BURIED and e.tube == name)
        tube = queue.tube_by_name.get(name)
        assert ([job.id for job in tube.buried.values()] if tube else []) == [jid for _, jid in buried]
    ids = [r[1] for r in records if r[0] in ("job", "delete")]
    assert queue.next_id > max(ids, default=0)


U32 = st.integers(0, 2**32 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(job_id=st.integers(1, 2**64 - 1), state=st.integers(0, 3), pri=U32, delay=I64, ttr=I64, created=I64,
       deadline=I64, counters=st.one_of(st.just((0, 0, 0, 0, 0)), st.tuples(U32, U32, U32, U32, U32)),
       tube=st.binary(max_size=20), body=st.binary(max_size=40), offset=st.integers(0, 9))
def test_both_decoders_read_every_field_alike(job_id, state, pri, delay, ttr, created, deadline, counters, tube, body,
                                              offset):
    """The compiled build reads records byte by byte, the interpreted one with struct calls:
    both functions exist in both builds, and must agree on every field of every record."""
    data = bytes(offset) + fmt.encode_job(job_id, state, pri, delay, ttr, created, deadline, counters, tube, body)
    fields = fmt.job_fields_bytes(data, offset)
    assert fields == tuple(fmt.job_fields_struct(data, offset)) == fmt.job_fields(data, offset)
    assert fields == (fmt.JOB_SIZE + len(tube) + len(body), job_id, state, pri, delay, ttr, created, deadline,
                      *counters, len(tube))
    assert fmt.head_bytes(data, offset) == fmt.HEAD.unpack_from(data, offset)
    assert fmt.read_head(data, offset, len(data)) == (len(data), fmt.K_JOB, job_id)
