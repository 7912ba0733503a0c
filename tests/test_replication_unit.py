"""The replication stream in process: a leader queue's records applied to a replica queue.

No sockets: the leader's ReplicationSource is its queue's listener, its messages are fed to
the replica's Applier. Checks that a replica ends in the leader's state, that replaying
records is harmless, that a snapshot drops jobs the leader no longer has, and that records
out of order or from an older epoch are refused.
"""
from __future__ import annotations

import asyncio
import sys

import pytest

from broker import queue_verbs
from broker.connection import BrokerConnection
from broker.queue import Client, Queue
from broker.replication import wire
from broker.replication.follower import Applier, Position
from broker.replication.source import Predecessor, ReplicaSession, ReplicationSource, SyncHold
from tests.helpers import FakeTransport, connect, make_server

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

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass

    async def drain(self) -> None:
        """As a StreamWriter's below its high-water mark: returns without a turn of the loop."""


def _leader(epoch: int = 5) -> tuple[Queue, ReplicationSource]:
    source = ReplicationSource()
    queue = Queue(Clock(), listener=source)
    source.recover(queue)
    source.start(epoch)
    return queue, source


def _state(queue: Queue) -> dict:
    return {j.id: (j.tube.name, j.state, j.pri, j.body, j.reserves, j.buries, j.kicks, j.releases)
            for j in queue.jobs.values()}


def _join(source: ReplicationSource, sink: Sink, pos: Position, exact: bool = False) -> None:
    """What the leader's replication listener does for a replica that asks from ``pos``."""
    session = ReplicaSession("r", sink)  # type: ignore[arg-type]
    if not source.attach(session, pos.epoch, pos.seq, exact):
        assert asyncio.run(source.send_snapshot(session))


def _attach(source: ReplicationSource, pos: Position) -> Sink:
    sink = Sink()
    _join(source, sink, pos)
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
    # An applied delete is a tube's delete, not a delete command (Queue.deletes_made): nor is a queue-level call
    assert [t.total_deletes for t in replica.tubes.items] == [2]
    assert replica.counted_ops()["delete"] == 0 and leader.counted_ops()["delete"] == 0


class Member:
    """A replica's queue and applier, with the source it leads with once elected (in process)."""

    def __init__(self) -> None:
        self.source = ReplicationSource()
        self.queue = Queue(Clock(), listener=self.source)
        self.source.recover(self.queue)
        self.applier = Applier(self.queue, Position())

    def follow(self, source: ReplicationSource) -> Sink:
        sink = Sink()
        _join(source, sink, self.applier.pos, self.applier.exact)
        return sink

    def apply(self, sink: Sink) -> None:
        self.applier.apply(wire.split_messages(bytearray(sink.data)))

    def elect(self, epoch: int) -> None:
        """What Member.become_leader hands the source: its position and tail, when exact."""
        a = self.applier
        self.source.start(epoch, Predecessor(a.pos.epoch, a.pos.seq, tuple(a.tail)) if a.exact else None)
        a.pos = Position(epoch, 0)
        a.clear_tail()


def _old_leader_with(replicas: list[Member], cut: int = 0) -> ReplicationSource:
    """Epoch 5's leader: every replica follows it and gets its workload; the last ``cut`` records miss
    the last replica (it was a little behind when the leader died)."""
    leader, source = _leader()
    sinks = [r.follow(source) for r in replicas]
    source.heartbeat()  # the leader's next tick: its seq tells a snapshotted replica when it is exact
    _workload(leader)
    source.sync_point()
    for r, sink in zip(replicas, sinks, strict=True):
        msgs = wire.split_messages(sink.data)
        if r is replicas[-1] and cut:
            msgs = msgs[:-cut]
        r.applier.apply(msgs)
    return source


def test_a_replica_in_step_with_the_new_leader_takes_its_epoch_without_a_snapshot():
    b, c = Member(), Member()
    old = _old_leader_with([b, c])
    assert b.applier.exact and c.applier.exact and b.applier.pos == c.applier.pos == Position(5, old.seq)
    b.elect(6)
    conn = queue_verbs.connect(b.queue, lambda _r: None)
    b.queue.put(conn, 1, 0, 60, b"after the failover")
    sink = c.follow(b.source)
    kinds = [m.kind for m in wire.split_messages(bytearray(sink.data))]
    assert kinds == [wire.M_NEW_EPOCH, wire.M_RECORD]
    c.apply(sink)
    assert b.source.catch_ups == {"backlog": 1, "snapshot": 0}
    assert c.applier.pos == Position(6, 1) and c.applier.exact
    assert _state(c.queue) == _state(b.queue)


