"""The C transport of plain-TCP client connections (broker/_netio.c, broker/netio.py).

Real sockets on 127.0.0.1 and a real uvloop loop in this process; each test checks one of
the asyncio Transport semantics the broker's connections rely on. The broker itself runs
on this transport in every other test of the compiled pass (tests/test_server_*.py,
tests/test_hardening.py, the client suites); the interpreted pass runs uvloop's.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import pytest
import uvloop

from broker import _build, netio
from broker.server import BrokerServer
from broker.state import ServerConfig
from spark_beanstalk.client import Connection
from tests.helpers import ServerProcess, broker_process, free_port, wait_until, wait_until_async

TIMEOUT = 10.0


def c_transport() -> ModuleType:
    """The built extension itself (it does not depend on the mypyc build). CI always builds it; only
    an install that skipped the compile on purpose (SPARK_BEANSTALK_NO_COMPILE=1) has none to test."""
    try:
        return importlib.import_module(netio.MODULE)
    except ImportError:
        if os.environ.get(_build.NO_COMPILE_ENV, "").strip() not in ("", "0"):
            pytest.skip(f"{_build.NO_COMPILE_ENV} is set: no C transport was built")
        raise


class Recorder(asyncio.Protocol):
    """Records every callback; ``on_data`` lets a test answer."""

    def __init__(self, on_data: Callable[[Recorder, bytes], None] | None = None, keep_open: bool = False) -> None:
        self.on_data = on_data
        self.keep_open = keep_open
        self.transport: Any = None
        self.data = bytearray()
        self.events: list[Any] = []
        self.lost: list[BaseException | None] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.events.append("made")

    def data_received(self, data: bytes) -> None:
        self.data += data
        if self.on_data is not None:
            self.on_data(self, data)

    def eof_received(self) -> bool:
        self.events.append("eof")
        return self.keep_open

    def connection_lost(self, exc: BaseException | None) -> None:
        self.events.append("lost")
        self.lost.append(exc)

    def pause_writing(self) -> None:
        self.events.append("pause")

    def resume_writing(self) -> None:
        self.events.append("resume")


def run(test: Callable[[], Awaitable[None]]) -> None:
    uvloop.run(asyncio.wait_for(test(), 60))


async def serve(protocols: list[Recorder], make: Callable[[], Recorder] = Recorder) -> tuple[netio.NetioServer, int]:
    def factory() -> Recorder:
        proto = make()
        protocols.append(proto)
        return proto

    server = await netio.create_server(c_transport(), factory, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def client(port: int, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:  # before connecting: the window is set at the handshake
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(TIMEOUT)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


async def recv_exactly(sock: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while len(got) < size:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, size - len(got)), TIMEOUT)
        if not chunk:
            break
        got += chunk
    return bytes(got)


async def recv_until_eof(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    got = bytearray()
    while True:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), TIMEOUT)
        if not chunk:
            return bytes(got)
        got += chunk


def echo(proto: Recorder, data: bytes) -> None:
    proto.transport.write(data.upper())


def test_commands_from_many_connections_are_answered_in_order() -> None:
    async def body() -> None:
        protos: list[Recorder] = []
        server, port = await serve(protos, lambda: Recorder(echo))
        socks = [await client(port) for _ in range(20)]
        loop = asyncio.get_running_loop()
        for round_ in range(50):
            for i, sock in enumerate(socks):
                await loop.sock_sendall(sock, f"c{i}r{round_};".encode())
            for i, sock in enumerate(socks):
                want = f"C{i}R{round_};".encode()
                assert await recv_exactly(sock, len(want)) == want
        assert [p.events for p in protos] == [["made"]] * 20
        for sock in socks:
            sock.close()
        await wait_until_async(lambda: all(p.lost for p in protos), TIMEOUT, "connection_lost on every connection")
        assert all(p.lost == [None] for p in protos)  # exactly once each, no error for a clean close
        server.close()
        await server.wait_closed()
        assert server.live_connections() == 0

    run(body)


def arrived(sock: socket.socket) -> bool:
    """Whether a reply waits on this client socket (without taking it)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False


def sender(data: bytes) -> int:
    """The index of the client that sent this command (commands_in_one_poll)."""
    return int(data.rstrip(b";"))


