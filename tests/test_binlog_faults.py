"""The binlog on a failing disk: real I/O errors from a FUSE file system (tests/faultfs.py).

A failed fsync may have lost any record written since the last good one (the kernel drops
the dirty pages; a retried fsync reports success). The broker must then acknowledge nothing
it could not make durable, rebuild the log from memory once the disk works again (a new base
segment replacing all others), and recover exactly that state after a crash at any point.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest
from test_binlog_helpers import job_snapshot, run_ours_expect_exit, start_ours

from broker.binlog_file import CRASH_ENV
from spark_beanstalk.client import BeanstalkError, Connection, ConnectionLost
from tests.helpers import FaultyDisk, ServerProcess, free_port, http_get, member_process, sample, scrape, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def disk(tmp_path):
    d = FaultyDisk(tmp_path / "disk")
    try:
        yield d
    finally:
        d.close()


def _put_until_inserted(proc: ServerProcess, body: bytes, timeout: float = 15.0) -> int:
    """Puts are refused (OUT_OF_MEMORY) until the log is rebuilt: try again until one is INSERTED."""
    def attempt() -> int | None:
        try:
            with Connection(proc.host, proc.port) as conn:
                reply = conn.call(f"put 1 0 60 {len(body)}", body)
        except ConnectionLost:
            return None  # taken but not acknowledged: the log was not writable yet
        return reply.int_arg() if reply.status == b"INSERTED" else None
    return wait_until(attempt, timeout, "a put to be INSERTED again", interval=0.2)


def _bodies(proc: ServerProcess, ids: list[int]) -> dict[int, bytes | None]:
    with Connection(proc.host, proc.port) as conn:
        snap = job_snapshot(conn, ids)
    return {i: (s["body"] if s else None) for i, s in snap.items()}


@pytest.mark.parametrize("fault", ["fail-fsync", "fail-write"])
def test_a_change_the_disk_failed_to_keep_is_not_acknowledged_and_the_log_heals(disk, tmp_path, fault):
    err = str(tmp_path / "broker.log")
    http = f"127.0.0.1:{free_port()}"
    proc = start_ours(str(disk.mount / "bl"), "-f", "0", "--http", http, stderr_path=err)
    try:
        with Connection(proc.host, proc.port) as conn:
            first = conn.put(b"before the fault")
        disk.fail(fault)
        with Connection(proc.host, proc.port) as conn, pytest.raises(ConnectionLost):
            conn.put(b"during the fault")  # its record may be lost: no INSERTED, the connection drops
        with Connection(proc.host, proc.port) as conn:
            assert conn.call("put 1 0 60 5", b"again").status == b"OUT_OF_MEMORY"
            assert conn.stats_job(first) is not None  # reads keep working
        status, text = http_get(f"http://{http}/readyz")
        assert status == 503 and "binlog cannot write" in text
        disk.heal(fault)
        after = _put_until_inserted(proc, b"after the fault")
        assert "works again" in proc.log()
        assert http_get(f"http://{http}/readyz")[0] == 200
        _, samples = scrape(http)
        assert sample(samples, "beanstalk_binlog_rebuilds_total") == 1
        assert (sample(samples, "beanstalk_binlog_io_errors_total") or 0) >= 1
        proc.kill()
        # What reached the disk: a broker on the backing directory finds both acknowledged jobs.
        assert not [n for n in os.listdir(disk.backing / "bl") if n.endswith((".partial", ".base"))]
        proc = start_ours(str(disk.backing / "bl"), "-f", "0")
        found = _bodies(proc, [first, after])
        assert found == {first: b"before the fault", after: b"after the fault"}
    finally:
        proc.kill()


def test_changes_a_failed_background_fsync_lost_are_rebuilt_and_a_crash_mid_rebuild_keeps_them(disk, tmp_path):
    """-f MS acknowledges after the write: a failed fsync can lose acknowledged changes, a delete too.

    The rebuilt log holds them again; the broker is killed right after the new base is
    committed, before the older segments are removed: the restart must read the base alone
    (the older segments still hold the put of the deleted job, without its delete).
    """
    d = str(disk.mount / "bl")
    proc = start_ours(d, "-f", "0")
    with Connection(proc.host, proc.port) as conn:
        keep = conn.put(b"keep")
        gone = conn.put(b"gone")
    proc.stop()
    err = str(tmp_path / "broker.log")
    proc = start_ours(d, "-f", "60000", env={CRASH_ENV: "base-committed"}, stderr_path=err)
    try:
        disk.fail("fail-fsync")
        with Connection(proc.host, proc.port) as conn:
            assert conn.delete(gone)  # acknowledged once written; the fsync that follows fails
        wait_until(lambda: "fdatasync failed" in proc.log(), 15, "the background fsync to fail")
        disk.heal("fail-fsync")
        with Connection(proc.host, proc.port) as conn, pytest.raises(ConnectionLost):
            conn.put(b"x")  # rebuilds the log; the crash hook kills the broker once the base is committed
        assert proc.proc is not None
        proc.proc.wait(15)
    finally:
        proc.kill()
    assert [n for n in os.listdir(disk.backing / "bl") if n.endswith(".base")], "the crash hit no base"
    proc = start_ours(str(disk.backing / "bl"), "-f", "0")
    try:
        assert _bodies(proc, [keep, gone]) == {keep: b"keep", gone: None}
        assert not [n for n in os.listdir(disk.backing / "bl") if n.endswith((".partial", ".base"))]
    finally:
        proc.kill()


def test_a_crash_while_ignore_damage_rewrites_the_log_brings_back_no_deleted_job(tmp_path):
    """--binlog-ignore-damage rewrites the jobs it recovered into a new base. Killed right
    after the base is committed, the restart (without the flag) reads the base alone: not the
    older segments, which hold the put of a job whose delete is in the damaged segment."""
    d = str(tmp_path / "bl")
    proc = start_ours(d, "-s", "2048")
    try:
        with Connection(proc.host, proc.port) as conn:
            deleted = conn.put(b"deleted later" + b"." * 60)
            start = int(conn.stats()["binlog-current-index"])
            kept = []
            while int(conn.stats()["binlog-current-index"]) == start:
                kept.append(conn.put(b"kept %d" % len(kept) + b"." * 60))
            damaged_index = int(conn.stats()["binlog-current-index"])  # the last put opened it
            first_there = kept.pop()
            assert conn.delete(deleted)  # its record follows that put, in the same segment
            while int(conn.stats()["binlog-current-index"]) == damaged_index:
                kept.append(conn.put(b"kept %d" % len(kept) + b"." * 60))
    finally:
        proc.kill()
    with open(os.path.join(d, f"binlog.{damaged_index}.sbl"), "r+b") as fh:
        fh.seek(40 + 60)  # inside the first record after the header: the put of `first_there`
        b = fh.read(1)
        fh.seek(40 + 60)
        fh.write(bytes([b[0] ^ 0x55]))
    res = run_ours_expect_exit(d, "-s", "2048", "--binlog-ignore-damage", env={CRASH_ENV: "base-committed"})
    assert res.returncode == -9, res.stderr  # killed by the hook once the base is committed
    assert "damage ignored" in res.stderr
    proc = start_ours(d, "-s", "2048")  # no flag: the damaged segment went with the others
    try:
        found = _bodies(proc, [deleted, first_there, *kept])
        assert found[deleted] is None
        assert found[first_there] is None  # the damaged record
        assert all(found[i] is not None for i in kept)
    finally:
        proc.kill()


def test_a_replica_whose_disk_fails_acknowledges_nothing_until_its_log_is_rebuilt(disk, tmp_path):
    """--sync-replicas 1: the leader's reply waits for a replica's ack, which says the replica
    has the records in its binlog. A replica that cannot write them must not ack them."""
    leader = member_process(str(tmp_path / "leader"), sync_replicas=1).start()
    replica = member_process(str(disk.mount / "r"), replica_of=leader.repl_address, extra_args=["-f", "0"],
                             stderr_path=str(tmp_path / "replica.log")).start()
    try:
        with Connection(leader.host, leader.port, timeout=10) as conn:
            first = conn.put(b"first")  # acknowledged: the replica has it
        disk.fail("fail-fsync")
        with socket.create_connection((leader.host, leader.port), timeout=10) as sock:
            sock.sendall(b"put 1 0 60 6\r\nsecond\r\n")
            sock.settimeout(2.0)  # observation window: no reply while the replica's disk fails
            with pytest.raises(TimeoutError):
                sock.recv(100)
            disk.heal("fail-fsync")
            sock.settimeout(15.0)
            reply = sock.recv(100)  # the replica rebuilt its log and acked
            assert reply.startswith(b"INSERTED "), reply
            second = int(reply.split()[1])
        wait_until(lambda: "works again" in replica.log(), 10, "the replica's binlog to be rebuilt")
    finally:
        replica.kill()
        leader.kill()
    alone = start_ours(str(disk.backing / "r"), "-f", "0")  # what reached the replica's disk
    try:
        assert _bodies(alone, [first, second]) == {first: b"first", second: b"second"}
    finally:
        alone.kill()


def test_a_delete_whose_reply_a_power_cut_stopped_may_have_happened(disk):
    """-f 0. The power goes at the fsync of a delete's record, after its write reached the disk
    (tests/faultfs.py ``power-cut-at-fsync``, ``kept``). The broker must not acknowledge the delete
    (its fsync failed), and after the restart the job is gone: a change whose reply never came is
    unknown to its client, done or not. The power-cut test below once counted such a job as one that
    must live (only acknowledged deletes were excused), and failed now and then under CPU load, when
    the cut landed between a delete's write and its fsync."""
    proc = start_ours(str(disk.mount / "bl"), "-f", "0")
    try:
        with Connection(proc.host, proc.port, timeout=5) as conn:
            doomed, kept = conn.put(b"doomed"), conn.put(b"kept")
            disk.fail("power-cut-at-fsync", "kept")
            with pytest.raises(ConnectionLost):
                conn.delete(doomed)
    finally:
        proc.kill()
    proc = start_ours(str(disk.backing / "bl"), "-f", "0")
    try:
        assert _bodies(proc, [doomed, kept]) == {doomed: None, kept: b"kept"}
    finally:
        proc.kill()


