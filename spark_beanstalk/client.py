"""A small blocking beanstalkd-protocol client with pipelining.

The connector needs things general clients do not give: many commands written in one
``sendall`` and their replies read back in order (put/touch/delete thousands of jobs
per batch), ``reserve-job``, and exact control of which connection holds which
reservation. It speaks only the wire protocol; it knows nothing of Spark.
"""
from __future__ import annotations

import re
import socket
import ssl
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

CRLF = b"\r\n"
# Replies followed by "<bytes>\r\n<data>\r\n"; the byte count is the last argument.
_REPLIES_WITH_BODY = frozenset({b"RESERVED", b"FOUND", b"OK"})
# Sent after a run of commands so the end of their replies is found with one search (see
# Connection.bulk): its reply "USING <tube>" cannot start a line of a YAML (stats) reply.
_MARKER = b"list-tube-used\r\n"
_MARKER_REPLY = b"\r\nUSING "
_RESERVED = re.compile(rb"RESERVED (\d+) (\d+)\r\n")


class BeanstalkError(Exception):
    """The server answered with something other than the expected success word."""

    def __init__(self, status: str, command: str, detail: str = "") -> None:
        self.status = status
        self.command = command
        message = f"{command!r} -> {status}"
        super().__init__(f"{message}: {detail}" if detail else message)


class ConnectionLost(BeanstalkError):
    """The connection closed or failed while a reply was expected."""


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


def parse_yaml(body: bytes) -> dict | list:
    """Parse beanstalkd's flat YAML (a mapping of scalars, or a list of names)."""
    lines = body.decode("utf-8", "replace").splitlines()
    if lines and lines[0] == "---":
        lines = lines[1:]
    if all(line.startswith("- ") for line in lines if line):
        return [line[2:] for line in lines if line]
    result: dict = {}
    for line in lines:
        key, sep, value = line.partition(": ")
        if not sep:
            continue
        result[key] = _scalar(value)
    return result


