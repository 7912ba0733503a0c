"""The queue state machine alone: no sockets, no asyncio, a clock we move by hand."""
from __future__ import annotations

import random

import pytest

from broker import protocol as p
from broker import queue_timers, queue_verbs
from broker import stats as broker_stats
from broker.model import READY_BITS
from broker.queue import CREATED_GRAIN, NS, Queue
from tests.helpers import traced_growth


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000 * NS

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * NS)


class Conn:
    """A client of the pure queue: collects replies delivered later."""

    def __init__(self, queue: Queue) -> None:
        self.later: list[bytes] = []
        self.client = queue_verbs.connect(queue, self.later.append)
        self.queue = queue

    def put(self, body: bytes = b"x", pri: int = 0, delay: int = 0, ttr: int = 60) -> int:
        reply = self.queue.put(self.client, pri, delay, ttr, body)
        assert reply.startswith(b"INSERTED "), reply
        return int(reply.split()[1])

    def reserve(self, timeout: int = -1) -> bytes | None:
        reply = self.queue.reserve(self.client, timeout)
        if reply is None and self.later:
            return self.later.pop(0)
        return reply


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def queue(clock):
    return Queue(clock)


def job_id(reply: bytes) -> int:
    return int(reply.split()[1])


def test_priority_then_fifo(queue):
    c = Conn(queue)
    low = c.put(b"low", pri=10)
    first = c.put(b"a", pri=1)
    second = c.put(b"b", pri=1)
    assert [job_id(c.reserve()) for _ in range(3)] == [first, second, low]


def test_reserved_job_body_is_framed(queue):
    c = Conn(queue)
    jid = c.put(b"hello")
    assert c.reserve() == b"RESERVED %d 5\r\nhello\r\n" % jid


def test_delay_becomes_ready_on_tick(queue, clock):
    c = Conn(queue)
    jid = c.put(delay=5)
    assert queue.reserve(c.client, 0) is None and c.later.pop() == p.TIMED_OUT
    clock.advance(4.9)
    queue_timers.tick(queue)
    assert queue_verbs.peek_ready(queue, c.client) == p.NOT_FOUND
    clock.advance(0.2)
    queue_timers.tick(queue)
    assert job_id(queue_verbs.peek_ready(queue, c.client)) == jid


def test_ttr_expiry_returns_job_and_counts_timeout(queue, clock):
    c = Conn(queue)
    jid = c.put(ttr=2)
    c.reserve()
    clock.advance(2.1)
    queue_timers.tick(queue)
    stats = broker_stats.stats_job(queue, c.client, jid)
    assert b"state: ready" in stats and b"timeouts: 1" in stats
    assert queue.timeout_ct == 1


def test_touch_postpones_ttr(queue, clock):
    c = Conn(queue)
    jid = c.put(ttr=2)
    c.reserve()
    for _ in range(5):
        clock.advance(1.5)
        assert queue_verbs.touch(queue, c.client, jid) == p.TOUCHED
        queue_timers.tick(queue)
    assert b"state: reserved" in broker_stats.stats_job(queue, c.client, jid)


def test_ttr_timer_is_one_entry_a_connection_and_expires_each_job_on_time(queue, clock):
    """The timer heap holds a connection's soonest TTR deadline, not an entry per reserve (as
    beanstalkd's connection heap): a later reserve with an earlier deadline re-arms it, an
    entry that comes due early (its job touched or deleted) expires nothing and arms the next."""
    c = Conn(queue)
    long_id, short_id, mid_id = c.put(b"l", ttr=10), c.put(b"s", ttr=2), c.put(b"m", ttr=5)
    for _ in range(3):
        c.reserve()
    for _ in range(200):  # reserve and delete in a loop: no timer entry a reserve
        put = c.put(b"x", pri=9)
        assert job_id(c.reserve(0)) == put
        assert queue.delete(c.client, put) == p.DELETED
    assert len(queue.timers) <= 3
    states = {}

    def state(jid: int) -> bytes:
        return broker_stats.stats_job(queue, c.client, jid).split(b"state: ")[1].split(b"\n")[0]

    clock.advance(1.5)
    assert queue_verbs.touch(queue, c.client, short_id) == p.TOUCHED  # 2 s from now: t = 3.5
    for at in [2.1, 3.6, 5.1, 10.1]:
        clock.now = 1_000 * NS + int(at * NS)
        queue_timers.tick(queue)
        states[at] = (state(short_id), state(mid_id), state(long_id))
    assert states == {2.1: (b"reserved", b"reserved", b"reserved"), 3.6: (b"ready", b"reserved", b"reserved"),
                      5.1: (b"ready", b"ready", b"reserved"), 10.1: (b"ready", b"ready", b"ready")}
    assert queue.timeout_ct == 3 and not c.client.held and not c.client.held_jobs()