@pytest.mark.parametrize("fsync", ["0", "500"])
def test_after_a_power_cut_the_broker_starts_by_itself_with_what_its_fsync_mode_promised(disk, fsync):
    """A power cut (tests/faultfs.py: of the pages written since the last fsync, every other one
    is lost, as writeback reaches the disk in any order) while four clients put and delete. The newest segment then
    holds lost pages with written ones after them: the broker must start without an operator
    (before: "binlog damaged ... refusing to start" in most runs). -f 0: every acknowledged
    change is there. -f 500: what was acknowledged well before the cut is there (a long
    window, so that the cut finds many pages unsynced). A job whose delete was sent may be gone
    whether or not the delete was acknowledged (the test above)."""
    proc = start_ours(str(disk.mount / "bl"), "-f", fsync, "-s", "4194304")
    acked: list[tuple[float, int]] = []
    deleted: list[tuple[float, int]] = []
    sent_deletes: set[int] = set()
    stop = threading.Event()

    def client(n: int) -> None:
        with contextlib.suppress(BeanstalkError), Connection(proc.host, proc.port, timeout=5) as conn:
            mine: list[int] = []
            while not stop.is_set():
                mine.append(conn.put(b"job %d-%d " % (n, len(mine)) + b"." * 200))
                acked.append((time.monotonic(), mine[-1]))
                if len(mine) % 3 == 0:
                    sent_deletes.add(mine[-2])
                    if conn.delete(mine[-2]):
                        deleted.append((time.monotonic(), mine[-2]))

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    try:
        began = time.monotonic()
        wait_until(lambda: len(acked) > 3000 and time.monotonic() - began > 3, 30, "puts under way")
        cut_at = time.monotonic()
        disk.fail("power-cut", "alternate")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        proc.kill()
    early = cut_at - (0.0 if fsync == "0" else 2.0)  # -f 500: up to 0.5 s may be lost (2 s of slack)
    proc = start_ours(str(disk.backing / "bl"), "-f", fsync, stderr_path=str(disk.backing / "start.log"))
    try:
        ids = [i for _, i in acked]
        with Connection(proc.host, proc.port) as conn:
            snap = job_snapshot(conn, ids)
        gone = {i for t, i in deleted if t <= early}
        must_live = [i for t, i in acked if t <= early and i not in sent_deletes]
        assert [i for i in must_live if snap[i] is None] == []
        assert [i for i in gone if snap[i] is not None] == []
    finally:
        proc.kill()


