"""The binlog record codec, and recovery rules checked in-process on real files (fast).

The harness drives broker.queue.Queue with a real broker.binlog.Binlog on a temporary
directory; ``crash()`` abandons it as SIGKILL would (buffered records lost, no fsync, no
trim). Process-level tests are in test_binlog_process.py and test_binlog_crash.py.
"""
from __future__ import annotations

import os
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_binlog_helpers import Harness, segment_files

from broker import binlog_format as fmt
from broker import queue_verbs
from broker.binlog import BinlogError, open_binlog

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- codec
def test_header_round_trip_and_checks():
    head = fmt.encode_header(7, 12345, 99)
    assert len(head) == fmt.HEADER_SIZE == 40
    assert fmt.decode_header(head) == (fmt.FORMAT_VERSION, 7, 12345, 99)
    bad = bytearray(head)
    bad[20] ^= 1
    with pytest.raises(fmt.FormatError, match="checksum"):
        fmt.decode_header(bytes(bad))
    with pytest.raises(fmt.FormatError, match="not a spark-beanstalk"):
        fmt.decode_header(b"\x06\x00\x00\x00" + b"x" * 60)  # a beanstalkd binlog starts with its version int
    future = fmt.SEGMENT_HEADER.pack(fmt.MAGIC, 99, 40, 1, 0, 0)
    with pytest.raises(fmt.FormatError, match="unsupported binlog format version 99"):
        fmt.decode_header(future + fmt.HEADER_CRC.pack(zlib.crc32(future)))


def test_records_round_trip():
    rec = fmt.encode_job(42, fmt.S_DELAYED, 7, 5 * 10**9, 60 * 10**9, 1000, 2000, (1, 2, 3, 4, 5), b"tube-a",
                         b"body\r\n")
    length, crc = fmt.FRAME.unpack_from(rec, 0)
    assert length == len(rec) - 8 and crc == zlib.crc32(rec[8:])
    f = fmt.JOB.unpack_from(rec, 8)
    assert f[:13] == (fmt.K_JOB, 42, fmt.S_DELAYED, 7, 5 * 10**9, 60 * 10**9, 1000, 2000, 1, 2, 3, 4, 5)
    assert rec[8 + fmt.JOB_SIZE:8 + fmt.JOB_SIZE + f[13]] == b"tube-a"
    assert rec.endswith(b"body\r\n")
    assert fmt.check_record(rec, 0, len(rec)) == len(rec)
    upd = fmt.encode_update(42, fmt.S_BURIED, 9, 0, 0, (1, 2, 3, 5, 5))
    assert len(upd) == fmt.UPDATE_RECORD_SIZE and fmt.check_record(upd, 0, len(upd)) == len(upd)
    dele = fmt.encode_delete(42)
    assert len(dele) == fmt.DELETE_RECORD_SIZE == 17 and fmt.check_record(dele, 0, len(dele)) == 17
    # a flipped bit anywhere in the payload is caught by the CRC
    for i in range(8, len(rec)):
        bad = bytearray(rec)
        bad[i] ^= 0x10
        with pytest.raises(fmt.FormatError):
            fmt.check_record(bytes(bad), 0, len(bad))
    # zeros are the end of the data; a torn frame is not
    assert fmt.check_record(b"\0" * 20, 0, 20) == 0
    with pytest.raises(fmt.FormatError, match="past the end"):
        fmt.check_record(rec[:-3], 0, len(rec) - 3)


@settings(max_examples=300, deadline=None)
@given(job_id=st.integers(1, 2**64 - 1), pri=st.integers(0, 2**32 - 1), ttr=st.integers(1, 2**63 - 1),
       created=st.integers(-(2**63), 2**63 - 1), tube=st.binary(min_size=1, max_size=200),
       body=st.binary(max_size=300))
def test_a_ready_put_record_is_the_full_record_with_zeros(job_id, pri, ttr, created, tube, body):
    """The put path packs a ready job from 6 values (append_ready_job); recovery reads it as
    the 14-value K_JOB record with state, delay, deadline and counters 0, byte for byte."""
    full, ready = bytearray(b"prefix"), bytearray(b"prefix")
    n_full = fmt.append_job(full, job_id, 0, pri, 0, ttr, created, 0, 0, 0, 0, 0, 0, tube, body)
    n_ready = fmt.append_ready_job(ready, job_id, pri, ttr, created, tube, body)
    assert ready == full and n_ready == n_full == len(full) - 6
    assert fmt.check_record(bytes(ready), 6, len(ready)) == len(ready)  # the end of a valid record


def test_segment_names():
    assert fmt.segment_name(12) == "binlog.12.sbl"
    assert fmt.parse_segment_name("binlog.12.sbl") == 12
    for name in ("binlog.12", "binlog.012.sbl", "binlog.x.sbl", "lock", "binlog.3.sbl.damaged"):
        assert fmt.parse_segment_name(name) is None