def _scalar(text: str):
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
        self._buf = bytearray()
        self._pos = 0
        if auth_token is not None:
            reply = self.call(f"auth {auth_token}")
            if reply.status != b"OK":
                self.close()
                raise BeanstalkError(reply.status.decode("latin-1"), "auth", f"{self.address} refused the token")

    # -- plumbing -------------------------------------------------------------------
    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def send(self, data: bytes) -> None:
        """Write raw bytes (one or many encoded commands)."""
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise ConnectionLost("SEND_FAILED", data[:40].decode("latin-1"), str(exc)) from exc

    def _fill(self) -> None:
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        try:
            chunk = self._sock.recv(262144)
        except socket.timeout as exc:
            raise ConnectionLost("TIMED_OUT", "read", f"no reply from {self.address}") from exc
        except OSError as exc:
            raise ConnectionLost("RECV_FAILED", "read", f"{self.address}: {exc}") from exc
        if not chunk:
            raise ConnectionLost("CLOSED", "read", f"{self.address} closed the connection")
        self._buf += chunk

    def _read_line(self) -> bytes:
        while True:
            end = self._buf.find(CRLF, self._pos)
            if end >= 0:
                line = bytes(self._buf[self._pos:end])
                self._pos = end + 2
                return line
            self._fill()

    def _read_exact(self, n: int) -> bytes:
        while len(self._buf) - self._pos < n:
            self._fill()
        data = bytes(self._buf[self._pos:self._pos + n])
        self._pos += n
        return data

    def read_reply(self) -> Reply:
        """Read one reply, with its body when the status carries one."""
        words = self._read_line().split(b" ")
        status, args = words[0], tuple(words[1:])
        body = None
        if status in _REPLIES_WITH_BODY and args:
            size = int(args[-1])
            body = self._read_exact(size + 2)[:-2]
        return Reply(status, args, body)

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
        scan = self._pos
        while True:
            buf = self._buf
            at = buf.find(_MARKER_REPLY, scan)
            if at >= 0:
                end = buf.find(CRLF, at + 2)
                if end >= 0:
                    start = self._pos
                    self._pos = end + 2
                    return bytes(buf[start:at + 2])
                scan = at                   # the marker's line is not complete yet
            else:
                scan = max(self._pos, len(buf) - len(_MARKER_REPLY))
            if self._pos > (1 << 20):       # drop what earlier calls consumed, so the buffer stays small
                scan -= self._pos
                del buf[:self._pos]
                self._pos = 0
            before = self._pos
            self._fill()
            if self._pos != before:         # _fill emptied a fully consumed buffer
                scan = 0

    def reserve_many(self, count: int, command: bytes = b"reserve-with-timeout 0\r\n"
                     ) -> tuple[list[int], list[bytes], list[bytes]]:
        """Send `count` reserve commands at once; returns (job ids, bodies, other reply lines).

        The other lines are TIMED_OUT / DEADLINE_SOON (or errors), one per command that
        reserved nothing. One regex match per reply: this is the source's hot loop.
        """
        self.send(command * count)
        ids: list[int] = []
        bodies: list[bytes] = []
        others: list[bytes] = []
        match = _RESERVED.match
        pos = self._pos
        left = count
        while left:
            buf = self._buf
            m = match(buf, pos)
            if m is not None:
                start = m.end()
                end = start + int(m[2])
                if end + 2 <= len(buf):
                    ids.append(int(m[1]))
                    bodies.append(bytes(buf[start:end]))
                    pos = end + 2
                    left -= 1
                    continue
            else:
                end = buf.find(CRLF, pos)
                if end >= 0:                # a complete line that is not a RESERVED header
                    others.append(bytes(buf[pos:end]))
                    pos = end + 2
                    left -= 1
                    continue
            if pos > (1 << 20):
                del buf[:pos]
                pos = 0
            self._pos = pos
            self._fill()
            pos = self._pos
        self._pos = pos
        return ids, bodies, others

    def call(self, line: str | bytes, body: bytes | None = None) -> Reply:
        """Send one command and read its reply."""
        self.send(encode(line, body))
        return self.read_reply()

    def expect(self, line: str | bytes, ok: bytes, body: bytes | None = None) -> Reply:
        reply = self.call(line, body)
        if reply.status != ok:
            raise BeanstalkError(reply.status.decode("latin-1"), _text(line))
        return reply

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
            yield self.read_reply()
            received += 1

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
        return self.call(f"delete {job_id}").status == b"DELETED"

    def release(self, job_id: int, priority: int = 2**31, delay: int = 0) -> bool:
        return self.call(f"release {job_id} {priority} {delay}").status == b"RELEASED"

    def bury(self, job_id: int, priority: int = 2**31) -> bool:
        return self.call(f"bury {job_id} {priority}").status == b"BURIED"

    def touch(self, job_id: int) -> bool:
        return self.call(f"touch {job_id}").status == b"TOUCHED"

    def kick(self, bound: int) -> int:
        return self.expect(f"kick {bound}", b"KICKED").int_arg()

    def kick_job(self, job_id: int) -> bool:
        return self.call(f"kick-job {job_id}").status == b"KICKED"

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

    def _yaml(self, line: str) -> dict | list | None:
        reply = self.call(line)
        if reply.status == b"OK":
            return parse_yaml(reply.body or b"")
        if reply.status == b"NOT_FOUND":
            return None
        raise BeanstalkError(reply.status.decode("latin-1"), line)

    def stats(self) -> dict:
        return self._yaml("stats")  # type: ignore[return-value]

    def stats_tube(self, tube: str) -> dict | None:
        return self._yaml(f"stats-tube {tube}")  # type: ignore[return-value]

    def stats_job(self, job_id: int) -> dict | None:
        return self._yaml(f"stats-job {job_id}")  # type: ignore[return-value]

    def list_tubes(self) -> list[str]:
        return self._yaml("list-tubes")  # type: ignore[return-value]

    def list_tubes_watched(self) -> list[str]:
        return self._yaml("list-tubes-watched")  # type: ignore[return-value]

    def list_tube_used(self) -> str:
        return self.expect("list-tube-used", b"USING").args[0].decode()

    def pause_tube(self, tube: str, delay: int) -> bool:
        return self.call(f"pause-tube {tube} {delay}").status == b"PAUSED"


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


