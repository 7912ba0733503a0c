"""Failover with etcd: 3 real members on loopback, SIGKILL of the leader under load, and a partition.

What is checked is what clients were told: every put acknowledged (INSERTED) and not
acknowledged deleted (DELETED) is present exactly once at the end, no acknowledged delete
comes back, job ids never repeat, a new leader takes puts within 3 s, and a killed leader
rejoins as a replica and catches up.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from spark_beanstalk.client import BeanstalkError, Connection, ConnectionLost
from tests.helpers import (
    EtcdProxy,
    ReplicaSet,
    TcpProxy,
    etcd_process,
    free_port,
    member_process,
    member_stats,
    wait_until,
)

FAILOVER_LIMIT = 3.0
# A snapshot of 300,000 jobs in one step held the leader's loop 0.8 s on the Intel Xeon VM (150,000 already outlasted
# the 1 s lease on the slower AMD VM). Sent in pieces, the slowest put waited 0.20-0.28 s interpreted on the AMD VM
# (0.69 s in a loaded CI run): a socket's drain() gave the loop no turn between pieces. With a turn after each piece,
# 0.06-0.07 s interpreted and 0.03-0.04 s compiled (test_replication_unit checks the turns themselves).
JOBS = 300_000
SLOWEST_PUT = 0.6  # CI runs it beside the Spark worker: room for the scheduler, still below the one-step stall


def _leaders(members) -> list:
    return [m for m in members if m.proc is not None and m.proc.poll() is None
            and (member_stats(m) or {}).get("replication-role") == "leader"]


def _one_leader(members):
    found = _leaders(members)
    return found[0] if len(found) == 1 else None


def _job_counts(member) -> tuple[int, int, int]:
    """(ready or reserved, delayed, buried): a job reserved on the leader is ready on a replica."""
    s = member_stats(member)
    assert s is not None
    return (s["current-jobs-ready"] + s["current-jobs-reserved"], s["current-jobs-delayed"], s["current-jobs-buried"])


class Ledger:
    """Every acknowledged operation, from every client thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.puts: dict[bytes, int] = {}
        self.deleted: set[bytes] = set()
        self.unsure: set[bytes] = set()  # a delete was sent but its reply never came: gone or not
        self.ids: list[int] = []

    def put(self, body: bytes, job_id: int) -> None:
        with self.lock:
            self.puts[body] = job_id
            self.ids.append(job_id)

    def delete(self, body: bytes) -> None:
        with self.lock:
            self.deleted.add(body)

    def delete_unsure(self, body: bytes) -> None:
        with self.lock:
            self.unsure.add(body)