def close_all(server: netio.NetioServer, socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()
    server.close()


async def commands_in_one_poll(count: int, make: Callable[[], Recorder]) -> tuple[
        netio.NetioServer, list[Recorder], list[socket.socket]]:
    """``count`` connected clients, then client i sends ``b"%d;" % i`` on each, all before the loop runs
    again: on loopback a send() queues the data on the server's socket at once, so one poll of the
    server finds every socket ready."""
    protos: list[Recorder] = []
    server, port = await serve(protos, make)
    socks = [await client(port) for _ in range(count)]
    await wait_until_async(lambda: len(protos) == count, TIMEOUT, "every connection accepted")
    await asyncio.sleep(0)  # the accepts' transports start reading
    for i, sock in enumerate(socks):
        sock.send(b"%d;" % i)
    return server, protos, socks


def test_replies_made_in_one_poll_leave_together_after_it() -> None:
    """broker/_netio.c, "Replies leave in batches": while a poll serves its ready sockets, no reply
    is sent until the last of them has been read; then every one is."""
    served: list[int] = []
    seen_early: list[int] = []
    socks: list[socket.socket] = []

    made: list[bytes] = []
    held_by_transport: list[bool] = []

    def answer(proto: Recorder, data: bytes) -> None:
        served.append(sender(data))
        seen_early.extend(i for i in served[:-1] if arrived(socks[i]))
        reply = b"reply %d;" % served[-1]
        made.append(reply)
        proto.transport.write(reply)
        held_by_transport.append(any(ref is proto.transport for ref in gc.get_referrers(reply)))

    async def body() -> None:
        server, protos, clients = await commands_in_one_poll(5, lambda: Recorder(answer))
        socks.extend(clients)
        for i, sock in enumerate(socks):
            want = b"reply %d;" % i
            assert await recv_exactly(sock, len(want)) == want
        assert sorted(served) == list(range(5))
        assert seen_early == [], f"replies sent before the poll had read every socket: {seen_early}"
        assert server.reply_batches() == (1, 5)
        # Held by reference, not copied into the connection's buffer; let go once sent.
        assert held_by_transport == [True] * 5
        assert not any(isinstance(ref, type(protos[0].transport)) for reply in made for ref in gc.get_referrers(reply))
        close_all(server, socks)

    run(body)


def test_a_poll_sends_the_held_replies_every_32_connections() -> None:
    """The bound on holding: a reply waits for at most 32 other connections' commands."""
    served: list[int] = []
    seen: list[int] = []  # when connection k of this poll is served: how many replies have left
    socks: list[socket.socket] = []

    def answer(proto: Recorder, data: bytes) -> None:
        seen.append(sum(arrived(socks[i]) for i in served))
        served.append(sender(data))
        proto.transport.write(b"ok;")

    async def body() -> None:
        server, _, clients = await commands_in_one_poll(70, lambda: Recorder(answer))
        socks.extend(clients)
        for sock in socks:
            assert await recv_exactly(sock, 3) == b"ok;"
        assert len(served) == 70
        assert seen == [0] * 33 + [32] * 32 + [64] * 5
        assert server.reply_batches() == (3, 70)
        close_all(server, socks)

    run(body)


def test_held_replies_keep_their_order_and_close_sends_them_abort_drops_them() -> None:
    """Several writes of one connection in a batch leave in order, and a reply too large to hold goes after
    what the connection holds; close() sends what is held and then closes; abort() drops it; a write
    outside a poll (a callback of the loop) leaves at once; a mutable buffer is copied, not referenced."""
    big = b"b" * (64 * 1024)
    sent_at_once: list[bool] = []
    socks: list[socket.socket] = []

    def answer(proto: Recorder, data: bytes) -> None:
        index = sender(data)
        if index == 0:
            proto.transport.write(b"small;")
            assert proto.transport.get_write_buffer_size() == 6  # held, and counted as buffered
            proto.transport.write(b"more;")  # after the held one
            proto.transport.write(big)  # past the hold's 16 KiB: sent now, after what is held
            proto.transport.write(b";end")
        elif index == 4:
            mutable = bytearray(b"as written")
            proto.transport.write(mutable)  # not bytes: copied when held, as asyncio's transports copy
            mutable[:] = b"overwritten"
        elif index == 1:
            proto.transport.write(b"bye")
            proto.transport.close()
            proto.transport.write(b"dropped")  # after close(), as asyncio drops it
        elif index == 2:
            proto.transport.write(b"never")
            proto.transport.abort()
        else:
            def later() -> None:
                proto.transport.write(b"later")
                sent_at_once.append(arrived(socks[3]))
            asyncio.get_running_loop().call_soon(later)

    async def body() -> None:
        server, protos, clients = await commands_in_one_poll(5, lambda: Recorder(answer))
        socks.extend(clients)
        want = b"small;more;" + big + b";end"
        assert await recv_exactly(socks[0], len(want)) == want
        assert await recv_until_eof(socks[1]) == b"bye"
        with contextlib.suppress(ConnectionResetError):
            assert await recv_until_eof(socks[2]) == b""
        assert await recv_exactly(socks[3], 5) == b"later"
        assert sent_at_once == [True]
        assert await recv_exactly(socks[4], 10) == b"as written"
        await wait_until_async(lambda: protos[1].lost and protos[2].lost, TIMEOUT, "connection_lost")
        assert protos[1].lost == [None] and protos[2].lost == [None]
        assert protos[1].events == ["made", "lost"]
        close_all(server, socks)

    run(body)


def test_a_peer_reset_while_its_reply_is_held_loses_only_that_connection() -> None:
    """The fault path of a held reply: its client resets during the poll, the send at the batch's end fails, and
    that connection is lost with the error, once; the others of the batch get their replies."""
    socks: list[socket.socket] = []

    def answer(proto: Recorder, data: bytes) -> None:
        index = sender(data)
        proto.transport.write(b"reply %d;" % index)  # held until the poll has read every socket
        if index == 1:
            peer = socks[1]
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            peer.close()  # RST, on loopback at once: the held reply's send meets it

    async def body() -> None:
        server, protos, clients = await commands_in_one_poll(3, lambda: Recorder(answer))
        socks.extend(clients)
        for i in (0, 2):
            want = b"reply %d;" % i
            assert await recv_exactly(socks[i], len(want)) == want
        await wait_until_async(lambda: protos[1].lost, TIMEOUT, "connection_lost of the reset connection")
        assert len(protos[1].lost) == 1 and isinstance(protos[1].lost[0], OSError), protos[1].lost
        assert protos[1].transport.get_write_buffer_size() == 0
        assert protos[0].lost == [] and protos[2].lost == []
        assert server.reply_batches() == (1, 3)
        close_all(server, [socks[0], socks[2]])

    run(body)


def test_close_delivers_everything_buffered_with_flow_control_then_eof() -> None:
    """A reply larger than the socket takes: the rest is buffered, the protocol paused above
    the high-water mark and resumed once drained; close() sends it all before closing."""
    payload = bytes(range(256)) * (64 * 1024)  # 16 MiB: far more than the sockets buffer

    def answer(proto: Recorder, data: bytes) -> None:
        proto.transport.write(payload)
        assert proto.transport.get_write_buffer_size() > 0
        proto.transport.close()
        proto.transport.write(b"after close")  # dropped, as asyncio drops it
        assert proto.lost == []  # connection_lost runs from the loop, never inside close()

    async def body() -> None:
        protos: list[Recorder] = []
        server, port = await serve(protos, lambda: Recorder(answer))
        sock = await client(port, rcvbuf=4096)
        await asyncio.get_running_loop().sock_sendall(sock, b"go")
        await wait_until_async(lambda: protos and "pause" in protos[0].events, TIMEOUT, "pause_writing")
        got = await recv_until_eof(sock)
        assert got == payload
        await wait_until_async(lambda: protos[0].lost, TIMEOUT, "connection_lost")
        assert protos[0].events == ["made", "pause", "resume", "lost"]
        assert protos[0].lost == [None]
        sock.close()
        server.close()

    run(body)


def test_abort_drops_the_buffer_and_loses_the_connection_once() -> None:
    payload = b"x" * (16 << 20)

    def answer(proto: Recorder, data: bytes) -> None:
        proto.transport.write(payload)
        proto.transport.abort()
        proto.transport.abort()
        proto.transport.close()

    async def body() -> None:
        protos: list[Recorder] = []
        server, port = await serve(protos, lambda: Recorder(answer))
        sock = await client(port, rcvbuf=4096)
        await asyncio.get_running_loop().sock_sendall(sock, b"go")
        await wait_until_async(lambda: protos and protos[0].lost, TIMEOUT, "connection_lost")
        got = len(await recv_until_eof(sock))
        assert got < len(payload)
        assert protos[0].lost == [None]
        assert protos[0].transport.get_write_buffer_size() == 0
        sock.close()
        server.close()

    run(body)


@pytest.mark.parametrize("keep_open", [True, False])
def test_a_client_half_close_keeps_the_connection_writable_only_if_the_protocol_asks(keep_open: bool) -> None:
    async def body() -> None:
        protos: list[Recorder] = []
        server, port = await serve(protos, lambda: Recorder(keep_open=keep_open))
        sock = await client(port)
        await asyncio.get_running_loop().sock_sendall(sock, b"last words")
        sock.shutdown(socket.SHUT_WR)
        await wait_until_async(lambda: protos and "eof" in protos[0].events, TIMEOUT, "eof_received")
        assert bytes(protos[0].data) == b"last words"
        if keep_open:
            assert not protos[0].transport.is_reading()
            protos[0].transport.write(b"reply after eof")
            protos[0].transport.close()
            assert await recv_until_eof(sock) == b"reply after eof"
        else:
            assert await recv_until_eof(sock) == b""
        await wait_until_async(lambda: protos[0].lost, TIMEOUT, "connection_lost")
        assert protos[0].events == ["made", "eof", "lost"]
        sock.close()
        server.close()

    run(body)


def test_pause_reading_holds_input_until_resumed() -> None:
    async def body() -> None:
        protos: list[Recorder] = []
        server, port = await serve(protos)
        sock = await client(port)
        loop = asyncio.get_running_loop()
        await wait_until_async(lambda: protos and protos[0].transport, TIMEOUT, "accept")
        proto = protos[0]
        await loop.sock_sendall(sock, b"one")
        await wait_until_async(lambda: proto.data == b"one", TIMEOUT, "first input")
        proto.transport.pause_reading()
        assert not proto.transport.is_reading()
        await loop.sock_sendall(sock, b"two")
        sock.shutdown(socket.SHUT_WR)  # neither the data nor the EOF may be seen while paused
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            assert proto.data == b"one" and "eof" not in proto.events
        proto.transport.resume_reading()
        await wait_until_async(lambda: "eof" in proto.events, TIMEOUT, "eof after resume")
        assert proto.data == b"onetwo"
        proto.transport.close()
        await wait_until_async(lambda: proto.lost, TIMEOUT, "connection_lost")
        sock.close()
        server.close()

    run(body)


def test_an_exception_in_data_received_is_reported_and_aborts_that_connection_only() -> None:
    def explode(proto: Recorder, data: bytes) -> None:
        if data.startswith(b"boom"):
            raise RuntimeError("protocol bug")
        proto.transport.write(b"ok")

    async def body() -> None:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        protos: list[Recorder] = []
        server, port = await serve(protos, lambda: Recorder(explode))
        bad, good = await client(port), await client(port)
        await wait_until_async(lambda: len(protos) == 2 and protos[1].transport, TIMEOUT, "two connections")
        await loop.sock_sendall(bad, b"boom")
        assert await recv_until_eof(bad) == b""
        await wait_until_async(lambda: protos[0].lost, TIMEOUT, "connection_lost")
        assert len(reported) == 1
        assert "data_received" in reported[0]["message"]
        assert isinstance(reported[0]["exception"], RuntimeError)
        assert isinstance(protos[0].lost[0], RuntimeError)
        await loop.sock_sendall(good, b"still there?")
        assert await recv_exactly(good, 2) == b"ok"
        bad.close()
        good.close()
        server.close()

    run(body)


def test_a_reset_peer_loses_the_connection_with_its_error() -> None:
    async def body() -> None:
        protos: list[Recorder] = []
        server, port = await serve(protos)
        sock = await client(port)
        await wait_until_async(lambda: protos and protos[0].transport, TIMEOUT, "accept")
        proto = protos[0]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # RST
        await wait_until_async(lambda: proto.lost or "eof" in proto.events, TIMEOUT, "the reset seen")
        if not proto.lost:  # seen as EOF first: a write then meets the reset
            for _ in range(3):
                proto.transport.write(b"x" * 1000)
                await asyncio.sleep(0.01)
        await wait_until_async(lambda: proto.lost, TIMEOUT, "connection_lost")
        assert proto.lost[0] is None or isinstance(proto.lost[0], OSError)
        assert len(proto.lost) == 1
        server.close()

    run(body)


def test_transport_details_and_argument_checks() -> None:
    async def body() -> None:
        protos: list[Recorder] = []
        server, port = await serve(protos)
        sock = await client(port)
        await wait_until_async(lambda: protos and protos[0].transport, TIMEOUT, "accept")
        t = protos[0].transport
        assert t.get_extra_info("peername") == sock.getsockname()
        assert t.get_extra_info("sockname") == ("127.0.0.1", port)
        assert isinstance(t.get_extra_info("socket"), socket.socket)
        assert t.get_extra_info("nothing", "dflt") == "dflt"
        assert t.get_protocol() is protos[0]
        assert not t.can_write_eof()
        t.set_write_buffer_limits(high=100)
        assert t.get_write_buffer_limits() == (25, 100)
        t.set_write_buffer_limits(low=10)
        assert t.get_write_buffer_limits() == (10, 40)
        with pytest.raises(ValueError):
            t.set_write_buffer_limits(high=1, low=2)
        with pytest.raises(TypeError, match="bytes-like"):
            t.write("text")
        t.write(bytearray(b"ab"))
        t.write(memoryview(b"cd"))
        t.writelines([b"e", b"f"])
        assert await recv_exactly(sock, 6) == b"abcdef"
        t.close()
        assert t.is_closing()
        await wait_until_async(lambda: protos[0].lost, TIMEOUT, "connection_lost")
        sock.close()
        server.close()
        await server.wait_closed()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1)

    run(body)


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_accept_returns_a_ready_connection_or_none_without_raising(family: socket.AddressFamily) -> None:
    """netio's accept in C: None on an empty listener (socket.accept raised BlockingIOError there, and
    each burst of connections ended on one); a connection non-blocking, close-on-exec, with TCP_NODELAY,
    and its peer address as the socket module gives it."""
    accept = c_transport().accept
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.socket(family) as listener:
        listener.bind((host, 0))
        listener.listen(8)
        listener.setblocking(False)
        assert accept(listener.fileno()) is None
        with socket.create_connection(listener.getsockname()[:2], timeout=TIMEOUT) as peer:
            accepted = wait_until(lambda: accept(listener.fileno()), TIMEOUT, "a connection to accept")
            fd, address = accepted
            with socket.socket(family, socket.SOCK_STREAM, 0, fd) as conn:
                assert address == peer.getsockname() == conn.getpeername()
                assert not os.get_blocking(fd) and not os.get_inheritable(fd)
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert accept(listener.fileno()) is None
    with socket.socket(family) as idle, pytest.raises(OSError):  # not listening (EINVAL): an error, not None
        accept(idle.fileno())