def test_find_next_valid_skips_garbage():
    good = fmt.encode_delete(5)
    data = b"\x01garbage!" + good + b"\0" * 10
    assert fmt.find_next_valid(data, 0, len(data)) == 9


# ---------------------------------------------------------------- recovery rules (in-process)
def test_every_state_and_counter_survives_a_crash(tmp_path):
    h = Harness(str(tmp_path))
    ready = h.put(b"ready", pri=5, tube="a")
    delayed = h.put(b"delayed", delay=300, tube="b")
    buried = h.put(b"buried", pri=9)
    h.reserve(buried)
    assert h.do("bury", buried, 77) == b"BURIED\r\n"
    kicked = h.put(b"kicked")
    h.reserve(kicked)
    h.do("bury", kicked, 3)
    queue_verbs.use(h.queue, h.client, "default")
    assert h.do("kick_job", kicked) == b"KICKED\r\n"
    released = h.put(b"released")
    h.reserve(released)
    h.do("release", released, 11, 0)
    reserved = h.put(b"reserved")
    h.reserve(reserved)
    gone = h.put(b"gone")
    h.do("delete", gone)
    before = h.state()
    h.crash()
    h2 = h.reopen()
    after = h2.state()
    assert set(after) == {ready, delayed, buried, kicked, released, reserved}
    for job_id, row in after.items():
        assert row == before[job_id], job_id
    assert after[delayed][0] == "delayed"
    job = h2.queue.jobs[delayed]
    assert 295 * 10**9 < job.deadline - h2.queue.clock() <= 300 * 10**9
    assert h2.queue.jobs[reserved].reserves == 1  # reserves are logged (issue 11): the reserve survives
    assert h2.put(b"next") > gone  # ids continue
    h2.close()


def test_buried_order_is_kept(tmp_path):
    h = Harness(str(tmp_path))
    ids = [h.put(b"j%d" % i) for i in range(4)]
    for job_id in reversed(ids):
        h.reserve(job_id)
        h.do("bury", job_id, 1)
    h.crash()
    h2 = h.reopen()
    assert list(h2.queue.default_tube.buried) == list(reversed(ids))
    h2.close()


def test_unsynced_records_are_lost_but_nothing_else(tmp_path):
    h = Harness(str(tmp_path))
    a = h.put(b"a")
    h.queue.put(h.client, 1, 0, 10, b"never synced")  # no sync_point: the reply never went out
    h.crash()
    h2 = h.reopen()
    assert set(h2.state()) == {a}
    assert h2.put(b"b") == a + 1  # the unacknowledged id may be reused: nobody saw it
    h2.close()


def test_ids_never_reused_after_every_segment_is_gone(tmp_path):
    h = Harness(str(tmp_path), segment_size=2048)
    last = 0
    for _i in range(200):
        last = h.put(b"x" * 50)
        h.do("delete", last)
    assert len(segment_files(str(tmp_path))) <= 2
    h.crash()
    h2 = h.reopen()
    assert h2.state() == {}
    assert h2.put(b"y") == last + 1
    h2.close()


def test_churn_keeps_the_log_bounded_and_compaction_moves_old_jobs(tmp_path):
    seg = 4096
    h = Harness(str(tmp_path), segment_size=seg)
    keep = [h.put(b"keeper %d" % i, pri=i) for i in range(5)]  # long-lived jobs pin the first segment
    for _i in range(3000):
        job_id = h.put(b"y" * 100)
        h.do("delete", job_id)
    usage = h.log.disk_usage()
    assert usage["bytes"] <= 2 * usage["live_bytes"] + 3 * seg, usage
    on_disk = sum(os.path.getsize(os.path.join(str(tmp_path), n)) for n in segment_files(str(tmp_path)))
    assert on_disk <= 4 * seg + 2 * usage["live_bytes"], (on_disk, segment_files(str(tmp_path)))
    assert h.log.records_migrated >= 5
    h.crash()
    h2 = h.reopen()
    assert sorted(h2.state()) == keep
    h2.close()


def test_torn_tail_is_dropped_with_a_warning(tmp_path, capfd):
    h = Harness(str(tmp_path))
    a = h.put(b"a")
    b = h.put(b"b" * 30)
    path = os.path.join(str(tmp_path), f"binlog.{h.log._cur}.sbl")
    end = h.log._pos
    h.crash()
    # cut the last record in half, as a crash in the middle of write() would
    with open(path, "r+b") as fh:
        fh.truncate(end - 10)
    h2 = h.reopen()
    err = capfd.readouterr().err
    offset = end - 10 - (8 + fmt.JOB_SIZE + 7 + 30) + 10
    assert "torn record at the end of the log dropped" in err and path in err and f"offset {offset}" in err
    assert set(h2.state()) == {a}
    h2.close()
    # the torn bytes were cut off: the next start is clean
    h3 = Harness(str(tmp_path))
    assert "torn" not in capfd.readouterr().err
    assert set(h3.state()) == {a}
    assert b, "the torn job had an id; it is simply never acknowledged"
    h3.close()