class Worker(threading.Thread):
    """Puts, and reserves+deletes every other round, on whichever member leads."""

    def __init__(self, n: int, members, ledger: Ledger, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.n, self.members, self.ledger, self.stop = n, members, ledger, stop
        self.ops = 0

    def run(self) -> None:
        conn = None
        i = 0
        while not self.stop.is_set():
            if conn is None:
                conn = self._connect()
                if conn is None:
                    time.sleep(0.02)
                    continue
            i += 1
            body = b"w%d-%d" % (self.n, i)
            job = None
            try:
                self.ledger.put(body, conn.put(body))
                if i % 2 == 0:
                    job = conn.reserve(timeout=0)
                    if job is not None and conn.delete(job.id):
                        self.ledger.delete(job.body)
                    job = None
                self.ops += 1
            except (BeanstalkError, OSError) as exc:
                if job is not None and isinstance(exc, (ConnectionLost, OSError)):
                    self.ledger.delete_unsure(job.body)  # the delete may have been done
                conn.close()
                conn = None

    def _connect(self) -> Connection | None:
        for m in list(self.members):
            try:
                conn = Connection(m.host, m.port, timeout=2, connect_timeout=0.5)
            except BeanstalkError:
                continue
            try:
                if conn.stats().get("replication-role") == "leader":
                    return conn
            except (BeanstalkError, OSError):
                pass
            conn.close()
        return None


def _first_put_after(members, t_kill: float, ledger: Ledger, tag: str) -> float:
    """Seconds from t_kill until some member acknowledges a put."""
    k = 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for m in members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            k += 1
            body = b"probe-%s-%d" % (tag.encode(), k)
            try:
                conn = Connection(m.host, m.port, timeout=2, connect_timeout=0.3)
            except BeanstalkError:
                continue
            try:
                ledger.put(body, conn.put(body))
                return time.monotonic() - t_kill
            except (BeanstalkError, OSError):
                pass
            finally:
                conn.close()
        time.sleep(0.02)
    raise AssertionError("no member accepted a put within 15 s of the kill")


def _hold_a_reservation(members, body: bytes) -> tuple[object, int, Connection]:
    """Put a job in tube 'held' on the leader and keep it reserved on a connection (kept open) that
    dies with the leader; returns (leader, job id, connection). Retried while leadership moves."""

    def attempt():
        leader = _one_leader(members)
        if leader is None:
            return None
        conn = Connection(leader.host, leader.port, timeout=5)
        try:
            conn.use("held")
            job_id = conn.put(body)
            if conn.reserve_job(job_id) is not None:
                return leader, job_id, conn
        except (BeanstalkError, OSError):
            pass
        conn.close()
        return None

    return wait_until(attempt, 10, what="a reservation held on the leader")


def _drain(leader) -> list[tuple[int, bytes]]:
    conn = Connection(leader.host, leader.port, timeout=5)
    try:
        found = []
        while (job := conn.reserve(timeout=0)) is not None:
            found.append((job.id, job.body))
        return found
    finally:
        conn.close()


@pytest.fixture
def etcd(tmp_path):
    proc = etcd_process(str(tmp_path / "etcd"), stderr_path=str(tmp_path / "etcd.log")).start()
    yield proc
    proc.stop()


@pytest.fixture
def started():
    """Every member a test starts, stopped at teardown even when the test fails."""
    procs: list = []
    yield procs
    for proc in procs:
        proc.stop()


def _start_cluster(tmp_path, started: list, endpoints: list[str], sync: int = 1, ttl: int = 1) -> list:
    members = started
    for n, endpoint in enumerate(endpoints):
        m = member_process(str(tmp_path / f"m{n}"), etcd=f"http://{endpoint}", name=f"m{n}", sync_replicas=sync,
                           lease_ttl=ttl, stderr_path=str(tmp_path / f"m{n}.log"))
        members.append(m.start())
        if n == 0:
            wait_until(lambda: _one_leader(members[:1]), 15, what="the first member leads")
    for m in members[1:]:
        wait_until(lambda m=m: ReplicaSet.caught_up(members[0], m), 15, what="replicas joined")
    return members


def test_failover_under_load_loses_no_acknowledged_job(tmp_path, etcd, started):
    members = _start_cluster(tmp_path, started, [etcd.address] * 3)
    ledger = Ledger()
    stop = threading.Event()
    workers = [Worker(n, members, ledger, stop) for n in range(3)]
    rng = random.Random(int(os.environ.get("FAILOVER_SEED", "15")))
    times: list[float] = []
    held_ids: list[int] = []
    holders: list[Connection] = []
    try:
        for w in workers:
            w.start()
        for rnd in range(3):
            before = sum(w.ops for w in workers)
            wait_until(lambda before=before: sum(w.ops for w in workers) > before + 50, 10, what="load running")
            leader, held, holder = _hold_a_reservation(members, b"held-%d" % rnd)
            holders.append(holder)
            time.sleep(rng.uniform(0.0, 0.8))  # a random moment under load
            t_kill = time.monotonic()
            leader.kill()
            times.append(_first_put_after(members, t_kill, ledger, f"r{rnd}"))
            new = wait_until(lambda: _one_leader(members), 10, what="the new leader")
            with Connection(new.host, new.port, timeout=5) as conn:
                assert conn.stats_job(held)["state"] == "ready"  # reserved on the old leader: ready here
            held_ids.append(held)
            leader.start()  # same directory and ports: it must come back as a replica
            new = wait_until(lambda: _one_leader(members), 10, what="one leader after the restart")
            assert new is not leader
            wait_until(lambda new=new, leader=leader: ReplicaSet.caught_up(new, leader), 15,
                       what="the old leader rejoined and caught up")
    finally:
        stop.set()
        for w in workers:
            w.join(10)
    leader = wait_until(lambda: _one_leader(members), 10, what="one leader at the end")
    for m in members:
        if m is not leader:
            wait_until(lambda m=m: ReplicaSet.caught_up(leader, m), 15, what="every replica caught up")
    # each restarted leader rejoined by a snapshot sent in pieces while the workers ran: same jobs everywhere
    assert len({_job_counts(m) for m in members}) == 1, [_job_counts(m) for m in members]
    for holder in holders:
        holder.close()
    with Connection(leader.host, leader.port, timeout=5) as conn:
        assert all(conn.stats_job(i)["state"] == "ready" for i in held_ids)
    with open(tmp_path / "failover.json", "w") as fh:
        json.dump({"failover_seconds": times, "acked_puts": len(ledger.puts), "acked_deletes": len(ledger.deleted),
                   "unanswered_deletes": len(ledger.unsure)}, fh)
    print(f"\nfailover seconds (kill -> first acknowledged put): {[round(t, 2) for t in times]}; "
          f"{len(ledger.puts)} puts and {len(ledger.deleted)} deletes acknowledged, "
          f"{len(ledger.unsure)} deletes unanswered")
    assert len(ledger.puts) > 300 and len(ledger.deleted) > 100
    _assert_the_ledger_holds(leader, members, ledger)
    assert max(times) < FAILOVER_LIMIT, times


def _assert_the_ledger_holds(leader, members, ledger: Ledger) -> collections.Counter[bytes]:
    """Drain the leader: every put acknowledged and not deleted is there once, no acknowledged delete
    came back, no job id was given twice. Returns the bodies found."""
    present = _drain(leader)
    bodies = collections.Counter(body for _, body in present)
    ids = [job_id for job_id, _ in present]
    assert len(set(ledger.ids)) == len(ledger.ids), "a job id was acknowledged twice"
    assert len(set(ids)) == len(ids)
    assert max(bodies.values()) == 1, "a job is present twice"
    missing = [b for b in ledger.puts if b not in ledger.deleted and b not in ledger.unsure and b not in bodies]
    if missing and os.environ.get("FAILOVER_DEBUG"):
        for b in missing:
            jid = ledger.puts[b]
            for m in members:
                conn = Connection(m.host, m.port, timeout=5)
                print("DEBUG", b, jid, m.port, conn.stats_job(jid), conn.stats()["replication-role"])
                conn.close()
        for m in members:
            with open(m.stderr_path, encoding="utf-8", errors="replace") as fh:
                print(fh.read()[-3000:])
    assert not missing, f"{len(missing)} acknowledged puts lost, e.g. {missing[:5]}"
    back = [b for b in ledger.deleted if b in bodies]
    assert not back, f"{len(back)} acknowledged deletes came back, e.g. {back[:5]}"
    return bodies


def test_leader_cut_off_from_etcd_stops_acknowledging_before_a_new_leader(tmp_path, etcd, started):
    proxy = TcpProxy(etcd.host, etcd.port)
    members = _start_cluster(tmp_path, started, [proxy.address, etcd.address, etcd.address], sync=0)
    old = members[0]
    acks: dict[str, list[float]] = {"old": [], "new": []}
    stop = threading.Event()

    def hammer(m, key: str) -> None:
        conn = None
        while not stop.is_set():
            try:
                conn = conn or Connection(m.host, m.port, timeout=2, connect_timeout=0.5)
                conn.put(b"x")
                acks[key].append(time.monotonic())
            except (BeanstalkError, OSError):
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.01)

    threads = [threading.Thread(target=hammer, args=(old, "old"), daemon=True)]
    try:
        threads[0].start()
        wait_until(lambda: len(acks["old"]) > 20, 10, what="puts on the leader")
        t_cut = time.monotonic()
        proxy.cut()  # the leader still serves clients, but cannot reach etcd
        new = wait_until(lambda: _one_leader(members[1:]), 10, what="a new leader")
        t_new = time.monotonic()
        threads.append(threading.Thread(target=hammer, args=(new, "new"), daemon=True))
        threads[1].start()
        wait_until(lambda: acks["new"], 10, what="puts on the new leader")
        assert (member_stats(old) or {}).get("replication-role") != "leader"
        stop.set()
        for t in threads:
            t.join(5)
        proxy.restore()  # etcd reachable again: the old leader rejoins as a replica
        wait_until(lambda: ReplicaSet.caught_up(new, old), 15, what="the old leader rejoined")
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        proxy.close()
    last_old, first_new = max(acks["old"]), min(acks["new"])
    print(f"\nold leader's last ack {last_old - t_cut:.2f}s after the cut; new leader seen at {t_new - t_cut:.2f}s, "
          f"its first ack at {first_new - t_cut:.2f}s")
    assert last_old < first_new, "two leaders acknowledged at once"
    assert last_old - t_cut < 1.5  # fenced within the lease (1 s), not after


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spark_beanstalk.cli", *args], check=False,
                          capture_output=True, text=True,
                          timeout=60)