def test_a_replica_a_little_behind_gets_the_old_epochs_records_from_the_new_leader():
    b, c = Member(), Member()
    old = _old_leader_with([b, c], cut=3)
    assert c.applier.pos == Position(5, old.seq - 3)
    b.elect(6)
    sink = c.follow(b.source)
    msgs = wire.split_messages(bytearray(sink.data))
    missed = [(wire.M_RECORD, 5, old.seq - 2), (wire.M_RECORD, 5, old.seq - 1), (wire.M_RECORD, 5, old.seq)]
    assert [(m.kind, m.epoch, m.seq) for m in msgs] == [*missed, (wire.M_NEW_EPOCH, 6, 0)]
    c.apply(sink)
    assert b.source.catch_ups["snapshot"] == 0
    assert _state(c.queue) == _state(b.queue)


@pytest.mark.parametrize("case", ["restarted", "ahead", "behind the tail", "leader not exact"])
def test_a_replica_not_in_step_with_the_new_leader_gets_a_snapshot(case):
    b, c = Member(), Member()
    if case == "ahead":
        _old_leader_with([c, b], cut=2)  # b, the new leader, missed the old leader's last two records
    else:
        _old_leader_with([b, c], cut=3 if case == "behind the tail" else 0)
    if case == "restarted":
        c.applier = Applier(c.queue, c.applier.pos)  # the position file after a restart: not known exact
    if case == "behind the tail":
        b.applier.tail.popleft()  # b keeps fewer records than c is behind
        while len(b.applier.tail) > 2:
            b.applier.tail.popleft()
    if case == "leader not exact":
        b.applier.exact = False
    b.elect(6)
    conn = queue_verbs.connect(b.queue, lambda _r: None)
    b.queue.put(conn, 1, 0, 60, b"after the failover")
    sink = c.follow(b.source)
    assert wire.split_messages(bytearray(sink.data))[0].kind == wire.M_SNAPSHOT_BEGIN
    c.apply(sink)
    assert b.source.catch_ups == {"backlog": 0, "snapshot": 1}
    assert _state(c.queue) == _state(b.queue)


def test_a_new_epoch_that_does_not_start_at_the_replicas_position_is_refused():
    b, c = Member(), Member()
    _old_leader_with([b, c])
    b.elect(6)
    sink = c.follow(b.source)
    c.applier.pos = Position(5, 1)  # not where the leader was when elected
    with pytest.raises(wire.StreamError):
        c.apply(sink)
    c.applier.pos = Position(5, b.source.predecessor.seq)
    c.applier.exact = False  # a queue not known to be at its position may not skip the snapshot
    with pytest.raises(wire.StreamError):
        c.apply(sink)


def _as_on_a_replica(state: dict) -> dict:
    """A job reserved on the leader is ready on a replica (its reserves count kept)."""
    return {i: s[:1] + (0 if s[1] == 2 else s[1],) + s[2:] for i, s in state.items()}


