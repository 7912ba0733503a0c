"""Differential harness: run one scripted exchange against two live servers, compare bytes.

A case is data: a list of steps, each on a named client connection (``c1``, ``c2``, ...
opened lazily on first use). The harness runs the same case against real beanstalkd
1.12 (the reference) and against the candidate (our broker), records what each server
sent back per step, normalises only what legitimately differs between two processes
(pids, clocks, host facts, and job ids when the servers are shared between cases), and
the test compares the two transcripts step by step.

Step kinds (build them with the helpers below):

- ``send(c, data, n)``: write raw bytes, then read until ``n`` complete replies are
  parsed (2 s per read). A reply is one CRLF-terminated line, plus ``<bytes>\\r\\n`` of
  body for RESERVED / FOUND / OK.
- ``silent(c, data, window)``: write, then assert that nothing arrives within a short
  window (a blocked reserve: asserting absence is the one legitimate use of a timeout).
- ``anyreply(c, data, n)``: like send, but the replies' content is not compared (only
  for replies real beanstalkd itself gives nondeterministically).
- ``replies(c, n)``: read ``n`` more replies without writing (answers to a blocked command).
- ``closed(c, data)``: write, then expect the server to close the connection.
- ``close(c)`` / ``halfclose(c)``: close our end, or shut down our write side only.
- ``until(c, data, prefix, contains=...)``: poll a command until its reply starts with
  ``prefix`` and contains ``contains`` (a condition, instead of sleeping); only
  "met"/"not met" is recorded.
- ``signal(name)``: send a signal to the server process (fresh servers only).
- ``restart(how)``: drop all connections, stop (or SIGKILL) and restart the server on the
  same port with the same arguments (fresh servers only; binlog cases).

Per-case options: ``fresh`` (own server pair), ``args`` (server flags; ``{dir}`` becomes a
private directory per server), ``exact_times`` (also compare stats-job age/time-left),
``polled_keys`` (stats keys a poll made unpredictable), and ``timed=True`` on a send
(compare how long the reply took, in whole seconds).

Placeholders in sent bytes: ``{t}`` is the case's own tube prefix (unique per case so cases
can share a server), ``{jN}`` is the N-th distinct job id this case has seen in replies.
"""
from __future__ import annotations

import contextlib
import difflib
import re
import select
import signal as _signal
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

READ_TIMEOUT = 2.0  # per read, while expecting replies
SILENCE_WINDOW = 0.3  # how long "no reply" is awaited
UNTIL_TIMEOUT = 6.0

BODY_STATUSES = frozenset({b"RESERVED", b"FOUND", b"OK"})

# Keys whose values differ between any two server processes (or with the clock). In a
# stats body "id" is the server's random id; in a stats-job body it is the job id, which
# is compared (renamed #N on shared servers). The "OK <bytes>" count before a body that
# had values normalised is replaced by "<bytes>" after checking it matches the body.
VOLATILE_STATS_KEYS = frozenset({
    b"pid", b"uptime", b"rusage-utime", b"rusage-stime", b"version", b"hostname", b"os",
    b"platform", b"id",
})
VOLATILE_JOB_KEYS = frozenset({b"age", b"time-left"})


# ---------------------------------------------------------------------------------------
# Case description
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    kind: str
    conn: str = ""
    data: bytes = b""
    n: int = 0
    window: float = SILENCE_WINDOW
    prefix: bytes = b""
    timeout: float = READ_TIMEOUT
    contains: bytes = b""
    timed: bool = False  # also compare how long the reply took, in whole seconds

    def describe(self) -> str:
        if self.kind == "send":
            return f"{self.conn} send {self.data[:160]!r} expecting {self.n} repl{'y' if self.n == 1 else 'ies'}"
        if self.kind == "silent":
            return f"{self.conn} send {self.data[:160]!r} expecting no reply within {self.window}s"
        if self.kind == "anyreply":
            return f"{self.conn} send {self.data[:160]!r} expecting {self.n} reply(ies) whose content is not compared"
        if self.kind == "replies":
            return f"{self.conn} read {self.n} more repl{'y' if self.n == 1 else 'ies'}"
        if self.kind == "closed":
            return f"{self.conn} send {self.data[:160]!r} expecting the server to close"
        if self.kind == "until":
            return (f"{self.conn} poll {self.data!r} until reply starts with {self.prefix!r}"
                    + (f" and contains {self.contains!r}" if self.contains else ""))
        if self.kind == "signal":
            return f"send signal {self.data.decode()} to the server"
        if self.kind == "restart":
            return f"restart the server ({self.data.decode()})"
        return f"{self.conn} {self.kind}"


