"""Recovery's batch loops (what the interpreted build runs) against its per-record walk.

``broker.binlog_recovery`` reads plain records in one loop per segment when interpreted
(``BATCH``) and one call per record when compiled. Both ways exist in both builds: here the
same logs are recovered both ways and everything a client or the binlog can observe must be
equal: every field of every job, the ready entries in order (heap and run: the order of
reserves), the delayed heap as a list, buried order, tube order, the queue's counts, the scan's result and the
per-segment id lists that compaction uses.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import binlog_format as fmt
from broker.binlog_file import BinlogDir, BinlogError
from broker.binlog_recovery import RestoreTally, Scanner, restore_records
from broker.jobtable import JobTable
from broker.model import COMPILED, INVALID, READY, Job, Tube, new_job
from broker.queue import Queue
from broker.queue_restore import Restorer

HOUR = 3600 * 10**9
JOB_FIELDS = ("id", "pri", "ttr", "body", "state", "created", "deadline", "reserves", "rare", "file")


def _recover(directory: str, batch: bool, wall_off: int, ignore_damage: bool = False) -> dict:
    """Recover a copy of ``directory`` one way; returns what both ways must agree on."""
    work = tempfile.mkdtemp(prefix="batch-")
    try:
        for name in os.listdir(directory):
            shutil.copy(os.path.join(directory, name), work)
        rec = Scanner(BinlogDir(work), ignore_damage, batch=batch).scan()
        scan = (rec.max_id, rec.records, rec.dead, rec.latest, rec.updates, rec.segments, rec.sizes, rec.damaged,
                [t[1:] for t in rec.torn], rec.skips)
        queue = Queue(time.monotonic_ns)
        tally = RestoreTally(home_ids={i: array("Q") for i in rec.segments}, live={i: 0 for i in rec.segments})
        restorer = Restorer(queue)
        restore_records(rec, wall_off, tally, restorer, batch=batch)
        restorer.finish()
        files = sorted(os.listdir(work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    jobs = [(job.tube.name, *(getattr(job, f) for f in JOB_FIELDS), job.reserver, job.delay)
            for job in queue.jobs.values()]
    tubes = [(t.name, sorted(t.ready + t.run_entries()), t.delayed, [j.id for j in t.buried.values()],
              t.ready_count, t.urgent_count, t.delayed_count, t.using, t.watching) for t in queue.tubes.items]
    counts = (*queue.job_counts(), queue.held_bytes, queue.next_id)
    segments = ({k: list(v) for k, v in tally.home_ids.items()}, tally.live, tally.jobs, tally.buried, tally.bytes)
    return {"scan": scan, "jobs": jobs, "tubes": tubes, "counts": counts, "segments": segments, "files": files,
            "table": queue.jobs.footprint()}


def _both_ways(directory: str, ignore_damage: bool = False) -> dict:
    wall_off = time.time_ns() - time.monotonic_ns()
    per_record = _recover(directory, False, wall_off, ignore_damage)
    batch = _recover(directory, True, wall_off, ignore_damage)
    assert batch == per_record
    return batch


def _write(directory: str, segments: list[list[bytes]], now: int) -> None:
    for idx, records in enumerate(segments, 1):
        with open(os.path.join(directory, fmt.segment_name(idx)), "wb") as fh:
            fh.write(fmt.encode_header(idx, 0, now) + b"".join(records))


def _job(jid: int, now: int, *, state: int = fmt.S_READY, pri: int = 1024, tube: bytes = b"bench",
         counters: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0), delay: int = 0, ttr: int = 60) -> bytes:
    deadline = now + HOUR if state == fmt.S_DELAYED else 0
    return fmt.encode_job(jid, state, pri, delay, ttr * 10**9, now + jid * 10_000, deadline, counters, tube,
                          b"body %d" % jid)


def test_many_jobs_with_every_kind_of_exception():
    """Thousands of jobs over three segments, in id runs that span pages, with the records the
    batch loops hand back to the per-record path mixed in: deletes, a compaction copy, updates
    (a reserve only, a bury, a delay), counters, a delay, a reserved state, other tubes, big priorities."""
    now = time.time_ns()
    d = tempfile.mkdtemp(prefix="batch-log-")
    try:
        seg1 = [_job(j, now, pri=j % 3 * 700) for j in range(1, 1500)]
        seg1 += [_job(1500, now, tube=b"other"), _job(1501, now, counters=(1, 0, 2, 0, 0)),
                 _job(1502, now, state=fmt.S_DELAYED, delay=5 * 10**9), _job(1503, now, state=fmt.S_RESERVED),
                 _job(1504, now, state=fmt.S_BURIED), fmt.encode_delete(7), fmt.encode_delete(3000)]
        seg1 += [_job(j, now, counters=tuple(int(j == 1490 + k) for k in range(5))) for j in range(1490, 1495)]
        seg2 = [_job(j, now, pri=2**31 + j % 2, ttr=1000 + j % 2) for j in range(1505, 3300)]
        seg2 += [fmt.encode_update(10, fmt.S_BURIED, 5, 0, 0, (1, 0, 0, 1, 0)),
                 fmt.encode_update(11, fmt.S_RESERVED, 1024, 0, 0, (1, 0, 0, 0, 0)),
                 fmt.encode_update(12, fmt.S_DELAYED, 9, 10**9, now + HOUR, (0, 0, 1, 0, 0)),
                 _job(20, now, tube=b"moved"), fmt.encode_delete(1600)]
        seg3 = [_job(j, now, tube=b"t%d" % (j % 3)) for j in range(3300, 3400)] + [_job(1600, now), _job(5000, now)]
        seg3 += [_job(2**32 + j, now, pri=j) for j in range(3)]  # ids that widen the ready heap, then fit it
        _write(d, [seg1, seg2, seg3], now)
        got = _both_ways(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert len(got["jobs"]) == 3402  # ids 1-3399, 5000 and 3 past 2**32, less 7 (deleted); 1600 came back, 3000's
    # delete came first
    assert {t[0] for t in got["tubes"]} >= {"bench", "other", "moved", "t0", "t1", "t2"}


@pytest.mark.parametrize("damage", ["torn", "middle"])
def test_damage_stops_the_batch_where_the_per_record_path_reports_it(damage):
    now = time.time_ns()
    d = tempfile.mkdtemp(prefix="batch-damage-")
    try:
        records = [_job(j, now) for j in range(1, 50)]
        data = bytearray(fmt.encode_header(1, 0, now) + b"".join(records))
        spot = fmt.HEADER_SIZE + 20 * len(records[0]) + 30 if damage == "middle" else len(data) - 10
        data[spot] ^= 0xFF
        with open(os.path.join(d, fmt.segment_name(1)), "wb") as fh:
            fh.write(data)
        if damage == "middle":
            # In the newest segment, damage with valid records after it is what a power cut leaves
            # of unsynced writes: skipped without the flag. In an older one, it stops the start.
            assert len(_both_ways(d)["jobs"]) == 48
            with open(os.path.join(d, fmt.segment_name(2)), "wb") as fh:
                fh.write(fmt.encode_header(2, 49, now) + _job(50, now))
            for batch in (False, True):
                with pytest.raises(BinlogError, match="binlog damaged"):
                    Scanner(BinlogDir(d), False, batch=batch).scan()
            got = _both_ways(d, ignore_damage=True)
            assert len(got["jobs"]) == 49
        else:
            got = _both_ways(d)
            assert len(got["jobs"]) == 48
    finally:
        shutil.rmtree(d, ignore_errors=True)


RECORD = st.one_of(
    st.tuples(st.just("job"), st.integers(1, 12), st.sampled_from([0, 0, 0, 1, 2, 3]),
              st.sampled_from([5, 1024, 70000]), st.sampled_from([b"a", b"a", b"b"]),
              st.sampled_from([(0, 0, 0, 0, 0), (0, 0, 0, 0, 0), (2, 1, 0, 0, 1)])),
    st.tuples(st.just("update"), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("delete"), st.integers(1, 12)),
    st.tuples(st.just("segment")),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(RECORD, min_size=1, max_size=40))
def test_random_logs_recover_alike_both_ways(records):
    now = time.time_ns()
    segments: list[list[bytes]] = [[]]
    for rec in records:
        if rec[0] == "segment":
            segments.append([])
        elif rec[0] == "job":
            _, jid, state, pri, tube, counters = rec
            segments[-1].append(_job(jid, now, state=state, pri=pri, tube=tube, counters=counters,
                                     delay=10**9 if state == fmt.S_DELAYED else 0))
        elif rec[0] == "update":
            state = rec[2]
            segments[-1].append(fmt.encode_update(rec[1], state, 3, 10**9 if state == fmt.S_DELAYED else 0,
                                                  now + HOUR if state == fmt.S_DELAYED else 0, (1, 0, 0, 0, 0)))
        else:
            segments[-1].append(fmt.encode_delete(rec[1]))
    d = tempfile.mkdtemp(prefix="batch-random-")
    try:
        _write(d, segments, now)
        _both_ways(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_new_job_sets_every_field_as_the_constructor_does():
    """new_job skips the class call when interpreted: a ready recovered job and a delayed put."""
    tube = Tube("t", JobTable())
    for delay, state, file in ((0, READY, 4), (5 * 10**9, INVALID, 0)):
        made = new_job(7, tube, 1024, 60, b"x", 123, state, file)
        if delay:
            made.delay = delay  # as Queue.put does
        ref = Job(7, tube, 1024, delay, 60, b"x", 123)
        ref.state = state
        ref.file = file
        names = JOB_FIELDS + ("tube", "reserver", "delay")
        assert [getattr(made, n) for n in names] == [getattr(ref, n) for n in names]
        if not COMPILED:  # every slot, also one added later to Job and forgotten in new_job
            assert [getattr(made, n) for n in Job.__slots__] == [getattr(ref, n) for n in Job.__slots__]


def test_put_lazy_equals_one_at_a_time():
    """JobTable.put_lazy stores runs by slice, unmade: once made, the same pages, overflow and
    order as single stores, also for ids out of order, repeated, below a freed page and far above
    the pages; every lazy id is made exactly once."""
    ids = [*range(1, 3000), 5, 2999, 40000, 40001, *range(100, 90, -1), 10**7, 10**7 + 1, 2**40]
    for cut in (1, 7, 1000, len(ids)):
        one, many = JobTable[int](), JobTable[int]()
        made: list[int] = []
        many.loader = lambda jid, number: made.append(jid) or number  # noqa: B023
        for jid in range(1, 200):  # a page emptied below the threshold: its ids then go to overflow
            one[jid] = many[jid] = -jid
        for jid in range(1, 150):
            one.pop(jid)
            many.pop(jid)
        for jid in ids:
            one[jid] = jid * 2
        near = ids[:-1]
        for start in range(0, len(near), cut):
            many.put_lazy(near[start:start + cut], [jid * 2 for jid in near[start:start + cut]])
        assert many.unmade >= 1000  # runs of consecutive new ids in a page stay unmade
        assert many.get(1500) == 3000 and 1500 in made and many.pop(1501) == 3002 and 1501 in made
        many[1501] = 3002
        assert sorted(many.keys()) == sorted(set(near)) and many.unmade >= 1000  # listing the ids makes nothing
        many.put_lazy(ids[-1:], [ids[-1] * 2])  # far above the pages: they are all freed, their jobs made first
        assert many.unmade == 1  # the new id, in a page of its own
        assert many.values() == one.values()
        assert sorted(made) == sorted(ids)  # the repeated ids: the lazy one made, then replaced
        assert (len(many), many.footprint(), many.base, many.high_page) == (len(one), one.footprint(), one.base,
                                                                              one.high_page)


def test_lazy_jobs_are_made_on_first_use_and_their_segments_let_go():
    """The batch restore makes no job for a plain ready one: the queue serves them all the same
    (reserve order, peek, stats-job, delete of an unmade job), each is made once, and a segment's
    bytes are let go when its last job is made or deleted."""
    from broker import queue_verbs
    from broker import stats as broker_stats

    now = time.time_ns()
    d = tempfile.mkdtemp(prefix="batch-lazy-")
    try:
        seg1 = [_job(j, now, pri=j % 2) for j in range(1, 1201)]
        seg2 = [_job(j, now, pri=5, tube=b"t2") for j in range(1201, 1301)] + [_job(1301, now, state=fmt.S_BURIED)]
        _write(d, [seg1, seg2], now)
        rec = Scanner(BinlogDir(d), False, batch=True).scan()
        queue = Queue(time.monotonic_ns)
        tally = RestoreTally(home_ids={i: array("Q") for i in rec.segments}, live={i: 0 for i in rec.segments})
        restorer = Restorer(queue)
        restore_records(rec, time.time_ns() - time.monotonic_ns(), tally, restorer, batch=True)
        restorer.finish()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    lazy = queue.jobs.loader.__self__  # type: ignore[union-attr]
    assert (len(queue.jobs), queue.jobs.unmade, sorted(lazy.datas)) == (1301, 1300, [0, 1])
    _urgent, ready, _reserved, _delayed, buried = queue.job_counts()
    assert (ready, buried) == (1300, 1)
    replies: list[bytes] = []
    client = queue_verbs.connect(queue, replies.append, "test")
    assert queue_verbs.peek(queue, client, 1200) == b"FOUND 1200 9\r\nbody 1200\r\n"
    assert b"\nstate: ready\npri: 0\n" in broker_stats.stats_job(queue, client, 2)
    assert queue.delete(client, 4) == b"DELETED\r\n"  # unmade until now
    queue_verbs.watch(queue, client, "bench")
    queue_verbs.watch(queue, client, "t2")
    got = []
    while True:
        reply = queue.reserve(client, 0)
        if reply is None or not reply.startswith(b"RESERVED"):
            break
        jid = int(reply.split()[1])
        assert reply.endswith(b"\r\nbody %d\r\n" % jid)
        got.append(jid)
        if jid == 1199:  # the last of segment 1 still unmade: made now, its bytes let go
            assert 0 not in lazy.datas
        assert queue.delete(client, jid) == b"DELETED\r\n"
    evens = [j for j in range(2, 1201, 2) if j != 4]
    assert got == evens + [j for j in range(1, 1201, 2)] + list(range(1201, 1301))  # (pri, id) order, then t2
    assert (queue.jobs.unmade, lazy.datas, len(queue.jobs)) == (0, {}, 1)