@pytest.mark.parametrize(("chunk", "piece_bytes"), [(4, 1 << 20), (1_000, 1)], ids=["by-jobs", "by-bytes"])
def test_a_snapshot_sent_in_pieces_ends_in_the_leaders_state_while_the_queue_changes(chunk, piece_bytes):
    """The leader serves its clients between pieces of a snapshot: jobs not yet sent are deleted,
    reserved and put meanwhile; the records logged meanwhile follow the end message."""
    leader, source = _leader()
    c = queue_verbs.connect(leader, lambda _r: None)
    for i in range(30):
        leader.put(c, i, 0, 60, b"job-%d" % i)
    replica = Queue(Clock())
    stale = queue_verbs.connect(replica, lambda _r: None)
    replica.next_id = 1000
    replica.put(stale, 0, 0, 60, b"from an older history")  # not named by the snapshot: the end drops it
    sink = Sink()
    session = ReplicaSession("r", sink)  # type: ignore[arg-type]

    async def snapshot_while_clients_work() -> tuple[bool, int]:
        task = asyncio.ensure_future(source.send_snapshot(session, chunk=chunk, piece_bytes=piece_bytes))
        rounds = 0
        while not task.done():
            leader.delete(c, 30 - rounds)  # a job in a piece not sent yet
            leader.put(c, 0, 0, 60, b"meanwhile-%d" % rounds)
            leader.reserve(c, 0)
            rounds += 1
            await asyncio.sleep(0)
        return task.result(), rounds

    done, rounds = asyncio.run(snapshot_while_clients_work())
    assert done and rounds >= 5 and source.sessions == [session]
    leader.put(c, 0, 0, 60, b"after")  # the live stream, now that the replica has joined it
    source.sync_point()
    applier = Applier(replica, Position())
    messages = wire.split_messages(bytearray(sink.data))
    end = next(n for n, m in enumerate(messages) if m.kind == wire.M_SNAPSHOT_END)
    applier.apply(messages[:end + 1])
    # the pieces show jobs as they were after the snapshot's start: not exact at the start
    assert applier.pos == Position(5, messages[end].seq) and not applier.exact
    applier.apply(messages[end + 1:])
    source.heartbeat()  # the leader's seq, known to the replica only from here
    applier.apply(wire.split_messages(bytearray(sink.data))[len(messages):])
    assert applier.pos == Position(5, source.seq) and applier.exact
    assert _state(replica) == _as_on_a_replica(_state(leader))


def _ten_jobs_and_a_replica() -> tuple[Queue, ReplicationSource, Client, ReplicaSession]:
    """A leader holding ten jobs (its client too) and the session of a replica about to be snapshotted."""
    leader, source = _leader()
    c = queue_verbs.connect(leader, lambda _r: None)
    for i in range(10):
        leader.put(c, 0, 0, 60, b"%d" % i)
    return leader, source, c, ReplicaSession("r", Sink())  # type: ignore[arg-type]


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_snapshot_over_a_socket_gives_the_leaders_clients_a_turn_after_every_piece(loop):
    """A real loopback socket: its writer's drain() returns at once below the high-water mark, so
    it is no turn of the loop. The pieces of a 300,000-job snapshot went out back to back and the
    leader's clients waited ~0.3 s, 0.69 s in a loaded CI run (test_failover's snapshot test)."""
    import uvloop

    leader, source = _leader()
    c = queue_verbs.connect(leader, lambda _r: None)
    for i in range(200):
        leader.put(c, 0, 0, 60, b"%d" % i)

    async def snapshot_beside_a_client() -> tuple[bool, int, list[wire.Message]]:
        received = bytearray()
        got_all = asyncio.Event()

        async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(1 << 16):
                received.extend(data)
            got_all.set()
            writer.close()

        server = await asyncio.start_server(replica, "127.0.0.1", 0)
        _reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        turns = 0

        async def client() -> None:  # one unit of a client's work each turn of the loop it gets
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        ticking = asyncio.ensure_future(client())
        done = await source.send_snapshot(ReplicaSession("r", writer), chunk=10)
        during = turns
        ticking.cancel()
        writer.close()
        await asyncio.wait_for(got_all.wait(), 10)
        server.close()
        return done, during, wire.split_messages(received)

    runner = uvloop.run if loop == "uvloop" else asyncio.run
    done, turns, messages = runner(asyncio.wait_for(snapshot_beside_a_client(), 30))
    assert done and [m.kind for m in messages].count(wire.M_RECORD) == 200
    assert messages[-2].kind == wire.M_SNAPSHOT_END
    assert turns >= 200 // 10, f"the client had {turns} turns of the loop during 20 pieces"


def test_a_snapshot_stops_when_leadership_is_lost_between_pieces():
    _leader_queue, source, _c, session = _ten_jobs_and_a_replica()

    async def step_down_meanwhile() -> bool:
        task = asyncio.ensure_future(source.send_snapshot(session, chunk=2))
        await asyncio.sleep(0)
        source.stop()
        return await task

    assert asyncio.run(step_down_meanwhile()) is False
    assert session.closed and source.sessions == [] and source.catch_ups["snapshot"] == 0