def test_stale_timer_entries_are_bounded_and_prune_drops_them_all(queue):
    """A closed client's TTR entry and a deleted delayed job's entry stay in the timer heap (lazy
    invalidation) and hold their objects: at most 2 x live + 1024 of them (compact_timers, after every
    disconnect), and none after ``prune``."""
    keeper = Conn(queue)
    live = [keeper.put(delay=3600) for _ in range(10)]  # ten live entries
    for i in range(3000):
        c = Conn(queue)
        c.put(b"job %d" % i, pri=1)
        held = job_id(c.reserve(0))  # its TTR entry
        assert queue.delete(c.client, held) == p.DELETED
        queue_verbs.disconnect(queue, c.client)  # the entry is stale, and holds the closed client
        gone = keeper.put(delay=3600)
        assert queue.delete(keeper.client, gone) == p.DELETED  # a stale delayed entry
        assert len(queue.timers) <= 2 * (len(queue.jobs) + queue.cur_conns + len(queue.tubes)) + 1024 + 2
    assert len(queue.jobs) == len(live)
    assert len(queue.timers) > len(live) + 2  # some stale entries are still held (6,000 were made)
    queue.timers.prune()
    assert len(queue.timers) == len(live)


def test_a_cancelled_delayed_job_is_not_kept_by_its_stale_timer_entry(queue):
    """Scheduling a job and deleting it before its time (a reminder cancelled) leaves the job's timer
    entry behind, which names the job's id only: the entry used to hold the job, and so its body, until
    the delay ran out or the heap was rebuilt (50,000 live delayed jobs of 1 KB, then 150,000 cancels:
    76 MB held beyond the live jobs before, 11.5 MB after; tracemalloc)."""
    c = Conn(queue)

    def cancel() -> None:
        for i in range(500):
            job = c.put(bytes(4096), delay=3600)
            assert queue.delete(c.client, job) == p.DELETED, i

    grown = traced_growth(cancel)
    assert len(queue.timers) == 500  # the stale entries are still there (fewer than compact's 1,024)
    assert grown < 500 * 4096 // 8, f"{grown} bytes held after 500 cancelled 4 KB jobs"


def test_a_worker_turning_over_held_jobs_keeps_no_deleted_body(queue):
    """A client holding many jobs and deleting them out of deadline order as it reserves more leaves the
    deleted jobs' entries inside its deadline heap (the top one goes at the next reserve) until the heap
    is pruned (more than 2 x held + 64). The entries name ids: they used to hold the jobs, up to as many
    deleted bodies again as the client held (1,000 held 4 KB jobs, 5,000 deleted in random order:
    8.7 MB traced at the peak before, 4.6 MB after, of which 4.1 MB are the held jobs)."""
    rnd = random.Random(1)
    c = Conn(queue)
    held: list[int] = []

    def turn_over() -> None:
        for _ in range(200):
            c.put(bytes(4096))
            held.append(job_id(c.reserve(0)))
        for _ in range(200):
            c.put(bytes(4096))
            held.append(job_id(c.reserve(0)))
            assert queue.delete(c.client, held.pop(rnd.randrange(len(held)))) == p.DELETED

    grown = traced_growth(turn_over)
    assert len(c.client.deadlines) >= 300  # the deleted jobs' entries are still there (pruned above 464)
    beyond = grown - 200 * 4096  # beyond the held jobs' bodies
    assert beyond < 200 * 4096 // 4, f"{beyond} bytes held beyond 200 held 4 KB jobs after 200 were turned over"


def test_the_soonest_held_job_follows_every_reserve_touch_release_and_expiry(queue, clock):
    """A client holding one job keeps no entry for it in its deadline heap (Client.hold: the deadline is on
    the job), and one holding more has an entry for each. Random reserves, touches, releases, buries,
    deletes and TTR expiries with 0-4 jobs held; after each step the soonest held job is the one with the
    least (deadline, id), a TTR never expires a job early or late, the heap stays bounded, and the held jobs
    are listed in the order they were reserved (the order a closed connection gives them back in)."""
    rnd = random.Random(7)
    c = Conn(queue)
    client = c.client
    order: list[int] = []  # the held jobs' ids, in the order they were reserved
    alone = 0  # reserves by a client holding none: each must leave the heap as it was
    for step in range(3000):
        held = {job.id: job for job in client.held_jobs()}
        assert list(held) == order and client.held == len(order), step
        roll = rnd.random()
        if roll < 0.35 and len(held) < 4:
            c.put(ttr=rnd.choice((1, 2, 3, 60)))
            before = list(client.deadlines) if not held else None
            order.append(job_id(c.reserve(0)))
            if before is not None:
                alone += 1
                assert client.deadlines == before, f"step {step}: a first held job pushed a heap entry"
        elif roll < 0.7 and held:
            jid = rnd.choice(order)
            if roll < 0.55:
                assert queue_verbs.touch(queue, client, jid) == p.TOUCHED
            else:
                if roll < 0.6:
                    assert queue_verbs.release(queue, client, jid, 0, 0) == p.RELEASED
                elif roll < 0.63:
                    assert queue_verbs.bury(queue, client, jid, 0) == p.BURIED
                else:
                    assert queue.delete(client, jid) == p.DELETED
                order.remove(jid)
        else:
            due = sorted(job.deadline for job in held.values())
            clock.advance(rnd.choice((0.3, 0.9, 1.7)))
            order = [jid for jid in order if held[jid].deadline > clock.now]
            queue_timers.tick(queue)
            assert [job.id for job in client.held_jobs()] == order, (step, due, clock.now)
        jobs = client.held_jobs()
        assert all(client.holding(job.id) is job for job in jobs) and client.holding(10**9) is None
        want = min(jobs, key=lambda job: (job.deadline, job.id), default=None)
        soonest = client.soonest_held()
        assert (soonest and soonest.deadline) == (want and want.deadline), step
        assert len(client.deadlines) <= 2 * max(client.held, 1) + 64 + 2, step
    assert alone > 150


