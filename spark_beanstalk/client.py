"""A small blocking beanstalkd-protocol client with pipelining.

The connector needs things general clients do not give: many commands written in one
``sendall`` and their replies read back in order (put/touch/delete thousands of jobs
per batch), ``reserve-job``, and exact control of which connection holds which
reservation. It speaks only the wire protocol; it knows nothing of Spark.
"""
from __future__ import annotations

import contextlib
import re
import socket
import ssl
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

CRLF = b"\r\n"
# Replies followed by "<bytes>\r\n<data>\r\n"; the byte count is the last argument.
_REPLIES_WITH_BODY = frozenset({b"RESERVED", b"FOUND", b"OK"})
# Sent after a run of commands so the end of their replies is found with one search (see
# Connection.bulk): its reply "USING <tube>" cannot start a line of a YAML (stats) reply.
_MARKER = b"list-tube-used\r\n"
_MARKER_REPLY = b"\r\nUSING "
_RESERVED = re.compile(rb"RESERVED (\d+) (\d+)\r\n")
T = TypeVar("T")
# Replies that refuse a change for now, not for good: a replicated member that does not lead (a
# replica, or a leader whose lease lapsed and that has not stepped down yet), a broker in drain
# mode or at a limit. beanstalkd never answers reserve, delete, touch, release, bury or reserve-job
# with either; the source takes them as a lost connection, the writer's markers wait through them.
REFUSED_FOR_NOW = frozenset({b"OUT_OF_MEMORY", b"DRAINING"})


class BeanstalkError(Exception):
    """The server answered with something other than the expected success word."""

    def __init__(self, status: str, command: str, detail: str = "") -> None:
        self.status = status
        self.command = command
        message = f"{command!r} -> {status}"
        super().__init__(f"{message}: {detail}" if detail else message)


class ConnectionLost(BeanstalkError):
    """The connection closed or failed while a reply was expected.

    ``replies`` holds what a pipelining helper read before the failure (those commands are
    known done; the ones after are unknown).
    """

    def __init__(self, status: str, command: str, detail: str = "") -> None:
        super().__init__(status, command, detail)
        self.replies: list[Any] = []


@dataclass(frozen=True, slots=True)
class Reply:
    """One server reply: status word, its arguments, and the body if it has one."""

    status: bytes
    args: tuple[bytes, ...]
    body: bytes | None = None

    def int_arg(self, index: int = 0) -> int:
        return int(self.args[index])


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    body: bytes


def parse_yaml(body: bytes) -> dict[str, Any] | list[str]:
    """Parse beanstalkd's flat YAML (a mapping of scalars, or a list of names)."""
    lines = body.decode("utf-8", "replace").splitlines()
    if lines and lines[0] == "---":
        lines = lines[1:]
    if all(line.startswith("- ") for line in lines if line):
        return [line[2:] for line in lines if line]
    result: dict[str, Any] = {}
    for line in lines:
        key, sep, value = line.partition(": ")
        if not sep:
            continue
        result[key] = _scalar(value)
    return result


def _scalar(text: str) -> str | int | float:
    if text.startswith('"') and text.endswith('"') and len(text) >= 2:
        return text[1:-1]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


