#!/usr/bin/env python3
"""Long fuzz run (issue 7): >= 1,000,000 generated and mutated inputs over many connections
against a live broker; afterwards zero crashes, zero leaked connections, memory back near
its baseline.

An *input* is one command line (with its body for put), either generated from the
beanstalkd grammar with edge values (ids near the newest one, extreme numbers, tube names
valid and not, bodies of 0..65536 bytes) or a mutation of one (bit flips, inserted or
deleted bytes, CR/LF damage, over-long lines, binary garbage, wrong body lengths, numbers
replaced by -1 / 2^64 / 30 nines, doubled spaces, tabs). Inputs are grouped into
sessions of ~1-600 inputs; each session is one new connection that sends its bytes in
random slices, and then -- at random -- reads every reply until quiet, closes at once
(sometimes with a RST), half-closes and reads to EOF, or never reads at all. --concurrency
sessions run at once (selectors, one process).

With --profile hardened (the default for our broker) the broker runs with every issue-7
limit on (connections, jobs, job bytes, tubes, reserves per connection, idle timeout,
output cap) and token auth; 95% of sessions start with the right `auth`, the rest fuzz the
unauthenticated path. --profile stock runs it with no flags.

The run is split into --rounds; after each round every connection is closed, the broker
must drop to one connection (ours, asking `stats`), and a janitor deletes every job. The
RSS after the first round's cleanup is the baseline; the RSS after the last one must be
within --rss-tolerance-mb of it. Throughout: every reply line must start with a
protocol word (replies are parsed, bodies skipped), no INTERNAL_ERROR, no traceback or
"Exception" in the broker's log, the process alive.

    python bench/fuzz_long.py                  # 1,000,000 inputs, hardened profile
    python bench/fuzz_long.py --quick          # 20,000 inputs (a smoke run, ~10 s)
    python bench/fuzz_long.py --server beanstalkd --profile stock   # the fuzzer against beanstalkd 1.12

Exit status 0 iff every check passed. Writes a JSON summary (bench/out/fuzz_long.json or --out).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import errno
import json
import os
import random
import selectors
import socket
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from beanstalk_rules.tubes import TUBE_NAME_ALPHABET  # noqa: E402
from spark_beanstalk.embedded import beanstalkd_process, broker_process, wait_until  # noqa: E402

TOKEN = "fuzz-token-7"
REPLY_WORDS = frozenset(
    b"INSERTED BURIED EXPECTED_CRLF JOB_TOO_BIG DRAINING USING WATCHING NOT_IGNORED RESERVED DEADLINE_SOON "
    b"TIMED_OUT DELETED NOT_FOUND RELEASED TOUCHED KICKED FOUND OK PAUSED OUT_OF_MEMORY INTERNAL_ERROR "
    b"BAD_FORMAT UNKNOWN_COMMAND UNAUTHORIZED".split())
WITH_BODY = (b"FOUND", b"RESERVED", b"OK")
# Set low enough that every limit refuses something during the run (see the summary's
# "refusals"): --concurrency 48 sessions against 52 connections (closes lag, so some are
# refused), ~60 tube names in use against 40 tubes, ...
HARDENED_ARGS = ["--max-connections", "52", "--max-jobs", "2000", "--max-job-bytes", str(256 << 10),
                 "--max-tubes", "40", "--max-reserved-per-connection", "3", "--idle-timeout", "2",
                 "--max-output-bytes", str(1 << 16), "--slow-reader-timeout", "1", "--extended-stats"]
LOG_ERROR_MARKERS = ("Traceback", "Exception", "exception", "ERROR", "CRITICAL", "Fatal")


# ------------------------------------------------------------------------------------------
# input generation
# ------------------------------------------------------------------------------------------
NUMS = [b"0", b"1", b"2", b"5", b"60", b"1024", b"65535", b"65536", b"4294967295", b"4294967296",
        b"18446744073709551615", b"18446744073709551616", b"-1", b"+1", b"999999999999999999999999999999",
        b"00000000000000000001", b" 1", b"1 ", b"0x10", b"", b"1e3", b"\t1"]
NAME_CHARS = TUBE_NAME_ALPHABET.encode()


OPS = ["put", "rwt", "reserve", "reserve-job", "delete", "release", "bury", "touch", "kick", "kick-job", "peek",
       "peek-x", "use", "watch", "ignore", "stats", "stats-job", "stats-tube", "list", "pause", "auth", "quit"]
OP_CUM = list(__import__("itertools").accumulate(
    [22, 8, 0.03, 3, 9, 4, 3, 2, 2, 2, 5, 4, 6, 5, 3, 1, 3, 2, 3, 1, 1, 0.05]))
# read: read every reply until quiet; halfclose: shutdown(SHUT_WR), read to EOF; close / rst:
# close at once (rst: SO_LINGER 0); noread: add ~9 MB worth of `stats` replies and never read
# (the broker's slow-reader handling must close it); idle: read, then stay silent until the
# broker's --idle-timeout closes it.
MODES = ["read", "halfclose", "close", "rst", "noread", "idle"]
MODE_CUM = list(__import__("itertools").accumulate([58, 20, 8, 6, 4, 4]))


class Gen:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.last_id = 1
        self.tubes = [b"default", b"a", b"b", b"c"] + [b"fz%d" % i for i in range(40)]

    def tube(self) -> bytes:
        r = self.rng.random()
        if r < 0.85:
            return self.rng.choice(self.tubes)
        if r < 0.93:  # a fresh valid name, up to the 200-byte limit (and sometimes over it)
            n = self.rng.choice([1, 5, 20, 199, 200, 201])
            name = bytes(self.rng.choices(NAME_CHARS, k=n))
            return name if not name.startswith(b"-") else b"x" + name[1:]
        return self.rng.choice([b"-leading-dash", b"has space", b"bad\x00nul", b"\xff\xfe", b"", b"a" * 300,
                                b"tab\tname", b"*", b"percent%"])

    def jid(self) -> bytes:
        r = self.rng.random()
        if r < 0.8:
            return b"%d" % max(1, self.last_id - int(self.rng.expovariate(1 / 20)))
        return self.rng.choice(NUMS)

    def num(self, *typical: int) -> bytes:
        if self.rng.random() < 0.9:
            return b"%d" % self.rng.choice(typical)
        return self.rng.choice(NUMS)

    def body(self) -> bytes:
        r = self.rng.random()
        if r < 0.94:
            n = int(self.rng.expovariate(1 / 40))
        elif r < 0.997:
            n = self.rng.randint(0, 2000)
        else:
            n = self.rng.choice([65534, 65535, 65536, 70000])
        if n > 4096:
            return b"B" * n
        return self.rng.randbytes(n) if self.rng.random() < 0.3 else b"j" * n

    def valid(self) -> bytes:
        rng = self.rng
        op = rng.choices(OPS, cum_weights=OP_CUM)[0]
        if op == "put":
            body = self.body()
            size = len(body)
            if rng.random() < 0.03:
                size += rng.choice([-2, -1, 1, 2])  # body length mismatch
            return (b"put " + self.num(0, 1, 1024, 2**31, 2**32 - 1) + b" " + self.num(0, 0, 0, 0, 1, 2, 3600) + b" "
                    + self.num(1, 2, 60, 120, 0) + b" %d\r\n" % max(0, size) + body + b"\r\n")
        if op == "rwt":
            return b"reserve-with-timeout " + (b"0" if rng.random() < 0.97 else self.num(1, 2)) + b"\r\n"
        if op == "reserve":
            return b"reserve\r\n"
        if op in ("reserve-job", "delete", "touch", "kick-job", "peek", "stats-job"):
            return op.encode() + b" " + self.jid() + b"\r\n"
        if op == "release":
            return b"release " + self.jid() + b" " + self.num(0, 1024) + b" " + self.num(0, 0, 1, 30) + b"\r\n"
        if op == "bury":
            return b"bury " + self.jid() + b" " + self.num(0, 1024) + b"\r\n"
        if op == "kick":
            return b"kick " + self.num(1, 10, 1000) + b"\r\n"
        if op == "peek-x":
            return rng.choice([b"peek-ready\r\n", b"peek-delayed\r\n", b"peek-buried\r\n"])
        if op in ("use", "watch", "ignore", "stats-tube"):
            return op.encode() + b" " + self.tube() + b"\r\n"
        if op == "stats":
            return b"stats\r\n"
        if op == "list":
            return rng.choice([b"list-tubes\r\n", b"list-tube-used\r\n", b"list-tubes-watched\r\n"])
        if op == "pause":
            return b"pause-tube " + self.tube() + b" " + self.num(0, 0, 1) + b"\r\n"
        if op == "auth":
            return b"auth " + rng.choice([TOKEN.encode(), b"wrong", b"", TOKEN.encode() + b"x"]) + b"\r\n"
        return b"quit\r\n"

    def mutate(self, data: bytes) -> bytes:
        rng = self.rng
        b = bytearray(data)
        for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
            kind = rng.randrange(13)
            pos = rng.randrange(len(b) + 1) if b else 0
            if kind == 0 and b:  # bit flip
                i = min(pos, len(b) - 1)
                b[i] ^= 1 << rng.randrange(8)
            elif kind == 1:  # insert a byte
                b[pos:pos] = bytes([rng.randrange(256)])
            elif kind == 2 and b:  # delete a range
                del b[pos:pos + rng.randint(1, 8)]
            elif kind == 3:  # truncate
                del b[pos:]
            elif kind == 4:  # duplicate a segment
                seg = b[pos:pos + rng.randint(1, 40)]
                b[pos:pos] = seg
            elif kind == 5:  # CR/LF damage
                bad_end = rng.choice([b"\n", b"\r", b"\r\r\n", b"\n\r", b"", b"\r\n\r\n"])
                b = bytearray(bytes(b).replace(b"\r\n", bad_end, 1))
            elif kind == 6:  # replace a number with an extreme one
                words = bytes(b).split(b" ")
                idx = [i for i, w in enumerate(words) if w[:1].isdigit()]
                if idx:
                    i = rng.choice(idx)
                    tail = b"\r\n" if words[i].endswith(b"\r\n") else b""
                    words[i] = rng.choice(NUMS) + tail
                    b = bytearray(b" ".join(words))
            elif kind == 7:  # spaces
                b = bytearray(bytes(b).replace(b" ", rng.choice([b"  ", b"\t", b"", b" \x00 "]), 1))
            elif kind == 8:  # an over-long line
                n = rng.choice([222, 223, 224, 225, 300, 5000])
                b[pos:pos] = b"x" * n
            elif kind == 9:  # binary garbage
                b[pos:pos] = rng.randbytes(rng.randint(1, 64))
            elif kind == 10:  # a lone put header with a big size
                size = rng.choice([0, 1, 2, 10]) if rng.random() < 0.95 else rng.choice([65535, 65536, 2**31])
                b = bytearray(b"put 0 0 1 %d\r\n" % size) + b
            elif kind == 11:  # case change of the command word
                b = bytearray(bytes(b).upper() if rng.random() < 0.5 else bytes(b).capitalize())
            else:  # splice with another input
                other = self.valid()
                cut = rng.randrange(len(other) + 1)
                b = b[:pos] + bytearray(other[cut:])
        return bytes(b)

    def one(self) -> bytes:
        v = self.valid()
        return v if self.rng.random() < 0.4 else self.mutate(v)


# ------------------------------------------------------------------------------------------
# sessions over many connections
# ------------------------------------------------------------------------------------------
class Session:
    __slots__ = ("sock", "data", "sent", "mode", "buf", "need_body", "deadline", "quiet_until", "done_sending", "id")

    def __init__(self, sock, data: bytes, mode: str, sid: int) -> None:
        self.sock = sock
        self.data = data
        self.sent = 0
        self.mode = mode
        self.buf = bytearray()
        self.need_body = 0
        self.deadline = time.monotonic() + 30
        self.quiet_until = None
        self.done_sending = False
        self.id = sid


class Fuzzer:
    def __init__(self, host: str, port: int, rng: random.Random, concurrency: int, auth: bool) -> None:
        self.host, self.port = host, port
        self.rng = rng
        self.gen = Gen(rng)
        self.concurrency = concurrency
        self.auth = auth
        self.sel = selectors.DefaultSelector()
        self.replies: Counter = Counter()
        self.violations: list[str] = []
        self.internal_errors = 0
        self.sessions = 0
        self.connect_failures = 0
        self.resets = 0
        self.bytes_sent = 0
        self.inputs = 0
        self.modes: Counter = Counter()
        self.parked: list[tuple[float, Session]] = []

    def _new_session(self, n_inputs: int) -> None:
        parts = []
        if self.auth and self.rng.random() < 0.95:
            parts.append(f"auth {TOKEN}\r\n".encode())
        for _ in range(n_inputs):
            parts.append(self.gen.one())
        self.inputs += n_inputs
        mode = self.rng.choices(MODES, cum_weights=MODE_CUM)[0]
        if mode == "noread":
            parts.append(b"stats\r\n" * 8000)  # ~9 MB of replies
        data = b"".join(parts)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        if mode == "noread":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        err = sock.connect_ex((self.host, self.port))
        if err not in (0, errno.EINPROGRESS):
            self.connect_failures += 1
            sock.close()
            return
        self.sessions += 1
        s = Session(sock, data, mode, self.sessions)
        if mode == "noread":
            s.deadline = time.monotonic() + 4
        self.sel.register(sock, selectors.EVENT_WRITE | (0 if mode == "noread" else selectors.EVENT_READ), s)
        self.modes[mode] += 1

    def _finish(self, s: Session) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(s.sock)
        if s.sock.fileno() < 0:
            return
        if s.mode == "rst":
            with contextlib.suppress(OSError):
                s.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.sock.close()

    def _parse(self, s: Session) -> None:
        buf = s.buf
        pos = 0
        while True:
            if s.need_body:
                if len(buf) - pos < s.need_body:
                    break
                pos += s.need_body
                s.need_body = 0
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if len(buf) - pos > 300:
                    self.violations.append(f"reply line without CRLF: {bytes(buf[pos:pos + 80])!r}")
                    pos = len(buf)
                break
            line = bytes(buf[pos:end])
            pos = end + 2
            words = line.split(b" ")
            word = words[0]
            if word not in REPLY_WORDS:
                if len(self.violations) < 50:
                    self.violations.append(f"unknown reply {line[:80]!r}")
                else:
                    self.violations.append("...")
                continue
            self.replies[word] += 1
            if word == b"INTERNAL_ERROR":
                self.internal_errors += 1
            elif word == b"INSERTED" and len(words) == 2 and words[1].isdigit():
                self.gen.last_id = max(self.gen.last_id, int(words[1]))
            if word in WITH_BODY and len(words) >= 2 and words[-1].isdigit():
                s.need_body = int(words[-1]) + 2
        del buf[:pos]

    def _on_event(self, s: Session, mask: int) -> None:
        now = time.monotonic()
        if mask & selectors.EVENT_WRITE and not s.done_sending:
            n = self.rng.choice([1, 7, 64, 512, 4096, 65536])
            try:
                sent = s.sock.send(s.data[s.sent:s.sent + n])
            except BlockingIOError:
                sent = 0
            except OSError:
                self.resets += 1
                self._finish(s)
                return
            s.sent += sent
            self.bytes_sent += sent
            if s.sent >= len(s.data):
                s.done_sending = True
                if s.mode in ("close", "rst"):
                    self._finish(s)
                    return
                if s.mode == "noread":  # hold it, never reading, for up to 3 s
                    self.sel.unregister(s.sock)
                    self.parked.append((now + 3, s))
                    return
                if s.mode == "idle":
                    s.deadline = now + 5
                elif s.mode == "halfclose":
                    with contextlib.suppress(OSError):
                        s.sock.shutdown(socket.SHUT_WR)
                    s.deadline = now + 3
                else:
                    s.quiet_until = now + 0.15
                    s.deadline = now + 5
                self.sel.modify(s.sock, selectors.EVENT_READ, s)
        if mask & selectors.EVENT_READ:
            try:
                chunk = s.sock.recv(262144)
            except BlockingIOError:
                return
            except OSError:
                self.resets += 1
                self._finish(s)
                return
            if not chunk:
                self._finish(s)
                return
            s.buf += chunk
            self._parse(s)
            if s.quiet_until is not None:
                s.quiet_until = now + 0.15

    def run(self, n_inputs: int, rss_probe=None) -> None:
        remaining = n_inputs
        last_probe = 0.0
        while remaining > 0 or self.sel.get_map() or self.parked:
            if remaining > 0 and self.rng.random() < 0.003:  # a burst past --max-connections
                for _ in range(16):
                    self._new_session(min(remaining, 2))
                    remaining -= min(remaining, 2)
            while remaining > 0 and len(self.sel.get_map()) + len(self.parked) < self.concurrency:
                k = min(remaining, max(1, int(self.rng.expovariate(1 / 80))) if self.rng.random() < 0.97
                        else self.rng.randint(1, 5))
                k = min(k, 400)
                remaining -= k
                self._new_session(k)
            for key, mask in self.sel.select(timeout=0.05):
                self._on_event(key.data, mask)
            now = time.monotonic()
            if self.parked:
                keep = []
                for until, s in self.parked:
                    if now > until:
                        s.sock.close()
                    else:
                        keep.append((until, s))
                self.parked = keep
            for key in list(self.sel.get_map().values()):
                s = key.data
                if now > s.deadline or (s.quiet_until is not None and now > s.quiet_until):
                    self._finish(s)
            if rss_probe is not None and now - last_probe > 0.5:
                last_probe = now
                rss_probe()

    def close_all(self) -> None:
        for key in list(self.sel.get_map().values()):
            self._finish(key.data)
        for _, s in self.parked:
            s.sock.close()
        self.parked = []


# ------------------------------------------------------------------------------------------
# checks around the run
# ------------------------------------------------------------------------------------------
class Admin:
    """A well-behaved connection for stats and cleanup."""

    def __init__(self, host: str, port: int, token: str | None) -> None:
        deadline = time.monotonic() + 20
        while True:  # with --max-connections the fuzz sessions may still be closing: retry
            try:
                self.sock = socket.create_connection((host, port), timeout=30)
                self.buf = b""
                if token:
                    assert self.cmd(f"auth {token}") == b"OK"
                else:
                    self.cmd("list-tube-used")
                return
            except (OSError, EOFError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("server closed the admin connection")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def cmd(self, line: str) -> bytes:
        self.sock.sendall(line.encode() + b"\r\n")
        reply = self.line()
        words = reply.split()
        if words and words[0] in WITH_BODY and len(words) > 1:
            n = int(words[-1]) + 2
            while len(self.buf) < n:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise EOFError
                self.buf += chunk
            self.last_body, self.buf = self.buf[:n - 2], self.buf[n:]
        return reply

    def stats(self) -> dict:
        assert self.cmd("stats").startswith(b"OK")
        out = {}
        for ln in self.last_body.decode().splitlines()[1:]:
            k, _, v = ln.partition(": ")
            out[k] = v.strip()
        return out

    def cleanup(self) -> int:
        """Delete every job in every tube; returns how many."""
        deleted = 0
        for _ in range(1000):
            assert self.cmd("list-tubes").startswith(b"OK")
            tubes = [ln[2:] for ln in self.last_body.decode().splitlines()[1:]]
            found = False
            for tube in tubes:
                if self.cmd(f"use {tube}") != f"USING {tube}".encode():
                    continue
                for peek in ("peek-ready", "peek-delayed", "peek-buried"):
                    while True:
                        r = self.cmd(peek)
                        if not r.startswith(b"FOUND"):
                            break
                        found = True
                        if self.cmd(f"delete {int(r.split()[1])}") == b"DELETED":
                            deleted += 1
                if self.cmd(f"pause-tube {tube} 0") not in (b"PAUSED", b"NOT_FOUND"):
                    pass
            self.cmd("use default")
            st = self.stats()
            total = sum(int(st[k]) for k in ("current-jobs-ready", "current-jobs-delayed", "current-jobs-buried",
                                               "current-jobs-reserved", "current-jobs-urgent"))
            if not found and total == 0:
                return deleted
        raise RuntimeError("cleanup did not converge")

    def close(self) -> None:
        self.sock.close()


def proc_kb(pid: int, key: str) -> int:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith(key + ":"):
            return int(ln.split()[1])
    return -1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5, help="cleanup and leak checks between rounds")
    ap.add_argument("--warmup", type=int, default=20_000, help="inputs before the baseline RSS is taken")
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--server", choices=["ours", "beanstalkd"], default="ours")
    ap.add_argument("--profile", choices=["hardened", "stock"], default=None,
                    help="hardened (ours' default): every limit on plus token auth; stock: no flags")
    ap.add_argument("--ours-args", default="", help="more flags for our broker")
    ap.add_argument("--rss-tolerance-mb", type=float, default=24.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    ap.add_argument("--quick", action="store_true", help="20,000 inputs in 2 rounds, 2,000 warm-up")
    ap.add_argument("--out", default=str(BENCH / "out" / "fuzz_long.json"))
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.inputs, opts.rounds, opts.warmup = min(opts.inputs, 20_000), min(opts.rounds, 2), min(opts.warmup, 2_000)
    profile = opts.profile or ("hardened" if opts.server == "ours" else "stock")
    seed = opts.seed if opts.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    tmp = tempfile.mkdtemp(prefix="fuzz_long.")
    stderr_path = os.path.join(tmp, "server.log")
    token = None
    if opts.server == "ours":
        args = list(opts.ours_args.split())
        if profile == "hardened":
            token_file = os.path.join(tmp, "token")
            Path(token_file).write_text(TOKEN)
            args += HARDENED_ARGS + ["--auth-token-file", token_file]
            token = TOKEN
        srv = broker_process(extra_args=args, stderr_path=stderr_path)
    else:
        srv = beanstalkd_process(stderr_path=stderr_path)
    srv.start(timeout=30)
    summary: dict = {"seed": seed, "server": opts.server, "profile": profile, "argv": srv.argv[1:],
                     "started_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                     "loadavg_start": os.getloadavg()}
    failures: list[str] = []
    fz = Fuzzer(srv.host, srv.port, rng, opts.concurrency, auth=token is not None)
    peak = {"rss": 0}

    def probe():
        if srv.proc.poll() is None:
            peak["rss"] = max(peak["rss"], proc_kb(srv.pid, "VmRSS"))

    def settle(label: str) -> dict:
        """All fuzz connections closed: wait for the broker to drop them, clean up, measure."""
        fz.close_all()
        if srv.proc.poll() is not None:
            raise RuntimeError(f"broker exited with {srv.proc.returncode} ({label})")
        admin = Admin(srv.host, srv.port, token)
        try:
            try:  # a round that does not settle is reported below, not fatal
                conns = wait_until(lambda: int(admin.stats()["current-connections"]) == 1, 30, "connections to close")
            except TimeoutError:
                conns = False
            st = admin.stats()
            deleted = admin.cleanup()
            st2 = admin.stats()
            # let a paused tube's pause run out (we set it to 0) and unreferenced tubes go
            try:
                tubes_ok = wait_until(lambda: int(admin.stats()["current-tubes"]) == 1, 5, "unused tubes to go")
            except TimeoutError:
                tubes_ok = False
            time.sleep(0.5)  # RSS is sampled after a fixed pause, the same in every round (no condition to poll)
            rss = proc_kb(srv.pid, "VmRSS")
            fds = len(os.listdir(f"/proc/{srv.pid}/fd"))
            info = {"label": label, "current_connections": int(st["current-connections"]), "jobs_deleted": deleted,
                    "jobs_left": sum(int(st2[k]) for k in ("current-jobs-ready", "current-jobs-delayed",
                                                           "current-jobs-buried", "current-jobs-reserved")),
                    "tubes_after": int(admin.stats()["current-tubes"]), "rss_kb": rss, "fds": fds,
                    "job_bytes_after": int(st2.get("current-job-bytes", 0)),
                    "total_connections": int(st2.get("total-connections", 0)),
                    "stats_extra": {k: st2[k] for k in st2 if k.startswith(("limit-", "closed-", "auth-", "accept-"))}}
            if not conns:
                info["leaked_connections"] = int(st["current-connections"]) - 1
            if not tubes_ok:
                info["tubes_left"] = admin.cmd("list-tubes") and admin.last_body.decode()[:500]
            return info
        finally:
            admin.close()

    rounds: list[dict] = []
    try:
        fz.run(opts.warmup, probe)
        base = settle("warm-up")
        rounds.append(base)
        log(f"warm-up: {base}")
        per_round = max(1, opts.inputs // opts.rounds)
        done = 0
        for r in range(opts.rounds):
            n = per_round if r < opts.rounds - 1 else opts.inputs - done
            t0 = time.monotonic()
            fz.run(n, probe)
            done += n
            info = settle(f"round {r + 1}")
            info["seconds"] = round(time.monotonic() - t0, 1)
            info["inputs_per_s"] = round(n / max(0.001, time.monotonic() - t0))
            rounds.append(info)
            log(f"round {r + 1}/{opts.rounds}: {n} inputs, {info}")
            if time.monotonic() - started > opts.timeout:
                failures.append(f"gave up after {opts.timeout:.0f}s ({done} of {opts.inputs} inputs)")
                break
        last = rounds[-1]
        grown_mb = (last["rss_kb"] - base["rss_kb"]) / 1024
        summary["refusals"] = last["stats_extra"]
        summary.update(rss_baseline_kb=base["rss_kb"], rss_after_kb=last["rss_kb"], rss_peak_kb=peak["rss"],
                       rss_growth_mb=round(grown_mb, 1), fds_baseline=base["fds"], fds_after=last["fds"])
        if grown_mb > opts.rss_tolerance_mb:
            failures.append(f"RSS {last['rss_kb'] / 1024:.0f} MB after vs {base['rss_kb'] / 1024:.0f} MB baseline "
                            f"(+{grown_mb:.0f} MB > {opts.rss_tolerance_mb:g} MB)")
        if last["fds"] > base["fds"] + 2:
            failures.append(f"descriptors: {last['fds']} after vs {base['fds']} at baseline")
        for info in rounds:
            if info.get("leaked_connections"):
                failures.append(f"{info['label']}: {info['leaked_connections']} connections never went away")
            if info["jobs_left"]:
                failures.append(f"{info['label']}: {info['jobs_left']} jobs left after cleanup")
            if info["job_bytes_after"]:
                failures.append(f"{info['label']}: current-job-bytes is {info['job_bytes_after']} with no job held")
            if info["tubes_after"] != 1:
                failures.append(f"{info['label']}: {info['tubes_after']} tubes after cleanup: {info.get('tubes_left')}")
    except Exception as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        alive = srv.proc.poll() is None
        code = srv.stop(timeout=30)
    log_text = Path(stderr_path).read_text(errors="replace") if os.path.exists(stderr_path) else ""
    bad_lines = [ln for ln in log_text.splitlines() if any(m in ln for m in LOG_ERROR_MARKERS)]
    if not alive:
        failures.append(f"CRASH: the broker exited with {srv.proc.returncode} during the run")
    if fz.internal_errors:
        failures.append(f"{fz.internal_errors} INTERNAL_ERROR replies")
    if fz.violations:
        failures.append(f"{len(fz.violations)} protocol violations, e.g. {fz.violations[:3]}")
    if bad_lines:
        failures.append(f"{len(bad_lines)} error lines in the broker log, e.g. {bad_lines[:3]}")
    summary.update(
        inputs=fz.inputs, sessions=fz.sessions, modes=dict(fz.modes), bytes_sent=fz.bytes_sent,
        connect_failures=fz.connect_failures,
        resets=fz.resets, replies=dict((k.decode(), v) for k, v in fz.replies.most_common()),
        replies_total=sum(fz.replies.values()), internal_errors=fz.internal_errors,
        violations=fz.violations[:20], log_error_lines=bad_lines[:20], crashed=not alive, exit_code=code,
        rounds=rounds, seconds=round(time.monotonic() - started, 1), failures=failures,
        finished_utc=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), loadavg_end=os.getloadavg(),
        server_log_tail=log_text[-2000:])
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("seed", "server", "profile", "inputs", "sessions", "replies_total",
                                              "internal_errors", "crashed", "rss_baseline_kb", "rss_after_kb",
                                              "rss_peak_kb", "rss_growth_mb", "fds_baseline", "fds_after", "seconds",
                                              "refusals", "failures") if k in summary}))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
