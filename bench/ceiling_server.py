#!/usr/bin/env python3
"""The ceiling: the most a server on asyncio + uvloop in Python can do at depth 1.

Not a broker and not the floor: it reads no command beyond its first byte and answers every
packet of bench/loadgen.c's depth-1 workloads (one command per packet: put with its body,
reserve, reserve-with-timeout, delete) with a constant reply, keeping no jobs. What it costs
(the event loop, the GIL taken around every callback, a bytes object in and one out, the
read and write system calls) every Python server on this stack pays per command; a broker's
cost above it is its own work. Packets that are not one whole command (the pipelined puts
that fill a tube before a drain) go through a plain line and body framing, not measured: the
benchmark runs this server at depth 1 only.

    python3 bench/ceiling_server.py PORT
"""
from __future__ import annotations

import asyncio
import sys

import uvloop

INSERTED = b"INSERTED 1\r\n"
RESERVED = b"RESERVED 1 100\r\n" + b"x" * 100 + b"\r\n"
DELETED = b"DELETED\r\n"
WATCHING = b"WATCHING 1\r\n"


class Ceiling(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.write = transport.write  # type: ignore[attr-defined]
        self.carry = b""  # a partial command (framed path only)
        self.need = 0  # body bytes + CRLF still owed by a put (framed path only)

    def data_received(self, data: bytes) -> None:
        if self.carry or self.need:
            self.framed(data)
            return
        first = data[0]
        if first == 114:  # reserve, reserve-with-timeout
            self.write(RESERVED)
        elif first == 100:  # delete
            self.write(DELETED)
        elif first == 112 and data.count(b"\r\n") == 2 and data[-2:] == b"\r\n":  # one put and its body
            self.write(INSERTED)
        elif first == 117:  # use <tube> (setup)
            self.write(b"USING " + data[4:])
        elif first == 119:  # watch <tube>, ignore default (setup: one packet)
            self.write(WATCHING * data.count(b"\r\n"))
        else:
            self.framed(data)

    def framed(self, data: bytes) -> None:
        """Several commands in a packet, or one split across packets: frame lines and put bodies."""
        buf = self.carry + data
        pos = 0
        out = []
        while pos < len(buf):
            if self.need:
                if len(buf) - pos < self.need:
                    break
                pos += self.need
                self.need = 0
                out.append(INSERTED)
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                break
            line = buf[pos:end]
            pos = end + 2
            if line.startswith(b"put "):
                self.need = int(line.rsplit(b" ", 1)[1]) + 2
            elif line.startswith(b"reserve"):
                out.append(RESERVED)
            elif line.startswith(b"delete"):
                out.append(DELETED)
            else:
                out.append(WATCHING)
        self.carry = buf[pos:]
        if out:
            self.write(b"".join(out))


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Ceiling, "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.install()
    asyncio.run(main(int(sys.argv[1])))