def test_promote_and_demote_move_leadership_without_losing_jobs(tmp_path, etcd, started):
    # a 2 s lease: on a loaded machine a 1 s one can lapse between keep-alives, and a put on a
    # fenced leader would be refused (correctly, but not what this test is about)
    members = _start_cluster(tmp_path, started, [etcd.address] * 3, sync=1, ttl=2)
    first, target = members[0], members[2]
    conn = Connection(first.host, first.port, timeout=5)
    ids = [conn.put(b"p%d" % i) for i in range(100)]
    conn.close()
    done = _cli("promote", "-m", target.repl_address)
    assert done.returncode == 0, done.stderr
    assert _one_leader(members) is target
    conn = Connection(target.host, target.port, timeout=5)
    assert all(conn.stats_job(i) is not None for i in ids)
    assert conn.put(b"after") > max(ids)
    conn.close()
    refused = _cli("demote", "-m", first.repl_address)
    assert refused.returncode != 0 and "not the leader" in refused.stderr
    done = _cli("demote", "-m", target.repl_address)
    assert done.returncode == 0, done.stderr
    new = wait_until(lambda: _one_leader(members), 10, what="a leader after demote")
    assert new is not target


class PutProbe(threading.Thread):
    """Puts one job every 10 ms and keeps the slowest reply: how long the leader kept its clients waiting."""

    def __init__(self, member) -> None:
        super().__init__(daemon=True)
        self.member = member
        self.stop = threading.Event()
        self.slowest = 0.0
        self.puts = 0

    def run(self) -> None:
        with Connection(self.member.host, self.member.port, timeout=30) as conn:
            while not self.stop.wait(0.01):
                t0 = time.monotonic()
                conn.put(b"probe")
                self.slowest = max(self.slowest, time.monotonic() - t0)
                self.puts += 1