@pytest.mark.parametrize("fault,what", [("fail-unlink", "binlog.1.sbl"), ("fail-rename", ".sbl.base")])
def test_a_base_whose_old_segments_could_not_all_be_removed_brings_back_no_deleted_job(disk, fault, what):
    """The base is committed, then removing an older segment (or renaming the base to a plain
    segment) fails. The base was left under its *.base name while the broker wrote on; once the
    segments holding later deletes were dropped, a restart read the stale base: deleted jobs came back."""
    d = str(disk.mount / "bl")
    proc = start_ours(d, "-f", "0", "-s", "3000")
    try:
        with Connection(proc.host, proc.port) as conn:
            doomed = [conn.put(b"doomed %d" % i) for i in range(20)]
        disk.fail(fault, what)
        disk.fail("fail-fsync")
        with Connection(proc.host, proc.port) as conn, pytest.raises(ConnectionLost):
            conn.put(b"during")
        disk.heal("fail-fsync")
        _put_until_inserted(proc, b"after")  # the base is written; its clean-up fails
        disk.heal(fault)
        _put_until_inserted(proc, b"after again")  # a second base, or the first one finished
        with Connection(proc.host, proc.port) as conn:
            for _ in range(300):
                conn.delete(conn.put(b"z" * 200))
            for job_id in doomed:
                assert conn.delete(job_id)
            for _ in range(300):
                conn.delete(conn.put(b"z" * 200))
    finally:
        proc.stop()
    assert not [n for n in os.listdir(d) if n.endswith((".base", ".partial"))]
    proc = start_ours(d, "-f", "0", "-s", "3000")
    try:
        assert [i for i, body in _bodies(proc, doomed).items() if body is not None] == []
    finally:
        proc.kill()