def test_a_worker_holding_one_job_while_turning_over_another_keeps_its_deadline_heap_small(queue):
    """Each time a client holding one job reserves a second, the first one's entry is pushed (it may have
    none: Client.hold), a duplicate when it has one; pruning drops the duplicates too, or a worker holding a
    long job while it turns over short ones would grow its heap by an entry a job."""
    c = Conn(queue)
    c.put(ttr=3600)
    long_held = job_id(c.reserve(0))
    for _ in range(2000):
        short = c.put()
        assert job_id(c.reserve(0)) == short
        assert queue.delete(c.client, short) == p.DELETED
        assert len(c.client.deadlines) <= 2 * 1 + 64 + 2
    assert c.client.soonest_held() is c.client.holding(long_held)


def test_ttr_zero_becomes_one_second(queue):
    c = Conn(queue)
    reply = queue.put(c.client, 0, 0, 0, b"x")
    assert b"ttr: 1\n" in broker_stats.stats_job(queue, c.client, job_id(reply))


def test_deadline_soon_while_holding_expiring_job(queue, clock):
    c = Conn(queue)
    c.put(ttr=1)
    c.reserve()
    assert c.reserve() == p.DEADLINE_SOON


def test_blocked_reserve_gets_deadline_soon_when_margin_reached(queue, clock):
    c = Conn(queue)
    c.put(ttr=5)
    c.reserve()
    assert queue.reserve(c.client, -1) is None
    clock.advance(3.9)
    queue_timers.tick(queue)
    assert c.later == []
    clock.advance(0.2)
    queue_timers.tick(queue)
    assert c.later == [p.DEADLINE_SOON]


def test_blocked_reserver_woken_by_put_from_other_client(queue):
    worker, producer = Conn(queue), Conn(queue)
    assert queue.reserve(worker.client, -1) is None
    jid = producer.put(b"work")
    assert worker.later == [b"RESERVED %d 4\r\nwork\r\n" % jid]


def test_reserve_with_timeout_times_out(queue, clock):
    c = Conn(queue)
    assert queue.reserve(c.client, 3) is None
    clock.advance(2.9)
    queue_timers.tick(queue)
    assert c.later == []
    clock.advance(0.2)
    queue_timers.tick(queue)
    assert c.later == [p.TIMED_OUT]


def test_only_reserver_may_delete_release_touch(queue):
    owner, other = Conn(queue), Conn(queue)
    jid = owner.put()
    owner.reserve()
    assert queue.delete(other.client, jid) == p.NOT_FOUND
    assert queue_verbs.release(queue, other.client, jid, 0, 0) == p.NOT_FOUND
    assert queue_verbs.touch(queue, other.client, jid) == p.NOT_FOUND
    assert queue.delete(owner.client, jid) == p.DELETED


def test_disconnect_releases_reserved_jobs(queue):
    owner, other = Conn(queue), Conn(queue)
    jid = owner.put()
    owner.reserve()
    queue_verbs.disconnect(queue, owner.client)
    assert job_id(other.reserve()) == jid


def test_kick_prefers_buried_over_delayed(queue):
    c = Conn(queue)
    delayed = c.put(delay=100)
    buried = c.put()
    c.reserve()
    assert queue_verbs.bury(queue, c.client, buried, 5) == p.BURIED
    assert queue_verbs.kick(queue, c.client, 10) == b"KICKED 1\r\n"
    assert b"state: delayed" in broker_stats.stats_job(queue, c.client, delayed)
    assert queue_verbs.kick(queue, c.client, 10) == b"KICKED 1\r\n"
    assert b"state: ready" in broker_stats.stats_job(queue, c.client, delayed)


def test_pause_tube_holds_reservations_until_unpaused(queue, clock):
    c = Conn(queue)
    jid = c.put()
    assert queue_verbs.pause_tube(queue, c.client, "default", 10) == p.PAUSED
    assert queue.reserve(c.client, -1) is None
    clock.advance(10.1)
    queue_timers.tick(queue)
    assert job_id(c.later.pop()) == jid


def test_tube_removed_when_unreferenced(queue):
    c = Conn(queue)
    queue_verbs.use(queue, c.client, "emails")
    jid = c.put()
    queue_verbs.use(queue, c.client, "default")
    assert b"- emails" in queue_verbs.list_tubes(queue, c.client)
    c.reserve_owner = queue_verbs.watch(queue, c.client, "emails")
    queue.delete(c.client, jid)
    queue_verbs.ignore(queue, c.client, "emails")
    assert b"- emails" not in queue_verbs.list_tubes(queue, c.client)


@pytest.mark.parametrize("state", ["ready", "reserved", "delayed", "buried"])
def test_a_job_in_any_state_keeps_its_tube_until_deleted(queue, state):
    """No client uses or watches "emails": its one job, in whatever state, keeps it; its delete drops it."""
    producer, worker = Conn(queue), Conn(queue)
    queue_verbs.use(queue, producer.client, "emails")
    jid = producer.put(delay=1 if state == "delayed" else 0)
    queue_verbs.use(queue, producer.client, "default")
    if state in ("reserved", "buried"):
        queue_verbs.watch(queue, worker.client, "emails")
        assert job_id(worker.reserve(0)) == jid
        if state == "buried":
            assert queue_verbs.bury(queue, worker.client, jid, 0) == p.BURIED
        queue_verbs.ignore(queue, worker.client, "emails")
    assert b"- emails" in queue_verbs.list_tubes(queue, producer.client)
    assert queue.delete(worker.client, jid) == p.DELETED
    assert b"- emails" not in queue_verbs.list_tubes(queue, producer.client)


