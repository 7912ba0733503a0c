"""greenstalk (a third-party Python beanstalkd client) end to end, against a real server
process: every command greenstalk offers, with real assertions. Each test runs twice, on
our broker and on real beanstalkd 1.12 (the `server` fixture), so a test that passes on
one and fails on the other points at an incompatibility.
"""
from __future__ import annotations

import threading
import time

import greenstalk
import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def client(server):
    c = greenstalk.Client((server.host, server.port))
    yield c
    c.close()


@pytest.fixture
def make_client(server):
    made: list[greenstalk.Client] = []

    def make(**kw) -> greenstalk.Client:
        c = greenstalk.Client((server.host, server.port), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_put_reserve_delete(client):
    job_id = client.put("hello")
    assert isinstance(job_id, int) and job_id >= 1
    job = client.reserve(timeout=0)
    assert (job.id, job.body) == (job_id, "hello")
    client.delete(job)
    with pytest.raises(greenstalk.NotFoundError):
        client.delete(job)
    with pytest.raises(greenstalk.NotFoundError):
        client.peek(job_id)


def test_delete_by_id_and_unicode_body(client):
    job_id = client.put("héllo wörld ✓")
    assert client.peek(job_id).body == "héllo wörld ✓"
    client.delete(job_id)
    with pytest.raises(greenstalk.NotFoundError):
        client.stats_job(job_id)


def test_binary_body_without_encoding(make_client):
    c = make_client(encoding=None)
    body = bytes(range(256)) + b"\r\nput 0 0 1 1\r\n"
    job_id = c.put(body)
    job = c.reserve(timeout=0)
    assert job.id == job_id and job.body == body


def test_empty_body(client):
    job_id = client.put("")
    job = client.reserve(timeout=0)
    assert job.id == job_id and job.body == ""


def test_priority_then_fifo(client):
    ids = {name: client.put(name, priority=pri) for name, pri in
           [("c", 10), ("a", 0), ("d", 10), ("b", 5), ("e", 2**32 - 1)]}
    order = []
    for _ in range(5):
        job = client.reserve(timeout=0)
        order.append(job.body)
        client.delete(job)
    assert order == ["a", "b", "c", "d", "e"]
    assert ids["c"] < ids["d"]


def test_reserve_timeout_and_zero(client):
    with pytest.raises(greenstalk.TimedOutError):
        client.reserve(timeout=0)
    start = time.monotonic()
    with pytest.raises(greenstalk.TimedOutError):
        client.reserve(timeout=1)
    assert time.monotonic() - start >= 0.9


def test_blocking_reserve_woken_by_put_from_other_client(make_client):
    worker = make_client(use="wake", watch="wake")
    producer = make_client(use="wake")
    got: list = []
    t = threading.Thread(target=lambda: got.append(worker.reserve(timeout=10)))
    t.start()
    try:
        wait_until(lambda: producer.stats_tube("wake")["current-waiting"] == 1, 5.0, "the reserve to wait")
        job_id = producer.put("for the waiter")
    finally:
        t.join(15)
    assert not t.is_alive()
    assert got and got[0].id == job_id and got[0].body == "for the waiter"


def test_release_and_release_with_delay(client):
    job_id = client.put("again", priority=100)
    job = client.reserve(timeout=0)
    client.release(job, priority=7)
    stats = client.stats_job(job_id)
    assert (stats["state"], stats["pri"], stats["releases"], stats["reserves"]) == ("ready", 7, 1, 1)

    job = client.reserve(timeout=0)
    client.release(job, priority=8, delay=1)
    stats = client.stats_job(job_id)
    assert (stats["state"], stats["delay"], stats["pri"]) == ("delayed", 1, 8)
    assert client.peek_delayed().id == job_id
    with pytest.raises(greenstalk.TimedOutError):
        client.reserve(timeout=0)
    job = client.reserve(timeout=3)  # the server's own clock makes it ready
    assert job.id == job_id
    with pytest.raises(greenstalk.NotFoundError):
        client.release(greenstalk.Job(job_id + 1000, "nope"))


def test_bury_kick_and_peek_buried(client):
    ids = [client.put(f"b{i}") for i in range(3)]
    for _ in ids:
        client.bury(client.reserve(timeout=0), priority=3)
    assert client.peek_buried().id == ids[0]
    stats = client.stats_job(ids[0])
    assert (stats["state"], stats["pri"], stats["buries"]) == ("buried", 3, 1)
    with pytest.raises(greenstalk.TimedOutError):
        client.reserve(timeout=0)
    assert client.kick(2) == 2
    assert client.peek_buried().id == ids[2]
    assert client.peek_ready().id == ids[0]
    assert client.kick(10) == 1
    assert client.kick(10) == 0
    with pytest.raises(greenstalk.NotFoundError):
        client.peek_buried()
    with pytest.raises(greenstalk.NotFoundError):
        client.bury(greenstalk.Job(ids[0], "b0"))  # ready, not reserved by us


def test_kick_takes_buried_before_delayed(client):
    delayed = client.put("later", delay=100)
    buried = client.put("buried")
    client.bury(client.reserve(timeout=0))
    assert client.kick(5) == 1
    assert client.stats_job(buried)["state"] == "ready"
    assert client.stats_job(delayed)["state"] == "delayed"
    assert client.kick(5) == 1
    assert client.stats_job(delayed)["state"] == "ready"


def test_kick_job_buried_and_delayed(client):
    delayed = client.put("d", delay=100)
    buried = client.put("b")
    ready = client.put("r", priority=2**31 + 1)
    client.bury(client.reserve_job(buried))
    client.kick_job(buried)
    client.kick_job(greenstalk.Job(delayed, "d"))
    assert client.stats_job(buried)["kicks"] == 1
    assert client.stats_job(delayed)["state"] == "ready"
    with pytest.raises(greenstalk.NotFoundError):
        client.kick_job(ready)
    with pytest.raises(greenstalk.NotFoundError):
        client.kick_job(10**9)


def test_touch(client):
    job_id = client.put("t", ttr=2)
    job = client.reserve(timeout=0)
    with pytest.raises(greenstalk.DeadlineSoonError):
        client.reserve(timeout=3)  # the last second of the TTR is the safety margin
    assert client.stats_job(job_id)["time-left"] == 0
    client.touch(job)
    assert client.stats_job(job_id)["time-left"] == 1
    other = client.put("not reserved")
    with pytest.raises(greenstalk.NotFoundError):
        client.touch(greenstalk.Job(other, "x"))


def test_deadline_soon_with_ttr_one(client):
    client.put("short", ttr=1)
    job = client.reserve(timeout=0)
    with pytest.raises(greenstalk.DeadlineSoonError):
        client.reserve(timeout=0)
    client.delete(job)
    with pytest.raises(greenstalk.TimedOutError):
        client.reserve(timeout=0)


def test_ttr_zero_becomes_one(client):
    job_id = client.put("x", ttr=0)
    assert client.stats_job(job_id)["ttr"] == 1


def test_peek_variants(client):
    for peek in (client.peek_ready, client.peek_delayed, client.peek_buried):
        with pytest.raises(greenstalk.NotFoundError):
            peek()
    with pytest.raises(greenstalk.NotFoundError):
        client.peek(10**9)
    r = client.put("ready", priority=5)
    client.put("ready-later", priority=5)
    d1 = client.put("d50", delay=50)
    client.put("d90", delay=90)
    assert (client.peek_ready().id, client.peek_ready().body) == (r, "ready")
    assert client.peek_delayed().id == d1
    assert client.peek(d1).body == "d50"
    job = client.reserve(timeout=0)
    assert client.peek(job.id).body == "ready"  # peek sees reserved jobs too


def test_reserve_job(client, make_client):
    a = client.put("a")
    d = client.put("d", delay=100)
    job = client.reserve_job(d)
    assert (job.id, job.body) == (d, "d")
    assert client.stats_job(d)["state"] == "reserved"
    other = make_client()
    with pytest.raises(greenstalk.NotFoundError):
        other.reserve_job(d)  # reserved by someone else
    with pytest.raises(greenstalk.NotFoundError):
        other.delete(d)
    assert other.reserve_job(a).body == "a"
    with pytest.raises(greenstalk.NotFoundError):
        client.reserve_job(10**9)


def test_use_watch_ignore_using_watching_tubes(client):
    assert client.using() == "default"
    assert client.watching() == ["default"]
    client.use("alpha")
    assert client.using() == "alpha"
    assert client.watch("beta") == 2
    assert client.watch("gamma") == 3
    assert client.watch("beta") == 3
    assert client.watching() == ["default", "beta", "gamma"]
    assert client.ignore("default") == 2
    assert client.ignore("gamma") == 1
    with pytest.raises(greenstalk.NotIgnoredError):
        client.ignore("beta")
    assert sorted(client.tubes()) == ["alpha", "beta", "default"]
    client.put("into alpha")
    assert client.stats_tube("alpha")["current-jobs-ready"] == 1
    with pytest.raises(greenstalk.TimedOutError):
        client.reserve(timeout=0)  # watching beta only
    client.watch("alpha")
    assert client.reserve(timeout=0).body == "into alpha"


def test_constructor_use_and_watch(make_client):
    c = make_client(use="pipe", watch=["pipe", "side"])
    assert c.using() == "pipe"
    assert sorted(c.watching()) == ["pipe", "side"]
    job_id = c.put("loop")
    assert c.reserve(timeout=0).id == job_id


def test_bad_tube_names(client):
    for bad in ("-starts-with-hyphen", "x" * 201, "a*b"):
        with pytest.raises(greenstalk.BadFormatError):
            client.use(bad)
        with pytest.raises(greenstalk.BadFormatError):
            client.watch(bad)
    client.use("y" * 200)
    assert client.using() == "y" * 200


def test_pause_tube(client):
    client.put("paused job")
    client.pause_tube("default", 1)
    stats = client.stats_tube("default")
    assert stats["pause"] == 1 and stats["cmd-pause-tube"] == 1
    with pytest.raises(greenstalk.TimedOutError):
        client.reserve(timeout=0)
    assert client.peek_ready().body == "paused job"  # peeking is not reserving
    job = client.reserve(timeout=4)  # unpaused by the server's clock
    assert job.body == "paused job"
    with pytest.raises(greenstalk.NotFoundError):
        client.pause_tube("no-such-tube", 1)


def test_stats(client, make_client):
    before = client.stats()
    for key in ("pid", "version", "uptime", "current-connections", "total-jobs", "cmd-put",
                "max-job-size", "current-tubes", "draining", "binlog-max-size", "id", "hostname"):
        assert key in before
    assert before["max-job-size"] == 65535
    assert before["draining"] == "false"
    assert before["current-connections"] == 1
    other = make_client()
    other.put("x", priority=1023)
    other.put("y", priority=1024)
    after = client.stats()
    assert after["current-connections"] == 2
    assert after["cmd-put"] == before["cmd-put"] + 2
    assert after["total-jobs"] == before["total-jobs"] + 2
    assert after["current-jobs-ready"] == 2
    assert after["current-jobs-urgent"] == 1
    assert after["current-producers"] == 1
    other.close()
    wait_until(lambda: client.stats()["current-connections"] == 1, 5.0, "the other connections to close")


def test_stats_tube(client):
    with pytest.raises(greenstalk.NotFoundError):
        client.stats_tube("nothing-here")
    client.use("st")
    client.put("a", priority=1)
    client.put("b", priority=5000)
    client.put("c", delay=100)
    stats = client.stats_tube("st")
    assert stats["name"] == "st"
    assert (stats["current-jobs-urgent"], stats["current-jobs-ready"], stats["current-jobs-delayed"]) == (1, 2, 1)
    assert (stats["total-jobs"], stats["current-using"], stats["current-watching"]) == (3, 1, 0)
    assert (stats["pause"], stats["pause-time-left"], stats["cmd-delete"]) == (0, 0, 0)


def test_stats_job(client):
    job_id = client.put("s", priority=42, delay=0, ttr=77)
    stats = client.stats_job(job_id)
    assert stats["id"] == job_id
    assert (stats["tube"], stats["state"], stats["pri"], stats["ttr"]) == ("default", "ready", 42, 77)
    assert (stats["reserves"], stats["timeouts"], stats["releases"], stats["buries"], stats["kicks"]) == (0, 0, 0, 0, 0)
    assert stats["file"] == 0 and 0 <= stats["age"] <= 1
    job = client.reserve(timeout=0)
    stats = client.stats_job(job)
    assert stats["state"] == "reserved" and stats["reserves"] == 1 and 75 <= stats["time-left"] <= 77


def test_close_releases_reserved_job(make_client):
    holder = make_client()
    other = make_client()
    job_id = holder.put("orphan")
    assert holder.reserve(timeout=0).id == job_id
    with pytest.raises(greenstalk.TimedOutError):
        other.reserve(timeout=0)
    holder.close()
    job = other.reserve(timeout=5)
    assert job.id == job_id


def test_job_too_big(server_factory, server):
    small = server_factory(server.kind, extra_args=["-z", "10"])
    c = greenstalk.Client((small.host, small.port))
    try:
        assert c.stats()["max-job-size"] == 10
        with pytest.raises(greenstalk.JobTooBigError):
            c.put("x" * 11)
        job_id = c.put("x" * 10)  # the connection is still usable after the error
        assert c.peek(job_id).body == "x" * 10
    finally:
        c.close()