def send(conn: str, data: bytes, n: int = 1, timeout: float = READ_TIMEOUT, timed: bool = False) -> Step:
    """timed=True also records how long the replies took, rounded to whole seconds (for
    replies the server's clock decides: delays, TTR margins, pauses, reserve timeouts)."""
    return Step("send", conn, data, n=n, timeout=timeout, timed=timed)


def silent(conn: str, data: bytes = b"", window: float = SILENCE_WINDOW) -> Step:
    return Step("silent", conn, data, window=window)


def anyreply(conn: str, data: bytes, n: int = 1, timeout: float = READ_TIMEOUT) -> Step:
    """Send and read n replies without comparing them: for the rare reply that real
    beanstalkd itself does not give deterministically (which of two timers fires first)."""
    return Step("anyreply", conn, data, n=n, timeout=timeout)


def replies(conn: str, n: int = 1, timeout: float = READ_TIMEOUT, timed: bool = False) -> Step:
    return Step("replies", conn, b"", n=n, timeout=timeout, timed=timed)


def closed(conn: str, data: bytes = b"") -> Step:
    return Step("closed", conn, data)


def close(conn: str) -> Step:
    return Step("close", conn)


def halfclose(conn: str) -> Step:
    return Step("halfclose", conn)


def until(conn: str, data: bytes, prefix: bytes = b"", timeout: float = UNTIL_TIMEOUT, contains: bytes = b"") -> Step:
    """Poll: resend `data` until its (normalised) reply starts with `prefix` and contains
    `contains`."""
    return Step("until", conn, data, prefix=prefix, timeout=timeout, contains=contains)


def blocked_in_turn(probe: str, *conns: str) -> tuple[Step, ...]:
    """Each of ``conns`` sends a reserve that blocks, in this order, ``probe`` polling stats-tube until each
    one waits: waiters are served in the order they came, so a case must not let them race."""
    steps: list[Step] = []
    for waiting, conn in enumerate(conns, 1):
        steps += [silent(conn, b"reserve\r\n"),
                  until(probe, b"stats-tube {t}\r\n", contains=b"current-waiting: %d\n" % waiting)]
    return tuple(steps)


def signal(name: str) -> Step:
    return Step("signal", data=name.encode())


def restart(how: str = "stop") -> Step:
    """Drop every connection, stop the server (SIGTERM, or SIGKILL with how="kill") and
    start it again on the same port with the same arguments (fresh cases only)."""
    return Step("restart", data=how.encode())


@dataclass(frozen=True)
class Case:
    """One scripted exchange. ``fresh`` cases get their own new pair of servers (needed
    for global state: stats counters, job ids, list-tubes, the default tube, signals)."""

    name: str
    steps: tuple[Step, ...]
    fresh: bool = False
    args: tuple[str, ...] = ()
    note: str = ""
    # Compare stats-job age/time-left too (True: both; or a tuple of the keys to keep).
    exact_times: bool | tuple[str, ...] = False
    # Stats keys not compared in this case, because a poll (`until`) issued the command an
    # unpredictable number of times (e.g. cmd-stats while waiting for a signal to land).
    polled_keys: tuple[str, ...] = ()
    # Keys (of any stats YAML) where we differ from beanstalkd on purpose; ``note`` says why.
    deliberate: tuple[str, ...] = ()

    @property
    def tube(self) -> str:
        return self.name.replace("_", "-")[:150]


def case(name: str, *steps: Step, fresh: bool = False, args: Sequence[str] = (), note: str = "",
         exact_times: bool | tuple[str, ...] = False, polled_keys: Sequence[str] = (),
         deliberate: Sequence[str] = ()) -> Case:
    if args:
        fresh = True
    if deliberate and not note:
        raise ValueError(f"case {name}: a deliberate difference needs a note saying why")
    return Case(name, tuple(steps), fresh=fresh, args=tuple(args), note=note, exact_times=exact_times,
                polled_keys=tuple(polled_keys), deliberate=tuple(deliberate))


# ---------------------------------------------------------------------------------------
# Wire reading
# ---------------------------------------------------------------------------------------
class _Timeout(Exception):
    pass


class _Eof(Exception):
    pass


