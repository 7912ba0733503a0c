"""The broker's one HTTP listener (``--http ADDR:PORT``, formerly ``--metrics``).

Serves, from the broker's own event loop with aiohttp:

* ``/metrics``: Prometheus text (broker/metrics.py);
* ``/healthz``: 200 while the process serves HTTP at all (a liveness probe);
* ``/readyz``: 200 when the broker accepts connections, its binlog directory takes
  writes and it is not draining; else 503 with the reasons, one a line (a readiness
  probe: load balancers stop sending clients, systemd/Kubernetes wait for it);
* ``/`` and below: the web dashboard (spark_beanstalk/dashboard), talking the beanstalk
  protocol to this broker over an in-process socket pair, so it needs no listener of
  ours and sees exactly what clients see.

The socket is bound before the broker starts (so a taken port is a clear error at
start), and served once the broker is up. Nothing here imports broker.server: the
broker is read through the small BrokerView protocol.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aiohttp import web

from beanstalk_rules.hosts import parse_listen
from beanstalk_rules.httplog import quiet_bad_requests
from broker.metrics import HasQueue, metrics_text
from broker.queue import QueueListener

log = logging.getLogger("broker.http")
PROBE_NAME = ".readyz-probe"  # never a segment name, so the binlog ignores it


class _Config(Protocol):
    @property
    def auth_token(self) -> bytes | None: ...


class BrokerView(HasQueue, Protocol):
    """What the HTTP listener reads from the broker (broker.server.BrokerServer)."""

    @property
    def config(self) -> _Config: ...

    @property
    def listener(self) -> QueueListener | None: ...

    @property
    def servers(self) -> Sequence[asyncio.AbstractServer]: ...

    def addresses(self) -> list[str]: ...

    def is_leader(self) -> bool: ...


class HttpAddressError(ValueError):
    """--http was not ADDR:PORT, or the port cannot be bound."""


def bind(address: str) -> socket.socket:
    """Bind ``ADDR:PORT`` now; raises HttpAddressError with a sentence for the operator."""
    try:
        host, port = parse_listen(address)
    except ValueError as exc:
        raise HttpAddressError(str(exc)) from None
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    reuse_port=False)
    except OSError as exc:
        raise HttpAddressError(f"cannot listen on {address}: {exc.strerror or exc}") from None
    except OverflowError:
        raise HttpAddressError(f"port out of range in {address!r}") from None


def is_loopback(sock: socket.socket) -> bool:
    try:
        return ipaddress.ip_address(sock.getsockname()[0]).is_loopback
    except ValueError:
        return False


def _probe_write(directory: str) -> str | None:
    """Create, write and remove a small file in the binlog directory: None, or why it failed."""
    path = os.path.join(directory, PROBE_NAME)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"ok\n")
        finally:
            os.close(fd)
        os.unlink(path)
    except OSError as exc:
        return f"binlog directory {directory} is not writable: {exc.strerror or exc}"
    return None


async def readiness(server: BrokerView) -> list[str]:
    """Why the broker should not get new clients now (empty: ready)."""
    reasons = []
    if not server.servers or not all(s.is_serving() for s in server.servers):
        reasons.append("not accepting connections")
    if server.queue.draining:
        reasons.append("draining (SIGUSR1): put answers DRAINING")
    write_error = getattr(server.listener, "write_error", None)
    if isinstance(write_error, str):
        reasons.append(f"binlog cannot write: {write_error}")
    if not server.is_leader():
        reasons.append("not the leader of its replicated broker: changes are refused here")
    directory = getattr(server.listener, "dir", None)
    if isinstance(directory, str):
        problem = await asyncio.to_thread(_probe_write, directory)
        if problem is not None:
            reasons.append(problem)
    return reasons


class HttpListener:
    """The aiohttp application on the pre-bound socket, run in the broker's loop."""

    def __init__(self, server: BrokerView, sock: socket.socket,
                 local_protocol: Callable[[], asyncio.Protocol] | None = None) -> None:
        self.server = server
        self.sock = sock
        self.local_protocol = local_protocol
        self.app = web.Application()
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/readyz", self.readyz)
        if local_protocol is not None:
            self._add_dashboard()
        self._runner: web.AppRunner | None = None
        self._task: asyncio.Task[None] | None = None

    def address(self) -> str:
        name = self.sock.getsockname()
        return f"{name[0]}:{name[1]}"

    def start_soon(self) -> None:
        """From the broker's (synchronous) on_ready hook: start serving in its loop."""
        self._task = asyncio.get_running_loop().create_task(self.start(), name="http listener")
        self._task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the HTTP listener on %s did not start: %r", self.address(), task.exception())

    async def start(self) -> None:
        quiet_bad_requests()
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, self.sock).start()

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        self.sock.close()

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=metrics_text(self.server),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, _request: web.Request) -> web.Response:
        reasons = await readiness(self.server)
        if reasons:
            return web.Response(status=503, text="".join(f"{r}\n" for r in reasons))
        return web.Response(text="ready\n")

    # -- dashboard ------------------------------------------------------------------
    async def _open_local(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A client connection to this broker over a socket pair (no TCP, TLS or listener needed)."""
        assert self.local_protocol is not None
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(self.local_protocol, ours)
        return await asyncio.open_connection(sock=theirs)

    def _add_dashboard(self) -> None:
        from spark_beanstalk.aio import AsyncConnection
        from spark_beanstalk.dashboard.app import create_app
        from spark_beanstalk.dashboard.guard import Guard
        from spark_beanstalk.dashboard.sampler import Endpoint

        token = self.server.config.auth_token
        listener = self.server.listener

        async def connect() -> AsyncConnection:
            return await AsyncConnection.open(self._open_local, "this broker", token)

        def extra() -> dict[str, Any]:
            return {"binlog_bytes": listener.stats().get("bytes")} if listener is not None else {}

        open_to_all = token is None and not is_loopback(self.sock)
        guard = Guard(action_token=token, read_only=open_to_all,
                      read_only_reason="the HTTP listener is reachable from other machines and the broker has "
                                       "no --auth-token-file, so actions are off")
        name = ",".join(self.server.addresses()) or "this broker"
        create_app([Endpoint(name, connect, extra)], guard, title=f"spark-beanstalk broker {name}", app=self.app)