def test_the_default_tube_stays_with_no_client_and_no_job(queue):
    c = Conn(queue)
    queue_verbs.use(queue, c.client, "emails")
    queue_verbs.watch(queue, c.client, "emails")
    queue_verbs.ignore(queue, c.client, "default")
    queue_verbs.disconnect(queue, Conn(queue).client)
    assert b"- default" in queue_verbs.list_tubes(queue, c.client)
    queue_verbs.disconnect(queue, c.client)
    assert [t.name for t in queue.tubes.items] == ["default"]


def test_jobs_put_within_a_millisecond_share_their_created_time(queue, clock):
    """`created` may be up to CREATED_GRAIN early (ages are whole seconds), so that such jobs share one int;
    a put one grain later, or after the clock stepped back, takes the time of its own put."""
    c = Conn(queue)
    start = clock.now
    ids = [c.put()]
    clock.now += CREATED_GRAIN - 1
    ids.append(c.put())
    clock.now += 1
    ids.append(c.put())
    clock.now -= 10 * NS
    ids.append(c.put())
    assert [queue.jobs[i].created for i in ids] == [start, start, start + CREATED_GRAIN, clock.now]


def test_ignore_last_tube_refused(queue):
    c = Conn(queue)
    assert queue_verbs.ignore(queue, c.client, "default") == p.NOT_IGNORED


def test_the_watch_tuple_follows_every_change_of_the_watch_set(queue):
    """Client.watching (what reserves read) is the watch set in its order after any watch and ignore; a
    reserve finds a job in a tube watched last, and none in a tube just ignored."""
    rng = random.Random(7)
    c, producer = Conn(queue), Conn(queue)
    names = ["default", "a", "b", "c", "d"]
    for _ in range(300):
        name = rng.choice(names)
        if rng.random() < 0.5:
            queue_verbs.watch(queue, c.client, name)
        else:
            queue_verbs.ignore(queue, c.client, name)
        assert c.client.watching == tuple(c.client.watch.items)
        assert len(set(c.client.watching)) == len(c.client.watching)
    queue_verbs.watch(queue, c.client, "fresh")
    queue_verbs.use(queue, producer.client, "fresh")
    job_id = producer.put(b"in fresh")
    assert queue.reserve(c.client, 0) == b"RESERVED %d 8\r\nin fresh\r\n" % job_id
    queue_verbs.ignore(queue, c.client, "fresh")
    producer.put(b"again")
    assert c.reserve(0) in (None, p.TIMED_OUT)  # (its timeout is the timer's to answer)
    assert queue.tube_by_name["fresh"].ready_count == 1
    queue_verbs.disconnect(queue, c.client)
    assert c.client.watching == ()


def test_reserve_job_takes_a_specific_job(queue):
    c = Conn(queue)
    c.put(b"a")
    b_id = c.put(b"b")
    assert queue_verbs.reserve_job(queue, c.client, b_id) == b"RESERVED %d 1\r\nb\r\n" % b_id
    assert queue_verbs.reserve_job(queue, c.client, b_id) == p.NOT_FOUND


def test_blocked_reservers_served_in_arrival_order(queue):
    producer = Conn(queue)
    first, second = Conn(queue), Conn(queue)
    queue.reserve(first.client, -1)
    queue.reserve(second.client, -1)
    a = producer.put(b"a")
    b = producer.put(b"b")
    assert job_id(first.later[0]) == a and job_id(second.later[0]) == b


def test_draining_refuses_put_but_serves_reads(queue):
    c = Conn(queue)
    jid = c.put()
    queue.draining = True
    assert queue.put(c.client, 0, 0, 1, b"x") == p.DRAINING
    assert job_id(c.reserve()) == jid


@pytest.mark.parametrize(
    "line,expected",
    [
        (b"put 1 2 3 4", ("put", 1, 2, 3, 4)),
        (b"put  1 2 3 4", ("put", 1, 2, 3, 4)),
        (b"delete 18446744073709551615", ("delete", 2**64 - 1)),
        (b"kick 5abc", ("kick", 5)),
        (b"kick -1", ("kick", 2**32 - 1)),
        (b"reserve-with-timeout abc", ("reserve-with-timeout", 0)),
        (b"pause-tubefoo 3", ("pause-tube", "foo", 3)),
        (b"use a+b/c;d.e$f_(g)", ("use", "a+b/c;d.e$f_(g)")),
    ],
)
def test_codec_accepts_what_beanstalkd_accepts(line, expected):
    assert p.parse_line(line, 65535) == expected


@pytest.mark.parametrize(
    "line,reply",
    [
        (b"put 1 2 3", p.BAD_FORMAT),
        (b"put 1 2 3 4 x", p.BAD_FORMAT),
        (b"delete 18446744073709551616", p.BAD_FORMAT),
        (b"delete +1", p.BAD_FORMAT),
        (b"reservex", p.BAD_FORMAT),
        (b"stats-tubex", p.BAD_FORMAT),
        (b"use -foo", p.BAD_FORMAT),
        (b"use " + b"a" * 201, p.BAD_FORMAT),
        (b"frobnicate", p.UNKNOWN_COMMAND),
        (b"", p.UNKNOWN_COMMAND),
        (b"peek", p.UNKNOWN_COMMAND),
        (b"stats\x00", p.BAD_FORMAT),
    ],
)
def test_codec_rejects_like_beanstalkd(line, reply):
    with pytest.raises(p.ParseError) as err:
        p.parse_line(line, 65535)
    assert err.value.reply == reply


