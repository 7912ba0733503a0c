"""The one home of test helpers: waiting, free ports, server processes, a TCP proxy for network faults.

Tests import from here (`from tests.helpers import wait_until`); the implementations live
in `spark_beanstalk.embedded` so that jobs/ and bench/ share them too.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.connection import BrokerConnection
from broker.limits import Limits
from broker.server import BrokerServer, ServerConfig, connection_class
from spark_beanstalk.embedded import (
    ServerExitedEarly,
    ServerProcess,
    beanstalkd_process,
    broker_process,
    cpu_seconds,
    etcd_process,
    free_port,
    member_process,
    start_server,
    wait_for_port,
    wait_until,
)

__all__ = [
    "BatchFiles",
    "EtcdProxy",
    "FakeTransport",
    "FaultyDisk",
    "ServerExitedEarly",
    "ReplicaSet",
    "ServerProcess",
    "TcpProxy",
    "TopProcess",
    "assert_exactly_once",
    "beanstalkd_process",
    "drain_tube",
    "broker_process",
    "connect",
    "cpu_seconds",
    "etcd_process",
    "free_port",
    "http_get",
    "make_server",
    "last_committed",
    "left_in",
    "member_process",
    "put_bodies",
    "report",
    "sample",
    "scrape",
    "shut_down",
    "start_query",
    "start_server",
    "traced_growth",
    "tube_jobs",
    "wait_delivered",
    "wait_for_port",
    "wait_until",
    "wait_until_async",
]


async def wait_until_async(predicate: Callable[[], Any], timeout: float, what: str = "condition",
                           interval: float = 0.005) -> Any:
    """``wait_until`` for a test running on an event loop: polls without blocking the loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        await asyncio.sleep(interval)


def traced_growth(work: Callable[[], object]) -> int:
    """Bytes of Python memory allocated by ``work`` and still held after it (tracemalloc, after a full
    collection): what a structure keeps that it should have let go."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        work()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


class TcpProxy:
    """A TCP forwarder on 127.0.0.1:<free port> to `target`, for network-fault tests.

    ``cut_all()`` drops every connection it carries at once (both sides see the close), as a
    network fault would, and keeps accepting; ``cut()`` also refuses new connections until
    ``restore()`` (a partition). Threads, not asyncio: it runs beside processes the test
    drives synchronously.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = "127.0.0.1", self._listener.getsockname()[1]
        self.open = True
        self.cuts = 0
        self.refused = 0  # connections closed at once during a partition: the attempts a client made
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                self.refused += 1
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)  # idle connections stay up until cut
            with self._lock:
                self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while self.open and (data := src.recv(65536)):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut_all(self) -> int:
        """Drop every connection now and keep accepting; returns how many there were."""
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.cuts += 1
        return len(socks) // 2

    def cut(self) -> None:
        """A partition: drop every connection and refuse new ones until restore()."""
        self.open = False
        self.cut_all()

    def restore(self) -> None:
        self.open = True

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut()