def test_out_of_descriptors_pauses_accepting_and_reports_it() -> None:
    """EMFILE on accept: reported to the loop's handler (the broker counts accept_errors) and
    accepting pauses instead of spinning on a listener that stays readable; it resumes."""
    c_transport()  # (skips where the compile was skipped on purpose, as the other tests of the C transport)
    code = r"""
import asyncio, resource, socket, sys, uvloop
from broker import netio
import broker._netio as c

async def main():
    loop = asyncio.get_running_loop()
    seen = []
    loop.set_exception_handler(lambda _l, ctx: seen.append(ctx["message"]))
    netio.ACCEPT_PAUSE = 0.2
    server = await netio.create_server(c, asyncio.Protocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers = []
    try:
        while True:
            fillers.append(socket.socket())
    except OSError:
        pass
    fillers.pop().close()  # one for the client's socket
    cl = socket.socket(); cl.setblocking(False); cl.connect_ex(("127.0.0.1", port))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if seen:
            break
    for f in fillers:
        f.close()
    for _ in range(200):
        await asyncio.sleep(0.01)
        if server.live_connections():
            break
    print(seen, server.live_connections())

uvloop.run(main())
"""
    limit = "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
    res = subprocess.run([sys.executable, "-c", limit + code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['socket.accept() out of system resource'] 1", res.stdout + res.stderr


def test_the_broker_serves_its_clients_on_the_c_transport_when_compiled(tmp_path: Any) -> None:
    """What a compiled install runs, said in the start-up log; SPARK_BEANSTALK_NETIO=0 turns it off."""
    c_transport()
    if not _build.inspect_build().compiled:
        pytest.fail("the compiled core is not built here (CI builds it): cannot check the C transport")
    for env, expect in (({}, "C transport"), ({netio.NETIO_ENV: "0"}, "uvloop transports")):
        proc: ServerProcess = broker_process(extra_args=["-V"], stderr_path=str(tmp_path / "log"),
                                             env={**os.environ, **env})
        proc.start()
        try:
            line = wait_until(lambda p=proc: next((ln for ln in p.log().splitlines() if "event=listening" in ln),
                                                  None), TIMEOUT, "the listening line")
            assert expect in line
            with socket.create_connection((proc.host, proc.port), timeout=TIMEOUT) as s:
                s.sendall(b"put 0 0 10 2\r\nhi\r\n")
                assert s.recv(100) == b"INSERTED 1\r\n"
        finally:
            proc.stop()
        (tmp_path / "log").unlink()


@pytest.mark.parametrize("transport", ["c", "uvloop"])
def test_a_client_flooding_commands_does_not_hold_the_loop(tmp_path: Any, transport: str) -> None:
    """One connection pipelines cheap commands faster than they run: every other client, the
    timers and a SIGTERM still get their turn (a read per connection and loop pass, as uvloop;
    the first edge-triggered C transport kept reading while each read filled its buffer, and
    another client waited over 15 s for a reply)."""
    if transport == "c":
        c_transport()
    env = {**os.environ, netio.NETIO_ENV: "1" if transport == "c" else "0"}
    proc = broker_process(stderr_path=str(tmp_path / "log"), env=env).start()
    stop = threading.Event()
    flood = socket.create_connection((proc.host, proc.port), timeout=TIMEOUT)

    def send() -> None:
        chunk = b"use a\r\n" * 100_000
        with contextlib.suppress(OSError):
            while not stop.is_set():
                flood.sendall(chunk)

    def drain() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set() and flood.recv(1 << 20):
                pass

    threads = [threading.Thread(target=send, daemon=True), threading.Thread(target=drain, daemon=True)]
    try:
        for thread in threads:
            thread.start()
        with socket.create_connection((proc.host, proc.port), timeout=TIMEOUT) as probe:
            worst = 0.0
            for _ in range(5):
                started = time.monotonic()
                probe.sendall(b"list-tube-used\r\n")
                assert probe.recv(100) == b"USING default\r\n"
                worst = max(worst, time.monotonic() - started)
            started = time.monotonic()
            probe.sendall(b"reserve-with-timeout 1\r\n")
            assert probe.recv(100) == b"TIMED_OUT\r\n"
            reserve_took = time.monotonic() - started
        assert worst < 2.0, f"a reply took {worst:.2f} s behind the flood"
        assert reserve_took < 3.0, f"a 1 s reserve timeout took {reserve_took:.2f} s"
        started = time.monotonic()
        assert proc.stop(timeout=TIMEOUT) == 0
        assert time.monotonic() - started < 5.0
    finally:
        stop.set()
        flood.close()
        proc.stop()


@pytest.mark.parametrize("transport", ["c", "uvloop"])
def test_a_closed_connection_leaves_no_reference_cycle(transport: str) -> None:
    """A client that goes away, whatever it held (a reserved job, its own tube, a reserve still
    waiting), is freed by reference counting: nothing of its connection is left for the cyclic
    collector, which visits a broker's old objects rarely (broker.gcpolicy), so a cycle would keep a
    closed connection's objects and buffers for a long time. The C transport kept its protocol after
    connection_lost, a cycle with the connection's ``transport``, until it let it go as asyncio's do."""
    if transport == "c":
        c_transport()

    def clients(port: int) -> None:
        for i in range(20):
            with Connection("127.0.0.1", port, timeout=TIMEOUT) as conn:
                conn.use(f"own-{i}")
                conn.put(b"job")
                conn.watch_only([f"own-{i}"])
                assert len(conn.reserve_many(1)[0]) == 1  # held when the client goes
                assert conn.call("no-such-command").status == b"UNKNOWN_COMMAND"
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw:
                raw.sendall(b"watch empty\r\nreserve-with-timeout 30\r\n")
                assert raw.recv(100) == b"WATCHING 2\r\n"

    async def body() -> None:
        server = BrokerServer(ServerConfig(listen="127.0.0.1", port=free_port()))
        if transport == "uvloop":
            server.netio = None
        assert server.transport_name == transport, server.transport_reason
        await server.start()
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage, to name it
        try:
            thread = threading.Thread(target=clients, args=(server.config.port,))
            thread.start()
            await wait_until_async(lambda: not thread.is_alive(), 60, "the clients")
            await wait_until_async(lambda: not server.connections, TIMEOUT, "every connection gone")
            gc.collect()
            left = sorted({type(o).__name__ for o in gc.garbage})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            await server.close()
        assert left == [], f"closed connections left reference cycles of {left}"

    run(body)