def drain(decoder: p.Decoder) -> list[tuple]:
    items = []
    while (item := decoder.next_command()) is not None:
        items.append(item)
    return items


def test_decoder_handles_split_put_and_pipelining():
    d = p.Decoder()
    d.feed(b"put 0 0 1 5\r\nhel")
    assert drain(d) == [("put-header", 0, 0, 1, 5)]
    d.feed(b"lo\r\nstats\r\n")
    assert drain(d) == [("put", 0, 0, 1, b"hello", True), ("stats",)]


def test_decoder_expected_crlf_then_rest_is_a_command():
    d = p.Decoder()
    d.feed(b"put 0 0 1 1\r\nxx\r\nstats\r\n")  # body is "xx\r"; "\nstats" follows
    assert drain(d) == [("put", 0, 0, 1, None, False), ("error", p.UNKNOWN_COMMAND, None)]


def test_decoder_job_too_big_skips_body():
    d = p.Decoder(max_job_size=3)
    d.feed(b"put 0 0 1 5\r\nhel")
    assert drain(d) == [("too-big",)]
    d.feed(b"lo\r\nstats\r\n")
    assert drain(d) == [("error", p.JOB_TOO_BIG, None), ("stats",)]


def test_decoder_overlong_line_answers_bad_format_once():
    d = p.Decoder()
    d.feed(b"x" * 300 + b"\r\nstats\r\n")
    assert drain(d) == [("error", p.BAD_FORMAT, None), ("stats",)]


# --- the one-packet fast path decodes exactly as the incremental decoder ---------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_WORDS = [b"put", b"peek", b"peek-ready", b"peek-delayed", b"peek-buried", b"reserve", b"reserve-with-timeout",
          b"reserve-job", b"delete", b"release", b"bury", b"kick", b"kick-job", b"touch", b"stats", b"stats-job",
          b"stats-tube", b"use", b"watch", b"ignore", b"list-tubes", b"list-tube-used", b"list-tubes-watched",
          b"quit", b"pause-tube", b"auth", b"putx", b"x"]
_ARGS = st.one_of(st.integers(0, 2**65).map(lambda n: str(n).encode()), st.sampled_from([b"", b"-1", b"+5", b" 7",
                  b"007", b"tube", b"-bad", b"a" * 201, b"x\x00", b"1 2"]))


@st.composite
def _packets(draw) -> bytes:
    """One command line (well-formed or nearly), a body for puts, and sometimes trailing bytes."""
    word = draw(st.sampled_from(_WORDS))
    args = draw(st.lists(_ARGS, max_size=5))
    line = b" ".join([word, *args])
    if draw(st.booleans()):
        line = line.replace(b" ", draw(st.sampled_from([b"  ", b"\t", b" "])), 1)
    body = b""
    if word == b"put":
        size = draw(st.integers(0, 12))
        line = b"put %d %d %d %d" % (draw(st.integers(0, 2**32)), draw(st.integers(0, 3)),
                                      draw(st.integers(0, 3)), size)
        body = draw(st.binary(min_size=max(0, size - 1), max_size=size + 1))
        body += draw(st.sampled_from([b"\r\n", b"\n", b""]))
    end = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n", b"\r", b"\r\r\n"]))
    tail = draw(st.sampled_from([b"", b"", b"stats\r\n", b"x"]))
    return line + end + body + tail


_IDS = st.integers(0, 2**64 + 5)
_CANONICAL = st.one_of(
    st.builds(lambda a: b"delete %d\r\n" % a, _IDS), st.builds(lambda a: b"touch %d\r\n" % a, _IDS),
    st.builds(lambda a: b"peek %d\r\n" % a, _IDS), st.builds(lambda a: b"stats-job %d\r\n" % a, _IDS),
    st.builds(lambda a: b"reserve-job %d\r\n" % a, _IDS), st.builds(lambda a: b"kick %d\r\n" % a, _IDS),
    st.builds(lambda a, b, c: b"release %d %d %d\r\n" % (a, b, c), _IDS, _IDS, _IDS),
    st.builds(lambda a, b: b"bury %d %d\r\n" % (a, b), _IDS, _IDS),
    st.builds(lambda a: b"reserve-with-timeout %d\r\n" % a, st.integers(-5, 2**40)),
    st.builds(lambda n: b"%s %s\r\n" % n, st.tuples(st.sampled_from([b"use", b"watch", b"ignore", b"stats-tube"]),
                                                     st.sampled_from([b"a", b"jobs", b"-x", b"a" * 200, b"a" * 201]))),
    st.sampled_from([b"reserve\r\n", b"stats\r\n", b"list-tubes\r\n", b"peek-ready\r\n", b"quit\r\n",
                     b"list-tube-used\r\n", b"pause-tube a 5\r\n", b"auth secret\r\n"]),
    st.builds(lambda a, d, t, body, end: b"put %d %d %d %d\r\n%s%s" % (a, d, t, len(body), body, end),
              _IDS, st.integers(0, 3), st.integers(0, 3), st.binary(max_size=20),
              st.sampled_from([b"\r\n", b"\r\n", b"\n", b"\r\nx"])),
)


