"""Plain-TCP client listeners on the C transport (broker/_netio.c), where it was built.

Why: the last per-command cost a Python broker can shed at depth 1 is the event loop's own
per-connection work; the C transport serves every ready client socket from one loop
callback (see the module's header and bench/README.md, "Past the ceiling").

What stays on uvloop: the loop, timers and busy polling, TLS and Unix-socket listeners, the
HTTP and replication listeners, and every client connection when the C transport is not
available: the interpreted build (``SPARK_BEANSTALK_PURE=1``, no C compiler), a build older
than its source, or ``SPARK_BEANSTALK_NETIO=0``.
"""
from __future__ import annotations

import asyncio
import errno
import importlib
import socket
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from broker import _build

NETIO_ENV = "SPARK_BEANSTALK_NETIO"
MODULE = "broker._netio"
SOURCE = Path(__file__).resolve().with_name("_netio.c")
# accept() errors that mean "out of descriptors or memory": asyncio stops accepting for a
# second rather than spinning on a listener that stays readable.
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_PAUSE = 1.0
_NONBLOCKING_STREAM = socket.SOCK_STREAM | getattr(socket, "SOCK_NONBLOCK", 0)  # (the C transport is Linux only)


def status() -> tuple[ModuleType | None, str]:
    """The C transport module if this process should use it, and why (or why not) in words."""
    if not _build.env_flag(NETIO_ENV, default=True):
        return None, f"uvloop transports ({NETIO_ENV}=0)"
    if not _build.inspect_build().compiled:
        return None, "uvloop transports (interpreted build)"
    ext = _build.extension(MODULE)
    if ext is None:
        return None, "uvloop transports (broker/_netio.c not built)"
    if _build.older_than_source(ext, SOURCE):
        return None, "uvloop transports (broker/_netio older than its source: rebuild)"
    try:
        return importlib.import_module(MODULE), "C transport (broker/_netio.c)"
    except ImportError as exc:
        return None, f"uvloop transports (broker._netio does not load: {exc})"


def available() -> bool:
    return status()[0] is not None


class NetioServer(asyncio.AbstractServer):
    """The listening sockets of one address, accepting into C transports; stands in for the
    ``asyncio.Server`` that ``loop.create_server`` returns (sockets, close, wait_closed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, netio: ModuleType, sockets: list[socket.socket],
                 factory: Callable[[], asyncio.Protocol], backlog: int) -> None:
        self._loop = loop
        self._sockets = sockets
        self._factory = factory
        self._backlog = backlog
        self._serving = True
        self._poller: Any = netio.Poller(loop)
        self._transport_type: Any = netio.Transport
        self._accept_fd: Callable[[int], tuple[int, Any] | None] = netio.accept
        loop.add_reader(self._poller.fileno(), self._poller.poll)
        for sock in sockets:
            loop.add_reader(sock.fileno(), self._accept, sock, int(sock.family))

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The listening sockets; none once closed (as asyncio.Server.sockets)."""
        return tuple(self._sockets) if self._serving else ()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    def live_connections(self) -> int:
        """Connections accepted whose connection_lost has not run yet."""
        return int(self._poller.live())

    def reply_batches(self) -> tuple[int, int]:
        """(batches of replies sent back to back, connections answered in them) so far (broker/_netio.c's
        header, "Replies leave in batches")."""
        batches, connections = self._poller.batches()
        return int(batches), int(connections)

    def _accept(self, sock: socket.socket, family: int) -> None:
        accept = self._accept_fd
        listening = sock.fileno()
        for _ in range(self._backlog):
            try:
                accepted = accept(listening)  # (fd, peername), or None once none is waiting
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRNOS:
                    raise
                self._loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                                   "exception": exc, "socket": sock})
                self._loop.remove_reader(listening)
                self._loop.call_later(ACCEPT_PAUSE, self._resume_accepting, sock, family)
                return
            if accepted is None:
                return
            fd, peer = accepted
            # Made non-blocking by accept itself: the flag in the type only tells the object so (no syscall),
            # as the explicit family, type and proto spare it the lookups of its own.
            conn = socket.socket(family, _NONBLOCKING_STREAM, 0, fd)
            protocol = self._factory()
            transport = self._transport_type(self._poller, conn, protocol, peer)
            # From the loop, as asyncio's transports call it: a connection_lost already scheduled in
            # this iteration (a client that hung up as another connected) runs first, so a
            # --max-connections count does not refuse the newcomer for a connection already gone.
            self._loop.call_soon(self._made, transport, protocol)

    def _resume_accepting(self, sock: socket.socket, family: int) -> None:
        if self._serving:
            self._loop.add_reader(sock.fileno(), self._accept, sock, family)

    def _made(self, transport: Any, protocol: asyncio.Protocol) -> None:
        try:
            protocol.connection_made(transport)
        except Exception as exc:  # noqa: BLE001 - asyncio reports it and drops the connection too
            self._loop.call_exception_handler({"message": "protocol.connection_made() failed",
                                               "exception": exc, "transport": transport, "protocol": protocol})
            transport.abort()
            return
        transport.start()

    def close(self) -> None:
        """Stop accepting (open connections are the broker's to close)."""
        if not self._serving:
            return
        self._serving = False
        for sock in self._sockets:
            self._loop.remove_reader(sock.fileno())
            sock.close()

    async def start_serving(self) -> None:
        return None

    async def serve_forever(self) -> None:
        raise NotImplementedError("the broker runs its own wait (BrokerServer.serve_until_stopped)")

    async def wait_closed(self) -> None:
        """Let the connection_lost callbacks of closed connections run, then give the epoll set
        back once none is left (asyncio 3.11's Server.wait_closed does not wait for them either)."""
        await asyncio.sleep(0)
        if not self._serving and self._poller.live() == 0 and self._poller.fileno() >= 0:
            self._loop.remove_reader(self._poller.fileno())
            self._poller.close()


def _listening_sockets(infos: list[Any], backlog: int) -> list[socket.socket]:
    """Bind every address a host name resolves to, as ``loop.create_server`` does."""
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _canon, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise OSError(exc.errno, f"error while attempting to bind on address {address!r}: "
                                         f"{exc.strerror.lower() if exc.strerror else exc}") from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def create_server(netio: ModuleType, factory: Callable[[], asyncio.Protocol], host: str | None,
                        port: int, backlog: int = 1024) -> NetioServer:
    """``loop.create_server(factory, host, port, reuse_address=True, backlog=...)`` on the C transport."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    if not infos:
        raise OSError(f"getaddrinfo({host!r}) returned an empty list")
    return NetioServer(loop, netio, _listening_sockets(infos, backlog), factory, backlog)