class ReplyReader:
    """The receive side of one connection: owns the buffer and every rule for reading it.

    Every pipelining helper of :class:`Connection` reads through it, so there is one copy
    of the buffer rules: consumed bytes are dropped once everything is read or once more
    than a megabyte of them has piled up, and a closed or silent socket raises
    ``ConnectionLost``.
    """

    _COMPACT = 1 << 20

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address
        self.buf = bytearray()
        self.pos = 0

    def fill(self) -> None:
        """Receive one chunk (blocking); drops consumed bytes first when that is cheap or overdue."""
        if self.pos and (self.pos == len(self.buf) or self.pos > self._COMPACT):
            del self.buf[:self.pos]
            self.pos = 0
        try:
            chunk = self.sock.recv(262144)
        except TimeoutError as exc:
            raise ConnectionLost("TIMED_OUT", "read", f"no reply from {self.address}") from exc
        except OSError as exc:
            raise ConnectionLost("RECV_FAILED", "read", f"{self.address}: {exc}") from exc
        if not chunk:
            raise ConnectionLost("CLOSED", "read", f"{self.address} closed the connection")
        self.buf += chunk

    def line(self) -> bytes:
        """One reply line, without its CRLF."""
        while True:
            end = self.buf.find(CRLF, self.pos)
            if end >= 0:
                line = bytes(self.buf[self.pos:end])
                self.pos = end + 2
                return line
            self.fill()

    def exact(self, n: int) -> bytes:
        while len(self.buf) - self.pos < n:
            self.fill()
        data = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return data

    def raw_reply(self) -> tuple[bytes, bytes | None]:
        """One reply as (status line, body or None); bodies come with RESERVED/FOUND/OK."""
        line = self.line()
        space = line.find(b" ")
        if space > 0 and line[:space] in _REPLIES_WITH_BODY:
            size = int(line[line.rfind(b" ") + 1:])
            return line, self.exact(size + 2)[:-2]
        return line, None

    def reply(self) -> Reply:
        """One reply as a Reply."""
        line, body = self.raw_reply()
        words = line.split(b" ")
        return Reply(words[0], tuple(words[1:]), body)

    def until_line_starting(self, marker: bytes) -> bytes:
        """Everything up to and excluding the first line that begins with `marker` after a CRLF
        (that line is consumed too): one search per received chunk, however many replies."""
        scan = self.pos
        while True:
            at = self.buf.find(marker, scan)
            if at >= 0:
                end = self.buf.find(CRLF, at + 2)
                if end >= 0:
                    data = bytes(self.buf[self.pos:at + 2])
                    self.pos = end + 2
                    return data
                scan = at                   # the marker's line is not complete yet
            else:
                scan = max(self.pos, len(self.buf) - len(marker))
            before = self.pos
            self.fill()
            scan -= before - self.pos       # fill may have dropped consumed bytes

    def reserved(self, count: int) -> tuple[list[int], list[bytes], list[bytes]]:
        """Read `count` replies to reserve commands: (job ids, bodies, other reply lines).

        One regex match per reply: this is the source's hot loop.
        """
        ids: list[int] = []
        bodies: list[bytes] = []
        others: list[bytes] = []
        match = _RESERVED.match
        left = count
        while left:
            buf = self.buf
            pos = self.pos
            m = match(buf, pos)
            if m is not None:
                start = m.end()
                end = start + int(m[2])
                if end + 2 <= len(buf):
                    ids.append(int(m[1]))
                    bodies.append(bytes(buf[start:end]))
                    self.pos = end + 2
                    left -= 1
                    continue
            else:
                end = buf.find(CRLF, pos)
                if end >= 0:                # a complete line that is not a RESERVED header
                    others.append(bytes(buf[pos:end]))
                    self.pos = end + 2
                    left -= 1
                    continue
            self.fill()
        return ids, bodies, others


