"""The writer's partition logic without Spark: validation, failover, lost connections, markers.

Fast (no SparkSession); every test runs against our broker and beanstalkd 1.12.
"""
from __future__ import annotations

import signal
import socket
import threading
import time

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

from spark_beanstalk.client import Connection
from spark_beanstalk.options import OptionError, WriterOptions
from spark_beanstalk.writer import (
    BeanstalkUnavailableError,
    BeanstalkWriteError,
    ColumnSpec,
    PartitionMark,
    _arrow_chunks,
    key_host,
    marker_exists,
    marker_namespace,
    marker_tube,
    put_partition,
    write_marker,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(60)

SCHEMA = StructType([StructField("body", StringType()), StructField("tube", StringType()),
                     StructField("priority", LongType()), StructField("k", StringType())])


def _put(rows: dict, hosts: str, **opts):
    o = WriterOptions.parse({"hosts": hosts, **opts})
    spec = ColumnSpec.from_schema(SCHEMA, o)
    columns = {name: rows.get(name, [None] * len(rows["body"])) for name in SCHEMA.fieldNames()}
    batch = pa.RecordBatch.from_pydict(columns,
                                       schema=pa.schema([("body", pa.string()), ("tube", pa.string()),
                                                         ("priority", pa.int64()), ("k", pa.string())]))
    return put_partition(_arrow_chunks([batch], spec), spec, o, {"partition": 0})


def _bodies(proc, tube: str) -> list[bytes]:
    """Every ready job body in `tube` (reserved and deleted)."""
    out = []
    with Connection(proc.host, proc.port) as c:
        c.watch_only([tube])
        while True:
            job = c.reserve(0)
            if job is None:
                return out
            out.append(job.body)
            c.delete(job.id)


def test_options_errors_name_key_and_value():
    with pytest.raises(OptionError, match="unknown beanstalk writer option.*tubee"):
        WriterOptions.parse({"tubee": "x"})
    with pytest.raises(OptionError, match="priority=4294967296 is above the maximum"):
        WriterOptions.parse({"priority": str(2**32)})
    with pytest.raises(OptionError, match="distribution=hash needs keyColumn"):
        WriterOptions.parse({"distribution": "hash"})
    with pytest.raises(OptionError, match="option tube: .*does not allow"):
        WriterOptions.parse({"tube": "a b"})
    o = WriterOptions.parse({"TTR": "7"}, {"spark.beanstalk.tube": "t", "spark.beanstalk.ttr": "9",
                                            "spark.other": "x"})
    assert (o.tube, o.ttr) == ("t", 7)            # explicit beats conf beats default
    bad = StructType([StructField("body", LongType())])
    with pytest.raises(OptionError, match="column 'body' .* must be binary or string, not bigint"):
        ColumnSpec.from_schema(bad, o)
    spec = ColumnSpec.from_schema(StructType([StructField("Body", BinaryType()), StructField("x", LongType())]), o)
    assert spec.body == "Body" and spec.json_columns == ()


@pytest.mark.parametrize("key", ["timeout", "connectTimeout", "retryInterval", "brokerRetrySeconds"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_float_options_are_refused(key, value):
    with pytest.raises(OptionError, match=f"option {key}=.* is not a finite number"):
        WriterOptions.parse({key: value})
    with pytest.raises(OptionError, match=f"option {key}=.* is beyond"):
        WriterOptions.parse({key: "1e300"})


@pytest.mark.parametrize("hosts", ["127.0.0.1:1,127.0.0.1:1", "cluster:a:1,b:1;b:1"])
def test_a_server_named_twice_is_refused_as_by_the_source(hosts):
    from spark_beanstalk.options import SourceOptions

    for parse in (WriterOptions.parse, SourceOptions.parse):
        with pytest.raises(OptionError, match="option hosts names a broker twice"):
            parse({"hosts": hosts})


def test_dead_letter_path_that_cannot_be_a_directory_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path in (afile, afile / "below"):
        with pytest.raises(OptionError, match="deadLetterPath=.* exists and is not a directory"):
            WriterOptions.parse({"deadLetterPath": str(path)})
    ok = tmp_path / "new" / "dead"
    assert WriterOptions.parse({"deadLetterPath": str(ok)}).dead_letter_path == str(ok)
    assert WriterOptions.parse({"deadLetterPath": "s3://bucket/dead"}).dead_letter_path == "s3://bucket/dead"


def test_key_hash_is_stable():
    # CRC-32 based: the same in every process and run, not Python's salted hash()
    assert [key_host(k, 3) for k in ("a", "b", "user-17", 42, None)] == [0, 2, 1, 2, 0]


def test_bad_rows_fail_before_anything_is_sent(server):
    rows = {"body": ["ok", "x" * 70000, None, "z", "w"], "tube": ["t", "t", "t", "bad tube!", "t"],
            "priority": [1, 2, 3, 4, 2**32]}
    with pytest.raises(BeanstalkWriteError) as info:
        _put(rows, server.address)
    msg = str(info.value)
    assert "row 1 of partition 0" in msg and "JOB_TOO_BIG: body is 70000 bytes" in msg
    assert "row 2 of partition 0" in msg and "body is null" in msg
    assert "row 3 of partition 0" in msg and "bad tube name 'bad tube!'" in msg
    assert "row 4 of partition 0" in msg and "priority 4294967296 out of range" in msg
    with Connection(server.host, server.port) as c:
        assert c.stats_tube("t") is None          # nothing of the partition was put


def test_dead_letter_keeps_bad_rows_and_puts_the_rest(server, tmp_path):
    import json

    rows = {"body": ["ok", "x" * 70000, "z"], "tube": ["t", "t", "-bad"], "priority": [1, 2, 3]}
    s = _put(rows, server.address, deadLetterPath=str(tmp_path / "dl"))
    assert (s["put"], s["dead_lettered"]) == (1, 2)
    assert _bodies(server, "t") == [b"ok"]
    recs = [json.loads(line) for f in (tmp_path / "dl").iterdir() for line in f.read_text().splitlines()]
    reasons = sorted((r["row"], r["reason"].split(":")[0]) for r in recs)
    assert reasons == [(1, "JOB_TOO_BIG"), (2, "bad tube name '-bad'")]


def test_hash_spreads_by_key_and_fails_over(server_factory, server):
    kind = server.kind
    procs = [server, server_factory(kind), server_factory(kind)]
    hosts = ",".join(p.address for p in procs)
    keys = [f"user-{i % 50}" for i in range(600)]
    s = _put({"body": [f"{k}/{i}" for i, k in enumerate(keys)], "tube": ["h"] * 600, "k": keys}, hosts,
             keyColumn="k")
    assert s["put"] == 600 and s["failovers"] == 0
    for h, p in enumerate(procs):
        got = _bodies(p, "h")
        assert got and all(key_host(b.decode().split("/")[0], 3) == h for b in got)
    # one broker down: its keys go to the next broker in the ring, nothing is lost
    procs[1].kill()
    s = _put({"body": [f"{k}/{i}" for i, k in enumerate(keys)], "tube": ["h"] * 600, "k": keys}, hosts,
             keyColumn="k", retries="0")
    assert s["put"] == 600 and s["failovers"] > 0
    got = _bodies(procs[0], "h") + _bodies(procs[2], "h")
    assert sorted(got) == sorted(f"{k}/{i}".encode() for i, k in enumerate(keys))


def test_draining_broker_is_skipped(server_factory, server):
    other = server_factory(server.kind)
    server.signal(signal.SIGUSR1)                  # drain mode: puts answer DRAINING
    with Connection(server.host, server.port) as c:
        deadline = time.monotonic() + 10
        while c.call("put 0 0 1 1", b"x").status != b"DRAINING":   # poll until the signal landed
            assert time.monotonic() < deadline
            time.sleep(0.02)
    s = _put({"body": [f"b{i}" for i in range(300)]}, f"{server.address},{other.address}", tube="dr")
    assert s["put"] == 300 and s["hosts"] == {other.address: 300}
    assert len(_bodies(other, "dr")) == 300


def test_all_brokers_down_is_a_clear_error(server):
    addr = server.address
    server.kill()
    with pytest.raises(BeanstalkUnavailableError) as info:
        _put({"body": ["a", "b"]}, f"{addr},127.0.0.1:1", retries="1", retryInterval="0.05",
             brokerRetrySeconds="0")
    msg = str(info.value)
    assert "no broker accepted the rows after 2 attempt(s)" in msg
    # none up at the start: the rows waited to be checked against a broker's max-job-size, unsent
    assert addr in msg and "cannot connect" in msg and "No row of this partition was sent" in msg


class _StandIn:
    """A broker stand-in: a listener on a free port whose connections a thread serves (``_run``)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()


class _DroppingServer(_StandIn):
    """Answers `stats`, then INSERTED for the first `answer` puts, then closes the connection."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        super().__init__()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        buf = b""
        answered = 0
        while answered < self.answer:
            data = conn.recv(65536)
            if not data:
                break
            buf += data
            while b"\r\n" in buf and answered < self.answer:
                line, _, rest = buf.partition(b"\r\n")
                if line == b"stats":
                    body = b"---\nmax-job-size: 65535\n"
                    conn.sendall(b"OK %d\r\n%s\r\n" % (len(body), body))
                    buf = rest
                elif line.startswith(b"use "):
                    conn.sendall(b"USING " + line[4:] + b"\r\n")
                    buf = rest
                elif line.startswith(b"put "):
                    size = int(line.split()[-1])
                    if len(rest) < size + 2:
                        break
                    buf = rest[size + 2:]
                    answered += 1
                    conn.sendall(b"INSERTED %d\r\n" % answered)
                else:
                    buf = rest
        conn.close()
        self.sock.close()


def test_lost_connection_mid_pipeline_resends_the_unanswered_rows(server):
    fake = _DroppingServer(answer=100)
    bodies = [f"r{i}" for i in range(1000)]
    s = _put({"body": bodies}, f"{fake.address},{server.address}", tube="lost", retries="0")
    assert s["put"] == 1000 and s["hosts"] == {fake.address: 100, server.address: 900}
    got = _bodies(server, "lost")
    acked = set(bodies[0:200:2])                   # round-robin: the fake got rows 0, 2, 4, ...
    assert sorted(got) == sorted(b.encode() for b in bodies if b not in acked)   # the rest, once each


def test_a_broker_that_refuses_every_put_fails_the_task_after_the_bound(server_factory):
    """A broker that accepts connections but answers OUT_OF_MEMORY to every put (at --max-jobs, or a
    full disk): each round reconnected, and a connection ended the outage, so brokerRetrySeconds never
    ran out and the task retried for ever. Only a put answered ends an outage now."""
    proc = server_factory("ours", extra_args=["--max-jobs", "10"])
    started = time.monotonic()
    with pytest.raises(BeanstalkUnavailableError, match="brokerRetrySeconds=1"):
        _put({"body": [f"r{i}" for i in range(20)]}, proc.address, tube="full", retries="2",
             brokerRetrySeconds="1")
    assert time.monotonic() - started < 15
    assert len(_bodies(proc, "full")) == 10


def test_rows_wait_for_a_broker_before_they_are_checked_against_its_size(server_factory, tmp_path):
    """No broker answering when a partition starts (a restart): the rows were checked against
    beanstalkd's default max-job-size (65,535) instead of the broker's, and a valid 100 KB row was
    refused (or, with deadLetterPath, dead-lettered: gone from the tube). They wait for the broker now."""
    proc = server_factory("ours", extra_args=["-b", str(tmp_path), "-z", "200000"])
    restarted = _restart_later(proc, 1.0)
    try:
        summary = _put({"body": ["x" * 100_000, "small"]}, proc.address, tube="big", retryInterval="0.1")
    finally:
        restarted.join(30)
    assert summary["put"] == 2 and summary["reconnect_rounds"] >= 1
    assert sorted(len(b) for b in _bodies(proc, "big")) == [5, 100_000]


def test_hashed_rows_go_back_to_their_own_broker_after_a_wait():
    """keyColumn: rows without an answer are re-sent after every broker was down. Their own broker
    is up again then, yet they went to the next one: one key on two brokers, out of order."""
    from spark_beanstalk.writer import PartitionWriter

    o = WriterOptions.parse({"hosts": "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "keyColumn": "k"})
    writer = PartitionWriter(ColumnSpec.from_schema(SCHEMA, o), o, {"partition": 0})
    pending: dict[int, list] = {}
    writer._reassign([(0, "t", b"put", 0, None), (1, "t", b"put", 1, None)], pending)  # own brokers 0 and 1
    assert {h: [e[3] for e in rows] for h, rows in pending.items()} == {0: [0], 1: [1]}, "every broker counts as up"
    writer.pool.down[0] = "lost"                      # broker 0 gone (the others up): its key moves on
    pending = {}
    writer._reassign([(0, "t", b"put", 0, None)], pending)
    assert list(pending) == [1]


def test_a_batch_marker_waits_through_a_draining_broker(server_factory, tmp_path):
    """A broker answering DRAINING (drain mode before a restart, a leader handing over) refuses only
    for now: the marker gave up at the first refusal, and a replay of the batch put it again. It
    waits as the rows do now, and is written once the broker is back."""
    import os

    proc = server_factory("ours", extra_args=["-b", str(tmp_path)])
    os.kill(proc.pid, signal.SIGUSR1)                          # drain mode: puts answer DRAINING
    with Connection(proc.host, proc.port) as c:
        wait_until(lambda: c.stats().get("draining") in ("true", True), 10, what="drain mode")
    o = WriterOptions.parse({"hosts": proc.address, "retryInterval": "0.1", "brokerRetrySeconds": "30"})
    ns = marker_namespace("drain-query", o, explicit=False)
    watch = Connection(proc.host, proc.port)

    def restart_once_refused() -> None:
        wait_until(lambda: int(watch.stats()["cmd-put"]) >= 1, 30, what="the marker refused")
        watch.close()
        proc.restart()

    restart = threading.Thread(target=restart_once_refused, daemon=True)
    restart.start()
    try:
        assert write_marker(o, ns, 3, {"put": 1}) == 1
    finally:
        restart.join(30)
    assert marker_exists(o, ns, 3) == proc.address


class _AnswersThenCloses(_StandIn):
    """A broker stand-in: on its first connection it reads `answer` puts, sends their INSERTED replies
    at once and closes with puts still unread (a reset), as a broker handing off on SIGTERM does; later
    connections answer every put. Counts the puts it took."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.taken = 0
        super().__init__()

    def _run(self) -> None:
        first = True
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while b"\r\n" not in buf:          # stats (the writer asks for max-job-size)
                    buf += conn.recv(100)
                buf = buf[buf.index(b"\r\n") + 2:]
                stats = b"---\nmax-job-size: 65535\n"
                conn.sendall(b"OK %d\r\n%s\r\n" % (len(stats), stats))
                held: list[bytes] = []
                while not first or len(held) < self.answer:
                    while buf.count(b"\r\n") < 2:
                        data = conn.recv(1 if first else 65536)  # leave the rest unread in the kernel
                        if not data:
                            break
                        buf += data
                    if buf.count(b"\r\n") < 2:
                        break
                    end = buf.index(b"\r\n", buf.index(b"\r\n") + 2) + 2
                    buf = buf[end:]                  # one put: header and body
                    self.taken += 1
                    reply = b"INSERTED %d\r\n" % self.taken
                    if first:
                        held.append(reply)
                    else:
                        conn.sendall(reply)
                if first:
                    conn.sendall(b"".join(held))     # the replies go out, then the close (unread input: RST)
                    first = False


def test_replies_that_arrived_before_a_failed_send_count():
    """The broker answers what it read and closes with puts unread. The writer's next send then fails;
    it kept only the replies it had parsed, so puts whose INSERTED had already arrived were sent again
    (16 duplicates of 200, every run). It reads what arrived before giving the connection up now."""
    fake = _AnswersThenCloses(48)
    try:
        summary = _put({"body": [f"r{i}" for i in range(200)]}, fake.address, tube="default", window="64")
        assert summary["put"] == 200
        assert fake.taken == 200, f"{fake.taken - 200} rows put twice"
    finally:
        fake.close()


def test_batch_markers(server):
    o = WriterOptions.parse({"hosts": server.address, "markerRetain": "2"})
    ns = marker_namespace("8d2f-query", o, explicit=False)
    assert marker_exists(o, ns, 5) is None
    assert write_marker(o, ns, 5, {"put": 3}) == 1
    assert marker_exists(o, ns, 5) == server.address
    write_marker(o, ns, 6, {"put": 3})
    write_marker(o, ns, 7, {"put": 3})
    assert marker_exists(o, ns, 7) == server.address and marker_exists(o, ns, 8) is None
    # below the last completed batch: not a replay (a query re-runs only its last batch) but a new
    # checkpoint reusing the writer id, whose batch ids start again at 0; skipping them lost their rows
    assert marker_exists(o, ns, 6) is None and marker_exists(o, ns, 0) is None
    with Connection(server.host, server.port) as c:        # one tube, one job: the last completed batch
        assert [t for t in c.list_tubes() if t.startswith("sbw.")] == [marker_tube(ns)]
        assert c.stats_tube(marker_tube(ns))["current-jobs-delayed"] == 1
    assert marker_namespace("a b", o, explicit=True) != "a b"       # unusable chars -> digest


def _restart_later(proc, seconds: float) -> threading.Thread:
    """SIGKILL the broker now and start it again (same port, same binlog) after `seconds`."""
    proc.kill()

    def restart() -> None:
        time.sleep(seconds)
        proc.restart()

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("kind", ["ours", "beanstalkd"])
def test_batch_markers_wait_for_a_restarting_broker(server_factory, tmp_path, kind):
    """With the broker down (a restart) the completion check and the markers (the batch's and a partition's)
    wait for it, as the rows do: "not completed" would put a completed batch again, and a marker not written
    lets a replay do the same."""
    proc = server_factory(kind, extra_args=["-b", str(tmp_path)])
    o = WriterOptions.parse({"hosts": proc.address, "retryInterval": "0.1", "brokerRetrySeconds": "30"})
    ns = marker_namespace("9c1e-query", o, explicit=False)
    assert write_marker(o, ns, 4, {"put": 3}) == 1

    restarted = _restart_later(proc, 1.5)
    try:
        assert marker_exists(o, ns, 4) == proc.address      # asked again until the broker was back
    finally:
        restarted.join(30)                                  # (never a restart after the test's teardown)

    restarted = _restart_later(proc, 1.5)
    try:
        assert write_marker(o, ns, 5, {"put": 3}) == 1      # written once the broker was back
    finally:
        restarted.join(30)
    assert marker_exists(o, ns, 5) == proc.address
    with Connection(proc.host, proc.port) as c:
        assert c.stats_tube(marker_tube(ns))["current-jobs-delayed"] == 1

    mark = PartitionMark(ns, 6, 1)
    restarted = _restart_later(proc, 1.5)
    try:
        recorded = mark.record(o, "3:ab:cd", 3)
    finally:
        restarted.join(30)
    assert mark.already_put(o, "3:ab:cd") == proc.address    # recorded once the broker was back
    assert recorded == 1

    proc.kill()                                              # down for good: all give up after the bound
    short = WriterOptions.parse({"hosts": proc.address, "retries": "1", "retryInterval": "0.05",
                                 "brokerRetrySeconds": "0.3"})
    started = time.monotonic()
    assert marker_exists(short, ns, 5) is None and write_marker(short, ns, 6, {"put": 1}) == 0
    assert PartitionMark(ns, 7, 0).record(short, "1:0:0", 1) == 0
    assert time.monotonic() - started < 10


class _RefusingServer(_StandIn):
    """Answers like beanstalkd to a put it refuses with BAD_FORMAT: the body line then reads as a
    command (UNKNOWN_COMMAND), so the replies run one ahead of the client's commands."""

    def __init__(self, refuse_body: bytes) -> None:
        self.refuse_body = refuse_body
        self.bodies: list[bytes] = []
        self.connections = 0
        super().__init__()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        buf = b""
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            buf += data
            out = []
            while b"\r\n" in buf:
                line, _, rest = buf.partition(b"\r\n")
                if line == b"stats":
                    body = b"---\nmax-job-size: 65535\n"
                    out.append(b"OK %d\r\n%s\r\n" % (len(body), body))
                elif line.startswith(b"use "):
                    out.append(b"USING " + line[4:] + b"\r\n")
                elif line.startswith(b"put "):
                    size = int(line.split()[-1])
                    if len(rest) < size + 2:
                        break
                    body = rest[:size]
                    if body == self.refuse_body and self.connections == 1:
                        out.append(b"BAD_FORMAT\r\n")
                        buf = rest                      # the body line is parsed as a command next
                        continue
                    self.bodies.append(body)
                    out.append(b"INSERTED %d\r\n" % len(self.bodies))
                    rest = rest[size + 2:]
                else:
                    out.append(b"UNKNOWN_COMMAND\r\n")
                buf = rest
            try:
                conn.sendall(b"".join(out))
            except OSError:
                return


def test_refused_put_that_desynchronises_replies_is_named_and_the_rest_resent():
    fake = _RefusingServer(b"r2")
    try:
        with pytest.raises(BeanstalkWriteError) as info:
            _put({"body": [f"r{i}" for i in range(50)]}, fake.address, tube="x")
        msg = str(info.value)
        assert "row 2 of partition 0" in msg and "answered BAD_FORMAT" in msg
        assert "the other 49 row(s) of this partition were put" in msg
        assert fake.connections == 2                    # a fresh connection for the rows after it
        assert b"r2" not in fake.bodies and set(fake.bodies) == {f"r{i}".encode() for i in range(50) if i != 2}
    finally:
        fake.close()