def test_the_position_file_says_exact_only_when_a_clean_shutdown_wrote_it(tmp_path):
    from broker.replication.follower import SavedPosition, load_position, save_position

    assert load_position(str(tmp_path)) == SavedPosition(Position(), False)  # no file: a fresh member
    save_position(str(tmp_path), Position(7, 42), exact=True)
    assert load_position(str(tmp_path)) == SavedPosition(Position(7, 42), True)
    save_position(str(tmp_path), Position(7, 43))
    assert load_position(str(tmp_path)) == SavedPosition(Position(7, 43), False)
    for garbage in ('{"epoch": 7, "seq": 43, "exact": "yes"}', "[1, 2]", "{", '{"epoch": "x", "seq": 1}'):
        (tmp_path / "replication.json").write_text(garbage)
        assert load_position(str(tmp_path)).exact is False


def test_a_pause_reaches_the_replicas_live_and_in_a_snapshot():
    """pause-tube is not in the binlog (nor in beanstalkd's), but the stream carries it: a failover keeps it."""
    leader, source = _leader()
    c = queue_verbs.connect(leader, lambda _r: None)
    queue_verbs.use(leader, c, "emails")
    leader.put(c, 0, 0, 60, b"a")
    queue_verbs.use(leader, c, "reports")
    leader.put(c, 0, 0, 60, b"b")
    assert queue_verbs.pause_tube(leader, c, "emails", 30) == b"PAUSED\r\n"  # before the replica joins
    live = _attach(source, Position())
    assert queue_verbs.pause_tube(leader, c, "reports", 90) == b"PAUSED\r\n"  # after: on the live stream
    source.sync_point()
    replica = Queue(Clock())
    applier = Applier(replica, Position())
    applier.apply(wire.split_messages(bytearray(live.data)))
    for name, seconds in (("emails", 30), ("reports", 90)):
        ours, theirs = leader.tube_by_name[name], replica.tube_by_name[name]
        assert theirs.pause == seconds * NS and theirs.pause_count == 1
        assert abs(theirs.unpause_at - ours.unpause_at) < NS // 10  # the same end, through the wall clock
    assert _state(replica) == _state(leader)
    pauses = [m for m in wire.split_messages(bytearray(live.data))
              if m.kind == wire.M_RECORD and isinstance(wire.decode_record(m.payload), wire.PauseFields)]
    assert [m.seq for m in pauses] == [0, source.seq]  # one in the snapshot, one numbered on the live stream


def test_a_pause_of_a_tube_the_replica_does_not_have_is_ignored():
    replica = Queue(Clock())
    applier = Applier(replica, Position(5, 0))
    record = wire.encode_pause(b"nowhere", 10 * NS, 0)
    applier.apply([wire.Message(wire.M_RECORD, 5, 1, 0, record)])
    assert "nowhere" not in replica.tube_by_name and applier.pos == Position(5, 1)


