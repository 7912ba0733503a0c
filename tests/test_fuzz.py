"""Fuzz a LIVE broker process with random and mutated protocol bytes over several
connections, then check on a fresh connection that it still works: a put/reserve/delete
round trip, stats still parseable, current-connections back to what it should be.

Every reply the fuzzed connections get must also be a well-formed beanstalkd reply (a
known status word, bodies of the announced length), never INTERNAL_ERROR, and a
half-closed connection must be answered and closed by the server.
"""
from __future__ import annotations

import contextlib
import itertools
import socket
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_beanstalk.client import Connection, parse_yaml
from tests.helpers import start_server, wait_until

KNOWN_STATUSES = {
    b"INSERTED", b"BURIED", b"RESERVED", b"FOUND", b"OK", b"USING", b"WATCHING", b"DELETED",
    b"RELEASED", b"TOUCHED", b"KICKED", b"PAUSED", b"NOT_FOUND", b"NOT_IGNORED", b"TIMED_OUT",
    b"DEADLINE_SOON", b"BAD_FORMAT", b"UNKNOWN_COMMAND", b"EXPECTED_CRLF", b"JOB_TOO_BIG",
    b"DRAINING", b"OUT_OF_MEMORY",
}
BODY_STATUSES = {b"RESERVED", b"FOUND", b"OK"}
STATS_KEYS = ("current-jobs-ready", "cmd-put", "total-jobs", "current-connections", "pid", "uptime",
              "max-job-size", "draining", "binlog-max-size")

_tube_counter = itertools.count()


@pytest.fixture(scope="module")
def live_broker():
    proc = start_server("ours")
    yield proc
    proc.stop()


# ---------------------------------------------------------------------------------------
# What gets thrown at the server
# ---------------------------------------------------------------------------------------
NUMBERS = st.sampled_from([
    b"0", b"1", b"5", b"-1", b"+1", b"4294967295", b"4294967296", b"18446744073709551615",
    b"18446744073709551616", b"99999999999999999999999999", b"00000000001", b"1x", b"", b" 1", b"0x10",
])
NAMES = st.sampled_from([
    b"default", b"fz", b"fz-b", b"-bad", b"a" * 200, b"a" * 201, b"x*y", b"", b"t(1);$/+._", b"f z",
])
BODIES = st.binary(max_size=40)


@st.composite
def valid_command(draw) -> bytes:
    """One well-formed command (with its body for put), except that it never blocks for long."""
    kind = draw(st.sampled_from([
        "put", "put", "reserve0", "reserve-job", "delete", "release", "bury", "touch", "kick", "kick-job",
        "peek", "peek-ready", "peek-delayed", "peek-buried", "stats", "stats-job", "stats-tube",
        "list-tubes", "list-tube-used", "list-tubes-watched", "use", "watch", "ignore", "pause-tube", "quit",
    ]))
    n = lambda: draw(st.integers(min_value=0, max_value=40))  # noqa: E731
    if kind == "put":
        body = draw(BODIES)
        pri, delay, ttr = n(), draw(st.sampled_from([0, 0, 0, 1, 100])), draw(st.sampled_from([0, 1, 60]))
        return b"put %d %d %d %d\r\n%s\r\n" % (pri, delay, ttr, len(body), body)
    if kind == "reserve0":
        return b"reserve-with-timeout 0\r\n"
    if kind in ("delete", "touch", "kick-job", "peek", "stats-job", "reserve-job"):
        return b"%s %d\r\n" % (kind.encode(), n())
    if kind == "release":
        return b"release %d %d %d\r\n" % (n(), n(), draw(st.sampled_from([0, 1, 100])))
    if kind == "bury":
        return b"bury %d %d\r\n" % (n(), n())
    if kind == "kick":
        return b"kick %d\r\n" % n()
    if kind in ("use", "watch", "ignore", "stats-tube"):
        return b"%s %s\r\n" % (kind.encode(), draw(st.sampled_from([b"default", b"fz", b"fz-b", b"fz-c"])))
    if kind == "pause-tube":
        return b"pause-tube %s %d\r\n" % (draw(st.sampled_from([b"fz", b"fz-b"])), draw(st.sampled_from([0, 1])))
    return kind.encode() + b"\r\n"


@st.composite
def mutated_command(draw) -> bytes:
    data = bytearray(draw(valid_command()))
    how = draw(st.sampled_from([
        "none", "flip", "truncate", "drop-crlf", "lone-cr", "lone-lf", "insert", "number", "name",
        "nul", "dup", "long", "garbage-args",
    ]))
    if not data:
        return bytes(data)
    pos = draw(st.integers(min_value=0, max_value=len(data) - 1))
    if how == "flip":
        data[pos] ^= draw(st.integers(min_value=1, max_value=255))
    elif how == "truncate":
        del data[pos:]
    elif how == "drop-crlf":
        data = data.replace(b"\r\n", b"", 1)
    elif how == "lone-cr":
        data = data.replace(b"\r\n", b"\r", 1)
    elif how == "lone-lf":
        data = data.replace(b"\r\n", b"\n", 1)
    elif how == "insert":
        data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    elif how == "number":
        words = bytes(data).split(b" ")
        if len(words) > 1:
            i = draw(st.integers(min_value=1, max_value=len(words) - 1))
            tail = b"\r\n" if words[i].endswith(b"\r\n") else b""
            words[i] = draw(NUMBERS) + tail
            data = bytearray(b" ".join(words))
    elif how == "name":
        first = bytes(data).split(b" ")[0]
        data = bytearray(first + b" " + draw(NAMES) + b"\r\n")
    elif how == "nul":
        data[pos:pos] = b"\x00"
    elif how == "dup":
        data = bytearray(bytes(data) * 2)
    elif how == "long":
        data[pos:pos] = b"9" * draw(st.integers(min_value=200, max_value=600))
    elif how == "garbage-args":
        data = data.replace(b"\r\n", b" " + draw(st.binary(max_size=10)) + b"\r\n", 1)
    return bytes(data)


