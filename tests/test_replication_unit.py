"""The replication stream in process: a leader queue's records applied to a replica queue.

No sockets: the leader's ReplicationSource is its queue's listener, its messages are fed to
the replica's Applier. Checks that a replica ends in the leader's state, that replaying
records is harmless, that a snapshot drops jobs the leader no longer has, and that records
out of order or from an older epoch are refused.
"""
from __future__ import annotations

import pytest

from broker import queue_verbs
from broker.queue import Queue
from broker.replication import wire
from broker.replication.follower import Applier, Position
from broker.replication.source import ReplicaSession, ReplicationSource

NS = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 10 * NS

    def __call__(self) -> int:
        return self.now


class Sink:
    """Stands in for a replica's stream writer: collects what the leader sends."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.transport = self

    def write(self, data: bytes) -> None:
        self.data += data

    def get_write_buffer_size(self) -> int:
        return 0

    def abort(self) -> None:
        pass


def _leader(epoch: int = 5) -> tuple[Queue, ReplicationSource]:
    source = ReplicationSource()
    queue = Queue(Clock(), listener=source)
    source.recover(queue)
    source.start(epoch)
    return queue, source


def _state(queue: Queue) -> dict:
    return {j.id: (j.tube.name, j.state, j.pri, j.body, j.reserves, j.buries, j.kicks, j.releases)
            for j in queue.jobs.values()}


def _attach(source: ReplicationSource, pos: Position) -> Sink:
    sink = Sink()
    source.attach(ReplicaSession("r", sink), pos.epoch, pos.seq)  # type: ignore[arg-type]
    return sink


def _workload(queue: Queue) -> None:
    c = queue_verbs.connect(queue, lambda _r: None)
    queue_verbs.use(queue, c, "emails")
    for i in range(6):
        queue.put(c, i, 0, 60, b"job-%d" % i)
    queue_verbs.watch(queue, c, "emails")
    queue.delete(c, 1)
    for _ in range(2):
        queue.reserve(c, 0)
    queue_verbs.bury(queue, c, 2, 7)
    queue_verbs.release(queue, c, 3, 99, 30)  # delayed 30 s
    queue_verbs.kick_job(queue, c, 2)
    queue.reserve(c, 0)  # stays reserved on the leader: ready on the replica


def test_replica_ends_in_the_leaders_state_and_replay_is_harmless():
    leader, source = _leader()
    sink = _attach(source, Position())  # a fresh replica: snapshot of nothing, then the live stream
    _workload(leader)
    source.sync_point()
    replica = Queue(Clock())
    applier = Applier(replica, Position())
    msgs = wire.split_messages(bytearray(sink.data))
    applier.apply(msgs)
    want = _state(leader)
    reserved = [i for i, s in want.items() if s[1] == 2]
    assert len(reserved) == 1
    got = _state(replica)
    assert got[reserved[0]][1] == 0  # a reserved job is ready on a replica (its reserves count is kept)
    assert got == {**want, reserved[0]: want[reserved[0]][:1] + (0,) + want[reserved[0]][2:]}
    assert applier.pos == Position(5, source.seq)
    # the same records again (a restart with a lagging position file): nothing changes
    applier.pos = Position(5, 0)
    applier.apply([m for m in msgs if m.kind == wire.M_RECORD])
    assert _state(replica) == got


def test_snapshot_drops_jobs_the_leader_does_not_have():
    leader, source = _leader(epoch=9)
    c = queue_verbs.connect(leader, lambda _r: None)
    ids = [int(leader.put(c, 0, 0, 60, b"x%d" % i).split()[1]) for i in range(3)]
    replica = Queue(Clock())
    stale = queue_verbs.connect(replica, lambda _r: None)
    for i in range(5):
        replica.put(stale, 0, 0, 60, b"old%d" % i)  # ids 1..5, from an older history
    applier = Applier(replica, Position(4, 77))
    sink = _attach(source, applier.pos)  # another epoch: snapshot
    applier.apply(wire.split_messages(bytearray(sink.data)))
    assert sorted(replica.jobs) == sorted(ids)
    assert replica.next_id >= leader.next_id
    assert applier.pos == Position(9, source.seq)


def test_out_of_order_and_older_epochs_are_refused():
    leader, source = _leader(epoch=3)
    sink = _attach(source, Position())
    c = queue_verbs.connect(leader, lambda _r: None)
    leader.put(c, 0, 0, 60, b"a")
    leader.put(c, 0, 0, 60, b"b")
    source.sync_point()
    msgs = wire.split_messages(bytearray(sink.data))
    records = [m for m in msgs if m.kind == wire.M_RECORD and m.seq]
    applier = Applier(Queue(Clock()), Position(3, 0))
    with pytest.raises(wire.StreamError):
        applier.apply([records[1]])  # seq 2 before seq 1: a gap
    newer = Applier(Queue(Clock()), Position(4, 0))
    with pytest.raises(wire.StreamError):
        newer.apply(records)  # epoch 3 after epoch 4: a deposed leader


def test_backlog_serves_a_replica_in_the_same_epoch():
    leader, source = _leader()
    c = queue_verbs.connect(leader, lambda _r: None)
    for i in range(10):
        leader.put(c, 0, 0, 60, b"%d" % i)
    sink = _attach(source, Position(5, 4))
    msgs = wire.split_messages(bytearray(sink.data))
    assert [m.seq for m in msgs] == list(range(5, 11))
    assert source.catch_ups == {"backlog": 1, "snapshot": 0}


def test_replaying_a_put_and_its_delete_recreates_and_deletes_the_job():
    """After a restart the position file may lag: a deleted job comes back for a moment, under the
    same heap key as its stale entry (a different Job object), and goes again."""
    leader, source = _leader()
    sink = _attach(source, Position())
    c = queue_verbs.connect(leader, lambda _r: None)
    leader.put(c, 5, 0, 60, b"gone")
    leader.put(c, 5, 0, 60, b"kept")
    leader.delete(c, 1)
    source.sync_point()
    records = [m for m in wire.split_messages(bytearray(sink.data)) if m.kind == wire.M_RECORD and m.seq]
    replica = Queue(Clock())
    applier = Applier(replica, Position(5, 0))
    applier.apply(records)
    applier.pos = Position(5, 0)
    applier.apply(records)
    assert _state(replica) == {2: ("default", 0, 5, b"kept", 0, 0, 0, 0)}