def test_a_new_member_joining_by_snapshot_neither_stalls_nor_fences_the_leader(tmp_path, etcd, started):
    """A member that joins empty gets a snapshot of every job. It was built in one step on the leader's
    event loop: with many jobs the leader's clients waited up to seconds, and the lease's renewal with them,
    so the leader was fenced and a replica set under load changed leaders every second (bench/soak.py
    --side write --server cluster). Now the snapshot goes out SNAPSHOT_CHUNK jobs at a time, the loop
    serving clients between pieces, and the lease is renewed from a thread of its own."""
    from spark_beanstalk.client import encode_put

    members = _start_cluster(tmp_path, started, [etcd.address, etcd.address], sync=0)
    leader = members[0]
    epoch = member_stats(leader)["replication-epoch"]
    body = b"x" * 100
    with Connection(leader.host, leader.port, timeout=60) as conn:
        for _ in range(JOBS // 10_000):
            for reply in conn.pipeline([encode_put(body, 100, 0, 60)] * 10_000):
                assert reply.status == b"INSERTED", reply
    wait_until(lambda: ReplicaSet.caught_up(leader, members[1]), 60, what="the replica caught up")
    probe = PutProbe(leader)
    probe.start()
    wait_until(lambda: probe.puts >= 10, 10, what="the probe putting")
    joining = member_process(str(tmp_path / "m9"), etcd=f"http://{etcd.address}", name="m9", sync_replicas=0,
                             lease_ttl=1, stderr_path=str(tmp_path / "m9.log"))
    started.append(joining.start())
    wait_until(lambda: ReplicaSet.caught_up(leader, joining), 150, what="the new member caught up by snapshot")
    probe.stop.set()
    probe.join(30)
    after = member_stats(leader)
    assert after["replication-role"] == "leader" and after["replication-epoch"] == epoch, after
    assert after["replication-joined-by-snapshot"] >= 1
    with open(leader.stderr_path, encoding="utf-8") as log:
        assert "fenced" not in log.read()
    assert probe.slowest < SLOWEST_PUT, f"a put waited {probe.slowest:.2f} s while the snapshot was sent"


def test_replicas_in_step_follow_a_new_leader_without_a_snapshot(tmp_path, etcd, started):
    """A failover used to snapshot every replica (a new epoch: no backlog could serve them), seconds of
    the new leader's loop with many jobs. A replica whose queue is exactly at the new leader's position
    when it was elected now takes the new epoch from the backlog; a restarted member still needs one."""
    from spark_beanstalk.client import encode_put

    members = _start_cluster(tmp_path, started, [etcd.address] * 3)
    leader = members[0]
    with Connection(leader.host, leader.port, timeout=30) as conn:
        for reply in conn.pipeline([encode_put(b"before %d" % i, 100, 0, 60) for i in range(5_000)]):
            assert reply.status == b"INSERTED", reply
        assert conn.delete(int(reply.args[0]))
    for m in members[1:]:
        wait_until(lambda m=m: ReplicaSet.caught_up(leader, m), 15, what="replicas caught up")
    for round_ in range(2):
        leader.kill()
        new = wait_until(lambda: _one_leader(members), 10, what="a new leader")
        others = [m for m in members if m is not new and m is not leader]
        for m in others:
            wait_until(lambda m=m, new=new: ReplicaSet.caught_up(new, m), 15, what="the other replica follows")
        with Connection(new.host, new.port, timeout=10) as conn:
            conn.put(b"after failover %d" % round_)
        for m in others:
            wait_until(lambda m=m, new=new: ReplicaSet.caught_up(new, m), 15, what="the put replicated")
        stats = member_stats(new)
        assert stats["replication-joined-by-snapshot"] == 0, stats
        assert stats["replication-joined-by-backlog"] == len(others), stats
        leader.start()  # a restarted member: its position file may lag its binlog, so it gets a snapshot
        wait_until(lambda new=new, leader=leader: ReplicaSet.caught_up(new, leader), 15, what="the old leader rejoined")
        assert member_stats(new)["replication-joined-by-snapshot"] == 1
        ready = [s["current-jobs-ready"] for s in map(member_stats, members)]
        assert ready == [4_999 + round_ + 1] * 3, ready
        leader = new


def test_a_member_stopped_cleanly_rejoins_a_new_leader_without_a_snapshot(tmp_path, etcd, started):
    """A rolling restart: the leader is stopped with SIGTERM, a replica leads, the old leader comes back.
    Its binlog closed cleanly, so it knows its queue is exactly at its position and takes the new epoch
    from the backlog. After a SIGKILL it cannot know (the binlog may be ahead of the position file):
    the test above shows it takes a snapshot."""
    from spark_beanstalk.client import encode_put

    members = _start_cluster(tmp_path, started, [etcd.address] * 3)
    leader = members[0]
    with Connection(leader.host, leader.port, timeout=30) as conn:
        for reply in conn.pipeline([encode_put(b"job %d" % i, 100, 0, 60) for i in range(1_000)]):
            assert reply.status == b"INSERTED", reply
    for m in members[1:]:
        wait_until(lambda m=m: ReplicaSet.caught_up(leader, m), 15, what="replicas caught up")
    assert leader.stop() == 0
    with open(tmp_path / "m0" / "replication.json", encoding="utf-8") as fh:
        assert json.load(fh)["exact"] is True
    new = wait_until(lambda: _one_leader(members), 15, what="a new leader")
    leader.start()
    wait_until(lambda: ReplicaSet.caught_up(new, leader), 15, what="the old leader rejoined")
    with open(tmp_path / "m0" / "replication.json", encoding="utf-8") as fh:
        assert "exact" not in json.load(fh)  # a crash from now on may leave the binlog ahead of the file
    stats = member_stats(new)
    assert stats["replication-joined-by-snapshot"] == 0, stats
    assert stats["replication-joined-by-backlog"] == 2, stats
    assert [s["current-jobs-ready"] for s in map(member_stats, members)] == [1_000] * 3


def test_a_leader_stopped_under_load_hands_over_at_once_and_rejoins_without_a_snapshot(tmp_path, etcd, started):
    """A planned restart of the leader while clients put, reserve and delete (SIGTERM, --sync-replicas 1,
    --lease-ttl 5). The leader stops reading clients, waits until every replica acknowledged its last
    record (the held replies go out), and gives its lease back before it closes. So a replica leads
    within a poll, not when the lease lapses 3.75-5 s later; the old leader is exactly where its
    replicas are and rejoins from the backlog; nothing acknowledged is lost. Before, a replica led only
    once the lease lapsed (4.9 s here), and records still pending at the signal were dropped (a leader
    ahead of its replicas rejoins by snapshot)."""
    members = _start_cluster(tmp_path, started, [etcd.address] * 3, ttl=5)
    leader = members[0]
    ledger = Ledger()
    stop = threading.Event()
    workers = [Worker(n, members, ledger, stop) for n in range(3)]
    try:
        for w in workers:
            w.start()
        wait_until(lambda: sum(w.ops for w in workers) > 300, 20, what="load running")
        t_stop = time.monotonic()
        assert leader.stop() == 0
        took = _first_put_after(members, t_stop, ledger, "stop")
        with open(leader.stderr_path, encoding="utf-8", errors="replace") as fh:
            assert "shutting down, replicas in step" in fh.read()
        new = wait_until(lambda: _one_leader(members), 10, what="the new leader")
        before = sum(w.ops for w in workers)
        wait_until(lambda: sum(w.ops for w in workers) > before + 100, 20, what="load on the new leader")
        leader.start()
        wait_until(lambda: ReplicaSet.caught_up(new, leader), 15, what="the old leader rejoined")
    finally:
        stop.set()
        for w in workers:
            w.join(10)
    print(f"\nSIGTERM -> first acknowledged put: {took:.2f} s")
    assert took < 2.5, took
    stats = member_stats(new)
    assert stats["replication-joined-by-snapshot"] == 0, stats
    assert stats["replication-joined-by-backlog"] == 2, stats
    for m in members:
        if m is not new:
            wait_until(lambda m=m: ReplicaSet.caught_up(new, m), 15, what="every replica caught up")
    assert len({_job_counts(m) for m in members}) == 1, [_job_counts(m) for m in members]
    _assert_the_ledger_holds(new, members, ledger)


def test_a_stopped_replica_does_not_hold_up_the_next_election(tmp_path, etcd, started):
    """A member stopped with SIGTERM gives its lease back. An election must ask every member that holds a
    lease for its position, so a replica stopped for maintenance held up the next failover until its
    lease lapsed (3.75-10 s after the stop with --lease-ttl 10)."""
    members = _start_cluster(tmp_path, started, [etcd.address] * 3, ttl=10)
    leader, stopped, survivor = members
    assert stopped.stop() == 0
    done = _cli("demote", "-m", leader.repl_address)
    assert done.returncode == 0, done.stderr
    took = _first_put_after(members, time.monotonic(), Ledger(), "demoted")
    print(f"\ndemote -> first acknowledged put: {took:.2f} s")
    assert _one_leader(members) is survivor
    assert took < 3.0, took  # 0.13 s here; 10.09 s before


def test_a_paused_tube_stays_paused_through_a_failover(tmp_path, etcd, started):
    """pause-tube is not logged (beanstalkd's binlog does not keep it either), so a new leader used to
    serve a tube the old one had paused; the replication stream now carries the pause."""
    members = _start_cluster(tmp_path, started, [etcd.address] * 3)
    leader = members[0]
    with Connection(leader.host, leader.port, timeout=10) as conn:
        conn.use("held")
        conn.put(b"wait for the pause to end")
        conn.pause_tube("held", 60)
    for m in members[1:]:
        wait_until(lambda m=m: ReplicaSet.caught_up(leader, m), 15, what="replicas caught up")
    leader.kill()
    new = wait_until(lambda: _one_leader(members), 15, what="a new leader")
    with Connection(new.host, new.port, timeout=10) as conn:
        tube = conn.stats_tube("held")
        assert tube["pause"] == 60 and 50 < tube["pause-time-left"] <= 60, tube
        conn.watch("held")
        assert conn.reserve(timeout=0) is None  # the job is ready, but its tube is paused


def test_a_tls_replica_under_etcd_keeps_its_stream(tmp_path, etcd, started, certs):
    """Every election poll (0.1 s) tells a replica where the leader is; it keeps its stream when the
    target is unchanged. With TLS the target held a new SSL context each time, and contexts compare
    by identity: the replica reconnected at every poll (and could never finish a long snapshot)."""
    tls = ["--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "server.key"),
           "--replication-ca", str(certs / "ca.crt")]
    for n in range(2):
        m = member_process(str(tmp_path / f"m{n}"), etcd=f"http://{etcd.address}", name=f"m{n}",
                           extra_args=[*tls, "--tls-port", str(free_port())], stderr_path=str(tmp_path / f"m{n}.log"))
        started.append(m.start())
        if n == 0:
            wait_until(lambda: _one_leader(started[:1]), 15, what="the first member leads")
    leader, replica = started
    wait_until(lambda: ReplicaSet.caught_up(leader, replica), 15, what="the TLS replica joined")
    joined = member_stats(leader)
    assert joined is not None
    joins = joined["replication-joined-by-backlog"] + joined["replication-joined-by-snapshot"]
    deadline = time.monotonic() + 1.5  # fifteen election polls
    while time.monotonic() < deadline:
        stats = member_stats(leader)
        assert stats is not None
        assert stats["replication-joined-by-backlog"] + stats["replication-joined-by-snapshot"] == joins, stats
        time.sleep(0.1)
    with Connection(leader.host, leader.port) as conn:
        conn.put(b"over tls")
    wait_until(lambda: ReplicaSet.caught_up(leader, replica), 15, what="the put replicated")


def _member_keys(etcd) -> list[str]:
    """The member keys registered in etcd (etcd's JSON gateway, read directly)."""
    import base64
    import urllib.request

    prefix = b"/spark-beanstalk/members/"
    body = {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(prefix[:-1] + b"0").decode()}
    request = urllib.request.Request(f"http://{etcd.address}/v3/kv/range", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=5) as resp:
        kvs = json.load(resp).get("kvs", [])
    return sorted(base64.b64decode(kv["key"]).decode()[len(prefix):] for kv in kvs)


def test_a_member_whose_registration_failed_registers_again(tmp_path, etcd, started):
    """A replica's first put of its member key fails (etcd hiccups). It kept the lease and never wrote
    the key: elections, which ask only members with a key, then ignored it, while its acks still
    released --sync-replicas replies. Killing the leader elected an empty new member and the replica
    was snapshotted to nothing: acknowledged puts lost. It registers again at the next poll now."""
    leader = member_process(str(tmp_path / "L"), etcd=f"http://{etcd.address}", name="L", sync_replicas=1,
                            stderr_path=str(tmp_path / "L.log"))
    started.append(leader.start())
    wait_until(lambda: _one_leader([leader]), 15, what="L leads")
    proxy = EtcdProxy(etcd.address)
    try:
        proxy.fail("/v3/kv/put")
        replica = member_process(str(tmp_path / "A"), etcd=f"http://{proxy.address}", name="A", sync_replicas=1,
                                 stderr_path=str(tmp_path / "A.log"))
        started.append(replica.start())
        wait_until(lambda: ReplicaSet.caught_up(leader, replica), 15, what="A follows L")
        assert proxy.failed == ["/v3/kv/put"]
        wait_until(lambda: _member_keys(etcd) == ["A", "L"], 10, what="A's member key")
        with Connection(leader.host, leader.port, timeout=10) as conn:
            ids = [conn.put(b"acked %d" % i) for i in range(20)]  # each acknowledged once A has it
        leader.kill()
        newcomer = member_process(str(tmp_path / "B"), etcd=f"http://{etcd.address}", name="B", sync_replicas=1,
                                  stderr_path=str(tmp_path / "B.log"))
        started.append(newcomer.start())
        new = wait_until(lambda: _one_leader([replica, newcomer]), 15, what="a new leader")
        assert new is replica, "the member holding every acknowledged put must win"
        with Connection(new.host, new.port) as conn:
            assert all(conn.stats_job(i) is not None for i in ids)
    finally:
        proxy.close()


def test_a_leader_handing_over_acknowledges_nothing_while_it_writes_the_grant(tmp_path, etcd, started):
    """promote: the leader checks that the target has every record, then writes the grant to etcd, and
    the target, granted, wins without the position check. The leader stepped down only after that etcd
    round trip, and meanwhile went on acknowledging puts that another replica had (--sync-replicas 1)
    but the target did not: lost when the target led. Here the round trip takes 0.8 s (a proxy in front of
    the leader's etcd) and the target is stopped (SIGSTOP) during it, as a slow target would be."""
    import signal

    proxy = EtcdProxy(etcd.address)
    try:
        members = _start_cluster(tmp_path, started, [proxy.address, etcd.address, etcd.address], sync=1, ttl=2)
        leader, target = members[0], members[2]
        proxy.delay("/v3/kv/put", 0.8)  # under the etcd client's 1 s timeout: the grant is written
        proxy.seen.clear()
        promote = subprocess.Popen([sys.executable, "-m", "spark_beanstalk.cli", "promote", "-m",
                                    target.repl_address], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: "/v3/kv/put" in proxy.seen, 15, interval=0.005, what="the leader writing the grant")
            os.kill(target.pid, signal.SIGSTOP)
            acked: list[int] = []
            try:
                with Connection(leader.host, leader.port, timeout=5) as conn:
                    deadline = time.monotonic() + 1.5
                    while time.monotonic() < deadline:
                        acked.append(conn.put(b"during the grant %d" % len(acked)))
            except (BeanstalkError, ConnectionLost, OSError):
                pass  # the leader stepped down: refused or closed, nothing acknowledged
            os.kill(target.pid, signal.SIGCONT)
            new = wait_until(lambda: _one_leader(members), 20, what="a leader after the handover")
            assert new is target
            with Connection(new.host, new.port, timeout=10) as conn:
                missing = [i for i in acked if conn.stats_job(i) is None]
            assert missing == [], f"{len(missing)} of {len(acked)} acknowledged puts lost"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target.pid, signal.SIGCONT)
            promote.wait(60)
    finally:
        proxy.close()