CHUNK = st.one_of(
    mutated_command(),
    mutated_command(),
    mutated_command(),
    st.binary(min_size=1, max_size=300),  # pure random bytes
    st.sampled_from([b"\r\n", b"\r", b"\n", b"\x00", b"\xff" * 10]),
)

SCRIPT = st.lists(
    st.tuples(st.integers(min_value=0, max_value=2), CHUNK),  # (connection index, bytes)
    min_size=1, max_size=25,
)
ENDINGS = st.lists(st.sampled_from(["halfclose", "halfclose", "reset", "close"]), min_size=3, max_size=3)


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------
def parse_replies(data: bytes) -> list[bytes]:
    """Split the server's bytes into replies; assert each one is well-formed."""
    statuses = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n", pos)
        assert end >= 0, f"reply without CRLF: {data[pos:pos + 80]!r}"
        words = data[pos:end].split(b" ")
        status = words[0]
        assert status in KNOWN_STATUSES, f"unknown or internal-error reply {data[pos:end][:80]!r}"
        pos = end + 2
        if status in BODY_STATUSES:
            assert words[-1].isdigit(), f"body reply without a byte count: {data[pos - 80:pos]!r}"
            size = int(words[-1])
            assert data[pos + size:pos + size + 2] == b"\r\n", f"body of {status!r} not {size} bytes + CRLF"
            pos += size + 2
        statuses.append(status)
    return statuses


def read_to_eof(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    deadline = time.monotonic() + timeout
    out = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return out, False
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return out, False
        except ConnectionResetError:
            return out, True
        if not chunk:
            return out, True
        out += chunk


def assert_healthy(proc) -> None:
    """A fresh connection gets correct answers and no fuzz connection is left counted."""
    assert proc.proc.poll() is None, f"broker process died (exit code {proc.proc.returncode})"
    tube = f"fuzz-check-{next(_tube_counter)}"
    with Connection(proc.host, proc.port, timeout=5) as c:
        c.use(tube)
        c.watch(tube)
        assert c.call("ignore default").status == b"WATCHING"
        job_id = c.put(b"health \x00\r\n check", priority=0, ttr=60)
        r = c.call("reserve-with-timeout 0")
        assert (r.status, r.int_arg(0), r.body) == (b"RESERVED", job_id, b"health \x00\r\n check")
        assert c.call(f"delete {job_id}").status == b"DELETED"
        assert c.call(f"peek {job_id}").status == b"NOT_FOUND"

        def stats():
            reply = c.call("stats")
            assert reply.status == b"OK" and int(reply.args[0]) == len(reply.body)
            parsed = parse_yaml(reply.body)
            assert isinstance(parsed, dict)
            for key in STATS_KEYS:
                assert key in parsed, f"stats lost key {key}"
            return parsed

        final = wait_until(lambda: (s := stats())["current-connections"] == 1 and s, 5.0, "fuzz connections to close")
        assert final, f"fuzz connections still counted: {stats()['current-connections']}"
        assert final["current-waiting"] == 0


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(script=SCRIPT, endings=ENDINGS, split=st.booleans())
def test_fuzzed_traffic_leaves_broker_healthy(live_broker, script, endings, split):
    conns = []
    try:
        for _ in range(3):
            s = socket.create_connection((live_broker.host, live_broker.port), timeout=5)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conns.append(s)
        alive = [True, True, True]
        for index, chunk in script:
            if not alive[index]:
                continue
            pieces = [chunk[:len(chunk) // 2], chunk[len(chunk) // 2:]] if split else [chunk]
            for piece in pieces:
                try:
                    conns[index].sendall(piece)
                except OSError:  # the server may legitimately have closed it (quit)
                    alive[index] = False
                    break
        for s, ending in zip(conns, endings, strict=True):
            if ending == "reset":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            elif ending == "close":
                s.close()
            else:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_WR)
                data, eof = read_to_eof(s, 5.0)
                assert eof, f"server did not close a half-closed connection; got {data[-200:]!r}"
                parse_replies(data)
                s.close()
    finally:
        for s in conns:
            s.close()
    assert_healthy(live_broker)


@pytest.mark.timeout(60)
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage=st.lists(st.binary(min_size=1, max_size=2000), min_size=1, max_size=5))
def test_random_binary_then_valid_command(live_broker, garbage):
    """After any garbage, a connection that then sends CRLF and a long run of CRLFs... is
    still answered by a server that stays healthy; a new connection works normally."""
    with socket.create_connection((live_broker.host, live_broker.port), timeout=5) as s:
        for g in garbage:
            try:
                s.sendall(g)
            except OSError:
                break
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_WR)
        data, eof = read_to_eof(s, 5.0)
        assert eof
        parse_replies(data)
    assert_healthy(live_broker)


@pytest.mark.timeout(60)
def test_many_short_lived_connections(live_broker):
    """Connections opened and dropped in every way leave no trace in current-connections."""
    for i in range(60):
        s = socket.create_connection((live_broker.host, live_broker.port), timeout=5)
        if i % 3 == 0:
            s.sendall(b"reserve-with-timeout 30\r\n")
        elif i % 3 == 1:
            s.sendall(b"put 0 0 10 100\r\npartial")
        if i % 2:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    assert_healthy(live_broker)