class Connection:
    """One TCP connection to a beanstalkd-protocol server.

    Not thread-safe: each thread or partition uses its own connection. Every method
    that sends also reads its reply, except :meth:`send` and :meth:`read_reply`, which
    a caller pairs up itself to pipeline.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 11300, timeout: float | None = 30.0,
                 connect_timeout: float = 10.0, *, tls: bool = False, ca_file: str | None = None,
                 certfile: str | None = None, keyfile: str | None = None, auth_token: str | None = None,
                 server_hostname: str | None = None) -> None:
        """Connect; with ``tls`` wrap the socket (``ca_file`` to trust a private CA,
        ``certfile``/``keyfile`` for a client certificate); with ``auth_token`` send our
        broker's ``auth`` extension first."""
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls:
                ctx = ssl.create_default_context(cafile=ca_file)
                if certfile:
                    ctx.load_cert_chain(certfile, keyfile)
                sock = ctx.wrap_socket(sock, server_hostname=server_hostname or host)
        except ssl.SSLError as exc:
            raise ConnectionLost("TLS_FAILED", "connect", f"TLS handshake with {self.address} failed: {exc}") from exc
        except OSError as exc:
            raise ConnectionLost("UNREACHABLE", "connect", f"cannot connect to {self.address}: {exc}") from exc
        self._sock = sock
        self._sock.settimeout(timeout)
        self._reader = ReplyReader(sock, self.address)
        if auth_token is not None:
            reply = self.call(f"auth {auth_token}")
            if reply.status != b"OK":
                self.close()
                raise BeanstalkError(reply.status.decode("latin-1"), "auth", f"{self.address} refused the token")

    # -- plumbing -------------------------------------------------------------------
    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def send(self, data: bytes) -> None:
        """Write raw bytes (one or many encoded commands)."""
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise ConnectionLost("SEND_FAILED", data[:40].decode("latin-1"), str(exc)) from exc

    def read_reply(self) -> Reply:
        """Read one reply, with its body when the status carries one."""
        return self._reader.reply()

    def _windowed(self, commands: Sequence[bytes], window: int, max_bytes: int,
                  read_one: Callable[[], T]) -> list[T]:
        """Send pre-encoded commands keeping at most `window` (and about `max_bytes`) unanswered,
        refilling once half the window is answered; `read_one` reads one reply each.

        On ConnectionLost the replies read so far are on the exception (``.replies``): those
        commands are known done, the rest are unknown.
        """
        out: list[T] = []
        total = len(commands)
        sent = 0
        try:
            while len(out) < total:
                if sent < total and sent - len(out) <= window // 2:
                    upto, size, limit = sent, 0, min(total, len(out) + window)
                    while upto < limit and (upto == sent or size < max_bytes):
                        size += len(commands[upto])
                        upto += 1
                    try:
                        self.send(b"".join(commands[sent:upto]))
                    except ConnectionLost:
                        # The server may have answered what it read before it closed: read those
                        # replies (until the connection gives no more), or their commands would
                        # count as unknown and be sent again (duplicates)
                        with contextlib.suppress(ConnectionLost, OSError):
                            while len(out) < upto:
                                out.append(read_one())
                        raise
                    sent = upto
                out.append(read_one())
        except ConnectionLost as exc:
            exc.replies = list(out)
            raise
        return out

    def pipeline_lines(self, commands: Sequence[bytes], window: int = 1024, max_bytes: int = 1 << 20) -> list[bytes]:
        """Commands whose replies are one line each (put, use, delete, ...): every reply line, in order."""
        return self._windowed(commands, window, max_bytes, self._reader.line)

    def pipeline_replies(self, commands: Sequence[bytes], chunk: int = 1024) -> list[tuple[bytes, bytes | None]]:
        """Every reply as ``(status line, body or None)``, in order (reserve-job, peek, stats-job runs)."""
        return self._windowed(commands, 2 * chunk, 1 << 30, self._reader.raw_reply)

    def pipeline(self, commands: Sequence[bytes], window: int = 512) -> Iterator[Reply]:
        """Send pre-encoded commands, keeping up to `window` unanswered, and yield replies in order."""
        sent = 0
        received = 0
        total = len(commands)
        while received < total:
            if sent < total and sent - received < window:
                upto = min(total, received + window)
                self.send(b"".join(commands[sent:upto]))
                sent = upto
            yield self._reader.reply()
            received += 1

    def bulk(self, commands: bytes) -> bytes:
        """Send pre-encoded commands and a marker, and return their raw replies (up to the marker's).

        For runs of commands whose replies carry no job body (stats-job, delete, touch,
        release, bury): the caller parses the whole run at once (a regex, ``bytes.count``)
        instead of reply by reply, and the wait is one search per received chunk. Keep a
        run to about a thousand commands: they are all sent before any reply is read.
        """
        if not commands:
            return b""
        self.send(commands + _MARKER)
        return self._reader.until_line_starting(_MARKER_REPLY)

    def reserve_many(self, count: int, command: bytes = b"reserve-with-timeout 0\r\n"
                     ) -> tuple[list[int], list[bytes], list[bytes]]:
        """Send `count` reserve commands at once; returns (job ids, bodies, other reply lines).

        The other lines are TIMED_OUT / DEADLINE_SOON (or errors), one per command that
        reserved nothing.
        """
        self.send(command * count)
        return self._reader.reserved(count)

    def call(self, line: str | bytes, body: bytes | None = None) -> Reply:
        """Send one command and read its reply."""
        self.send(encode(line, body))
        return self.read_reply()

    def expect(self, line: str | bytes, ok: bytes, body: bytes | None = None) -> Reply:
        reply = self.call(line, body)
        if reply.status != ok:
            raise BeanstalkError(reply.status.decode("latin-1"), _text(line))
        return reply

    # -- commands ---------------------------------------------------------------------
    def put(self, body: bytes, priority: int = 2**31, delay: int = 0, ttr: int = 120) -> int:
        reply = self.call(f"put {priority} {delay} {ttr} {len(body)}", body)
        if reply.status in (b"INSERTED", b"BURIED"):
            return reply.int_arg()
        raise BeanstalkError(reply.status.decode("latin-1"), "put")

    def use(self, tube: str) -> None:
        self.expect(f"use {tube}", b"USING")

    def watch(self, tube: str) -> int:
        return self.expect(f"watch {tube}", b"WATCHING").int_arg()

    def ignore(self, tube: str) -> int:
        return self.expect(f"ignore {tube}", b"WATCHING").int_arg()

    def watch_only(self, tubes: Iterable[str]) -> None:
        """Watch exactly these tubes (watch them, then ignore 'default' if not listed)."""
        tubes = list(tubes)
        for tube in tubes:
            self.watch(tube)
        if "default" not in tubes:
            self.ignore("default")

    def reserve(self, timeout: int | None = None) -> Job | None:
        """Reserve a job; None on TIMED_OUT. DEADLINE_SOON raises."""
        line = "reserve" if timeout is None else f"reserve-with-timeout {timeout}"
        reply = self.call(line)
        if reply.status == b"RESERVED":
            return Job(reply.int_arg(), reply.body or b"")
        if reply.status == b"TIMED_OUT":
            return None
        raise BeanstalkError(reply.status.decode("latin-1"), line)

    def reserve_job(self, job_id: int) -> Job | None:
        """beanstalkd 1.12's reserve-job; None when the job is gone or held elsewhere."""
        reply = self.call(f"reserve-job {job_id}")
        if reply.status == b"RESERVED":
            return Job(reply.int_arg(), reply.body or b"")
        if reply.status == b"NOT_FOUND":
            return None
        raise BeanstalkError(reply.status.decode("latin-1"), f"reserve-job {job_id}")

    def delete(self, job_id: int) -> bool:
        line = f"delete {job_id}"
        return found(self.call(line), b"DELETED", line)

    def release(self, job_id: int, priority: int = 2**31, delay: int = 0) -> bool:
        return self.call(f"release {job_id} {priority} {delay}").status == b"RELEASED"

    def bury(self, job_id: int, priority: int = 2**31) -> bool:
        return self.call(f"bury {job_id} {priority}").status == b"BURIED"

    def touch(self, job_id: int) -> bool:
        return self.call(f"touch {job_id}").status == b"TOUCHED"

    def kick(self, bound: int) -> int:
        return self.expect(f"kick {bound}", b"KICKED").int_arg()

    def kick_job(self, job_id: int) -> bool:
        line = f"kick-job {job_id}"
        return found(self.call(line), b"KICKED", line)

    def _peek(self, line: str) -> Job | None:
        reply = self.call(line)
        if reply.status == b"FOUND":
            return Job(reply.int_arg(), reply.body or b"")
        if reply.status == b"NOT_FOUND":
            return None
        raise BeanstalkError(reply.status.decode("latin-1"), line)

    def peek(self, job_id: int) -> Job | None:
        return self._peek(f"peek {job_id}")

    def peek_ready(self) -> Job | None:
        return self._peek("peek-ready")

    def peek_delayed(self) -> Job | None:
        return self._peek("peek-delayed")

    def peek_buried(self) -> Job | None:
        return self._peek("peek-buried")

    def _yaml(self, line: str) -> dict[str, Any] | list[str] | None:
        reply = self.call(line)
        if reply.status == b"OK":
            return parse_yaml(reply.body or b"")
        if reply.status == b"NOT_FOUND":
            return None
        raise BeanstalkError(reply.status.decode("latin-1"), line)

    def stats(self) -> dict[str, Any]:
        return self._yaml("stats")  # type: ignore[return-value]

    def stats_tube(self, tube: str) -> dict[str, Any] | None:
        return self._yaml(f"stats-tube {tube}")  # type: ignore[return-value]

    def stats_job(self, job_id: int) -> dict[str, Any] | None:
        return self._yaml(f"stats-job {job_id}")  # type: ignore[return-value]

    def list_tubes(self) -> list[str]:
        return self._yaml("list-tubes")  # type: ignore[return-value]

    def list_tubes_watched(self) -> list[str]:
        return self._yaml("list-tubes-watched")  # type: ignore[return-value]

    def list_tube_used(self) -> str:
        return self.expect("list-tube-used", b"USING").args[0].decode()

    def pause_tube(self, tube: str, delay: int) -> bool:
        line = f"pause-tube {tube} {delay}"
        return found(self.call(line), b"PAUSED", line)