# 3,000 packets as 300 examples of 10: the same packets, half of hypothesis's per-example cost
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(_packets(), _CANONICAL), st.booleans(), st.integers(3, 70000)),
                min_size=10, max_size=10))
def test_parse_packet_agrees_with_the_incremental_decoder(cases):
    for packet, auth, max_job_size in cases:
        fast = p.Decoder(max_job_size, auth_enabled=auth).parse_packet(packet)
        slow = p.Decoder(max_job_size, auth_enabled=auth)
        slow.feed(packet)
        items = drain(slow)
        if fast is not None:  # it may decline, never disagree
            assert [fast] == items and slow.buffered() == 0, packet


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(_packets(), _CANONICAL), min_size=1, max_size=6), st.lists(st.integers(0, 5), min_size=20,
       max_size=20), st.booleans(), st.integers(3, 70000))
def test_one_decoder_parsing_packets_that_repeat_agrees_with_the_incremental_decoder(pool, order, auth, max_job_size):
    """As a connection does: one decoder (its last-line memo) and the server's shared line cache over a stream
    in which packets repeat, each checked against a fresh decoder's exact path."""
    cache: p.LineCache = {}
    fast = p.Decoder(max_job_size, auth_enabled=auth, line_cache=cache)
    for i in order:
        packet = pool[i % len(pool)]
        got = fast.parse_packet(packet)
        slow = p.Decoder(max_job_size, auth_enabled=auth)
        slow.feed(packet)
        items = drain(slow)
        if got is not None:
            assert [got] == items and slow.buffered() == 0, packet


def test_a_decoder_answers_its_last_cached_line_again_without_the_cache() -> None:
    """A worker sends the same put and reserve lines again and again: after the first hit, the decoder compares
    the line with its last put line or its last other line instead of hashing it for the shared cache. Seen
    here through a cleared cache: a look-up would miss and parse the line into the cache again (the compiled
    build reads a dict subclass's table directly, so a counting ``get`` would not see it)."""
    cache: p.LineCache = {}
    decoder = p.Decoder(65535, line_cache=cache)
    put = b"put 1 0 60 3\r\nabc\r\n"
    assert decoder.parse_packet(put) == ("put", 1, 0, 60, b"abc", False)  # a miss: parsed, then cached
    assert decoder.parse_packet(put) == ("put", 1, 0, 60, b"abc", False)  # a hit: remembered
    cache.clear()
    assert decoder.parse_packet(b"put 1 0 60 3\r\nxyz\r\n") == ("put", 1, 0, 60, b"xyz", False)
    assert not cache, "the decoder looked its last line up again"
    assert decoder.parse_packet(b"reserve\r\n") == p.Bare("reserve")  # another line: looked up, parsed, cached
    assert list(cache) == [b"reserve"]
    assert decoder.parse_packet(b"reserve\r\n") == p.Bare("reserve")  # a hit: remembered
    cache.clear()
    assert decoder.parse_packet(b"reserve\r\n") == p.Bare("reserve") and not cache
    assert decoder.parse_packet(put) == ("put", 1, 0, 60, b"abc", False)  # the last put line, reserves between
    assert not cache, "a reserve made the decoder look its last put line up again"
    assert decoder.parse_packet(b"delete 7\r\n") == ("delete", 7) and not cache  # a delete line is never cached
    assert decoder.parse_packet(b"put 2 0 60 3\r\nabc\r\n") == ("put", 2, 0, 60, b"abc", False)  # another
    assert list(cache) == [b"put 2 0 60 3"]
    assert decoder.parse_packet(b"reserve\r\n") == p.Bare("reserve") and list(cache) == [b"put 2 0 60 3"]


def test_a_cached_put_line_serves_every_path_of_the_decoder() -> None:
    """The line cache keeps a put line as a plain tuple (protocol.PutLine): a decoder with a smaller
    limit sharing the cache still refuses it (parse_line, parse_packet, next_command), and a body
    arriving in pieces still gives the named put-header record and then the put."""
    cache: p.LineCache = {}
    big = p.Decoder(65535, line_cache=cache)
    assert big.parse_packet(b"put 1 0 60 200\r\n" + b"x" * 200 + b"\r\n") == ("put", 1, 0, 60, b"x" * 200, False)
    assert b"put 1 0 60 200" in cache
    with pytest.raises(p.TooBig):
        p.parse_line(b"put 1 0 60 200", 100, cache)
    small = p.Decoder(100, line_cache=cache)
    assert small.parse_packet(b"put 1 0 60 200\r\n" + b"x" * 200 + b"\r\n") is None
    small.feed(b"put 1 0 60 200\r\n" + b"x" * 200 + b"\r\n")
    assert drain(small) == [p.TOO_BIG, p.Error("error", p.JOB_TOO_BIG, None)]
    big.feed(b"put 1 0 60 200\r\n" + b"y" * 100)
    header = big.next_command()
    assert type(header) is p.PutLine and header == ("put-header", 1, 0, 60, 200)
    big.feed(b"y" * 100 + b"\r\n")
    assert big.next_command() == ("put", 1, 0, 60, b"y" * 200, True)


