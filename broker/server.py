"""The asyncio server: listening sockets, the one loop timer, the idle sweep, shutdown.

One ``asyncio.Protocol`` per connection (no task per connection, no stream layers; see
:mod:`broker.connection`). What the connections share with the server (queue, config,
loop timer, group commit) is one :class:`broker.state.ServerState`. All timed work runs
from one loop timer set to the queue's earliest deadline (:class:`broker.state.LoopTimer`).
"""
from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import resource
import signal
import stat
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from broker import _build, logs, netio
from broker.busypoll import BusyPoll
from broker.connection import BrokerConnection
from broker.gcpolicy import tune_gc
from broker.queue import Queue, QueueListener
from broker.state import LoopTimer, ServerConfig, ServerState

if TYPE_CHECKING:
    from broker.metrics import Collector

__all__ = ["BrokerServer", "ServerConfig", "clear_unix_path", "connection_class", "install_uvloop", "run_server"]

log = logging.getLogger("broker")

_RESERVED_DESCRIPTORS = 64  # binlog segments, listeners, metrics, stdio


class BrokerServer:
    """Owns the queue, the listening sockets and the one timer."""

    def __init__(self, config: ServerConfig, listener: QueueListener | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.config = config
        self.clock = clock
        self.queue = Queue(clock, max_job_size=config.max_job_size, listener=listener, limits=config.limits,
                           binlog_max_size=config.binlog_max_size)
        if config.extended_stats:
            self.queue.extra_stats = lambda: self.queue.refusals.stats_items(self.queue.held_bytes)
        self.listener = listener
        self.timer = LoopTimer(self.queue, clock)
        soft_fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # Connections beyond this are refused: the rest of the descriptors stay for us.
        reserve = min(_RESERVED_DESCRIPTORS, max(8, soft_fd_limit // 4))
        # sync_point: called before acknowledging replies go out (the binlog's write; its
        # fsync with -f 0). A binlog (listener.group_commit): the replies of one loop
        # iteration wait for one write (and one fsync with -f 0).
        self.state = ServerState(config, self.queue, self.timer,
                                 sync_point=listener.sync_point if listener is not None else None,
                                 group_commit=listener is not None and listener.group_commit,
                                 descriptor_cap=soft_fd_limit - reserve if soft_fd_limit > 0 else 1 << 30)
        self.connections = self.state.connections
        self.extra_collectors: list[Collector] = []  # more /metrics (replication's)
        self.servers: list[asyncio.Server | netio.NetioServer] = []
        # The C transport for plain-TCP clients where it was built (broker/netio.py), else uvloop's.
        self.netio, self.transport_reason = netio.status()
        # replication: runs at shutdown after clients stop being read, before they are closed
        self.before_close: Callable[[], Awaitable[None]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._idle_timer: asyncio.TimerHandle | None = None

    @property
    def busy_poll(self) -> BusyPoll | None:
        """The busy poll of the client connections, once started (None with --busy-poll-us 0)."""
        return self.state.busy_poll

    @property
    def transport_name(self) -> str:
        """For beanstalk_build_info{transport}: "c" (broker/_netio.c) or "uvloop"."""
        return "c" if self.netio is not None else "uvloop"

    def is_leader(self) -> bool:
        """For /readyz and load balancers: False only on a replicated member that does not lead now."""
        gate = self.state.write_gate
        return gate is None or gate.is_leader()

    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        if self._stopped is None:
            self._stopped = asyncio.Event()
        loop.set_exception_handler(self._loop_error)
        config = self.config
        tls = config.tls
        tls_ctx = tls.server_context() if tls is not None else None
        # Our protocol sees a TLS connection only once its handshake is done, so limits and
        # the idle sweep cannot see one that never starts it: bound that wait instead.
        handshake: dict[str, Any] = {}
        if tls is not None:
            handshake["ssl_handshake_timeout"] = config.limits.idle_timeout or 10.0
        main_ctx = tls_ctx if tls is not None and tls.port is None else None
        listen = config.listen
        state = self.state
        state.loop = loop
        # With -f 0 a round trip takes an fsync, longer than the window: spinning through it bought
        # nothing and took the CPU the disk's completion work needed (1 x 1 puts: 5.4-5.9k/s with
        # polling, 6.2-6.7k without; bench/README.md, "The binlog and replication write path").
        if config.busy_poll_us > 0 and not (self.listener is not None and self.listener.waits_for_disk):
            # real time, not the queue's clock: a test's frozen clock would keep a poll on for good
            state.busy_poll = BusyPoll(config.busy_poll_us, loop, time.monotonic_ns)

        protocol = connection_class(state)

        def factory() -> BrokerConnection:
            return protocol(state)

        if listen.startswith("unix:"):
            path = listen[5:]
            clear_unix_path(path)
            self.servers.append(await loop.create_unix_server(factory, path, ssl=main_ctx,
                                                              **(handshake if main_ctx else {})))
        elif main_ctx is None and self.netio is not None:
            self.servers.append(await netio.create_server(self.netio, factory, listen, config.port, backlog=1024))
        else:
            self.servers.append(await loop.create_server(factory, listen, config.port, reuse_address=True,
                                                         backlog=1024, ssl=main_ctx,
                                                         **(handshake if main_ctx else {})))
        if tls is not None and tls.port is not None:
            host = "127.0.0.1" if listen.startswith("unix:") else listen
            self.servers.append(await loop.create_server(factory, host, tls.port, reuse_address=True,
                                                         backlog=1024, ssl=tls_ctx, **handshake))
        if config.limits.idle_timeout > 0:
            self._schedule_idle_sweep()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Errors the loop could not hand to a connection (accept failures such as EMFILE)."""
        message = str(context.get("message", ""))
        exc = context.get("exception")
        if "accept" in message.lower() or (isinstance(exc, OSError) and exc.errno in (23, 24)):
            self.queue.refusals.refuse("accept_errors", "listener", f"{message} {exc or ''}".strip())
            return
        loop.default_exception_handler(context)

    def _schedule_idle_sweep(self) -> None:
        interval = max(0.05, self.config.limits.idle_timeout / 4)
        self._idle_timer = asyncio.get_running_loop().call_later(interval, self._idle_sweep, interval)

    def _idle_sweep(self, interval: float) -> None:
        """Close connections with no input for --idle-timeout (never one blocked in reserve)."""
        limit = self.config.limits.idle_timeout
        for conn in list(self.connections):
            if conn.take_activity() or conn.client.waiting or conn.busy:
                conn.idle_sweeps = 0
                continue
            conn.idle_sweeps += 1
            if conn.idle_sweeps * interval >= limit:
                self.queue.refusals.refuse("idle", conn.peer, f"silent for {limit:g}s")
                conn.close()
        self._schedule_idle_sweep()

    def addresses(self) -> list[str]:
        result = []
        for server in self.servers:
            for sock in server.sockets:
                name = sock.getsockname()
                result.append(name if isinstance(name, str) else f"{name[0]}:{name[1]}")
        return result

    def reschedule(self) -> None:
        """Point the loop timer at the queue's earliest deadline (after changes made outside a connection)."""
        self.timer.reschedule()

    def drain(self) -> None:
        """SIGUSR1: refuse new jobs (put answers DRAINING), keep serving the rest."""
        self.queue.draining = True
        logs.event(log, logging.WARNING, "drain", "put now answers DRAINING")

    def request_stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    async def serve_until_stopped(self) -> None:
        if self._stopped is None:
            self._stopped = asyncio.Event()
        await self._stopped.wait()
        await self.close()

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        if self.before_close is not None:
            for conn in list(self.connections):
                conn.stop_reading()
            try:
                await self.before_close()
            except Exception:  # the clients and the binlog must still close
                log.exception("the shutdown hook failed")
        for conn in list(self.connections):
            conn.close()
        for server in self.servers:
            await server.wait_closed()
        self.timer.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self.listener is not None:
            self.listener.close()


def clear_unix_path(path: str) -> None:
    """Make room for a Unix socket at ``path``: remove a stale socket, never anything else.

    Removing whatever was there destroyed regular files given by mistake (``-l unix:data.db``);
    beanstalkd refuses those too. Raises OSError with a readable strerror.
    """
    if not path:
        raise OSError(errno.EINVAL, "unix: needs a path (unix:PATH)")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket (not removing it)")
    os.unlink(path)


def install_uvloop() -> bool:
    """Use uvloop when it is installed (it roughly halves per-command overhead)."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


LANE_ENV = "SPARK_BEANSTALK_LANE"


def connection_class(state: ServerState) -> type[BrokerConnection]:
    """The interpreted core serves a worker's plain commands in one frame (:mod:`broker.lane`) on a
    broker without a binlog (so without group commit, a sync point or replication: a replicated member
    has a binlog, and its write gate is checked here too) and without auth, all fixed when the server is
    made; compiled, calls are cheap and the general path serves everything. ``SPARK_BEANSTALK_LANE=0``
    turns the lane off (benchmarks compare the two)."""
    if (_build.core_name() == "compiled" or not _build.env_flag(LANE_ENV, True) or state.queue.listening
            or state.config.auth_token is not None or state.write_gate is not None):
        return BrokerConnection
    from broker.lane import LaneConnection  # imported only here: it subclasses the interpreted class

    return LaneConnection


async def run_server(config: ServerConfig, listener: QueueListener | None = None,
                     on_ready: Callable[[BrokerServer], None] | None = None,
                     before_start: Callable[[BrokerServer], None] | None = None) -> None:
    collector = tune_gc()
    server = BrokerServer(config, listener)
    loop = asyncio.get_running_loop()
    collector.start(loop)
    server._stopped = asyncio.Event()
    # Handlers first: once the port accepts connections, signals must already be ours.
    loop.add_signal_handler(signal.SIGTERM, server.request_stop)
    loop.add_signal_handler(signal.SIGINT, server.request_stop)
    loop.add_signal_handler(signal.SIGUSR1, server.drain)
    if listener is not None:
        # The recovered jobs are long-lived: frozen out of future collections. The collector
        # stays off until then: all of them are in the youngest generation, and the first
        # allocation after gc.enable() would start a collection that visits each one.
        gc.disable()
        try:
            listener.recover(server.queue)
        finally:
            gc.freeze()
            gc.enable()
    if before_start is not None:
        before_start(server)  # replication: gates and hooks in place before the first client
    await server.start()
    if on_ready is not None:
        on_ready(server)
    try:
        await server.serve_until_stopped()
    finally:
        collector.stop()