def test_a_replica_asks_an_older_leader_again_without_exact():
    """A rolling upgrade does the replicas first: a leader that predates `exact` answers the five-word
    `replicate` line UNKNOWN_COMMAND, and the replica asks again with the four words it knows."""
    from broker.replication.follower import Follower, StreamTarget

    async def scenario() -> list[bytes]:
        lines: list[bytes] = []

        async def old_leader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            line = await reader.readline()
            lines.append(line)
            writer.write(b"UNKNOWN_COMMAND\r\n" if len(line.split()) != 4 else b"STREAMING 5\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(old_leader, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        applier = Applier(Queue(Clock()), Position(5, 3))
        applier.exact = True
        follower = Follower(StreamTarget("127.0.0.1", port), "r1", applier, lambda: True, "/nonexistent")
        task = asyncio.ensure_future(follower.run())
        for _ in range(200):
            if len(lines) >= 2:
                break
            await asyncio.sleep(0.02)
        follower.stopped = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()
        return lines

    lines = asyncio.run(scenario())
    assert lines[:2] == [b"replicate r1 5 3 exact\r\n", b"replicate r1 5 3\r\n"]


def test_a_snapshot_gives_up_when_more_is_logged_meanwhile_than_the_backlog_holds():
    """The records logged during a snapshot follow its end from the backlog; once the backlog no longer
    reaches back to the snapshot's start, the replica is dropped (it asks again) rather than left with a gap."""
    leader, source, c, session = _ten_jobs_and_a_replica()
    source.backlog_limit = 2_000  # bytes: a few records

    async def busy_meanwhile() -> bool:
        task = asyncio.ensure_future(source.send_snapshot(session, chunk=2))
        while not task.done():
            leader.put(c, 0, 0, 60, b"x" * 1_000)  # each record about half the backlog
            await asyncio.sleep(0)
        return task.result()

    assert asyncio.run(busy_meanwhile()) is False
    assert session.closed and source.sessions == [] and source.catch_ups["snapshot"] == 0


def _client() -> tuple[BrokerConnection, FakeTransport]:
    """A client connection over a fake transport: what the hold lets out lands in its ``out``."""
    return connect(make_server())


def test_sync_hold_keeps_a_new_terms_first_put_until_a_replica_has_it():
    """--sync-replicas 1: a member that leads again starts its seq at 0. Its first put of the new term
    ends at seq 1, as its last group of the old term did; the hold compared seqs alone, took the put
    for a group that logged nothing, and acknowledged it before any replica had the record."""
    queue, source = _leader(epoch=10)
    hold = SyncHold(source, 1, lambda: True)
    session = ReplicaSession("r", Sink())  # type: ignore[arg-type]
    source.sessions.append(session)
    c = queue_verbs.connect(queue, lambda _r: None)
    first, first_out = _client()
    queue.put(c, 0, 0, 60, b"old term")  # seq 1 of epoch 10
    assert hold.hold([(first, b"INSERTED 1\r\n")]) is True and first_out.take() == b""
    source.acknowledged(session, 10, 1)
    assert first_out.take() == b"INSERTED 1\r\n"

    hold.abort()  # step down, then lead epoch 20 with a replica that has acknowledged nothing
    source.stop()
    source.start(20)
    fresh = ReplicaSession("r", Sink())  # type: ignore[arg-type]
    source.sessions.append(fresh)
    second, second_out = _client()
    queue.put(c, 0, 0, 60, b"new term")  # seq 1 of epoch 20
    assert source.acked_by(1) == 0
    assert hold.hold([(second, b"INSERTED 2\r\n")]) is True
    assert second_out.take() == b""  # held: no replica has the record
    source.acknowledged(fresh, 20, 1)
    assert second_out.take() == b"INSERTED 2\r\n"


def test_sync_hold_releases_on_the_next_heartbeat_what_an_ack_in_doubt_could_not():
    """An ack that arrives while the lease is in doubt (lapsed, not yet renewed nor stepped down)
    releases nothing. Once the lease is renewed, the next tick's heartbeat releases it: no later ack
    may ever come when the one client is waiting for that very reply."""
    queue, source = _leader(epoch=3)
    lease_ok = [True]
    hold = SyncHold(source, 1, lambda: lease_ok[0])
    session = ReplicaSession("r", Sink())  # type: ignore[arg-type]
    source.sessions.append(session)
    c = queue_verbs.connect(queue, lambda _r: None)
    client, out = _client()
    queue.put(c, 0, 0, 60, b"in doubt")
    assert hold.hold([(client, b"INSERTED 1\r\n")]) is True
    lease_ok[0] = False
    source.acknowledged(session, 3, 1)
    assert out.take() == b""          # not while the lease is in doubt
    lease_ok[0] = True                # a late keep-alive renewed it
    source.heartbeat()
    assert out.take() == b"INSERTED 1\r\n"


def test_the_backlog_limit_bounds_memory_not_just_payload():
    """Small records cost ~2.6x their bytes in the backlog (tuple, int, bytes header, deque slot):
    a 64 MiB limit counted on payload let a leader hold ~190 MB. The per-entry overhead counts."""
    queue, source = _leader()
    source.backlog_limit = 100_000
    c = queue_verbs.connect(queue, lambda _r: None)
    for _ in range(5_000):
        jid = int(queue.put(c, 0, 0, 60, b"x").split()[1])
        queue.delete(c, jid)
    slot = 8  # the deque's pointer to the entry
    held = sum(sys.getsizeof(entry) + sys.getsizeof(seq) + sys.getsizeof(msg) + slot for entry in source.backlog
               for seq, msg in (entry,))
    assert held <= source.backlog_limit  # 2.6x the limit without counting the overhead
    assert source.backlog_bytes <= source.backlog_limit