def found(reply: Reply, ok: bytes, line: str) -> bool:
    """True for ``ok``, False for NOT_FOUND; any other reply raises BeanstalkError.

    The verbs that name a job or a tube (delete, kick-job, pause-tube) answered False for every
    refusal, so a BAD_FORMAT (a bad tube name, an id or a delay beyond the server's range) was
    reported as "not found". Both clients (this one and spark_beanstalk.aio) read replies here.
    """
    if reply.status == ok:
        return True
    if reply.status == b"NOT_FOUND":
        return False
    detail = "the server could not parse it (a bad tube name, or a number beyond its range)" \
        if reply.status == b"BAD_FORMAT" else ""
    raise BeanstalkError(reply.status.decode("latin-1"), line, detail)


def split_replies(data: bytes) -> list[tuple[bytes, bytes | None]]:
    """Complete raw replies (as from Connection.bulk) -> [(status line, body or None)]."""
    out: list[tuple[bytes, bytes | None]] = []
    pos = 0
    while pos < len(data):
        end = data.index(CRLF, pos)
        line = data[pos:end]
        words = line.split(b" ")
        if words[0] in _REPLIES_WITH_BODY and len(words) > 1:
            start = end + 2
            stop = start + int(words[-1])
            out.append((line, data[start:stop]))
            pos = stop + 2
        else:
            out.append((line, None))
            pos = end + 2
    return out


def encode(line: str | bytes, body: bytes | None = None) -> bytes:
    """One command on the wire: the line, CRLF, and for put the body and CRLF."""
    head = line.encode() if isinstance(line, str) else line
    if body is None:
        return head + CRLF
    return head + CRLF + body + CRLF


def encode_put(body: bytes, priority: int, delay: int, ttr: int) -> bytes:
    return b"put %d %d %d %d\r\n%s\r\n" % (priority, delay, ttr, len(body), body)


def _text(line: str | bytes) -> str:
    return line if isinstance(line, str) else line.decode("latin-1")
