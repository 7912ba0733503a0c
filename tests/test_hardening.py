"""Broker hardening (issue 7) on real broker processes: every limit and refusal.

Each test starts its own ``python -m broker`` child (stderr captured to a file), talks
to it over real sockets, and -- for every misbehaviour -- checks that a well-behaved
client on another connection still completes put/reserve/delete while it goes on.
No mocks; waiting is done by polling with deadlines, never by fixed sleeps (the only
``time.sleep`` calls are the poll interval and the measurement window of the EMFILE
spin check).

Covered: --max-connections, --max-jobs, --max-job-bytes, --max-tubes,
--max-reserved-per-connection, EMFILE (broker started with a low RLIMIT_NOFILE),
a client that never reads its replies (default 16 MiB output cap and
--max-output-bytes), a slow but honest reader, half-sent bodies and never-finished
command lines, --idle-timeout, TLS (main listener, second listener, required client
certificates), --auth-token-file, the extra `stats` keys, the --metrics endpoint,
the conf/broker.toml keys, and that refusals are logged with the client's address.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import inspect
import logging
import os
import resource
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.security import TlsConfig
from broker.server import BrokerServer, ServerConfig
from spark_beanstalk.client import Connection
from spark_beanstalk.embedded import beanstalkd_binary, beanstalkd_process, wait_for_port
from tests.helpers import (
    ServerProcess,
    broker_process,
    cpu_seconds,
    free_port,
    sample,
    scrape,
    wait_until,
    wait_until_async,
)

pytestmark = [pytest.mark.timeout(60)]

NEW_STATS_KEYS = [
    "current-job-bytes", "limit-refused-connections", "limit-refused-jobs", "limit-refused-job-bytes",
    "limit-refused-tubes", "limit-refused-reserves", "closed-slow-readers", "closed-idle", "auth-failures",
    "accept-errors",
]
REFUSAL_REASONS = ["connections", "jobs", "job_bytes", "tubes", "reserves", "slow_reader", "idle", "auth"]
BIG = 65535  # default max job size


# ----------------------------------------------------------------------------------------
# process and socket helpers
# ----------------------------------------------------------------------------------------
Proc = ServerProcess  # the shared one: preexec, log() and the port retry included


@pytest.fixture
def start_broker(tmp_path):
    """start_broker(*args, preexec=None) -> a running Proc; stopped (and checked alive) after the test."""
    started: list[Proc] = []

    def start(*args: str, preexec=None, port: int | None = None) -> Proc:
        proc = broker_process(port, extra_args=args, stderr_path=str(tmp_path / f"broker{len(started)}.log"),
                              preexec=preexec)
        started.append(proc)
        try:
            proc.start()
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\nbroker argv: {proc.argv}\nbroker log:\n{proc.log()[-3000:]}") from None
        return proc

    yield start
    crashed = []
    for proc in started:
        if proc.proc is not None and proc.proc.poll() is not None:
            crashed.append(f"broker {proc.argv[5:]} exited early with {proc.proc.returncode}:\n{proc.log()[-2000:]}")
        proc.stop()
    assert not crashed, "\n".join(crashed)


# a connection may fail while the broker settles: those errors mean "not yet"
poll = functools.partial(wait_until, interval=0.02, retry_on=(AssertionError, OSError, EOFError))


class Raw:
    """A blocking beanstalk client on a raw socket (optionally TLS), for precise misbehaviour."""

    def __init__(self, host: str, port: int, timeout: float = 5.0, rcvbuf: int | None = None,
                 tls: ssl.SSLContext | None = None, token: str | None = None, connect_only: bool = False) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        sock.connect((host, port))
        if tls is not None and not connect_only:
            sock = tls.wrap_socket(sock, server_hostname="localhost")
        self.sock = sock
        self.buf = b""
        self.port = port
        if token is not None:
            assert self.cmd(f"auth {token}") == b"OK", "auth with the right token failed"

    @property
    def local_port(self) -> int:
        return self.sock.getsockname()[1]

    def send(self, data: bytes | str) -> None:
        self.sock.sendall(data.encode() if isinstance(data, str) else data)

    def _fill(self) -> None:
        chunk = self.sock.recv(262144)
        if not chunk:
            raise EOFError("server closed the connection")
        self.buf += chunk

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def reply(self) -> tuple[bytes, bytes | None]:
        line = self.line()
        words = line.split()
        if words and words[0] in (b"OK", b"RESERVED", b"FOUND") and len(words) > 1:
            body = self.exact(int(words[-1]) + 2)
            assert body.endswith(b"\r\n"), body[-10:]
            return line, body[:-2]
        return line, None

    def cmd(self, line: bytes | str, body: bytes | None = None) -> bytes:
        """Send one command (and body), return the reply line (the body, if any, is in .last_body)."""
        data = line.encode() if isinstance(line, str) else line
        self.send(data + b"\r\n" + (body + b"\r\n" if body is not None else b""))
        reply, self.last_body = self.reply()
        return reply

    def put(self, body: bytes, pri: int = 100, delay: int = 0, ttr: int = 60) -> int:
        reply = self.cmd(f"put {pri} {delay} {ttr} {len(body)}", body)
        assert reply.startswith(b"INSERTED "), reply
        return int(reply.split()[1])

    def stats(self) -> dict[str, str]:
        return dict(self.stats_items())

    def stats_items(self, command: str = "stats") -> list[tuple[str, str]]:
        reply = self.cmd(command)
        assert reply.startswith(b"OK "), reply
        items = []
        for ln in self.last_body.decode().splitlines()[1:]:
            key, _, value = ln.partition(": ")
            items.append((key, value.strip().strip('"')))
        return items

    def closed_by_server(self, timeout: float) -> bool:
        """True if the server closes (EOF or reset) within timeout; bytes received meanwhile are dropped."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.sock.settimeout(left)
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    return True
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
            return True
        except OSError as exc:
            return exc.errno in (errno.ECONNRESET, errno.EPIPE)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Clients:
    """Opens Raw clients to one broker with its TLS/auth settings; closes them all at the end."""

    def __init__(self, proc: ServerProcess, port: int | None = None, tls: ssl.SSLContext | None = None,
                 token: str | None = None) -> None:
        self.proc = proc
        self.port = port or proc.port
        self.tls = tls
        self.token = token
        self.opened: list[Raw] = []

    def open(self, **kw) -> Raw:
        kw.setdefault("tls", self.tls)
        kw.setdefault("token", self.token)
        raw = Raw(self.proc.host, kw.pop("port", self.port), **kw)
        self.opened.append(raw)
        return raw

    def stats(self) -> dict[str, str]:
        raw = self.open()
        try:
            return raw.stats()
        finally:
            raw.close()

    def stat(self, key: str) -> int:
        return int(self.stats()[key])

    def well_behaved(self, tag: str = "wb", limit: float = 5.0, tube: str | None = None) -> None:
        """A well-behaved client on a fresh connection completes put/reserve/delete, quickly."""
        t0 = time.monotonic()
        raw = self.open()
        try:
            tube = tube or f"{tag}-{os.getpid()}-{raw.local_port}"
            assert raw.cmd(f"use {tube}") == f"USING {tube}".encode()
            assert raw.cmd(f"watch {tube}") == b"WATCHING 2"
            assert raw.cmd("ignore default") == b"WATCHING 1"
            body = f"well-behaved {tag}".encode()
            job = raw.put(body)
            reply = raw.cmd("reserve-with-timeout 5")
            assert reply == f"RESERVED {job} {len(body)}".encode() and raw.last_body == body, reply
            assert raw.cmd(f"delete {job}") == b"DELETED"
        finally:
            raw.close()
        elapsed = time.monotonic() - t0
        assert elapsed < limit, f"well-behaved put/reserve/delete took {elapsed:.2f}s"

    def close_all(self) -> None:
        for raw in self.opened:
            raw.close()