class FaultyDisk:
    """A directory on tests/faultfs.py (FUSE): real I/O errors and lost writes on command.

    ``mount`` is where the broker writes; ``backing`` holds what "reached the disk" (what a
    broker started on it after a crash finds). ``fail("fail-fsync")`` / ``heal(...)`` turn a
    fault of tests/faultfs.py on and off.
    """

    def __init__(self, root: Path) -> None:
        self.backing, self.mount, self.control = root / "backing", root / "mnt", root / "control"
        for d in (self.backing, self.mount, self.control):
            d.mkdir(parents=True)
        script = Path(__file__).with_name("faultfs.py")
        self.proc = subprocess.Popen([sys.executable, str(script), str(self.backing), str(self.mount),
                                      str(self.control)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until(lambda: os.path.ismount(self.mount) or self.proc.poll() is not None, 15, "FUSE mount")
        if self.proc.poll() is not None:
            assert self.proc.stderr is not None
            raise RuntimeError(f"tests/faultfs.py exited: {self.proc.stderr.read().decode(errors='replace')}")

    def fail(self, fault: str, arg: str = "") -> None:
        """Turn ``fault`` on; ``arg`` is what tests/faultfs.py reads from it (power-cut: a seed)."""
        (self.control / fault).write_text(arg)

    def heal(self, fault: str) -> None:
        (self.control / fault).unlink()

    def close(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], capture_output=True)
        self.proc.kill()
        self.proc.wait(10)


class EtcdProxy:
    """An HTTP forwarder on 127.0.0.1:<free port> to etcd's JSON gateway, for etcd-fault tests.

    ``fail(path, n)`` answers the next ``n`` requests to ``path`` (e.g. ``/v3/kv/put``) with a 503
    and forwards nothing; ``delay(path, seconds)`` holds every answer to ``path`` that long after
    etcd gave it (a slow etcd round trip). Threads, like TcpProxy.
    """

    def __init__(self, target: str) -> None:
        import http.server

        self.target = target if "://" in target else "http://" + target
        self.failures: dict[str, int] = {}
        self.delays: dict[str, float] = {}
        self.failed: list[str] = []
        self.seen: list[str] = []  # the path of every request, as it arrives
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path
                proxy.seen.append(path)
                if proxy.failures.get(path, 0) > 0:
                    proxy.failures[path] -= 1
                    proxy.failed.append(path)
                    self._answer(503, b"injected failure")
                    return
                request = urllib.request.Request(proxy.target + path, data=body,
                                                 headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=10) as resp:
                        status, data = resp.status, resp.read()
                except urllib.error.HTTPError as exc:
                    status, data = exc.code, exc.read()
                delay = proxy.delays.get(path, 0.0)
                if delay:
                    threading.Event().wait(delay)
                self._answer(status, data)

            def _answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.address = f"127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="etcd-proxy", daemon=True).start()

    def fail(self, path: str, n: int = 1) -> None:
        self.failures[path] = self.failures.get(path, 0) + n

    def delay(self, path: str, seconds: float) -> None:
        self.delays[path] = seconds

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()



class TopProcess:
    """`spark-beanstalk top --json` running as its own process, its refreshes collected as they come:
    for tests of an operator's view that outlives restarts and failovers."""

    def __init__(self, hosts: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "spark_beanstalk.cli", "top", "-i", "0.1", "--json",
                                      "-H", hosts, *args], stdout=subprocess.PIPE, text=True)
        self.frames: list[dict[str, Any]] = []
        self._seen = 0
        threading.Thread(target=self._read, name="top-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.frames.append(json.loads(line))

    def wait_for(self, match: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30) -> dict[str, Any]:
        """The first refresh after the last one returned that matches."""
        def found() -> dict[str, Any] | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"top exited with {self.proc.returncode} waiting for {what}")
            for i in range(self._seen, len(self.frames)):
                if match(self.frames[i]):
                    self._seen = i + 1
                    return self.frames[i]
            return None

        return wait_until(found, timeout, interval=0.05, what=what)

    def running(self) -> bool:
        return self.proc.poll() is None

    def __enter__(self) -> TopProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def drain_tube(proc: ServerProcess, tube: str) -> list[bytes]:
    """Reserve and delete every ready job of `tube`; returns their bodies (pipelined: 100k jobs in a second or two)."""
    from spark_beanstalk.client import Connection

    out: list[bytes] = []
    with Connection(proc.host, proc.port, timeout=30) as conn:
        conn.watch_only([tube])
        while True:
            ids, bodies, _ = conn.reserve_many(1000)
            if not ids:
                return out
            out.extend(bodies)
            for reply in conn.pipeline([b"delete %d\r\n" % i for i in ids]):
                assert reply.status == b"DELETED", reply


def tube_jobs(proc: ServerProcess, tube: str) -> dict[str, int]:
    """The tube's current ready/reserved/delayed/buried counts (all 0 for a tube that does not exist)."""
    from spark_beanstalk.client import Connection

    with Connection(proc.host, proc.port, timeout=10) as conn:
        st = conn.stats_tube(tube) or {}
    return {k: int(st.get(f"current-jobs-{k}", 0)) for k in ("ready", "reserved", "delayed", "buried")}


def member_stats(proc: ServerProcess) -> dict[str, object] | None:
    """A server's stats, or None when it cannot answer (down, mid-restart)."""
    from spark_beanstalk.client import BeanstalkError, Connection

    try:
        with Connection(proc.host, proc.port, timeout=2, connect_timeout=1) as conn:
            return conn.stats()
    except (BeanstalkError, OSError):
        return None