def _damage_middle(tmp_path):
    h = Harness(str(tmp_path), segment_size=2048)
    ids = [h.put(b"job %03d" % i + b"." * 40) for i in range(80)]
    files = segment_files(str(tmp_path))
    assert len(files) >= 3
    h.crash()
    victim = os.path.join(str(tmp_path), files[0])
    with open(victim, "r+b") as fh:
        fh.seek(fmt.HEADER_SIZE + 100)
        byte = fh.read(1)
        fh.seek(fmt.HEADER_SIZE + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return ids, victim


def test_damage_in_the_middle_refuses_to_start(tmp_path):
    ids, victim = _damage_middle(tmp_path)
    with pytest.raises(BinlogError) as info:
        open_binlog(str(tmp_path), fsync_ms=0, segment_size=2048)
    msg = str(info.value)
    assert victim in msg and "offset" in msg and "--binlog-ignore-damage" in msg and "checksum" in msg


def test_ignore_damage_keeps_what_can_be_read_and_sets_the_file_aside(tmp_path, capfd):
    ids, victim = _damage_middle(tmp_path)
    h = Harness(str(tmp_path), segment_size=2048, ignore_damage=True)
    got = set(h.state())
    assert 60 < len(got) < len(ids)  # one record lost, the rest of that segment still read
    assert os.path.exists(victim + ".damaged") and not os.path.exists(victim)
    assert "damage ignored" in capfd.readouterr().err
    h.close()
    h2 = Harness(str(tmp_path), segment_size=2048)  # clean now, no flag needed
    assert set(h2.state()) == got
    h2.close()


def test_unused_spare_and_torn_header_are_cleaned(tmp_path):
    h = Harness(str(tmp_path))
    a = h.put(b"a")
    cur = h.log._cur
    h.crash()
    with open(os.path.join(str(tmp_path), f"binlog.{cur + 1}.sbl"), "wb") as fh:
        fh.write(b"\0" * 4096)  # allocated, header never written
    h2 = h.reopen()
    assert set(h2.state()) == {a}
    h2.close()


def test_lock_excludes_a_second_broker(tmp_path):
    import subprocess
    import sys
    log = open_binlog(str(tmp_path), fsync_ms=0)
    try:
        code = ("from broker.binlog import open_binlog, BinlogError\n"
                f"try:\n open_binlog({str(tmp_path)!r})\nexcept BinlogError as e:\n print(e)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30).stdout
        assert "in use by another process" in out
    finally:
        log.close()


def test_stats_values(tmp_path):
    h = Harness(str(tmp_path), segment_size=2048)
    for _i in range(50):
        h.put(b"z" * 40)
    st = h.log.stats()
    assert st["records-written"] == 50 and st["max-size"] == 2048
    assert st["current-index"] >= st["oldest-index"] >= 1
    h.close()


def test_delete_records_outlive_the_puts_they_cancel(tmp_path):
    """A segment holding only deletes must not go while an older segment still holds the puts."""
    h = Harness(str(tmp_path), segment_size=2048)
    keeper = h.put(b"keeper")  # pins the first segment
    doomed = [h.put(b"doomed %d" % i + b"." * 50) for i in range(20)]
    first = h.log._cur
    while h.log._cur == first:
        h.put(b"filler" * 10)
        h.do("delete", max(h.queue.jobs))
    for job_id in doomed:  # the deletes land in later segments that hold no live job
        h.do("delete", job_id)
    while h.log._cur < first + 3:
        h.do("delete", h.put(b"more filler" * 10))
    h.crash()
    h2 = h.reopen()
    assert set(h2.state()) == {keeper}
    h2.close()


def test_fsync_thread_syncs_within_the_interval(tmp_path):
    from tests.helpers import wait_until
    h = Harness(str(tmp_path), fsync_ms=20)
    assert h.log._fsync_thread is not None and h.log._fsync_thread.is_alive()
    h.put(b"a")
    wait_until(lambda: not h.log._dirty, timeout=5)
    h.close()
    assert not h.log._fsync_thread.is_alive()


def test_no_fsync_mode_has_no_thread_and_still_recovers(tmp_path):
    h = Harness(str(tmp_path), fsync_ms=None)
    assert h.log._fsync_thread is None
    a = h.put(b"a")
    h.crash()
    h2 = h.reopen()
    assert set(h2.state()) == {a}
    h2.close()


def test_bodies_larger_than_a_segment(tmp_path):
    h = Harness(str(tmp_path), segment_size=2048)
    small = h.put(b"s")
    big = [h.put(bytes([65 + i]) * 50_000) for i in range(3)]
    after = h.put(b"t")
    assert h.log._pos <= h.log._alloc
    h.crash()
    h2 = h.reopen()
    st = h2.state()
    assert set(st) == {small, after, *big}
    assert all(st[b][3] == bytes([65 + i]) * 50_000 for i, b in enumerate(big))
    h2.close()
