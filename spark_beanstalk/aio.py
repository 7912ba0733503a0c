"""A small asyncio beanstalkd-protocol client, for code that runs in an event loop.

The dashboard polls many servers from one loop (inside the broker's own loop, too), and
the tube verbs (clear, move) stop cleanly between two jobs on Ctrl-C. It shares the wire
rules of the blocking client (encoding, reply shapes, the flat YAML of stats) by
importing them, so the two cannot drift.
"""
from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from spark_beanstalk.client import (
    BeanstalkError,
    ConnectionLost,
    Reply,
    encode,
    encode_put,
    found,
    parse_yaml,
)

_WITH_BODY = frozenset({b"RESERVED", b"FOUND", b"OK"})
Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@dataclass(frozen=True)
class PeekedJob:
    """A job seen by peek, with its stats-job (None if it went away meanwhile)."""

    id: int
    body: bytes
    stats: dict[str, Any] | None


class AsyncConnection:
    """One connection; calls are serialized by a lock so tasks can share it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str,
                 timeout: float = 10.0) -> None:
        self.reader = reader
        self.writer = writer
        self.address = address
        self.timeout = timeout
        self._lock = asyncio.Lock()
        self.closed = False

    @classmethod
    async def open(cls, opener: Opener, address: str, token: str | bytes | None = None,
                   timeout: float = 10.0, auth_optional: bool = False) -> AsyncConnection:
        """Connect with ``opener`` and, given a token, send our broker's ``auth`` first.

        ``auth_optional``: a server that does not know ``auth`` (stock beanstalkd answers
        UNKNOWN_COMMAND) is used without it, for tools that watch mixed servers.
        """
        try:
            reader, writer = await asyncio.wait_for(opener(), timeout)
        except ssl.SSLError as exc:
            raise ConnectionLost("TLS_FAILED", "connect", f"TLS handshake with {address} failed: {exc}") from exc
        except (TimeoutError, OSError) as exc:
            raise ConnectionLost("UNREACHABLE", "connect", f"cannot connect to {address}: {exc or 'timeout'}") from exc
        conn = cls(reader, writer, address, timeout)
        if token is not None:
            text = token.decode() if isinstance(token, bytes) else token
            reply = await conn.call(f"auth {text}")
            if reply.status != b"OK" and not (auth_optional and reply.status == b"UNKNOWN_COMMAND"):
                await conn.close()
                raise BeanstalkError(reply.status.decode("latin-1"), "auth", f"{address} refused the token")
        return conn

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await self.writer.wait_closed()

    async def call(self, line: str | bytes, body: bytes | None = None) -> Reply:
        return await self.raw(encode(line, body), line)

    async def raw(self, data: bytes, what: str | bytes = "") -> Reply:
        """Send one encoded command and read its reply."""
        if self.closed:
            raise ConnectionLost("CLOSED", str(what), f"connection to {self.address} is closed")
        async with self._lock:
            try:
                self.writer.write(data)
                return await asyncio.wait_for(self._read_reply(), self.timeout)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                self.closed = True
                self.writer.close()
                raise ConnectionLost("LOST", str(what), f"lost {self.address}: {exc or 'timeout'}") from exc

    async def _read_reply(self) -> Reply:
        line = (await self.reader.readuntil(b"\r\n"))[:-2]
        words = line.split(b" ")
        body = None
        if words[0] in _WITH_BODY and len(words) > 1:
            body = (await self.reader.readexactly(int(words[-1]) + 2))[:-2]
        return Reply(words[0], tuple(words[1:]), body)

    # -- commands --------------------------------------------------------------------
    async def expect(self, line: str, ok: bytes, body: bytes | None = None) -> Reply:
        reply = await self.call(line, body)
        if reply.status != ok:
            raise BeanstalkError(reply.status.decode("latin-1"), line.split(" ")[0])
        return reply

    async def yaml(self, line: str) -> Any:
        reply = await self.call(line)
        if reply.status != b"OK":
            return None
        return parse_yaml(reply.body or b"")

    async def stats(self) -> dict[str, Any]:
        result = await self.yaml("stats")
        return result if isinstance(result, dict) else {}

    async def stats_tube(self, tube: str) -> dict[str, Any] | None:
        result = await self.yaml(f"stats-tube {tube}")
        if isinstance(result, dict):
            result["name"] = tube  # a tube named "123" would parse as a number
            return result
        return None

    async def stats_job(self, job_id: int) -> dict[str, Any] | None:
        result = await self.yaml(f"stats-job {job_id}")
        if isinstance(result, dict):
            result["tube"] = str(result.get("tube", ""))
            return result
        return None

    async def list_tubes(self) -> list[str]:
        result = await self.yaml("list-tubes")
        return sorted(str(t) for t in result) if isinstance(result, list) else []

    async def use(self, tube: str) -> None:
        await self.expect(f"use {tube}", b"USING")

    async def put(self, body: bytes, priority: int, delay: int, ttr: int) -> int:
        reply = await self.raw(encode_put(body, priority, delay, ttr), "put")
        if reply.status != b"INSERTED":
            raise BeanstalkError(reply.status.decode("latin-1"), "put")
        return reply.int_arg()

    async def delete(self, job_id: int) -> bool:
        line = f"delete {job_id}"
        return found(await self.call(line), b"DELETED", line)

    async def kick(self, bound: int) -> int:
        return (await self.expect(f"kick {bound}", b"KICKED")).int_arg()

    async def kick_job(self, job_id: int) -> bool:
        line = f"kick-job {job_id}"
        return found(await self.call(line), b"KICKED", line)

    async def reserve_job(self, job_id: int) -> bool:
        return (await self.call(f"reserve-job {job_id}")).status == b"RESERVED"

    async def bury(self, job_id: int, priority: int) -> bool:
        return (await self.call(f"bury {job_id} {priority}")).status == b"BURIED"

    async def pause_tube(self, tube: str, seconds: int) -> bool:
        line = f"pause-tube {tube} {seconds}"
        return found(await self.call(line), b"PAUSED", line)

    async def peek(self, command: str, with_stats: bool = True) -> PeekedJob | None:
        """``peek-ready`` / ``peek-delayed`` / ``peek-buried`` (of the used tube) or ``peek <id>``."""
        reply = await self.call(command)
        if reply.status != b"FOUND":
            return None
        job_id = reply.int_arg()
        stats = await self.stats_job(job_id) if with_stats else None
        return PeekedJob(job_id, reply.body or b"", stats)


async def open_tcp(host: str, port: int, token: str | bytes | None = None, tls: ssl.SSLContext | None = None,
                   timeout: float = 10.0, auth_optional: bool = False) -> AsyncConnection:
    async def opener() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port, ssl=tls, limit=1 << 22)

    return await AsyncConnection.open(opener, f"{host}:{port}", token, timeout, auth_optional)