class ReplicaSet:
    """etcd + `n` replicated members on loopback (`--sync-replicas`, lease TTL 1 s): the topology
    of docs/replication.md, for tests of clients that follow the leader (`cluster:` hosts)."""

    def __init__(self, root: str, n: int = 3, sync: int = 1) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.etcd = etcd_process(f"{root}/etcd", stderr_path=f"{root}/etcd.log").start()
        self.members: list[ServerProcess] = []
        try:
            for i in range(n):
                self.members.append(member_process(f"{root}/m{i}", etcd=f"http://{self.etcd.address}", name=f"m{i}",
                                                   sync_replicas=sync, stderr_path=f"{root}/m{i}.log").start())
                if i == 0:
                    wait_until(self.leader, 15, what="the first member leads")
            leader = self.members[0]
            for m in self.members[1:]:
                wait_until(functools.partial(self.caught_up, leader, m), 15, what="replicas joined")
        except BaseException:
            self.stop()
            raise

    @property
    def hosts(self) -> str:
        """The connector's spec for the set: one logical broker."""
        return "cluster:" + ",".join(m.address for m in self.members)

    def leader(self) -> ServerProcess | None:
        """The one live member that reports itself leader, or None (none or, briefly, two)."""
        found = [m for m in self.members if m.proc is not None and m.proc.poll() is None
                 and (member_stats(m) or {}).get("replication-role") == "leader"]
        return found[0] if len(found) == 1 else None

    @staticmethod
    def caught_up(leader: ServerProcess, member: ServerProcess) -> bool:
        a, b = member_stats(leader), member_stats(member)
        position = ("replication-epoch", "replication-seq")
        return bool(a and b and b["replication-role"] == "replica" and b["replication-lag-records"] == 0
                    and [a[k] for k in position] == [b[k] for k in position])

    def kill_leader(self) -> ServerProcess:
        """SIGKILL the leader; returns it (start it again with `.restart()`)."""
        leader = self.leader()
        assert leader is not None, "no single leader to kill"
        leader.kill()
        return leader

    def stop_leader(self) -> ServerProcess:
        """SIGTERM the leader (a planned restart: it hands over first) and wait for it to exit; returns it."""
        leader = self.leader()
        assert leader is not None, "no single leader to stop"
        assert leader.stop() == 0
        return leader

    def stop(self) -> None:
        for m in self.members:
            m.stop()
        self.etcd.stop()


# --- streaming-query helpers: an idempotent sink and exactly-once checks (source fault tests, bench/soak.py)

def put_bodies(proc: ServerProcess, tube: str, bodies: list[bytes]) -> list[int]:
    """Put each body (pri 100, ttr 60) into `tube`, pipelined; their ids."""
    from spark_beanstalk.client import Connection, encode_put

    with Connection(proc.host, proc.port, timeout=10) as conn:
        conn.use(tube)
        ids = []
        for reply in conn.pipeline([encode_put(b, 100, 0, 60) for b in bodies]):
            assert reply.status == b"INSERTED", reply
            ids.append(int(reply.args[0]))
    return ids


def last_committed(ckpt: Path) -> int:
    """The last batch id a streaming checkpoint records as committed (-1: none yet)."""
    commits = ckpt / "commits"
    ids = [int(p.name) for p in commits.iterdir() if p.name.isdigit()] if commits.is_dir() else []
    return max(ids, default=-1)


def left_in(proc: ServerProcess, tube: str) -> int:
    """Jobs of the tube still ready or reserved."""
    counts = tube_jobs(proc, tube)
    return counts["ready"] + counts["reserved"]


def report(query: Any) -> dict[str, Any]:
    """The source's latest offset as the query last reported it (per-broker state)."""
    progress = query.lastProgress
    latest = progress["sources"][0].get("latestOffset") if progress else None
    return json.loads(latest) if isinstance(latest, str) else (latest or {})


def shut_down(query: Any, proxy: TcpProxy | None, *servers: ServerProcess) -> None:
    """A streaming test's teardown: the query first (it holds reservations), then the proxy, then the servers."""
    if query is not None:
        query.stop()
    if proxy is not None:
        proxy.close()
    for srv in servers:
        srv.stop()