class Client:
    """A raw socket with a receive buffer; replies are parsed only for framing."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=5.0)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.eof = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def _recv(self, deadline: float) -> None:
        if self.eof:
            raise _Eof()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Timeout()
        ready, _, _ = select.select([self.sock], [], [], remaining)
        if not ready:
            raise _Timeout()
        try:
            chunk = self.sock.recv(262144)
        except (ConnectionResetError, BrokenPipeError):
            chunk = b""
        if not chunk:
            self.eof = True
            raise _Eof()
        self.buf += chunk

    def read_reply(self, timeout: float) -> bytes:
        """One complete reply's raw bytes; raises _Timeout / _Eof (buffer kept intact)."""
        deadline = time.monotonic() + timeout
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                words = line.split(b" ")
                total = end + 2
                if words[0] in BODY_STATUSES and len(words) >= 2 and words[-1].isdigit() and len(words[-1]) < 9:
                    total += int(words[-1]) + 2
                if len(self.buf) >= total:
                    reply = bytes(self.buf[:total])
                    del self.buf[:total]
                    return reply
            self._recv(deadline)

    def drain(self, window: float) -> bytes:
        """Whatever arrives within `window` seconds (plus what is already buffered)."""
        deadline = time.monotonic() + window
        try:
            while True:
                self._recv(deadline)
        except (_Timeout, _Eof):
            pass
        data = bytes(self.buf)
        self.buf.clear()
        return data

    def wait_eof(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        try:
            while True:
                self._recv(deadline)
        except _Eof:
            return True
        except _Timeout:
            return False


# ---------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------
_ID_REPLY = re.compile(rb"^(INSERTED|BURIED|RESERVED|FOUND) (\d+)")
_PLACEHOLDER = re.compile(rb"\{(t|j\d+)\}")


class IdBook:
    """Job ids in order of first appearance; used both for {jN} placeholders and, on
    shared servers, to rename ids (#1, #2, ...) so two servers' transcripts compare."""

    def __init__(self) -> None:
        self.order: list[bytes] = []

    def see(self, job_id: bytes) -> int:
        if job_id not in self.order:
            self.order.append(job_id)
        return self.order.index(job_id) + 1

    def lookup(self, n: int) -> bytes:
        if 1 <= n <= len(self.order):
            return self.order[n - 1]
        # Not seen (yet): a number no server will reach in a test run.
        return str(3_000_000_000 + n).encode()


def _normalise_yaml(body: bytes, book: IdBook, rename_ids: bool, exact_times=False,
                    polled_keys: tuple[str, ...] = ()) -> tuple[bytes, bool]:
    polled = {k.encode() for k in polled_keys if not k.startswith("*")}
    deliberate = {k[1:].encode() for k in polled_keys if k.startswith("*")}
    if exact_times is True:
        volatile_job_keys: frozenset = frozenset()
    elif exact_times:
        volatile_job_keys = VOLATILE_JOB_KEYS - {k.encode() for k in exact_times}
    else:
        volatile_job_keys = VOLATILE_JOB_KEYS
    lines = body.split(b"\n")
    is_job = any(line.startswith(b"state: ") for line in lines) and any(line.startswith(b"ttr: ") for line in lines)
    is_server = any(line.startswith(b"pid: ") for line in lines)
    changed = False
    out = []
    for line in lines:
        key, sep, value = line.partition(b": ")
        if sep:
            if is_job and key == b"id":
                if rename_ids and value.isdigit():
                    line = b"id: #%d" % book.see(value)
                    changed = True
                elif value.isdigit():
                    book.see(value)
            elif (is_job and key in volatile_job_keys
                  or (is_server and (key in VOLATILE_STATS_KEYS or key in polled)) or key in deliberate):
                line = key + b": <" + key + b">"
                changed = True
        out.append(line)
    return b"\n".join(out), changed


def normalise_reply(reply: bytes, book: IdBook, rename_ids: bool, exact_times=False,
                    polled_keys: tuple[str, ...] = ()) -> bytes:
    end = reply.find(b"\r\n")
    line, rest = reply[:end], reply[end + 2:]
    m = _ID_REPLY.match(line)
    if m:
        n = book.see(m.group(2))
        if rename_ids:
            line = m.group(1) + b" #%d" % n + line[m.end():]
    if line.startswith(b"OK ") and rest.endswith(b"\r\n"):
        body = rest[:-2]
        claimed = line[3:]
        new_body, changed = _normalise_yaml(body, book, rename_ids, exact_times, polled_keys)
        if changed:
            # The count is compared for honesty (it must match the body), not for value.
            if claimed.isdigit() and int(claimed) == len(body):
                line = b"OK <bytes>"
            else:
                line = b"OK <bytes WRONG: says %s, body has %d>" % (claimed, len(body))
            rest = new_body + b"\r\n"
    return line + b"\r\n" + rest


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------
@dataclass
class Record:
    step: int
    what: str
    got: bytes
    problem: str = ""  # non-empty when the step's own expectation was not met


@dataclass
class Transcript:
    records: list[Record] = field(default_factory=list)

    def problems(self) -> list[Record]:
        return [r for r in self.records if r.problem]


def _substitute(data: bytes, c: Case, book: IdBook) -> bytes:
    def repl(m: re.Match) -> bytes:
        token = m.group(1)
        if token == b"t":
            return c.tube.encode()
        return book.lookup(int(token[1:]))
    return _PLACEHOLDER.sub(repl, data)


def run_case(c: Case, server, rename_ids: bool) -> Transcript:
    """Run every step of `c` against `server` (a ServerProcess); never raises for
    protocol-level surprises, it records them."""
    book = IdBook()
    conns: dict[str, Client] = {}
    tr = Transcript()

    def get(name: str) -> Client:
        if name not in conns:
            conns[name] = Client(server.host, server.port)
        return conns[name]

    def read_n(cl: Client, n: int, timeout: float) -> tuple[bytes, str]:
        out = []
        for _ in range(n):
            try:
                ignored = c.polled_keys + tuple('*' + k for k in c.deliberate)
                out.append(normalise_reply(cl.read_reply(timeout), book, rename_ids, c.exact_times, ignored))
            except _Timeout:
                partial = bytes(cl.buf)
                cl.buf.clear()
                return b"".join(out) + partial + b"<NO FURTHER REPLY WITHIN %.1fs>" % timeout, "timeout"
            except _Eof:
                partial = bytes(cl.buf)
                cl.buf.clear()
                return b"".join(out) + partial + b"<CONNECTION CLOSED BY SERVER>", "closed"
        return b"".join(out), ""

    def write(cl: Client, data: bytes) -> str:
        if not data:
            return ""
        try:
            cl.sock.sendall(_substitute(data, c, book))
        except OSError as exc:
            return f"send failed: {exc}"
        return ""

    try:
        for i, st in enumerate(c.steps):
            what = st.describe()
            if st.kind == "signal":
                server.signal(getattr(_signal, st.data.decode()))
                tr.records.append(Record(i, what, b""))
                continue
            if st.kind == "restart":
                for cl in conns.values():
                    cl.close()
                conns.clear()
                if st.data == b"kill":
                    server.kill()
                else:
                    server.stop()
                server.start()
                tr.records.append(Record(i, what, b""))
                continue
            cl = get(st.conn)
            if st.kind == "close":
                cl.close()
                del conns[st.conn]
                tr.records.append(Record(i, what, b""))
            elif st.kind == "halfclose":
                cl.sock.shutdown(socket.SHUT_WR)
                tr.records.append(Record(i, what, b""))
            elif st.kind in ("send", "replies"):
                started = time.monotonic()
                problem = write(cl, st.data)
                got, p = read_n(cl, st.n, st.timeout)
                if st.timed:
                    got += b" <after ~%ds>" % round(time.monotonic() - started)
                tr.records.append(Record(i, what, got, problem or p))
            elif st.kind == "anyreply":
                problem = write(cl, st.data)
                got, p = read_n(cl, st.n, st.timeout)
                tr.records.append(Record(i, what, b"<%d reply(ies), content not compared>" % st.n if not p else got,
                                         problem or p))
            elif st.kind == "silent":
                problem = write(cl, st.data)
                got = cl.drain(st.window)
                if cl.eof:
                    got += b"<CONNECTION CLOSED BY SERVER>"
                got = b"".join(_split_normalise(got, book, rename_ids))
                tr.records.append(Record(i, what, got, problem or ("unexpected bytes" if got else "")))
            elif st.kind == "closed":
                write(cl, st.data)
                got = b""
                try:
                    while True:
                        ignored = c.polled_keys + tuple('*' + k for k in c.deliberate)
                        got += normalise_reply(cl.read_reply(READ_TIMEOUT), book, rename_ids, c.exact_times, ignored)
                except _Eof:
                    got += bytes(cl.buf) + b"<CONNECTION CLOSED BY SERVER>"
                    cl.buf.clear()
                    tr.records.append(Record(i, what, got))
                except _Timeout:
                    got += bytes(cl.buf) + b"<STILL OPEN AFTER %.1fs>" % READ_TIMEOUT
                    cl.buf.clear()
                    tr.records.append(Record(i, what, got, "connection not closed"))
            elif st.kind == "until":
                deadline = time.monotonic() + st.timeout
                last = b""
                met = False
                while time.monotonic() < deadline:
                    write(cl, st.data)
                    last, p = read_n(cl, 1, READ_TIMEOUT)
                    if last.startswith(st.prefix) and st.contains in last:
                        met = True
                        break
                    if p:
                        break
                    time.sleep(0.02)  # polling interval of a condition, not a synchronisation sleep
                if met:
                    tr.records.append(Record(i, what, b"<condition met>"))
                else:
                    shown = b"<condition NOT met; last reply: " + last + b">"
                    tr.records.append(Record(i, what, shown, "condition not met"))
            else:  # pragma: no cover - a typo in a case
                raise ValueError(f"unknown step kind {st.kind!r}")
        # Anything left unread at the end is part of the transcript too.
        for name in sorted(conns):
            cl = conns[name]
            extra = bytes(cl.buf)
            cl.buf.clear()
            try:
                cl.sock.setblocking(False)
                while True:
                    chunk = cl.sock.recv(65536)
                    if not chunk:
                        break
                    extra += chunk
            except (BlockingIOError, OSError):
                pass
            if extra:
                tr.records.append(Record(len(c.steps), f"{name}: bytes left unread at the end of the case", extra,
                                         "unexpected bytes"))
    finally:
        for cl in conns.values():
            cl.close()
    return tr


def _split_normalise(data: bytes, book: IdBook, rename_ids: bool) -> list[bytes]:
    """Normalise a run of complete replies (as far as they parse)."""
    out = []
    cl = _BufferOnly(data)
    while True:
        try:
            out.append(normalise_reply(cl.read_reply(0), book, rename_ids))
        except (_Timeout, _Eof):
            out.append(bytes(cl.buf))
            return out


class _BufferOnly(Client):
    def __init__(self, data: bytes) -> None:  # no socket: parses a byte string
        self.buf = bytearray(data)
        self.eof = False

    def _recv(self, deadline: float) -> None:
        raise _Eof()


def run_pair(c: Case, reference, candidate, rename_ids: bool) -> tuple[Transcript, Transcript]:
    """Run the case on both servers at once (two threads: timing cases cost once)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        ref = pool.submit(run_case, c, reference, rename_ids)
        cand = pool.submit(run_case, c, candidate, rename_ids)
        return ref.result(), cand.result()


def diff_report(c: Case, ref: Transcript, cand: Transcript, cand_name: str) -> str | None:
    """None when the transcripts agree; otherwise a step-by-step account."""
    lines: list[str] = []
    n = max(len(ref.records), len(cand.records))
    for k in range(n):
        r = ref.records[k] if k < len(ref.records) else None
        o = cand.records[k] if k < len(cand.records) else None
        if r is not None and o is not None and r.got == o.got and r.what == o.what:
            continue
        what = (r or o).what
        step = (r or o).step
        lines.append(f"step {step}: {what}")
        lines.append(f"    beanstalkd 1.12: {r.got if r else '<no such record>'!r}")
        lines.append(f"    {cand_name:>15}: {o.got if o else '<no such record>'!r}")
        if r is not None and o is not None and r.got.count(b"\n") > 2:
            ref_lines = r.got.decode("latin-1").splitlines()
            cand_lines = o.got.decode("latin-1").splitlines()
            delta = [d for d in difflib.unified_diff(ref_lines, cand_lines, "beanstalkd", cand_name, n=0, lineterm="")
                     if not d.startswith("@@")]
            lines.extend("      " + d for d in delta)
    if not lines:
        return None
    return f"case {c.name}: transcripts differ\n" + "\n".join(lines)


def transcript_text(tr: Transcript) -> str:
    return "\n".join(f"  [{r.step}] {r.what}\n      -> {r.got!r}" + (f"  !! {r.problem}" if r.problem else "")
                     for r in tr.records)


# ---------------------------------------------------------------------------------------
# Helpers for writing cases
# ---------------------------------------------------------------------------------------
def put(body: bytes, pri: int = 0, delay: int = 0, ttr: int = 60) -> bytes:
    """The bytes of one well-formed put command with its body."""
    return b"put %d %d %d %d\r\n%s\r\n" % (pri, delay, ttr, len(body), body)


def on_tube(conn: str = "c1", tube: bytes = b"{t}") -> Step:
    """Use and watch the case's own tube only (keeps shared-server cases apart)."""
    return send(conn, b"use " + tube + b"\r\nwatch " + tube + b"\r\nignore default\r\n", 3)