def parse_hosts(spec: str, default_port: int = 11300) -> list[tuple[str, int]]:
    """'h1:p1,tls://h2' -> [('h1', p1), ('h2', 11300)]; raises ValueError with the bad entry."""
    hosts = []
    for raw in spec.split(","):
        entry = raw.strip()
        if entry.startswith("tls://"):  # the scheme turns TLS on (see options.Security)
            entry = entry[6:]
        if not entry:
            continue
        host, sep, port_text = entry.rpartition(":")
        if not sep:
            host, port_text = entry, str(default_port)
        host = host.strip("[]")
        if not host:
            raise ValueError(f"bad host entry {entry!r}: empty host name")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"bad host entry {entry!r}: port {port_text!r} is not a number") from None
        if not 0 < port < 65536:
            raise ValueError(f"bad host entry {entry!r}: port {port} out of range 1-65535")
        hosts.append((host, port))
    if not hosts:
        raise ValueError(f"no hosts in {spec!r}")
    return hosts


# -- appended for the writers (spark_beanstalk/writer.py) -----------------------------------
def _pipeline_lines(self: Connection, commands: Sequence[bytes], window: int = 1024,
                    max_bytes: int = 1 << 20) -> list[bytes]:
    """Send pre-encoded commands whose replies are one line each (put, use, delete, ...).

    Keeps at most `window` commands and about `max_bytes` unanswered, and returns every
    reply line in order. If the connection fails, the ConnectionLost raised carries
    ``.replies``: the lines received before the failure (those commands are known done;
    the rest are unknown).
    """
    replies: list[bytes] = []
    total = len(commands)
    sent = 0
    buf = self._buf
    try:
        while len(replies) < total:
            if sent < total and sent - len(replies) < window:
                upto = sent
                size = 0
                limit = min(total, len(replies) + window)
                while upto < limit and (size < max_bytes or upto == sent):
                    size += len(commands[upto])
                    upto += 1
                self.send(b"".join(commands[sent:upto]))
                sent = upto
            # read every complete line available, then fill once more if short
            want = sent
            while len(replies) < want:
                end = buf.find(CRLF, self._pos)
                if end < 0:
                    if len(replies) > 0 and sent < total and sent - len(replies) < window // 2:
                        break  # room to send more before blocking on the socket
                    self._fill()
                    buf = self._buf
                    continue
                replies.append(bytes(buf[self._pos:end]))
                self._pos = end + 2
    except ConnectionLost as exc:
        exc.replies = replies  # type: ignore[attr-defined]
        raise
    return replies


Connection.pipeline_lines = _pipeline_lines  # type: ignore[attr-defined]


# -- appended for the source (spark_beanstalk/source.py) ------------------------------------
def _pipeline_replies(self: Connection, commands: Sequence[bytes], chunk: int = 1024) -> list[tuple[bytes, bytes | None]]:
    """Send pre-encoded commands in chunks (two chunks in flight) and return every reply as
    ``(status line, body or None)``, in order. Bodies come with RESERVED/FOUND/OK replies.

    The fast path for bulk reserve / reserve-job / stats-job: one ``sendall`` per chunk
    and no per-reply objects.
    """
    out: list[tuple[bytes, bytes | None]] = []
    total = len(commands)
    sent = 0
    # prime: first chunk
    if total:
        upto = min(total, chunk)
        self.send(b"".join(commands[:upto]))
        sent = upto
    pos = self._pos
    while len(out) < total:
        # keep the server busy: send the next chunk once we are reading the previous one
        if sent < total and sent - len(out) <= chunk:
            upto = min(total, sent + chunk)
            self._pos = pos
            self.send(b"".join(commands[sent:upto]))
            sent = upto
        buf = self._buf
        end = buf.find(CRLF, pos)
        if end < 0:
            if pos > (1 << 20):      # drop what was consumed, so the buffer does not grow without bound
                del buf[:pos]
                pos = 0
            self._pos = pos
            self._fill()
            pos = self._pos
            continue
        line = bytes(buf[pos:end])
        status = line[:line.find(b" ")] if b" " in line else line
        if status in _REPLIES_WITH_BODY and line != status:
            size = int(line[line.rfind(b" ") + 1:])
            need = end + 2 + size + 2
            if len(buf) < need:
                self._pos = pos
                self._fill()
                pos = self._pos
                continue
            out.append((line, bytes(buf[end + 2:end + 2 + size])))
            pos = need
        else:
            out.append((line, None))
            pos = end + 2
    self._pos = pos
    return out


Connection.pipeline_replies = _pipeline_replies  # type: ignore[attr-defined]
