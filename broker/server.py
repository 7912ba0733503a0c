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
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

from broker import protocol as p
from broker.queue import Client, Queue, QueueListener

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


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1"
    port: int = 11300
    max_job_size: int = p.DEFAULT_MAX_JOB_SIZE
    verbose: int = 0
    extra: dict = field(default_factory=dict)


class BrokerConnection(asyncio.Protocol):
    """One client connection."""

    __slots__ = ("server", "queue", "transport", "client", "decoder", "out", "busy", "eof",
                 "closing", "paused")

    def __init__(self, server: "BrokerServer") -> None:
        self.server = server
        self.queue = server.queue
        self.transport: asyncio.Transport | None = None
        self.out: list[bytes] = []
        self.busy = False
        self.eof = False
        self.closing = False
        self.paused = False
        self.decoder = p.Decoder(server.config.max_job_size)

    # -- asyncio callbacks ------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = self.queue.connect(self._deliver, str(peer) if peer else "unix")
        self.server.connections.add(self)
        if self.server.config.verbose:
            log.info("accept %s", self.client.peer)

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        if self.client.waiting:
            if self.decoder.buffered() > _MAX_BUFFER_WHILE_WAITING and not self.paused:
                self.paused = True
                self.transport.pause_reading()
            return
        self._process()

    def eof_received(self) -> bool:
        self.eof = True
        self._process()
        self._close()
        return True

    def connection_lost(self, exc) -> None:
        self.closing = True
        self.server.connections.discard(self)
        self.queue.disconnect(self.client)
        self.server.reschedule()
        if self.server.config.verbose:
            log.info("close %s", self.client.peer)

    # -- command loop ---------------------------------------------------------------
    def _process(self) -> None:
        if self.closing:
            return
        queue = self.queue
        client = self.client
        decoder = self.decoder
        out = self.out
        simple = _SIMPLE
        counts = queue.op_counts
        self.busy = True
        try:
            while True:
                if client.waiting:
                    if not self.eof:
                        break
                    queue.hangup(client)  # half-closed while blocked: TIMED_OUT, as beanstalkd
                cmd = decoder.next_command()
                if cmd is None:
                    break
                name = cmd[0]
                if name == "put":
                    out.append(queue.put(client, cmd[1], cmd[2], cmd[3], cmd[4], cmd[5]))
                    continue
                fn = simple.get(name)
                if fn is not None:
                    counts[name] += 1
                    out.append(fn(queue, client, *cmd[1:]))
                elif name == "reserve":
                    counts[name] += 1
                    reply = queue.reserve(client, -1)
                    if reply is not None:
                        out.append(reply)
                elif name == "reserve-with-timeout":
                    counts[name] += 1
                    reply = queue.reserve(client, cmd[1])
                    if reply is not None:
                        out.append(reply)
                elif name == "error":
                    if cmd[2]:
                        counts[cmd[2]] += 1
                    out.append(cmd[1])
                elif name == "put-header":
                    queue.put_header(client)
                elif name == "too-big":
                    counts["put"] += 1
                elif name == "quit":
                    self._flush()
                    self._close()
                    return
        finally:
            self.busy = False
        self._flush()
        if self.paused and not client.waiting:
            self.paused = False
            self.transport.resume_reading()
        self.server.reschedule()

    def _flush(self) -> None:
        out = self.out
        if out and not self.closing:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()

    def _deliver(self, reply: bytes) -> None:
        """A reply produced outside this connection's command loop (woken reserve, timeout)."""
        self.out.append(reply)
        if not self.busy:
            self._flush()
            if self.decoder.buffered() or self.eof:
                asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        if not self.closing and not self.client.waiting:
            self._process()
            if self.eof:
                self._close()

    def _close(self) -> None:
        if not self.closing:
            self.closing = True
            self.transport.close()


class BrokerServer:
    """Owns the queue, the listening sockets and the one timer."""

    def __init__(self, config: ServerConfig, listener: QueueListener | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.config = config
        self.clock = clock
        self.queue = Queue(clock, max_job_size=config.max_job_size, listener=listener)
        self.connections: set[BrokerConnection] = set()
        self.servers: list[asyncio.base_events.Server] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        listen = self.config.listen
        if listen.startswith("unix:"):
            path = listen[5:]
            if os.path.exists(path):
                os.unlink(path)
            server = await self._loop.create_unix_server(lambda: BrokerConnection(self), path)
        else:
            server = await self._loop.create_server(lambda: BrokerConnection(self), listen, self.config.port,
                                                    reuse_address=True, backlog=1024)
        self.servers.append(server)

    def addresses(self) -> list[str]:
        result = []
        for server in self.servers:
            for sock in server.sockets:
                name = sock.getsockname()
                result.append(name if isinstance(name, str) else f"{name[0]}:{name[1]}")
        return result

    def reschedule(self) -> None:
        """Point the one loop timer at the queue's earliest deadline."""
        when = self.queue.next_deadline()
        if when is None:
            return
        if self._timer_when is not None and self._timer_when <= when and self._timer is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, (when - self.clock()) / 1e9)
        self._timer_when = when
        self._timer = self._loop.call_later(delay + 0.0005, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_when = None
        self.queue.tick()
        self.reschedule()

    def drain(self) -> None:
        """SIGUSR1: refuse new jobs (put answers DRAINING), keep serving the rest."""
        self.queue.draining = True
        log.warning("entering drain mode: put now answers DRAINING")

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


def install_uvloop() -> bool:
    """Use uvloop when it is installed (it roughly halves per-command overhead)."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


async def run_server(config: ServerConfig, listener: QueueListener | None = None,
                     on_ready: Callable[[BrokerServer], None] | None = None) -> None:
    server = BrokerServer(config, listener)
    await server.start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, server.request_stop)
    loop.add_signal_handler(signal.SIGINT, server.request_stop)
    loop.add_signal_handler(signal.SIGUSR1, server.drain)
    if on_ready is not None:
        on_ready(server)
    await server.serve_until_stopped()