def test_ready_heap_entries_of_a_requeued_job_stay_bounded_and_serve_it_once() -> None:
    """reserve-job takes a ready job out of the middle of its heap (its entry goes stale);
    released under the same priority, the job has two equal entries: served once, and the
    heap does not grow with repeats (the rebuild keeps each live entry once)."""
    queue = Queue(FakeClock())
    c = Conn(queue)
    first = c.put(b"a", pri=5)
    job_id = c.put(b"b", pri=5)
    tube = queue.default_tube
    for _ in range(500):
        assert queue_verbs.reserve_job(queue, c.client, job_id).startswith(b"RESERVED")
        assert queue_verbs.release(queue, c.client, job_id, 5, 0) == b"RELEASED\r\n"
    assert tube.ready_entries() <= 2 * tube.ready_count + 64 + 1
    assert c.reserve(0) == b"RESERVED %d 1\r\na\r\n" % first
    assert c.reserve(0) == b"RESERVED %d 1\r\nb\r\n" % job_id
    assert c.reserve(0) == p.TIMED_OUT
    assert tube.ready_count == 0


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.one_of(st.sampled_from([0, 1, 1023, 2**30 - 1, 2**30, 2**31, 2**32 - 1]), st.none()),
                    min_size=1, max_size=40),
       narrow_left=st.integers(0, 30))
def test_ready_order_holds_across_the_narrow_to_wide_heap_switch(ops, narrow_left):
    """The ready heap keeps (pri << READY_BITS) | id while ids fit READY_BITS bits and re-encodes itself
    with 64-bit ids at the first id past that: reserves (None in ``ops``) still serve the least (pri, id), before,
    across and after the switch, with every priority width."""
    queue = Queue(FakeClock())
    queue.next_id = 2**READY_BITS - narrow_left  # the first `narrow_left` ids fit the narrow form
    c = Conn(queue)
    held: set[tuple[int, int]] = set()
    for pri in ops:
        if pri is None:
            reply = c.reserve(0)
            if not held:
                assert reply == p.TIMED_OUT
                continue
            best = min(held)
            assert job_id(reply) == best[1]
            held.discard(best)
            assert queue.delete(c.client, best[1]) == p.DELETED
        else:
            held.add((pri, c.put(b"x", pri=pri)))
    assert [job_id(c.reserve(0)) for _ in range(len(held))] == [i for _, i in sorted(held)]
    wide = queue.next_id - 1 >= 2**READY_BITS and any(pri is not None for pri in ops)
    assert queue.default_tube.ready_shift == (64 if wide else READY_BITS)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300).map(lambda b: b.replace(b"\x0d", b"") if len(b) % 3 == 0 else b),
       start=st.integers(0, 320), length=st.integers(0, 320))
def test_find_cr_is_bytes_find(data, start, length):
    """The compiled decoder's native CR scan answers exactly as bytes.find (both builds run it)."""
    end = start + length
    assert p.find_cr(data, start, end) == data.find(b"\r", start, end)


@settings(max_examples=400, deadline=None)
@given(text=st.one_of(st.binary(max_size=22), st.integers(0, 10**20).map(lambda n: b"%d" % n),
                      st.integers(0, 10**6).map(lambda n: b"00%d" % n)),
       start=st.integers(0, 3))
def test_plain_number_is_int_of_plain_digits(text, start):
    """The delete fast path's number parse (a native loop compiled) agrees with int() on 1-18
    ASCII digits and declines (-1) everything else, in both builds."""
    digits = text[start:]
    expected = int(digits) if 0 < len(digits) <= 18 and digits.isdigit() else -1
    assert p.plain_number(text, start) == expected


@pytest.mark.parametrize("line, expected", [
    (b"bury 9223372036854775808 0", ("bury", 2**63, 0)),
    (b"release 18446744073709551615 1 2", ("release", 2**64 - 1, 1, 2)),
    (b"delete 18446744073709551615", ("delete", 2**64 - 1)),
    (b"delete 123456789012345678", ("delete", 123456789012345678)),
])
def test_ids_past_the_native_range_parse(line, expected):
    """Ids of 2**63 and more (beanstalkd's read_u64 takes them) parse in the compiled build too:
    the delete fast path's native number must not narrow the other commands' ids."""
    assert p.parse_line(line, 65535) == expected


