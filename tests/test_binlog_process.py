"""The binlog through a real broker process: restarts, fsync modes, damage handling, full disk."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from test_binlog_helpers import job_snapshot, run_ours_expect_exit, segment_files, start_ours

from broker import binlog_format as fmt
from spark_beanstalk.client import Connection
from tests.helpers import sample, scrape

pytestmark = pytest.mark.timeout(90)


def _fill(conn: Connection) -> dict:
    """A bit of everything; returns the ids by role."""
    ids = {}
    conn.use("alpha")
    ids["ready"] = conn.put(b"ready body", priority=10, ttr=30)
    ids["delayed"] = conn.put(b"delayed body", delay=500)
    conn.use("beta")
    ids["buried"] = conn.put(b"to bury")
    conn.watch("beta")
    assert conn.reserve_job(ids["buried"]) is not None
    assert conn.bury(ids["buried"], priority=4)
    ids["released"] = conn.put(b"to release")
    conn.reserve_job(ids["released"])
    assert conn.release(ids["released"], priority=6, delay=0)
    ids["reserved"] = conn.put(b"held when the broker dies", ttr=1000)
    conn.reserve_job(ids["reserved"])
    ids["deleted"] = conn.put(b"to delete")
    assert conn.delete(ids["deleted"])
    return ids


@pytest.mark.parametrize("flags,stop", [(["-f", "0"], "kill"), (["-f", "50"], "kill"), (["-F"], "kill"),
                                        (["-f", "50"], "term")])
def test_restart_keeps_jobs(tmp_path, flags, stop):
    d = str(tmp_path / "bl")
    err = str(tmp_path / "err.log")
    proc = start_ours(d, *flags, stderr_path=err)
    try:
        with Connection(proc.host, proc.port) as conn:
            ids = _fill(conn)
            before = job_snapshot(conn, ids.values())
        proc.kill() if stop == "kill" else proc.stop()
        proc = start_ours(d, *flags, stderr_path=err)
        with Connection(proc.host, proc.port) as conn:
            after = job_snapshot(conn, ids.values())
            assert after[ids["deleted"]] is None
            for role in ("ready", "delayed", "buried", "released", "reserved"):
                a, b = after[ids[role]], before[ids[role]]
                want_state = "ready" if role == "reserved" else b["state"]
                same = ("tube", "pri", "body", "ttr", "releases", "buries", "kicks")
                assert (a["state"], *(a[k] for k in same)) == (want_state, *(b[k] for k in same)), role
            assert 490 <= after[ids["delayed"]]["time-left"] <= 500
            assert conn.put(b"new") > max(ids.values())
    finally:
        proc.kill()
    log = Path(err).read_text()
    assert "binlog: recovered 5 jobs (1 buried)" in log


def test_sigterm_fsyncs_and_trims(tmp_path):
    d = str(tmp_path / "bl")
    proc = start_ours(d, "-F")
    with Connection(proc.host, proc.port) as conn:
        for _i in range(20):
            conn.put(b"x" * 100)
    assert proc.stop() == 0
    files = segment_files(d)
    data = Path(d, files[-1]).read_bytes()
    assert not data.endswith(b"\0" * 64), "the current segment is trimmed to its data at shutdown"
    assert data.count(b"x" * 100) == 20


def _corrupt_middle(d: str) -> str:
    files = segment_files(d)
    victim = os.path.join(d, files[0])
    with open(victim, "r+b") as fh:
        fh.seek(fmt.HEADER_SIZE + 60)
        b = fh.read(1)
        fh.seek(fmt.HEADER_SIZE + 60)
        fh.write(bytes([b[0] ^ 0x55]))
    return victim


def test_damage_refuses_to_start_then_flag_starts_anyway(tmp_path):
    d = str(tmp_path / "bl")
    proc = start_ours(d, "-s", "2048")
    with Connection(proc.host, proc.port) as conn:
        ids = [conn.put(b"job-%d" % i + b"." * 60) for i in range(100)]
    proc.kill()
    victim = _corrupt_middle(d)
    res = run_ours_expect_exit(d, "-s", "2048")
    assert res.returncode != 0
    assert victim in res.stderr and "offset" in res.stderr and "--binlog-ignore-damage" in res.stderr
    assert "Traceback" not in res.stderr
    proc = start_ours(d, "-s", "2048", "--binlog-ignore-damage")
    try:
        with Connection(proc.host, proc.port) as conn:
            snap = job_snapshot(conn, ids)
            present = [i for i in ids if snap[i] is not None]
            assert 80 <= len(present) < len(ids)
    finally:
        proc.stop()
    assert os.path.exists(victim + ".damaged")
    proc = start_ours(d, "-s", "2048")  # clean again without the flag
    try:
        with Connection(proc.host, proc.port) as conn:
            assert [i for i, v in job_snapshot(conn, ids).items() if v is not None] == present
    finally:
        proc.stop()


def test_torn_tail_warning_names_file_and_offset(tmp_path):
    d = str(tmp_path / "bl")
    err = str(tmp_path / "err.log")
    proc = start_ours(d, stderr_path=err)
    with Connection(proc.host, proc.port) as conn:
        a = conn.put(b"first")
        b = conn.put(b"second" * 20)
    proc.kill()
    path = os.path.join(d, segment_files(d)[-1])
    data = Path(path).read_bytes().rstrip(b"\0")
    with open(path, "r+b") as fh:
        fh.truncate(len(data) - 30)
    proc = start_ours(d, stderr_path=err)
    try:
        with Connection(proc.host, proc.port) as conn:
            snap = job_snapshot(conn, [a, b])
            assert snap[a] is not None and snap[b] is None
    finally:
        proc.stop()
    log = Path(err).read_text()
    assert "torn record at the end of the log dropped" in log and path in log and "offset" in log


@contextlib.contextmanager
def _small_filesystem(size: str):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tempfile.mkdtemp(prefix="binlog-full-")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt], capture_output=True)
    if res.returncode != 0:
        os.rmdir(mnt)
        pytest.skip(f"cannot mount tmpfs: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)
        os.rmdir(mnt)


def test_full_disk_refuses_puts_and_keeps_serving(tmp_path):
    with _small_filesystem("1m") as mnt:
        d = os.path.join(mnt, "bl")
        proc = start_ours(d, "-f", "0", "-s", "131072")
        try:
            conn = Connection(proc.host, proc.port)
            body = b"b" * 8000
            ids = []
            for _ in range(400):
                reply = conn.call(f"put 1 0 60 {len(body)}", body)
                if reply.status != b"INSERTED":
                    assert reply.status == b"OUT_OF_MEMORY", reply
                    break
                ids.append(reply.int_arg())
            else:
                pytest.fail("the disk never filled up")
            assert len(ids) > 20
            # reads, state changes and deletes keep working
            assert conn.peek(ids[0]).body == body
            assert conn.stats()["current-jobs-ready"] == len(ids)
            assert conn.reserve_job(ids[1]) is not None and conn.bury(ids[1])
            half = len(ids) // 2
            for job_id in ids[:half]:
                assert conn.delete(job_id)
            # old segments emptied by the deletes are removed: puts work again
            reply = conn.call(f"put 1 0 60 {len(body)}", body)
            assert reply.status == b"INSERTED", reply
            ids.append(reply.int_arg())
            conn.close()
            proc.kill()
            proc = start_ours(d, "-f", "0", "-s", "131072")
            with Connection(proc.host, proc.port) as conn:
                snap = job_snapshot(conn, ids)
                assert [i for i in ids if snap[i] is not None] == ids[half:]
                assert snap[ids[1]] is None and snap[ids[-1]]["body"] == body
        finally:
            proc.kill()


def test_a_restart_sets_aside_room_for_the_deletes_of_the_recovered_jobs(tmp_path):
    """Fill the disk, restart, and let another process take any space left: the restarted broker has
    no room to log deletes and answers DELETED without logging them. It also kept counting those jobs
    as live, so their segments were never dropped: after the next crash 1,779 of them came back. Now
    an unlogged delete still counts, the emptied segments go (taking the jobs' records with them), and
    recovery sets room aside for the deletes while it can (a warning when it cannot)."""
    with _small_filesystem("1m") as mnt:
        d = os.path.join(mnt, "bl")
        proc = start_ours(d, "-f", "0", "-s", "131072")
        try:
            with Connection(proc.host, proc.port) as conn:
                ids = []
                while True:
                    reply = conn.call("put 1 0 60 1", b"x")
                    if reply.status != b"INSERTED":
                        assert reply.status == b"OUT_OF_MEMORY", reply
                        break
                    ids.append(reply.int_arg())
            assert len(ids) > 1000
            proc.kill()
            proc = start_ours(d, "-f", "0", "-s", "131072")
            filler = os.path.join(mnt, "filler")
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
            try:
                with contextlib.suppress(OSError):
                    while True:  # another process takes every byte left
                        os.write(fd, b"\0" * 4096)
            finally:
                os.close(fd)
            with Connection(proc.host, proc.port) as conn:
                # newest first: the oldest segments, whose dropping would free room, stay pinned longest
                replies = list(conn.pipeline([b"delete %d\r\n" % i for i in reversed(ids)], window=256))
                assert all(r.status == b"DELETED" for r in replies)
            proc.kill()
            os.unlink(filler)
            proc = start_ours(d, "-f", "0", "-s", "131072")
            with Connection(proc.host, proc.port) as conn:
                assert conn.stats()["current-jobs-ready"] == 0, "deleted jobs came back"
        finally:
            proc.kill()


def _binlog_counts(metrics_addr: str) -> tuple[float, float]:
    """(records writes, fsyncs) of a broker's binlog so far, from its /metrics."""
    _types, samples = scrape(metrics_addr)
    writes = sample(samples, "beanstalk_binlog_writes_total")
    fsyncs = sample(samples, "beanstalk_binlog_fsync_seconds_count")
    assert writes is not None and fsyncs is not None, sorted(samples)
    return writes, fsyncs


@pytest.mark.parametrize("flags", [["-f", "0"], ["-f", "50"], ["-F"]])
def test_group_commit_shares_writes_and_loses_nothing(tmp_path, flags):
    """20 connections whose puts arrive in the same instant (the broker is stopped with
    SIGSTOP while they are sent): every put is acknowledged only after its record is written
    (and with -f 0 fsynced), yet they share a few writes (and fsyncs) instead of paying one
    each, in every -f mode; every acknowledged job survives a SIGKILL."""
    import signal
    import socket

    from spark_beanstalk.embedded import free_port

    d = str(tmp_path / "bl")
    metrics = f"127.0.0.1:{free_port()}"
    proc = start_ours(d, *flags, "--metrics", metrics)
    socks = []
    try:
        for _ in range(20):
            sock = socket.create_connection((proc.host, proc.port), timeout=10)
            sock.sendall(b"use group\r\n")
            assert sock.recv(64) == b"USING group\r\n"  # accepted and served before the pause
            socks.append(sock)
        writes_before, fsyncs_before = _binlog_counts(metrics)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            for n, sock in enumerate(socks):
                body = b"job %02d" % n
                sock.sendall(b"put 0 0 60 %d\r\n%s\r\n" % (len(body), body))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        ids = []
        for sock in socks:
            reply = b""
            while not reply.endswith(b"\r\n"):
                reply += sock.recv(64)
            assert reply.startswith(b"INSERTED "), reply
            ids.append(int(reply.split()[1]))
        writes_after, fsyncs_after = _binlog_counts(metrics)
        writes = writes_after - writes_before
        assert 1 <= writes <= 5, f"{writes} binlog writes for 20 puts that arrived together"
        if flags == ["-f", "0"]:
            fsyncs = fsyncs_after - fsyncs_before
            assert 1 <= fsyncs <= 5, f"{fsyncs} fsyncs for 20 puts that arrived together"
        proc.kill()
        proc = start_ours(d, *flags)
        with Connection(proc.host, proc.port) as conn:
            snap = job_snapshot(conn, ids)
        assert sorted(s["body"] for s in snap.values()) == [b"job %02d" % n for n in range(20)]
    finally:
        for sock in socks:
            sock.close()
        proc.kill()


@pytest.mark.parametrize("flags", [["-f", "0"], ["-f", "50"]])
def test_reserves_survive_sigkill(tmp_path, flags):
    """Issue 11: a job reserved twice (released between) comes back with reserves 2 after a SIGKILL.

    The second reserve is the last thing the broker did: its record is written before the
    RESERVED reply (no fsync waited for), so a SIGKILL does not lose it.
    """
    d = str(tmp_path / "bl")
    proc = start_ours(d, *flags)
    try:
        with Connection(proc.host, proc.port) as conn:
            job_id = conn.put(b"counted", ttr=100)
            for attempt in range(2):
                got = conn.reserve(timeout=5)
                assert got is not None and got.id == job_id
                if attempt == 0:
                    assert conn.release(job_id)
            assert conn.stats_job(job_id)["reserves"] == 2
        proc.kill()
        proc = start_ours(d, *flags)
        with Connection(proc.host, proc.port) as conn:
            stats = conn.stats_job(job_id)
            assert stats["reserves"] == 2 and stats["releases"] == 1 and stats["state"] == "ready"
    finally:
        proc.stop()