class BatchFiles:
    """foreachBatch sink writing one JSON file per batch id (a replay overwrites it); `hook`
    runs after the write, while Spark still waits for the batch: "during a batch"."""

    def __init__(self, out: Path, hook: Callable[[int, list[tuple[str, str]]], None] | None = None) -> None:
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.hook = hook
        self.calls: Counter[int] = Counter()
        self.lock = threading.Lock()

    def __call__(self, df: Any, batch_id: int) -> None:
        rows = [(r.broker, bytes(r.body).decode()) for r in df.select("broker", "body").collect()]
        tmp = self.out / f".{batch_id}.tmp"
        tmp.write_text(json.dumps(rows))
        tmp.replace(self.out / f"{batch_id:06d}.json")
        with self.lock:
            self.calls[batch_id] += 1
        if self.hook is not None and rows:
            self.hook(batch_id, rows)

    def batches(self) -> dict[int, list[tuple[str, str]]]:
        return {int(p.stem): [tuple(r) for r in json.loads(p.read_text())] for p in sorted(self.out.glob("*.json"))}

    def seen(self) -> Counter[tuple[str, str]]:
        return Counter(row for rows in self.batches().values() for row in rows)


def assert_exactly_once(sink: BatchFiles, expected: set[tuple[str, str]]) -> None:
    seen = sink.seen()
    dups = sorted(k for k, n in seen.items() if n > 1)
    lost = sorted(expected - set(seen))
    extra = sorted(set(seen) - expected)
    assert not lost and not dups and not extra, (
        f"lost {len(lost)} {lost[:5]}, duplicated across batches {len(dups)} {dups[:5]}, unexpected {len(extra)} "
        f"{extra[:5]}")


def start_query(spark: Any, sink: BatchFiles, ckpt: Path, hosts: str, **options: Any) -> Any:
    reader = spark.readStream.format("beanstalk").option("hosts", hosts).option("tubes", "t")
    for key, value in {"maxJobsPerTrigger": 100, **options}.items():
        reader = reader.option(key, str(value))
    return (reader.load().writeStream.foreachBatch(sink).option("checkpointLocation", str(ckpt))
            .trigger(processingTime="500 milliseconds").start())


def wait_delivered(sink: BatchFiles, expected: set[tuple[str, str]], procs: list[ServerProcess], query: Any,
                   timeout: float = 120) -> None:
    def done() -> bool:
        if query is not None and query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        return expected <= set(sink.seen()) and all(left_in(p, "t") == 0 for p in procs)

    wait_until(done, timeout, interval=0.25, what="every job in the sink and none left ready or reserved")


def http_get(url: str) -> tuple[int, str]:
    """GET ``url``: its status and text, an error status (503, 404) included."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def scrape(addr: str) -> tuple[dict[str, str], dict[str, list[tuple[dict[str, str], float]]]]:
    """A broker's /metrics at ADDR: metric family types by name, and samples by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    types: dict[str, str] = {}
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return types, samples


def sample(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float | None:
    """The value of the first sample NAME whose labels include LABELS (None: no such sample)."""
    for lab, value in samples.get(name, []):
        if all(lab.get(k) == v for k, v in labels.items()):
            return value
    return None


# --- in-process protocol tests (as uvicorn tests its protocols) ----------------------------------

class FakeTransport:
    """What BrokerConnection uses of an asyncio transport, recorded."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.reading = True
        self.closed = False
        self.aborted = False
        self.buffered = 0  # what get_write_buffer_size reports (the client's unread replies)
        self.writes = 0
        # A client that reads nothing: with pause_at set, every write adds to ``buffered``, and the write
        # that takes it past pause_at calls the protocol's pause_writing, as asyncio's transports do.
        self.pause_at: int | None = None
        self.protocol: Any = None
        self.write_paused = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.out += data
        self.writes += 1
        if self.pause_at is not None:
            self.buffered += len(data)
            if not self.write_paused and self.buffered > self.pause_at:
                self.write_paused = True
                self.protocol.pause_writing()

    def take(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
        return data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return self.buffered


def make_server(limits: Limits | None = None) -> BrokerServer:
    return BrokerServer(ServerConfig(limits=limits or Limits()))


def connect(server: BrokerServer, cls: type[BrokerConnection] | None = None) -> tuple[BrokerConnection, FakeTransport]:
    """A connection of ``cls``, by default the class the server makes (interpreted: the lane's, broker/lane.py)."""
    conn = (cls or connection_class(server.state))(server.state)
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport
