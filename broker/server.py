"""The asyncio server: sockets in, the codec and the queue in between, replies out.

One ``asyncio.Protocol`` per connection (no task per connection, no stream layers):
``data_received`` feeds the decoder, runs every complete command in order, gathers the
replies and writes them once. A reserve that has to wait stops the loop for that
connection only; its later commands stay buffered until the reply has gone out, as in
beanstalkd. All timed work runs from one loop timer set to the queue's earliest
deadline.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import resource
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from broker import logs, security
from broker import protocol as p
from broker.limits import OUTPUT_HIGH_WATER, Limits
from broker.queue import Queue, QueueListener
from broker.timers import NEVER

if TYPE_CHECKING:
    from broker.metrics import Collector

log = logging.getLogger("broker")

# Commands that map straight onto a Queue method taking (client, *args).
_SIMPLE = {
    "reserve-job": Queue.reserve_job,
    "delete": Queue.delete,
    "release": Queue.release,
    "bury": Queue.bury,
    "touch": Queue.touch,
    "kick": Queue.kick,
    "kick-job": Queue.kick_job,
    "peek": Queue.peek,
    "peek-ready": Queue.peek_ready,
    "peek-delayed": Queue.peek_delayed,
    "peek-buried": Queue.peek_buried,
    "use": Queue.use,
    "watch": Queue.watch,
    "ignore": Queue.ignore,
    "pause-tube": Queue.pause_tube,
    "stats": Queue.stats,
    "stats-job": Queue.stats_job,
    "stats-tube": Queue.stats_tube,
    "list-tubes": Queue.list_tubes,
    "list-tube-used": Queue.list_tube_used,
    "list-tubes-watched": Queue.list_tubes_watched,
}

# While a client is blocked in reserve we keep reading (to notice a hang-up), but stop
# reading once this much unprocessed input has piled up behind the reserve.
_MAX_BUFFER_WHILE_WAITING = 1 << 20
_FLUSH_BYTES = 1 << 16
_RESERVED_DESCRIPTORS = 64  # binlog segments, listeners, metrics, stdio
_QUIT = object()  # _execute's answer to quit: the connection is closing


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1"
    port: int = 11300
    max_job_size: int = p.DEFAULT_MAX_JOB_SIZE
    verbose: int = 0
    limits: Limits = field(default_factory=Limits)
    tls: security.TlsConfig | None = None
    auth_token: bytes | None = None
    metrics: str | None = None  # "addr:port" of the HTTP listener (served by broker/http.py, not here)
    extended_stats: bool = False  # our extra stats keys (beanstalkd's own stay byte-exact without it)
    binlog_max_size: int = 10485760  # -s: shown in stats even without -b, as beanstalkd does


class BrokerConnection(asyncio.Protocol):
    """One client connection."""

    __slots__ = ("server", "queue", "transport", "client", "decoder", "out", "busy", "eof",
                 "closing", "paused", "write_paused", "refused", "authed", "auth_failures",
                 "activity", "idle_sweeps", "peer", "stall_timer")

    def __init__(self, server: "BrokerServer") -> None:
        self.server = server
        self.queue = server.queue
        self.transport: asyncio.Transport | None = None
        self.out: list[bytes] = []
        self.busy = False
        self.eof = False
        self.closing = False
        self.paused = False  # reading paused: input piled up behind a blocked reserve
        self.write_paused = False  # the client is not reading its replies
        self.refused = False
        self.authed = server.config.auth_token is None
        self.auth_failures = 0
        self.activity = 0  # bumped on input; the idle sweep compares it between sweeps
        self.idle_sweeps = 0
        self.peer = "?"
        self.stall_timer: asyncio.TimerHandle | None = None
        self.decoder = p.Decoder(server.config.max_job_size, auth_enabled=not self.authed)

    # -- asyncio callbacks ------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = _format_peer(peer)
        limits = self.server.config.limits
        open_now = self.queue.cur_conns
        if limits.max_connections and open_now >= limits.max_connections:
            self._refuse("connections", f"{open_now} open")
            return
        if open_now >= self.server.descriptor_cap:
            # libuv copes with EMFILE silently (accepts and drops); refusing just before it
            # keeps descriptors for the binlog and listeners, and lets us count it.
            self._refuse("accept_errors", f"{open_now} open, near the file descriptor limit")
            return
        transport.set_write_buffer_limits(high=OUTPUT_HIGH_WATER)
        self.client = self.queue.connect(self._deliver, self.peer)
        self.server.connections.add(self)
        if self.server.config.verbose:
            logs.event(log, logging.INFO, "accept", peer=self.peer)

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused = True
        self.closing = True
        self.queue.refusals.refuse(reason, self.peer, detail)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.activity += 1
        if self.authed and not self.client.waiting:
            # The fast path: one command decoded straight from its packet.
            cmd = self.decoder.parse_packet(data)
            if cmd is not None:
                self.busy = True
                try:
                    reply = self._execute(cmd)
                finally:
                    self.busy = False
                if reply is None or reply is _QUIT:
                    self._flush()  # what a reserve got through deliver(), if anything
                elif self.out:
                    self.out.append(reply)
                    self._flush()
                else:
                    self._write(reply)
                if self.queue.timers.earliest_pushed < self.server.timer_when:
                    self.server.reschedule()
                return
        self.decoder.feed(data)
        if self.client.waiting:
            if self.decoder.buffered() > _MAX_BUFFER_WHILE_WAITING and not self.paused:
                self.paused = True
                self.transport.pause_reading()
            return
        self._process()

    def eof_received(self) -> bool:
        self.eof = True
        if not self.closing:
            self._process()
            if not self.client.waiting or self.closing:
                self._close()
        return True

    def connection_lost(self, exc) -> None:
        self.closing = True
        if self.refused:
            return
        self.server.connections.discard(self)
        self.queue.disconnect(self.client)
        self.client.deliver = _discard  # break the client <-> connection cycle
        self.server.reschedule()
        if self.server.config.verbose:
            logs.event(log, logging.INFO, "close", peer=self.peer)

    def pause_writing(self) -> None:
        """The client stopped reading: stop reading its commands until it catches up.

        If it has not caught up after --slow-reader-timeout, close it (its reservations
        go back to ready); a rare event, so one timer handle per stalled connection.
        """
        self.write_paused = True
        if not self.paused:
            self.transport.pause_reading()
        timeout = self.server.config.limits.slow_reader_timeout
        if timeout > 0 and self.stall_timer is None:
            self.stall_timer = asyncio.get_running_loop().call_later(timeout, self._stalled)

    def _stalled(self) -> None:
        self.stall_timer = None
        if self.write_paused and not self.closing:
            self.queue.refusals.refuse("slow_reader", self.peer, f"{self.transport.get_write_buffer_size()} "
                                       f"reply bytes unread for {self.server.config.limits.slow_reader_timeout:g}s")
            self.closing = True
            self.transport.abort()

    def resume_writing(self) -> None:
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None
        self.write_paused = False
        if not self.paused and not self.closing:
            self.transport.resume_reading()
            asyncio.get_running_loop().call_soon(self._resume)

    # -- command loop ---------------------------------------------------------------
    def _process(self) -> None:
        if self.closing:
            return
        if not self.authed and not self._process_unauthenticated():
            return
        queue = self.queue
        client = self.client
        decoder = self.decoder
        out = self.out
        self.busy = True
        handled = 0
        pending = 0  # bytes of the large replies (jobs, stats) gathered since the last write
        try:
            while True:
                handled += 1
                # Write out every 64 commands or 64 KiB of replies: output stays bounded (a
                # client pipelining `peek` of big jobs), back-pressure is noticed promptly.
                if not handled & 63 or pending > _FLUSH_BYTES:
                    pending = 0
                    self._flush()
                    if self.write_paused or self.closing:
                        break
                if client.waiting:
                    if not self.eof:
                        break
                    queue.hangup(client)  # half-closed while blocked: TIMED_OUT, as beanstalkd
                cmd = decoder.next_command()
                if cmd is None:
                    break
                reply = self._execute(cmd)
                if reply is not None:
                    if reply is _QUIT:
                        return
                    out.append(reply)
                    pending += len(reply)
        finally:
            self.busy = False
        self._flush()
        if self.paused and not client.waiting:
            self.paused = False
            self.transport.resume_reading()
        if queue.timers.earliest_pushed < self.server.timer_when:
            self.server.reschedule()

    def _execute(self, cmd: tuple) -> bytes | object | None:
        """Run one decoded command; the reply, None when there is none yet (a reserve now
        waiting, a put header), or _QUIT once the connection is closing."""
        name = cmd[0]
        queue = self.queue
        gate = self.server.write_gate
        if gate is not None and name in gate.commands:
            refusal = gate.refuse(name)
            if refusal is not None:
                return refusal
        if name == "put":
            return queue.put(self.client, cmd[1], cmd[2], cmd[3], cmd[4], cmd[5])
        if name == "reserve":
            queue.op_counts[name] += 1
            return queue.reserve(self.client, -1)
        fn = _SIMPLE.get(name)
        if fn is not None:
            queue.op_counts[name] += 1
            if len(cmd) == 2:
                return fn(queue, self.client, cmd[1])
            return fn(queue, self.client, *cmd[1:])
        if name == "reserve-with-timeout":
            queue.op_counts[name] += 1
            return queue.reserve(self.client, cmd[1])
        if name == "error":
            if cmd[2]:
                queue.op_counts[cmd[2]] += 1
            return cmd[1]
        if name == "put-header":
            queue.put_header(self.client)
        elif name == "too-big":
            queue.op_counts["put"] += 1
        elif name == "quit":
            self._flush()
            self._close()
            return _QUIT
        elif name == "auth":
            return self._check_token(cmd[1])
        return None

    def _flush(self) -> None:
        out = self.out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self.closing:
            return
        if self.server.group_commit:
            self.server.hold_for_commit(self, data)
            return
        sync = self.server.sync_point
        if sync is not None:
            sync()
        self._send(data)

    def _send(self, data: bytes) -> None:
        """Write replies whose changes are already durable as the binlog's -f asks."""
        if self.closing:
            return
        transport = self.transport
        transport.write(data)
        if self.write_paused and transport.get_write_buffer_size() > self.server.config.limits.max_output_bytes:
            self.queue.refusals.refuse("slow_reader", self.peer,
                                       f"{transport.get_write_buffer_size()} reply bytes unread")
            self.closing = True
            transport.abort()  # connection_lost releases its reservations

    def _check_token(self, offered: bytes) -> bytes:
        if security.token_matches(self.server.config.auth_token, offered):
            self.authed = True
            return security.AUTH_OK
        self.auth_failures += 1
        self.queue.refusals.refuse("auth", self.peer, f"wrong token ({self.auth_failures})")
        if self.auth_failures >= security.MAX_AUTH_FAILURES:
            self.out.append(security.UNAUTHORIZED)
            self._flush()
            self._close()
        return security.UNAUTHORIZED

    def _process_unauthenticated(self) -> bool:
        """Before `auth`: answer UNAUTHORIZED to everything. True once authenticated."""
        decoder = self.decoder
        out = self.out
        while not self.authed and not self.closing:
            cmd = decoder.next_command()
            if cmd is None:
                break
            name = cmd[0]
            if name == "auth":
                reply = self._check_token(cmd[1])
                if not self.closing:
                    out.append(reply)
            elif name == "quit":
                self._flush()
                self._close()
            elif name not in ("put-header", "too-big"):
                out.append(security.UNAUTHORIZED)
        self._flush()
        return self.authed and not self.closing

    def _deliver(self, reply: bytes) -> None:
        """A reply produced outside this connection's command loop (woken reserve, timeout)."""
        self.out.append(reply)
        if not self.busy:
            self._flush()
            if self.decoder.buffered() or self.eof:
                asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        if not self.closing and not self.client.waiting and not self.write_paused:
            self._process()
            if self.eof and not self.client.waiting:
                self._close()

    def _close(self) -> None:
        if not self.closing:
            if self.server.held_replies:
                self.server.commit_group()  # this connection's last replies may be held
            self.closing = True
            self.transport.close()


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
        # Called before acknowledging replies go out (binlog fsync with -f 0); None = nothing to do.
        self.sync_point = listener.sync_point if listener is not None else None
        # -f 0: the replies of one loop iteration wait for one fsync (see hold_for_commit).
        self.group_commit = listener is not None and listener.syncs_every_reply
        self.held_replies: list[tuple[BrokerConnection, bytes]] = []
        # Replication hooks (broker.replication): refuses changes on a member that is not the
        # leader, and holds acknowledging replies until enough replicas have their records.
        self.write_gate: WriteGate | None = None
        self.replication_hold: ReplicationHold | None = None
        self.extra_collectors: list[Collector] = []  # more /metrics (replication's)
        self.held_bytes = 0
        self.connections: set[BrokerConnection] = set()
        self.servers: list[asyncio.base_events.Server] = []
        self._timer: asyncio.TimerHandle | None = None
        self.timer_when = NEVER  # when the loop timer is set for (NEVER: not set)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        soft_fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # Connections beyond this are refused: the rest of the descriptors stay for us.
        reserve = min(_RESERVED_DESCRIPTORS, max(8, soft_fd_limit // 4))
        self.descriptor_cap = soft_fd_limit - reserve if soft_fd_limit > 0 else 1 << 30

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
        handshake = {"ssl_handshake_timeout": config.limits.idle_timeout or 10.0} if tls is not None else {}
        main_ctx = tls_ctx if tls is not None and tls.port is None else None
        listen = config.listen
        factory = lambda: BrokerConnection(self)  # noqa: E731
        if listen.startswith("unix:"):
            path = listen[5:]
            if os.path.exists(path):
                os.unlink(path)
            self.servers.append(await loop.create_unix_server(factory, path, ssl=main_ctx,
                                                              **(handshake if main_ctx else {})))
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

    def _loop_error(self, loop, context: dict) -> None:
        """Errors the loop could not hand to a connection (accept failures such as EMFILE)."""
        message = str(context.get("message", ""))
        exc = context.get("exception")
        if "accept" in message.lower() or (isinstance(exc, OSError) and exc.errno in (23, 24)):
            self.queue.refusals.refuse("accept_errors", "listener", f"{message} {exc or ''}".strip())
            return
        loop.default_exception_handler(context)

    def _schedule_idle_sweep(self) -> None:
        interval = max(0.05, self.config.limits.idle_timeout / 4)
        self._idle_timer = self._loop.call_later(interval, self._idle_sweep, interval)

    def _idle_sweep(self, interval: float) -> None:
        """Close connections with no input for --idle-timeout (never one blocked in reserve)."""
        limit = self.config.limits.idle_timeout
        for conn in list(self.connections):
            if conn.activity or conn.client.waiting or conn.busy:
                conn.activity = 0
                conn.idle_sweeps = 0
                continue
            conn.idle_sweeps += 1
            if conn.idle_sweeps * interval >= limit:
                self.queue.refusals.refuse("idle", conn.peer, f"silent for {limit:g}s")
                conn._close()
        self._schedule_idle_sweep()

    def hold_for_commit(self, conn: BrokerConnection, data: bytes) -> None:
        """Group commit: keep a reply until the end of this event-loop iteration.

        Every connection served in one iteration shares one fsync, where beanstalkd's -f 0
        pays one per command. Replies still leave only after the fsync (nothing is
        acknowledged before it is durable), and in order, since every reply of every
        connection goes through here while group commit is on.
        """
        if not self.held_replies:
            self._loop.call_soon(self.commit_group)
        self.held_replies.append((conn, data))
        self.held_bytes += len(data)
        if self.held_bytes > OUTPUT_HIGH_WATER:
            self.commit_group()  # big replies (peek floods): write now, so back-pressure can act

    def commit_group(self) -> None:
        held = self.held_replies
        if not held:
            return
        self.held_replies = []
        self.held_bytes = 0
        self.sync_point()
        if self.replication_hold is not None and self.replication_hold.hold(held):
            return  # sent by the hold once enough replicas have the records (--sync-replicas)
        for conn, data in held:
            conn._send(data)

    def is_leader(self) -> bool:
        """For /readyz and load balancers: False only on a replicated member that does not lead now."""
        return self.write_gate is None or self.write_gate.is_leader()

    def addresses(self) -> list[str]:
        result = []
        for server in self.servers:
            for sock in server.sockets:
                name = sock.getsockname()
                result.append(name if isinstance(name, str) else f"{name[0]}:{name[1]}")
        return result

    def reschedule(self) -> None:
        """Point the one loop timer at the queue's earliest deadline, if something earlier
        than the current timer was pushed. Stale entries at the top of the heap are left
        for the timer to skip when it fires."""
        timers = self.queue.timers
        if timers.earliest_pushed >= self.timer_when:
            timers.earliest_pushed = NEVER
            return
        timers.earliest_pushed = NEVER
        when = self.queue.next_deadline()
        if when is None or when >= self.timer_when:
            return
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, (when - self.clock()) / 1e9)
        self.timer_when = when
        self._timer = self._loop.call_later(delay + 0.0005, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.timer_when = NEVER
        self.queue.tick()
        self.queue.timers.earliest_pushed = 0  # whatever is left is due later: look again
        self.reschedule()

    def drain(self) -> None:
        """SIGUSR1: refuse new jobs (put answers DRAINING), keep serving the rest."""
        self.queue.draining = True
        logs.event(log, logging.WARNING, "drain", "put now answers DRAINING")

    def request_stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    async def serve_until_stopped(self) -> None:
        await self._stopped.wait()
        await self.close()

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        for conn in list(self.connections):
            conn._close()
        for server in self.servers:
            await server.wait_closed()
        if self._timer is not None:
            self._timer.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self.listener is not None:
            self.listener.close()


class WriteGate(Protocol):
    """Refuses the commands in ``commands`` while this member may not change the queue."""

    commands: frozenset[str]

    def refuse(self, name: str) -> bytes | None: ...

    def is_leader(self) -> bool: ...


class ReplicationHold(Protocol):
    """Takes a group of replies that must wait for replicas; False: send them now."""

    def hold(self, replies: list[tuple[BrokerConnection, bytes]]) -> bool: ...


def _discard(_reply: bytes) -> None:
    """deliver() of a closed connection."""


def _format_peer(peer) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) if peer else "unix"


def install_uvloop() -> bool:
    """Use uvloop when it is installed (it roughly halves per-command overhead)."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def tune_gc() -> None:
    """Keep the cyclic GC from walking every held job.

    A broker holds up to millions of long-lived, acyclic job objects; the default
    thresholds make Python re-scan them again and again while a queue fills. The queue
    breaks its own reference cycles when connections and tubes go away, so collections
    can be rare: what exists at start is frozen out of the scan, and young-generation
    collections run only every 50,000 net allocations.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


async def run_server(config: ServerConfig, listener: QueueListener | None = None,
                     on_ready: Callable[[BrokerServer], None] | None = None,
                     before_start: Callable[[BrokerServer], None] | None = None) -> None:
    tune_gc()
    server = BrokerServer(config, listener)
    loop = asyncio.get_running_loop()
    server._stopped = asyncio.Event()
    # Handlers first: once the port accepts connections, signals must already be ours.
    loop.add_signal_handler(signal.SIGTERM, server.request_stop)
    loop.add_signal_handler(signal.SIGINT, server.request_stop)
    loop.add_signal_handler(signal.SIGUSR1, server.drain)
    if listener is not None:
        listener.recover(server.queue)
        gc.freeze()  # the recovered jobs are long-lived: keep them out of future collections
    if before_start is not None:
        before_start(server)  # replication: gates and hooks in place before the first client
    await server.start()
    if on_ready is not None:
        on_ready(server)
    await server.serve_until_stopped()