def test_nothing_is_written_to_the_old_segments_while_the_log_waits_for_its_base(disk):
    """After a failed fsync (its records lost: a stretch of zeros), releases within the second
    before the next base attempt went on into the old segment and rotated, so the lost stretch
    ended up in an older segment with records after it: a kill then meant a refused start."""
    d = str(disk.mount / "bl")
    proc = start_ours(d, "-f", "0", "-s", "3000")
    try:
        with Connection(proc.host, proc.port) as conn:
            ids = [conn.put(b"j%d" % i) for i in range(20)]
        disk.fail("fail-fsync")
        with Connection(proc.host, proc.port) as conn, pytest.raises(ConnectionLost):
            conn.put(b"during the fault")
        disk.heal("fail-fsync")
        with Connection(proc.host, proc.port) as conn:  # within the retry second: no base yet
            conn.send(b"".join(b"reserve-job %d\r\nrelease %d 1 0\r\n" % (ids[k % 20], ids[k % 20])
                               for k in range(600)))
            with pytest.raises(ConnectionLost):
                while True:
                    conn.read_reply()  # dropped: unacknowledged changes
    finally:
        proc.kill()
    proc = start_ours(d, "-f", "0", "-s", "3000")  # a refused start raises here
    try:
        assert all(body is not None for body in _bodies(proc, ids).values())
    finally:
        proc.kill()


def test_a_start_that_dies_before_rewriting_newest_segment_damage_does_not_block_the_next(tmp_path):
    """Damage in the newest segment is skipped, then rewritten into a base. The start makes its
    own new segment first: killed before the base was committed, it left the damaged segment
    second-newest, and the next start refused it as damage in an older segment."""
    d = str(tmp_path / "bl")
    proc = start_ours(d, "-f", "0")
    try:
        with Connection(proc.host, proc.port) as conn:
            ids = [conn.put(b"job %d " % i + b"." * 100) for i in range(50)]
    finally:
        proc.kill()
    newest = max((n for n in os.listdir(d) if n.endswith(".sbl")), key=lambda n: int(n.split(".")[1]))
    path = os.path.join(d, newest)
    with open(path, "r+b") as fh:
        data = fh.read()
        middle = len(data.rstrip(b"\0")) // 2
        fh.seek(middle)
        fh.write(bytes([data[middle] ^ 0xFF]))
    res = run_ours_expect_exit(d, "-f", "0", env={CRASH_ENV: "base-written"})
    assert res.returncode == -9, res.stderr
    proc = start_ours(d, "-f", "0")
    try:
        found = _bodies(proc, ids)
        assert 45 <= sum(body is not None for body in found.values()) < 50  # one record or so lost
    finally:
        proc.kill()


def test_a_stop_while_the_disk_fails_exits_cleanly_and_loses_nothing_acknowledged(disk, tmp_path):
    """SIGTERM while the disk still fails: the last fsync's error escaped close(), and the broker
    exited 1 saying 'cannot listen on ...: Input/output error'."""
    d = str(disk.mount / "bl")
    proc = start_ours(d, "-f", "0", stderr_path=str(tmp_path / "broker.log"))
    with Connection(proc.host, proc.port) as conn:
        ids = [conn.put(b"j%d" % i) for i in range(20)]
    disk.fail("fail-fsync")
    with Connection(proc.host, proc.port) as conn, pytest.raises(ConnectionLost):
        conn.delete(ids[0])
    assert proc.stop() == 0
    assert "cannot listen" not in proc.log() and "shutting down with a binlog that could not be rewritten" in proc.log()
    disk.heal("fail-fsync")
    proc = start_ours(d, "-f", "0")
    try:
        assert all(body is not None for body in _bodies(proc, ids[1:]).values())
    finally:
        proc.kill()


def test_a_malformed_crash_hook_is_a_one_line_error(tmp_path):
    """The test hook's variable, set wrong, ended the start in a ValueError traceback."""
    res = run_ours_expect_exit(str(tmp_path / "bl"), env={CRASH_ENV: "base-committed:x"})
    assert res.returncode != 0 and "Traceback" not in res.stderr and "expected POINT or POINT:N" in res.stderr