@pytest.fixture
def clients():
    made: list[Clients] = []

    def make(proc, **kw) -> Clients:
        c = Clients(proc, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close_all()


def wait_connections(c: Clients, n: int, timeout: float = 5.0) -> None:
    """Wait until `stats` (from one extra connection) shows n + 1 current connections."""
    poll(lambda: c.stat("current-connections") == n + 1, timeout, f"current-connections == {n + 1}")


def proc_status_kb(pid: int, key: str) -> int:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith(key + ":"):
            return int(ln.split()[1])
    raise KeyError(key)


def runnable_ns(pid: int) -> int:
    """Time on CPU plus time waiting for a CPU, over all threads (schedstat): a spinning process
    accumulates about 1 s per wall second even on a machine shared with other work."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            run, wait, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (FileNotFoundError, ValueError):
            continue
        total += int(run) + int(wait)
    return total


def has_flag(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "broker", "--help"], capture_output=True, text=True, timeout=30)
    return flag in out.stdout


# ----------------------------------------------------------------------------------------
# TLS material
# ----------------------------------------------------------------------------------------
def client_ctx(certs: Path, client: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if client:
        ctx.load_cert_chain(str(certs / f"{client}.crt"), str(certs / f"{client}.key"))
    return ctx


# ----------------------------------------------------------------------------------------
# stats keys and defaults
# ----------------------------------------------------------------------------------------
@pytest.mark.skipif(beanstalkd_binary() is None, reason="beanstalkd not installed")
def test_stats_keys_follow_beanstalkds_and_count_job_bytes(start_broker, clients):
    with beanstalkd_process() as bd:
        raw = Raw(bd.host, bd.port)
        bd_keys = [k for k, _ in raw.stats_items()]
        raw.close()
    assert bd_keys[-1] == "platform"
    stock = start_broker()  # no flag at all: byte-for-byte beanstalkd's key list (stock behaviour unchanged)
    raw = clients(stock).open()
    assert [k for k, _ in raw.stats_items()] == bd_keys
    assert raw.cmd("auth secret") == b"UNKNOWN_COMMAND"
    proc = start_broker("--extended-stats")
    c = clients(proc)
    raw = c.open()
    items = raw.stats_items()
    keys = [k for k, _ in items]
    assert keys[:len(bd_keys)] == bd_keys, "beanstalkd's own keys first, in its order"
    assert keys[len(bd_keys):] == NEW_STATS_KEYS
    assert all(int(v) == 0 for k, v in items if k in NEW_STATS_KEYS), items[-10:]
    a = raw.put(b"x" * 10)
    raw.put(b"y" * 5)
    raw.put(b"")
    assert int(raw.stats()["current-job-bytes"]) == 15
    assert raw.cmd(f"delete {a}") == b"DELETED"
    assert int(raw.stats()["current-job-bytes"]) == 5
    # stock behaviour with every limit off: auth is an unknown command, many tubes and jobs are fine
    assert raw.cmd("auth secret") == b"UNKNOWN_COMMAND"
    for i in range(300):
        assert raw.cmd(f"use t{i}") == f"USING t{i}".encode()
        raw.put(b"z" * 200)
    assert int(raw.stats()["current-jobs-ready"]) == 302
    assert all(int(raw.stats()[k]) == 0 for k in NEW_STATS_KEYS[1:])


@pytest.mark.skipif(beanstalkd_binary() is None, reason="beanstalkd not installed")
def test_auth_is_unknown_command_in_beanstalkd_too():
    with beanstalkd_process() as bd:
        raw = Raw(bd.host, bd.port)
        assert raw.cmd("auth secret") == b"UNKNOWN_COMMAND"
        raw.close()


# ----------------------------------------------------------------------------------------
# limits
# ----------------------------------------------------------------------------------------
def test_max_connections(start_broker, clients):
    proc = start_broker("--max-connections", "4")
    c = clients(proc)
    wait_connections(c, 0)
    held = [c.open() for _ in range(3)]
    wait_connections(c, 3)  # the stats connection is the 4th
    for raw in held:
        assert raw.cmd("list-tube-used") == b"USING default"
    # fourth held connection (the stats connection may still be closing: retry until accepted)
    hog = poll(lambda: (h := c.open()) and h.cmd("list-tube-used") == b"USING default" and h, 5,
               "a fourth connection is accepted")
    refused = c.open()
    refused_port = refused.local_port
    with contextlib.suppress(OSError):
        refused.send(b"list-tube-used\r\n")
    assert refused.closed_by_server(5), "a connection beyond --max-connections must be closed at once"
    assert refused.buf == b"", f"nothing may be sent to a refused connection, got {refused.buf!r}"
    # existing connections keep working: a full put/reserve/delete on one of them
    raw = held[0]
    assert raw.cmd("use mc") == b"USING mc" and raw.cmd("watch mc") == b"WATCHING 2"
    job = raw.put(b"still here")
    assert raw.cmd("reserve-with-timeout 2").startswith(f"RESERVED {job} ".encode())
    assert raw.cmd(f"delete {job}") == b"DELETED"
    # free one slot: new connections are accepted again, and the refusal was counted
    hog.close()
    st = poll(lambda: (s := c.stats()) and s, 5, "a connection is accepted after one closed")
    assert int(st["limit-refused-connections"]) >= 1
    c.well_behaved("after-max-conn")
    assert str(refused_port) in proc.log(), "the refusal is logged with the client's address"


def test_max_jobs(start_broker, clients):
    proc = start_broker("--max-jobs", "5")
    c = clients(proc)
    raw = c.open()
    assert raw.cmd("use mj") == b"USING mj" and raw.cmd("watch mj") == b"WATCHING 2"
    ids = [raw.put(f"job{i}".encode()) for i in range(3)]
    ids.append(raw.put(b"delayed", delay=3600))
    ids.append(raw.put(b"to-bury"))
    # held in every state counts: reserve one, bury one (held jobs: 5)
    assert raw.cmd("reserve-with-timeout 0").startswith(f"RESERVED {ids[0]} ".encode())
    assert raw.cmd(f"bury {ids[0]} 1") == b"BURIED"
    assert raw.cmd("reserve-with-timeout 0").startswith(f"RESERVED {ids[1]} ".encode())
    # pipelined: the refused put's body is consumed and the next command still parses
    raw.send(b"put 1 0 60 5\r\nhello\r\nlist-tube-used\r\n")
    assert raw.reply() == (b"OUT_OF_MEMORY", None)
    assert raw.line() == b"USING mj"
    # nothing held was lost
    st = raw.stats()
    assert (int(st["current-jobs-ready"]), int(st["current-jobs-reserved"]), int(st["current-jobs-buried"]),
            int(st["current-jobs-delayed"])) == (2, 1, 1, 1)
    for i in ids:
        assert raw.cmd(f"peek {i}").startswith(f"FOUND {i} ".encode())
    assert int(st["limit-refused-jobs"]) == 1
    # other connections are refused too, but everything else works
    other = c.open()
    assert other.cmd("put 1 0 60 2", b"no") == b"OUT_OF_MEMORY"
    assert other.cmd(f"delete {ids[2]}") == b"DELETED"
    c.well_behaved("after-max-jobs")  # one slot free again: put/reserve/delete works
    assert int(c.stats()["limit-refused-jobs"]) == 2


def test_max_job_bytes(start_broker, clients):
    proc = start_broker("--max-job-bytes", "1000")
    c = clients(proc)
    raw = c.open()
    a = raw.put(b"a" * 600)
    assert raw.cmd("put 1 0 60 401", b"b" * 401) == b"OUT_OF_MEMORY"  # 1001 would exceed
    b = raw.put(b"c" * 400)  # exactly 1000 does not exceed
    assert raw.cmd("put 1 0 60 1", b"d") == b"OUT_OF_MEMORY"
    st = raw.stats()
    assert int(st["current-job-bytes"]) == 1000
    assert int(st["limit-refused-job-bytes"]) == 2
    assert int(st["current-jobs-ready"]) == 2
    assert raw.cmd(f"peek {a}") == b"FOUND %d 600" % a and raw.last_body == b"a" * 600
    # an empty body still fits (0 bytes); then free bytes by deleting
    raw.put(b"")
    assert raw.cmd(f"delete {a}") == b"DELETED"
    assert int(raw.stats()["current-job-bytes"]) == 400
    c.well_behaved("after-max-job-bytes")
    assert raw.cmd(f"peek {b}").startswith(b"FOUND")


def test_max_tubes(start_broker, clients):
    proc = start_broker("--max-tubes", "3")
    c = clients(proc)
    t1, t2 = c.open(), c.open()
    assert t1.cmd("use alpha") == b"USING alpha"       # tubes: default, alpha
    assert t2.cmd("watch beta") == b"WATCHING 2"       # tubes: default, alpha, beta
    raw = c.open()
    assert raw.cmd("use gamma") == b"OUT_OF_MEMORY"
    assert raw.cmd("watch gamma") == b"OUT_OF_MEMORY"
    assert raw.cmd("list-tube-used") == b"USING default", "a refused use leaves the used tube alone"
    assert raw.cmd("list-tubes-watched") == b"OK 14" and raw.last_body == b"---\n- default\n"
    assert raw.cmd("use alpha") == b"USING alpha", "existing tubes can still be used"
    assert raw.cmd("watch beta") == b"WATCHING 2"
    lt = c.open()
    assert lt.cmd("list-tubes").startswith(b"OK ")
    assert sorted(lt.last_body.decode().split("\n")[1:-1]) == ["- alpha", "- beta", "- default"]
    assert int(c.stats()["limit-refused-tubes"]) == 2
    # a well-behaved client on an existing tube keeps working
    c.well_behaved("tubes", tube="alpha")
    # once a tube goes away, a new one may be created
    assert t1.cmd("use default") == b"USING default"
    assert raw.cmd("use default") == b"USING default"
    poll(lambda: c.open().cmd("use gamma") == b"USING gamma", 5, "use of a new tube once alpha is gone")


def test_max_reserved_per_connection(start_broker, clients):
    proc = start_broker("--max-reserved-per-connection", "2")
    c = clients(proc)
    prod = c.open()
    ids = [prod.put(f"r{i}".encode()) for i in range(5)]
    w = c.open()
    assert w.cmd("reserve-with-timeout 0").startswith(f"RESERVED {ids[0]} ".encode())
    assert w.cmd("reserve").startswith(f"RESERVED {ids[1]} ".encode())
    t0 = time.monotonic()
    assert w.cmd("reserve") == b"OUT_OF_MEMORY", "a third reserve is refused at once, not blocked"
    assert time.monotonic() - t0 < 2
    assert w.cmd("reserve-with-timeout 10") == b"OUT_OF_MEMORY"
    assert w.cmd(f"reserve-job {ids[2]}") == b"OUT_OF_MEMORY"
    assert int(prod.stats()["current-jobs-ready"]) == 3, "refused reserves leave the jobs ready"
    # another connection has its own allowance
    w2 = c.open()
    assert w2.cmd(f"reserve-job {ids[2]}").startswith(f"RESERVED {ids[2]} ".encode())
    # release a slot: the first connection can reserve again
    assert w.cmd(f"delete {ids[0]}") == b"DELETED"
    assert w.cmd("reserve-with-timeout 0").startswith(f"RESERVED {ids[3]} ".encode())
    assert int(prod.stats()["limit-refused-reserves"]) == 3
    c.well_behaved("after-max-reserved")


# ----------------------------------------------------------------------------------------
# EMFILE
# ----------------------------------------------------------------------------------------
NOFILE_LIMIT = 64


def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE_LIMIT, NOFILE_LIMIT))


def test_emfile_does_not_spin_and_recovers(start_broker, clients):
    proc = start_broker("--extended-stats", preexec=_low_nofile)
    c = clients(proc)
    held: list[Raw] = []
    refused = None
    for _ in range(NOFILE_LIMIT + 20):
        raw = c.open(timeout=3)
        try:
            raw.sock.settimeout(1.5)
            raw.send(b"list-tube-used\r\n")
            assert raw.line() == b"USING default"
        except (OSError, EOFError):
            refused = raw
            break
        held.append(raw)
    assert refused is not None, f"all {len(held)} connections accepted despite RLIMIT_NOFILE={NOFILE_LIMIT}"
    assert len(held) >= 10, f"only {len(held)} connections before running out of descriptors"
    # out of descriptors with a connection pending: the broker must not spin
    pending = [c.open(timeout=3, connect_only=True) for _ in range(3)]
    cpu0, run0, t0 = cpu_seconds(proc.pid), runnable_ns(proc.pid), time.monotonic()
    time.sleep(2.0)  # measurement window
    wall = time.monotonic() - t0
    cpu = cpu_seconds(proc.pid) - cpu0
    busy = (runnable_ns(proc.pid) - run0) / 1e9 / wall
    assert proc.proc.poll() is None, "broker died at EMFILE"
    assert busy < 0.35 and cpu < 0.5, f"broker spins at EMFILE: {cpu:.2f}s CPU, runnable {busy:.0%} of {wall:.1f}s"
    # open connections keep being served: a full put/reserve/delete on one of them
    raw = held[0]
    raw.sock.settimeout(5)
    assert raw.cmd("use emfile") == b"USING emfile" and raw.cmd("watch emfile") == b"WATCHING 2"
    job = raw.put(b"served at EMFILE")
    assert raw.cmd("reserve-with-timeout 2").startswith(f"RESERVED {job} ".encode())
    assert raw.cmd(f"delete {job}") == b"DELETED"
    for other in held[1:4]:
        assert other.cmd("list-tube-used") == b"USING default"
    # free descriptors: new connections are accepted again
    refused.close()
    for p in pending:
        p.close()
    for raw in held[-10:]:
        raw.close()
    poll(lambda: c.stats(), 10, "a new connection is accepted once descriptors are free", interval=0.1)
    c.well_behaved("after-emfile")
    assert proc.proc.poll() is None
    st = c.stats()
    assert int(st.get("accept-errors", 0)) >= 1, "EMFILE accept failures are counted in stats accept-errors"


# ----------------------------------------------------------------------------------------
# slow and hostile clients
# ----------------------------------------------------------------------------------------
def _never_reader(c: Clients, proc: Proc, peeks: int) -> dict:
    """A client holding a reservation pipelines `peeks` peeks of a 64 KiB job and never reads.
    Returns what was observed; asserts that a well-behaved client works meanwhile."""
    good = c.open()
    big_id = good.put(b"B" * BIG)
    assert good.cmd("use nr-res") == b"USING nr-res"
    held_id = good.put(b"held by the never-reader")
    bad = c.open(rcvbuf=4096)
    bad_port = bad.local_port
    assert bad.cmd("watch nr-res") == b"WATCHING 2" and bad.cmd("ignore default") == b"WATCHING 1"
    assert bad.cmd("reserve-with-timeout 0").startswith(f"RESERVED {held_id} ".encode())
    rss0 = proc_status_kb(proc.pid, "VmRSS")
    payload = f"peek {big_id}\r\n".encode() * peeks
    bad.sock.setblocking(False)
    sent = 0
    max_rss = rss0
    deadline = time.monotonic() + 20
    send_error = None
    wb_done = False

    def held_released() -> bool:
        st = good.stats_items(f"stats-job {held_id}")
        return dict(st)["state"] == "ready"

    while time.monotonic() < deadline:
        if sent < len(payload):
            try:
                sent += bad.sock.send(payload[sent:sent + 65536])
            except BlockingIOError:
                pass
            except OSError as exc:
                send_error = exc
                sent = len(payload)
        max_rss = max(max_rss, proc_status_kb(proc.pid, "VmRSS"))
        if not wb_done:
            c.well_behaved("never-reader")  # while the never-reader is at it
            wb_done = True
        if held_released():
            break
        time.sleep(0.02)
    released = held_released()
    max_rss = max(max_rss, proc_status_kb(proc.pid, "VmRSS"))
    hwm = proc_status_kb(proc.pid, "VmHWM")
    bad.sock.setblocking(True)
    closed = bad.closed_by_server(10)
    return dict(sent=sent, send_error=send_error, released=released, closed=closed, rss0=rss0, max_rss=max_rss,
                hwm=hwm, bad_port=bad_port, held_id=held_id, good=good)


@pytest.mark.parametrize("cap", [None, 65536], ids=["default", "max-output-64KiB"])
def test_never_reading_client_is_closed_and_memory_bounded(start_broker, clients, cap):
    args = ["--extended-stats"] + ([] if cap is None else ["--max-output-bytes", str(cap)])
    proc = start_broker(*args)
    c = clients(proc)
    peeks = 5000  # 320 MB of replies if nothing stopped it
    t0 = time.monotonic()
    r = _never_reader(c, proc, peeks)
    took = time.monotonic() - t0
    if cap is not None:  # the output cap acts at once, well before --slow-reader-timeout (10 s)
        assert r["released"] and took < 5, f"--max-output-bytes {cap}: never-reader closed only after {took:.1f}s"
    grown_mb = (r["max_rss"] - r["rss0"]) / 1024
    assert r["released"], f"the never-reader's reservation was not released (sent {r['sent']} bytes)"
    assert r["closed"], "the never-reading connection was not closed"
    assert grown_mb < 100, f"broker RSS grew by {grown_mb:.0f} MB for one never-reading client"
    assert proc.proc.poll() is None
    good = r["good"]
    st = good.stats()
    assert int(st["closed-slow-readers"]) == 1
    assert int(st["current-jobs-ready"]) >= 2
    c.well_behaved("after-never-reader")
    assert str(r["bad_port"]) in proc.log(), "the slow-reader close is logged with the client's address"


def test_never_reader_of_big_jobs_stays_bounded(start_broker, clients):
    """The output cap must bound memory by bytes, not by a count of replies: with -z 2 MB,
    64 pipelined peeks of a 2 MB job (512 bytes of input) must not make 128+ MB of replies."""
    # Back-pressure stops reading its input before the cap is passed, so --slow-reader-timeout closes
    # it: 2 s instead of the default 10 (the default is covered above); the peak comes before either.
    proc = start_broker("-z", str(2_100_000), "--max-output-bytes", str(4 << 20), "--slow-reader-timeout", "2",
                        "--extended-stats")
    c = clients(proc)
    good = c.open()
    big = good.put(b"J" * 2_000_000)
    rss0 = proc_status_kb(proc.pid, "VmRSS")
    bad = c.open(rcvbuf=4096)
    bad.send(f"peek {big}\r\n".encode() * 64)
    poll(lambda: int(good.stats()["closed-slow-readers"]) == 1, 20, "the never-reader is closed")
    grown_mb = (proc_status_kb(proc.pid, "VmHWM") - rss0) / 1024
    assert grown_mb < 48, f"peak RSS grew {grown_mb:.0f} MB for 512 bytes of input (cap 4 MiB)"
    c.well_behaved("after-big-never-reader")


def test_slow_but_honest_reader_gets_every_reply(start_broker, clients):
    """Back-pressure (stop reading past 1 MiB unsent) must not break a client that reads late."""
    proc = start_broker("--extended-stats")
    c = clients(proc)
    raw = c.open(rcvbuf=8192, timeout=15)
    body = bytes(range(256)) * 256  # 65536 bytes: over the default limit, so use 65535
    body = body[:BIG]
    job = raw.put(body)
    n = 150  # ~9.8 MB of replies, under the 16 MiB cap
    raw.send(f"peek {job}\r\n".encode() * n + b"list-tube-used\r\n")
    c.well_behaved("while-slow-reader")  # before the slow reader reads anything
    for _ in range(n):
        reply, got = raw.reply()
        assert reply == f"FOUND {job} {BIG}".encode() and got == body
    assert raw.line() == b"USING default"
    assert raw.cmd(f"delete {job}") == b"DELETED"
    assert int(c.stats()["closed-slow-readers"]) == 0


def test_half_sent_body_and_unfinished_line_hold_only_their_connection(start_broker, clients):
    proc = start_broker()
    c = clients(proc)
    half_body = c.open()
    half_body.send(b"put 1 0 60 100\r\n" + b"h" * 50)
    half_line = c.open()
    half_line.send(b"put 1 0 60 1")
    long_line = c.open()
    long_line.send(b"x" * 200)  # a command line never finished
    mid_crlf = c.open()
    mid_crlf.send(b"stats\r")
    slow = c.open()
    slow.send(b"put 1 0 60 40\r\n")
    slow_body = b"s" * 40
    wait_connections(c, 5)
    for i in range(0, len(slow_body), 4):  # a body sent slowly, while others work
        slow.send(slow_body[i:i + 4])
        c.well_behaved(f"half{i}", limit=3)
    slow.send(b"\r\n")
    assert slow.line().startswith(b"INSERTED ")
    st = c.stats()
    assert int(st["current-jobs-ready"]) == 1, "only the slow job is in; half-sent ones are not"
    # each finishes later and is answered as usual
    half_body.send(b"h" * 50 + b"\r\n")
    assert half_body.line().startswith(b"INSERTED ")
    half_line.send(b"\r\nx\r\n")
    assert half_line.line().startswith(b"INSERTED ")
    mid_crlf.send(b"\n")
    assert mid_crlf.reply()[0].startswith(b"OK ")
    long_line.send(b"\r\n")
    assert long_line.line() in (b"UNKNOWN_COMMAND", b"BAD_FORMAT")
    assert int(c.stats()["current-jobs-ready"]) == 3


def test_idle_timeout(start_broker, clients):
    proc = start_broker("--idle-timeout", "1")
    c = clients(proc)
    silent = c.open()
    t_silent = time.monotonic()
    silent_port = silent.local_port
    blocked = c.open()
    assert blocked.cmd("watch idle-b") == b"WATCHING 2" and blocked.cmd("ignore default") == b"WATCHING 1"
    blocked.send(b"reserve\r\n")
    timed = c.open(timeout=10)
    timed.send(b"reserve-with-timeout 3\r\n")
    chatty = c.open()
    half = c.open()
    half.send(b"put 1 0 60 10\r\nabc")  # silent in the middle of a body: still silent
    closed_at = None
    while time.monotonic() - t_silent < 3.2:
        assert chatty.cmd("list-tube-used") == b"USING default", "an active connection was closed"
        if closed_at is None and silent.closed_by_server(0.25):
            closed_at = time.monotonic() - t_silent
    assert closed_at is not None, "a silent connection was not closed after --idle-timeout 1"
    assert 0.8 <= closed_at <= 3.2, f"closed after {closed_at:.2f}s with --idle-timeout 1"
    assert half.closed_by_server(1), "a connection silent mid-body is idle too"
    c.well_behaved("idle")
    # the one blocked in reserve is still there and gets a job
    prod = c.open()
    assert prod.cmd("use idle-b") == b"USING idle-b"
    job = prod.put(b"for the patient one")
    assert blocked.reply()[0] == f"RESERVED {job} 19".encode()
    time.sleep(0.5)  # the worker processes its job (half the idle timeout): it must not be cut off now
    assert blocked.cmd(f"delete {job}") == b"DELETED"
    assert timed.line() == b"TIMED_OUT", "reserve-with-timeout 3 must not be cut by --idle-timeout 1"
    st = c.stats()
    assert int(st["closed-idle"]) >= 2
    assert str(silent_port) in proc.log(), "the idle close is logged with the client's address"


# ----------------------------------------------------------------------------------------
# auth
# ----------------------------------------------------------------------------------------
def test_auth_token(start_broker, clients, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cr3t-t0ken")
    proc = start_broker("--auth-token-file", str(token_file))
    c = clients(proc)
    anon = c.open()
    assert anon.cmd("stats") == b"UNAUTHORIZED"
    # a put's body is consumed: the next command is read as a command, not as the body
    anon.send(b"put 1 0 60 5\r\nhello\r\nlist-tube-used\r\n")
    assert anon.line() == b"UNAUTHORIZED"
    assert anon.line() == b"UNAUTHORIZED"
    assert anon.cmd("auth s3cr3t-t0ken") == b"OK"
    assert anon.cmd("list-tube-used") == b"USING default"
    assert int(anon.stats()["current-jobs-ready"]) == 0, "nothing was put before auth"
    # three wrong tokens close the connection; the refusals are counted
    bad = c.open()
    bad_port = bad.local_port
    assert bad.cmd("auth nope") == b"UNAUTHORIZED"
    assert bad.cmd("auth s3cr3t") == b"UNAUTHORIZED"
    bad.send(b"auth s3cr3t-t0ken-\r\n")
    assert bad.line() == b"UNAUTHORIZED"
    assert bad.closed_by_server(3), "three failed auths must close the connection"
    # while an unauthenticated client keeps knocking, an authenticated one works
    knock = c.open()
    knock.send(b"stats\r\nreserve\r\nput 0 0 1 1\r\nx\r\n" * 50)
    ok = Clients(proc, token="s3cr3t-t0ken")
    try:
        ok.well_behaved("auth")
        assert int(ok.stats()["auth-failures"]) >= 3
    finally:
        ok.close_all()
    for _ in range(150):
        assert knock.line() == b"UNAUTHORIZED"
    assert str(bad_port) in proc.log(), "auth failures are logged with the client's address"


def test_auth_token_file_with_trailing_newline(start_broker, clients, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("tok-123\n")  # as `echo tok-123 > token` writes it
    proc = start_broker("--auth-token-file", str(token_file))
    raw = clients(proc).open()
    assert raw.cmd("auth tok-123") == b"OK"
    assert raw.cmd("list-tube-used") == b"USING default"


# ----------------------------------------------------------------------------------------
# TLS
# ----------------------------------------------------------------------------------------
def test_tls_on_main_listener(start_broker, clients, certs):
    proc = start_broker("--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "server.key"))
    c = clients(proc, tls=client_ctx(certs))
    # a client that connects and never starts the handshake, and one speaking plain text
    stuck = c.open(connect_only=True)
    plain = c.open(tls=None, connect_only=True)
    plain.send(b"stats\r\n")
    c.well_behaved("tls")
    assert not plain.sock.recv(4096).startswith(b"OK"), "plain text answered on a TLS listener"
    raw = c.open()
    assert raw.sock.version() in ("TLSv1.2", "TLSv1.3")
    job = raw.put(b"over tls" * 1000)
    assert raw.cmd(f"peek {job}").startswith(b"FOUND") and raw.last_body == b"over tls" * 1000
    # a client that does not trust the server's CA refuses it
    with pytest.raises(ssl.SSLCertVerificationError):
        Raw(proc.host, proc.port, tls=ssl.create_default_context())
    stuck.close()


def test_tls_silent_before_handshake_is_idle_too(start_broker, clients, certs):
    """--idle-timeout must also cover a TLS client that connects and never starts the handshake
    (otherwise it holds a descriptor for asyncio's 60 s handshake timeout, uncounted)."""
    proc = start_broker("--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "server.key"),
                        "--idle-timeout", "1")
    c = clients(proc, tls=client_ctx(certs))
    silent = c.open(connect_only=True)
    t0 = time.monotonic()
    c.well_behaved("tls-idle")
    assert silent.closed_by_server(6), (f"a TLS connection silent before its handshake was still open after "
                                        f"{time.monotonic() - t0:.1f}s with --idle-timeout 1")


def test_a_tls_client_that_hangs_up_is_not_a_warning_on_asyncios_own_loop(certs, caplog):
    """Without uvloop (it is optional) the broker runs on asyncio's loop, whose TLS transport logs a
    warning whenever the protocol's eof_received asks to stay half-open: one per TLS client that hung
    up. The broker asks that only of a plain TCP transport (half-closed clients still get their replies)."""
    async def body() -> None:
        port = free_port()
        tls = TlsConfig(cert=str(certs / "server.crt"), key=str(certs / "server.key"))
        server = BrokerServer(ServerConfig(listen="127.0.0.1", port=port, tls=tls))
        await server.start()
        try:
            def hang_up() -> None:
                for _ in range(3):
                    with Connection("127.0.0.1", port, tls=True, ca_file=str(certs / "ca.crt")) as conn:
                        conn.put(b"x")
            await asyncio.wait_for(asyncio.to_thread(hang_up), 30)
            await wait_until_async(lambda: not server.connections, 10, "the connections closed")
        finally:
            await server.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(body())
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_tls_on_second_listener(start_broker, clients, certs):
    tls_port = free_port()
    proc = start_broker("--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "server.key"),
                        "--tls-port", str(tls_port))
    wait_for_port(proc.host, tls_port, 10, proc.proc)
    plain = clients(proc)
    tls = clients(proc, port=tls_port, tls=client_ctx(certs))
    plain.well_behaved("plain-side")
    tls.well_behaved("tls-side")
    # one queue behind both listeners
    p = plain.open()
    assert p.cmd("use shared") == b"USING shared"
    job = p.put(b"from plain")
    t = tls.open()
    assert t.cmd("watch shared") == b"WATCHING 2" and t.cmd("ignore default") == b"WATCHING 1"
    assert t.cmd("reserve-with-timeout 2") == f"RESERVED {job} 10".encode()
    assert t.cmd(f"delete {job}") == b"DELETED"


def test_tls_client_certificate_required(start_broker, clients, certs):
    proc = start_broker("--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "server.key"),
                        "--tls-client-ca", str(certs / "ca.crt"))
    good = clients(proc, tls=client_ctx(certs, "client"))
    good.well_behaved("mtls")

    def refused(ctx) -> bool:
        try:
            raw = Raw(proc.host, proc.port, tls=ctx, timeout=5)
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
            return True  # TLS 1.2: the handshake fails
        try:  # TLS 1.3: the client's handshake completes; the server's alert arrives on first read
            reply = raw.cmd("list-tube-used")
            return not reply.startswith(b"USING")
        except (ssl.SSLError, EOFError, ConnectionResetError, BrokenPipeError):
            return True
        finally:
            raw.close()

    assert refused(client_ctx(certs)), "a client without a certificate was served"
    assert refused(client_ctx(certs, "rogue")), "a client certificate from another CA was served"
    good.well_behaved("mtls-after")


def test_connector_speaks_tls_and_auth_if_available(start_broker, certs, tmp_path):
    params = inspect.signature(Connection.__init__).parameters
    if not {"tls", "ca_file", "auth_token"} <= set(params):
        pytest.skip("spark_beanstalk.client.Connection has no tls/ca_file/auth_token arguments yet")
    token_file = tmp_path / "token"
    token_file.write_text("conn-token")
    proc = start_broker("--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "server.key"),
                        "--tls-client-ca", str(certs / "ca.crt"), "--auth-token-file", str(token_file))
    kw = dict(tls=True, ca_file=str(certs / "ca.crt"), auth_token="conn-token")
    if {"certfile", "keyfile"} <= set(params):
        kw.update(certfile=str(certs / "client.crt"), keyfile=str(certs / "client.key"))
    with Connection(proc.host, proc.port, timeout=5, **kw) as conn:
        conn.use("connector")
        conn.watch("connector")
        job = conn.put(b"via connector")
        got = conn.reserve(timeout=2)
        assert got.id == job and got.body == b"via connector"
        assert conn.delete(job)


def test_operator_cli_speaks_tls_and_auth_if_available(start_broker, clients, certs, tmp_path):
    cli = [sys.executable, "-m", "spark_beanstalk.cli"]
    help_text = subprocess.run(cli + ["put", "--help"], capture_output=True, text=True, timeout=60).stdout
    if not all(flag in help_text for flag in ("--ca-file", "--cert-file", "--key-file", "--token-file")):
        pytest.skip("the operator CLI has no --ca-file/--cert-file/--key-file/--token-file yet")
    token_file = tmp_path / "token"
    token_file.write_text("cli-token\n")
    proc = start_broker("--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "server.key"),
                        "--tls-client-ca", str(certs / "ca.crt"), "--auth-token-file", str(token_file))
    common = ["-H", f"tls://127.0.0.1:{proc.port}", "--ca-file", str(certs / "ca.crt"),
              "--cert-file", str(certs / "client.crt"), "--key-file", str(certs / "client.key")]
    put = subprocess.run(cli + ["put", "-t", "cli-tube", *common, "--token-file", str(token_file), "--json",
                                "from the cli"], capture_output=True, text=True, timeout=60)
    assert put.returncode == 0, put.stderr
    raw = Raw(proc.host, proc.port, tls=client_ctx(certs, "client"), token="cli-token")
    assert raw.cmd("watch cli-tube") == b"WATCHING 2" and raw.cmd("ignore default") == b"WATCHING 1"
    assert raw.cmd("reserve-with-timeout 2").startswith(b"RESERVED") and raw.last_body == b"from the cli"
    raw.close()
    # without the token the CLI fails clearly (non-zero exit, no traceback)
    anon = subprocess.run(cli + ["stats", *common], capture_output=True, text=True, timeout=60)
    assert anon.returncode != 0 and "Traceback" not in anon.stderr, anon.stderr


# ----------------------------------------------------------------------------------------
# metrics, config file, logging
# ----------------------------------------------------------------------------------------
def test_metrics_endpoint(start_broker, clients, tmp_path):
    mport = free_port()
    token_file = tmp_path / "token"
    token_file.write_text("mt")
    proc = start_broker("--metrics", f"127.0.0.1:{mport}", "--max-jobs", "3", "--auth-token-file", str(token_file))
    addr = f"127.0.0.1:{mport}"
    wait_for_port("127.0.0.1", mport, 10, proc.proc)
    # a scraper that never finishes its request must not block anything
    slowloris = socket.create_connection(("127.0.0.1", mport))
    slowloris.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    c = clients(proc, token="mt")
    raw = c.open()
    assert raw.cmd("use mtube") == b"USING mtube"
    for i in range(3):
        raw.put(b"m%d" % i)
    assert raw.cmd("put 1 0 60 1", b"x") == b"OUT_OF_MEMORY"
    assert raw.cmd("watch mtube") == b"WATCHING 2"
    assert raw.cmd("reserve-with-timeout 0").startswith(b"RESERVED")
    assert Raw(proc.host, proc.port).cmd("auth wrong-token") == b"UNAUTHORIZED"
    types, samples = scrape(addr)
    assert sample(samples, "beanstalk_jobs", tube="mtube", state="ready") == 2
    assert sample(samples, "beanstalk_jobs", tube="mtube", state="reserved") == 1
    assert types.get("beanstalk_jobs") == "gauge"
    assert (sample(samples, "beanstalk_commands_total", command="put") or 0) >= 4
    assert (sample(samples, "beanstalk_commands_total", command="reserve-with-timeout") or 0) >= 1
    assert (sample(samples, "beanstalk_connections") or 0) >= 1
    assert (sample(samples, "beanstalk_connections_total") or 0) >= 3
    assert sample(samples, "beanstalk_refusals_total", reason="jobs") == 1
    assert (sample(samples, "beanstalk_refusals_total", reason="auth") or 0) >= 1
    for reason in REFUSAL_REASONS:
        assert sample(samples, "beanstalk_refusals_total", reason=reason) is not None, f"no refusals{{reason={reason}}}"
    peeked = raw.cmd("peek-ready")
    assert peeked.startswith(b"FOUND ")
    assert raw.cmd(f"delete {int(peeked.split()[1])}") == b"DELETED"
    c.well_behaved("metrics")  # while a scraper holds a half-sent HTTP request
    slowloris.close()


def test_metrics_binlog(start_broker, clients, tmp_path):
    mport = free_port()
    proc = start_broker("--metrics", f"127.0.0.1:{mport}", "-b", str(tmp_path / "binlog"), "-f", "0")
    raw = clients(proc).open()
    for i in range(20):
        raw.put(b"durable %d" % i)
    wait_for_port("127.0.0.1", mport, 10, proc.proc)
    types, samples = scrape(f"127.0.0.1:{mport}")
    assert (sample(samples, "beanstalk_binlog_bytes") or 0) > 20 * 9, "beanstalk_binlog_bytes with -b"
    assert types.get("beanstalk_binlog_bytes") == "gauge"
    assert types.get("beanstalk_binlog_fsync_seconds") in ("histogram", "summary"), types
    assert (sample(samples, "beanstalk_binlog_fsync_seconds_count") or 0) >= 1, "fsyncs observed with -f 0"


def test_config_file_keys(start_broker, clients, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("cfg")
    mport = free_port()
    cfg = tmp_path / "broker.toml"
    cfg.write_text(f"""
max_connections = 50
max_jobs = 2
max_job_bytes = 100000
max_tubes = 100
max_reserved_per_connection = 5
idle_timeout = 30
max_output_bytes = 16777216
auth_token_file = "{token_file}"
metrics = "127.0.0.1:{mport}"
""")
    proc = start_broker("--config", str(cfg))
    c = clients(proc, token="cfg")
    raw = c.open()
    raw.put(b"1")
    raw.put(b"2")
    assert raw.cmd("put 1 0 60 1", b"3") == b"OUT_OF_MEMORY"
    assert Raw(proc.host, proc.port).cmd("stats") == b"UNAUTHORIZED"
    wait_for_port("127.0.0.1", mport, 10, proc.proc)
    _, samples = scrape(f"127.0.0.1:{mport}")
    assert sample(samples, "beanstalk_refusals_total", reason="jobs") == 1
    # flags override the file
    proc2 = start_broker("--config", str(cfg), "--max-jobs", "3", "--metrics", f"127.0.0.1:{free_port()}")
    raw2 = clients(proc2, token="cfg").open()
    for _i in range(3):
        raw2.put(b"x")


def test_shipped_config_file_still_starts(start_broker, clients):
    proc = start_broker("--config", str(Path(__file__).resolve().parent.parent / "conf" / "broker.toml"))
    clients(proc).well_behaved("shipped-conf")


def test_refusals_logged_once_with_client_address(start_broker, clients, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("lg")
    proc = start_broker("--max-jobs", "1", "--auth-token-file", str(token_file))
    c = clients(proc, token="lg")
    raw = c.open()
    raw.put(b"only one")
    assert raw.cmd("put 1 0 60 1", b"x") == b"OUT_OF_MEMORY"
    bad = Raw(proc.host, proc.port)
    assert bad.cmd("auth wrong") == b"UNAUTHORIZED"

    def lines_with(port: int) -> list[str]:
        return [ln for ln in proc.log().splitlines() if f"{port}" in ln]

    poll(lambda: lines_with(raw.local_port) and lines_with(bad.local_port), 5, "refusals logged")
    assert len(lines_with(raw.local_port)) == 1, lines_with(raw.local_port)
    assert len(lines_with(bad.local_port)) == 1, lines_with(bad.local_port)