def test_find_cr_at_every_position():
    """Every CR position in a 300-byte packet (random data rarely puts the first CR far out), with
    windows that end before, at and past it."""
    for pos in range(300):
        data = bytes(pos) + b"\r" + bytes(299 - pos)
        for start in (0, pos // 2, pos, pos + 1):
            for end in (pos, pos + 1, 300, 400):
                if start <= end:
                    assert p.find_cr(data, start, end) == data.find(b"\r", start, end), (pos, start, end)


def test_ready_heap_widens_for_ids_past_the_narrow_form(queue):
    """Ready-heap entries shift the priority by READY_BITS until an id needs more; the heap is then
    re-encoded. Reserves stay in (priority, id) order across the change, with stale entries in it."""
    narrow = 2**READY_BITS
    c = Conn(queue)
    queue.next_id = narrow - 4
    ids = {body: c.put(body, pri=pri) for body, pri in
           [(b"a", 5), (b"b", 2**32 - 1), (b"c", 5), (b"d", 0)]}  # ids narrow-4 .. narrow-1: narrow entries
    released = job_id(c.reserve())  # d: its entry leaves the heap; released again below with a new priority
    assert released == ids[b"d"]
    tube = queue.tube_by_name["default"]
    assert tube.ready_shift == READY_BITS
    ids[b"e"] = c.put(b"e", pri=5)  # id 2**READY_BITS: the heap widens
    assert tube.ready_shift == 64 and ids[b"e"] == narrow
    assert queue_verbs.release(queue, c.client, released, 2**32 - 1, 0) == p.RELEASED
    ids[b"f"] = c.put(b"f", pri=0)
    order = [job_id(c.reserve()) for _ in range(6)]
    assert order == [ids[b"f"], ids[b"a"], ids[b"c"], ids[b"e"], ids[b"b"], ids[b"d"]]


_READY_OPS = st.lists(st.tuples(st.sampled_from(["put", "reserve", "release", "delete", "take", "bury_kick"]),
                                st.sampled_from([0, 1, 5, 2**31])), max_size=120)


@settings(max_examples=200, deadline=None)
@given(ops=_READY_OPS)
def test_ready_heap_and_run_serve_least_priority_then_id(ops):
    """Ready entries queue on a sorted run while they come in ascending order and on the heap
    otherwise: whatever the mix of puts, releases, kicks (old ids back), deletes and reserve-jobs
    of ready jobs (stale entries in both), a reserve serves the least (priority, id)."""
    queue = Queue(FakeClock())
    c = Conn(queue)
    ready: dict[int, int] = {}  # id -> pri of the ready jobs: the model
    held: list[int] = []
    tube = queue.default_tube
    for op, pri in ops:
        if op == "put":
            ready[c.put(b"x", pri=pri)] = pri
        elif op == "reserve":
            reply = c.reserve(0)
            if not ready:
                assert reply == p.TIMED_OUT
                continue
            best = min(ready, key=lambda i: (ready[i], i))
            assert job_id(reply) == best
            del ready[best]
            held.append(best)
        elif op == "release" and held:
            victim = held.pop(0)
            assert queue_verbs.release(queue, c.client, victim, pri, 0) == p.RELEASED
            ready[victim] = pri
        elif op in ("delete", "take") and ready:
            victim = sorted(ready)[len(ready) // 2]
            if op == "delete":
                assert queue.delete(c.client, victim) == p.DELETED
            else:
                assert queue_verbs.reserve_job(queue, c.client, victim).startswith(b"RESERVED")
                held.append(victim)
            del ready[victim]
        elif op == "bury_kick" and held:
            victim = held.pop()
            assert queue_verbs.bury(queue, c.client, victim, pri) == p.BURIED
            assert queue_verbs.kick_job(queue, c.client, victim) == p.KICKED
            ready[victim] = pri
        assert tube.ready_count == len(ready)
        assert tube.ready_entries() <= 2 * len(ready) + 64 + 1
        assert not tube.ready_clean or tube.ready_entries() == len(ready)  # "clean": no stale entry
    order = [job_id(c.reserve(0)) for _ in range(len(ready))]
    assert order == sorted(ready, key=lambda i: (ready[i], i))
    assert c.reserve(0) == p.TIMED_OUT


def test_stale_entries_left_by_deletes_are_pruned_as_reserves_drain_the_rest() -> None:
    """A reserve of the top leaves no stale entry and skips the stale test while a tube has none
    (``ready_clean``); once deletes left some, reserves alone must still keep them within twice the
    ready jobs plus slack, and the tube is clean again once they are gone."""
    queue = Queue(FakeClock())
    c = Conn(queue)
    ids = [c.put(b"x", pri=7) for _ in range(400)]
    tube = queue.default_tube
    assert tube.ready_clean
    for victim in ids[250:]:  # the newest: stale entries at the end of the run, under the bound
        assert queue.delete(c.client, victim) == p.DELETED
    assert not tube.ready_clean and tube.ready_entries() == 400 and tube.ready_count == 250
    for n, expected in enumerate(ids[:250]):
        assert job_id(c.reserve(0)) == expected
        assert tube.ready_entries() <= 2 * (249 - n) + 64 + 1
    assert c.reserve(0) == p.TIMED_OUT
    assert tube.ready_clean and tube.ready_entries() == 0


def test_a_job_handed_to_a_waiting_client_leaves_no_stale_entry() -> None:
    """A put that wakes a waiting worker takes the job's entry with it: the tube stays clean."""
    queue = Queue(FakeClock())
    worker, producer = Conn(queue), Conn(queue)
    assert worker.reserve() is None  # waits
    jid = producer.put(b"y", pri=3)
    assert worker.later == [b"RESERVED %d 1\r\ny\r\n" % jid]
    tube = queue.default_tube
    assert tube.ready_clean and tube.ready_entries() == 0 and tube.ready_count == 0


def test_stale_run_entries_are_pruned_and_the_rest_served_in_order() -> None:
    """Deleting most of a backlog put in id order leaves stale entries on the run: the rebuild
    drops them (entries stay within twice the ready jobs plus slack) and keeps the rest in order."""
    queue = Queue(FakeClock())
    c = Conn(queue)
    ids = [c.put(b"x", pri=7) for _ in range(400)]
    tube = queue.default_tube
    assert tube.ready_entries() == 400 and not tube.ready  # ascending puts queue on the run only
    for victim in ids[:300]:
        assert queue.delete(c.client, victim) == p.DELETED
    assert tube.ready_entries() <= 2 * 100 + 64 + 1
    assert [job_id(c.reserve(0)) for _ in range(100)] == ids[300:]
    assert c.reserve(0) == p.TIMED_OUT
