"""Replication without etcd: one primary (--replication-listen), replicas (--replica-of), real processes."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import greenstalk
import pytest

from spark_beanstalk.client import Connection
from tests.helpers import free_port, http_get, member_process, wait_until


def _client(proc) -> greenstalk.Client:
    return greenstalk.Client((proc.host, proc.port))


def _stats(proc) -> dict:
    with _client(proc) as c:
        return c.stats()


def _jobs(proc, ids) -> dict:
    """id -> (state, pri, body, buries, kicks, releases) of every id the member holds."""
    out = {}
    with _client(proc) as c:
        for job_id in ids:
            try:
                s = c.stats_job(job_id)
            except greenstalk.NotFoundError:
                continue
            out[job_id] = (s["state"], s["pri"], c.peek(job_id).body, s["buries"], s["kicks"], s["releases"])
    return out


def _caught_up(primary, replica) -> bool:
    p, r = _stats(primary), _stats(replica)
    return (r["replication-epoch"], r["replication-seq"]) == (p["replication-epoch"], p["replication-seq"]) \
        and r["replication-lag-records"] == 0


@pytest.fixture
def pair(tmp_path):
    pm, rm = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    primary = member_process(str(tmp_path / "a"), stderr_path=str(tmp_path / "a.log"),
                             extra_args=["--metrics", pm]).start()
    replica = member_process(str(tmp_path / "b"), replica_of=primary.repl_address,
                             stderr_path=str(tmp_path / "b.log"), extra_args=["--metrics", rm]).start()
    primary.metrics, replica.metrics = pm, rm
    yield primary, replica
    replica.stop()
    primary.stop()


def test_replica_applies_every_change_and_refuses_changes(pair):
    primary, replica = pair
    with _client(primary) as c:
        ids = [c.put(f"job-{i}", priority=i) for i in range(8)]
        c.delete(c.reserve(timeout=0))  # id 1
        c.bury(c.reserve(timeout=0), priority=7)  # id 2
        c.release(c.reserve(timeout=0), priority=99, delay=60)  # id 3: delayed
        c.kick_job(ids[1])  # the buried one comes back ready, kicks=1
        c.bury(c.reserve(timeout=0))  # the most urgent ready job
    wait_until(lambda: _caught_up(primary, replica), 10, what="replica caught up")
    want = _jobs(primary, ids)
    assert len(want) == 7 and want[ids[2]][0] == "delayed" and want[ids[1]][4] == 1  # kicked once
    assert [v[0] for v in want.values()].count("buried") == 1
    assert _jobs(replica, ids) == want
    with _client(replica) as r:
        with pytest.raises(greenstalk.DrainingError):
            r.put("refused")
        with pytest.raises(greenstalk.OutOfMemoryError):
            r.reserve(timeout=0)
        with pytest.raises(greenstalk.OutOfMemoryError):
            r.delete(ids[4])
        with pytest.raises(greenstalk.OutOfMemoryError):
            r.kick(10)
        assert r.peek(ids[4]).body == "job-4"  # reads work
        s = r.stats()
    assert s["replication-role"] == "replica" and s["current-jobs-ready"] == 5
    assert _stats(primary)["replication-replicas"] == 1
    assert "beanstalk_replication_leader 1.0" in _metrics(primary)
    assert "beanstalk_replication_leader 0.0" in _metrics(replica)
    assert "beanstalk_replication_lag_records 0.0" in _metrics(replica)
    assert _readyz(primary) == 200 and _readyz(replica) == 503  # load balancers route clients to the leader


def _readyz(proc) -> int:
    return http_get(f"http://{proc.metrics}/readyz")[0]


def _metrics(proc) -> str:
    with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_replica_catches_up_from_backlog_then_by_snapshot(pair, tmp_path):
    primary, replica = pair
    with _client(primary) as c:
        first = [c.put(f"a{i}") for i in range(50)]
    wait_until(lambda: _caught_up(primary, replica), 10, what="replica caught up")
    replica.kill()
    with _client(primary) as c:
        for job_id in first[:20]:
            c.delete(job_id)
        second = [c.put(f"b{i}") for i in range(30)]
    replica.start()  # restarts from its own binlog and position: the primary's backlog has the rest
    wait_until(lambda: _caught_up(primary, replica), 10, what="replica caught up after restart")
    assert set(_jobs(replica, first + second)) == set(first[20:] + second)
    assert _stats(primary)["replication-joined-by-backlog"] == 1
    # the primary restarts: a new epoch and an empty backlog, so the replica gets a snapshot
    primary.kill()
    primary.start()
    with _client(primary) as c:
        third = c.put("c")
        c.delete(second[0])
    assert third > second[-1]  # ids continue above every id the log ever issued
    wait_until(lambda: _caught_up(primary, replica), 10, what="replica caught up by snapshot")
    assert set(_jobs(replica, first + second + [third])) == set(first[20:] + second[1:] + [third])
    assert _stats(primary)["replication-joined-by-snapshot"] == 1


def _log(proc) -> str:
    with open(proc.stderr_path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def _put_raw(proc, body: bytes, timeout: float) -> bytes:
    """Send one put and wait at most ``timeout`` s for its reply (b'' if none came)."""
    with socket.create_connection((proc.host, proc.port)) as s:
        s.sendall(b"put 0 0 60 %d\r\n%s\r\n" % (len(body), body))
        s.settimeout(timeout)
        try:
            return s.recv(100)
        except TimeoutError:
            return b""


def test_sync_replicas_hold_the_reply_until_a_replica_has_the_record(tmp_path):
    primary = member_process(str(tmp_path / "a"), sync_replicas=1, stderr_path=str(tmp_path / "a.log")).start()
    try:
        assert _put_raw(primary, b"waits", 0.5) == b""  # no replica: no acknowledgement
        with Connection(primary.host, primary.port, timeout=5) as c:  # reads on other connections are answered
            assert c.stats()["replication-role"] == "leader"
        replica = member_process(str(tmp_path / "b"), replica_of=primary.repl_address).start()
        try:
            t0 = time.monotonic()
            assert _put_raw(primary, b"goes", 10).startswith(b"INSERTED ")
            assert time.monotonic() - t0 < 5
            with _client(primary) as c:
                acked = [c.put(f"s{i}") for i in range(200)]
            primary.kill()  # every acknowledged put is on the replica already
            held = _jobs(replica, acked)
            assert set(held) == set(acked)
        finally:
            replica.stop()
    finally:
        primary.stop()


def test_stream_over_tls_with_the_brokers_token(tmp_path, certs):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    tls = ["--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "server.key"),
           "--tls-port", str(free_port())]
    primary = member_process(str(tmp_path / "a"), extra_args=[*tls, "--auth-token-file", str(token)]).start()
    good = member_process(str(tmp_path / "b"), replica_of=primary.repl_address, stderr_path=str(tmp_path / "b.log"),
                          extra_args=["--replication-ca", str(certs / "ca.crt"), "--auth-token-file", str(token)])
    bad = member_process(str(tmp_path / "c"), replica_of=primary.repl_address, stderr_path=str(tmp_path / "c.log"),
                         extra_args=["--replication-ca", str(certs / "ca.crt"), "--auth-token-file", str(wrong)])
    try:
        with Connection(primary.host, primary.port, auth_token="s3cret") as c:
            ids = [c.put(b"t%d" % i) for i in range(10)]
        good.start()
        bad.start()

        def replica_has_all() -> bool:
            with Connection(good.host, good.port, auth_token="s3cret") as c:
                return all(c.stats_job(i) is not None for i in ids)

        wait_until(replica_has_all, 15, what="the TLS replica has every job")
        wait_until(lambda: "auth refused" in _log(bad), 15, what="the wrong token refused")
        with Connection(primary.host, primary.port, auth_token="s3cret") as c:
            assert c.stats()["replication-replicas"] == 1
        with Connection(bad.host, bad.port, auth_token="nope") as c:
            assert c.stats()["current-jobs-ready"] == 0
    finally:
        for proc in (bad, good, primary):
            proc.stop()


def test_a_replica_that_drops_its_stream_loses_no_client_reply(tmp_path):
    """A replica reset mid-snapshot: the leader's next write to it raised inside the commit of a
    group of client replies, and the whole group was dropped (put applied, client never answered)."""
    leader = member_process(str(tmp_path / "a"), stderr_path=str(tmp_path / "a.log")).start()
    try:
        with Connection(leader.host, leader.port) as conn:
            conn.pipeline([b"put 0 0 60 10\r\n0123456789\r\n"] * 300)  # a snapshot the replica leaves unread
        host, port = leader.repl_address.split(":")
        for _ in range(10):
            with Connection(leader.host, leader.port, timeout=3) as conn:
                replica = socket.create_connection((host, int(port)), timeout=3)
                replica.sendall(b"replicate r1 0 0\r\n")
                assert replica.recv(4096)  # the stream has started
                replica.close()  # input unread: a reset
                assert conn.put(b"after") > 0  # answered (ConnectionLost after 3 s without the fix)
        assert "Exception in callback" not in leader.log()
    finally:
        leader.kill()


def test_replication_port_that_cannot_be_bound_is_a_nonzero_exit(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "broker", "-p", str(free_port()), "-b", str(tmp_path / "b"),
                                 "--replication-listen", f"127.0.0.1:{port}"],
                                capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert result.returncode != 0
    assert f"--replication-listen: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_replication_ca_that_is_not_a_certificate_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    result = subprocess.run([sys.executable, "-m", "broker", "-p", str(free_port()), "-b", str(tmp_path / "b"),
                             "--replica-of", f"127.0.0.1:{free_port()}", "--replication-ca", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--replication-ca" in result.stderr and "cannot listen" not in result.stderr
