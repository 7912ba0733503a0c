"""The beanstalkd 1.12 wire codec: bytes in, commands out; reply constants out.

No sockets and no queue state here. :class:`Decoder` turns a client's byte stream into
command tuples exactly as beanstalkd 1.12 reads it, quirks included, because clients
(and our differential tests) see them:

* Commands are recognised by prefix, in beanstalkd's order, so ``reservex`` is a
  malformed ``reserve`` (BAD_FORMAT), not an unknown command.
* A command line must fit beanstalkd's 224-byte line buffer including CRLF. Only the
  first CR in that window counts: if it is not followed by LF the line can never end,
  and once the window is full the input is discarded up to the next CRLF, which is
  answered with BAD_FORMAT.
* Numbers follow C's strtoul/strtol rules where beanstalkd uses them (``kick``,
  ``reserve-with-timeout``: leading white space and a sign accepted, trailing garbage
  ignored) and its stricter read_u32/read_u64 elsewhere.
* A put whose body does not end in CRLF costs a job id and is answered
  EXPECTED_CRLF; the bytes after the body are read as the next command.

Each command is a named record (a NamedTuple, so it still reads and compares as a tuple)
whose first field is the command name (interned str); see :meth:`Decoder.next_command`.
The two made for every command, a complete put (:class:`Put`) and a delete (:class:`IdArg`),
are built as plain tuples of the same fields: their readers index or unpack them, never use
the field names.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Final, NamedTuple

from mypy_extensions import i64

from beanstalk_rules.tubes import NAME_BYTES as NAME_CHARS
from beanstalk_rules.tubes import valid_tube_name
from broker._build import is_compiled_file

# Final, and literals: mypyc compiles these values in, where a module global costs a dict
# look-up and an unboxing at each use (this module runs for every command).
LINE_LIMIT: Final = 224  # beanstalkd's LINE_BUF_SIZE: command line including CRLF
DEFAULT_MAX_JOB_SIZE: Final = 65535
U32_MAX: Final = 4294967295  # 2**32 - 1
U64_MAX: Final = 18446744073709551615  # 2**64 - 1
ULONG_MAX: Final = 18446744073709551615
LONG_MIN: Final = -9223372036854775808  # -(2**63)
LONG_MAX: Final = 9223372036854775807

C_SPACE: Final = b" \t\n\v\f\r"


# -- command records -----------------------------------------------------------------------
class Bare(NamedTuple):
    """A command without arguments: reserve, stats, peek-ready, list-tubes, quit, too-big..."""

    name: str


class IdArg(NamedTuple):
    """peek, reserve-job, delete, kick-job, touch, stats-job."""

    name: str
    job_id: int


class TubeArg(NamedTuple):
    """use, watch, ignore, stats-tube."""

    name: str
    tube: str


class IntArg(NamedTuple):
    """kick (bound) and reserve-with-timeout (seconds)."""

    name: str
    value: int


class Release(NamedTuple):
    name: str
    job_id: int
    pri: int
    delay: int


class Bury(NamedTuple):
    name: str
    job_id: int
    pri: int


class PauseTube(NamedTuple):
    name: str
    tube: str
    delay: int


class PutLine(NamedTuple):
    """A put line without its body ("put"), or ("put-header") a put whose body is still arriving.

    A well-formed "put" line is parsed once and kept in the line cache as a plain tuple of these
    fields (readers unpack it, never use the names): interpreted, unpacking a tuple subclass goes
    through the iterator protocol (~450 instructions more a put than a plain tuple's unpack)."""

    name: str
    pri: int
    delay: int
    ttr: int
    size: int


class Put(NamedTuple):
    """A complete put; ``body`` is None when its CRLF was wrong (EXPECTED_CRLF, still costs an id).

    Made once per put, so the decoder builds it as a plain tuple of these fields (readers unpack
    it, never use the attribute names): one tuple from the free list, where ``Put(...)`` or
    ``tuple.__new__(Put, ...)`` allocate a tuple subclass and an argument tuple and free both
    (compiled, ~500 instructions a put)."""

    name: str
    pri: int
    delay: int
    ttr: int
    body: bytes | None
    header_seen: bool


class Auth(NamedTuple):
    name: str
    token: bytes


class Error(NamedTuple):
    """Answer ``reply``; ``counted`` is the command whose stats counter beanstalkd still bumps."""

    name: str
    reply: bytes
    counted: str | None


LineCommand = Bare | IdArg | TubeArg | IntArg | Release | Bury | PauseTube | PutLine
Command = Bare | IdArg | TubeArg | IntArg | Release | Bury | PauseTube | PutLine | Put | Auth | Error
# Parsed lines that repeat endlessly ("put 0 0 60 312", "reserve", "use jobs"), shared by the
# decoders of one server (see ServerState); bounded: cleared when full.
LineCache = dict[bytes, LineCommand]
LINE_CACHE_SIZE: Final = 4096
TOO_BIG: Final = Bare("too-big")
# Compiled, the decoder finds a line's CR with a native loop (find_cr) instead of bytes.find, which
# parses its arguments through the C API: ~800 instructions a call, for lines of 10-30 bytes.
# Interpreted, bytes.find stays (a Python loop costs more per byte than the call).
COMPILED: Final = is_compiled_file(__file__)


def find_cr(data: bytes, start: int, end: int) -> int:
    """The index of the first CR in ``data[start:end]``, or -1 (``data.find(b"\\r", start, end)``
    for 0 <= start <= end). Native 64-bit ints: compiled, a C loop of a few instructions a byte
    (with tagged ints each step checked for overflow and boxing: ~25)."""
    stop: i64 = end
    n: i64 = len(data)
    if stop > n:
        stop = n
    i: i64 = start
    while i < stop:
        if data[i] == 13:
            return i
        i += 1
    return -1


# Parsed lines that go into the line cache and the rarer per-command records are built with
# tuple.__new__: the NamedTuple constructor is a Python-level function, several times slower.
# (A put line, a complete put and a delete are plain tuples, see PutLine and Put.) Final: compiled, a C static.
_new: Final = tuple.__new__

# Replies (constants; formatted ones are built where used).
BAD_FORMAT: Final = b"BAD_FORMAT\r\n"
UNKNOWN_COMMAND: Final = b"UNKNOWN_COMMAND\r\n"
EXPECTED_CRLF: Final = b"EXPECTED_CRLF\r\n"
JOB_TOO_BIG: Final = b"JOB_TOO_BIG\r\n"
OUT_OF_MEMORY: Final = b"OUT_OF_MEMORY\r\n"
DRAINING: Final = b"DRAINING\r\n"
NOT_FOUND: Final = b"NOT_FOUND\r\n"
DELETED: Final = b"DELETED\r\n"
RELEASED: Final = b"RELEASED\r\n"
BURIED: Final = b"BURIED\r\n"
KICKED: Final = b"KICKED\r\n"
TOUCHED: Final = b"TOUCHED\r\n"
PAUSED: Final = b"PAUSED\r\n"
NOT_IGNORED: Final = b"NOT_IGNORED\r\n"
TIMED_OUT: Final = b"TIMED_OUT\r\n"
DEADLINE_SOON: Final = b"DEADLINE_SOON\r\n"


def yaml_list(names: Iterable[str]) -> bytes:
    body = "---\n" + "".join(f"- {n}\n" for n in names)
    data = body.encode()
    return b"OK %d\r\n%s\r\n" % (len(data), data)


def yaml_ok(text: str) -> bytes:
    data = text.encode()
    return b"OK %d\r\n%s\r\n" % (len(data), data)

# Command words in the order beanstalkd's which_cmd() tests them (prefix match).
_PREFIXES: Final[tuple[tuple[bytes, str], ...]] = (
    (b"put ", "put"),
    (b"peek ", "peek"),
    (b"peek-ready", "peek-ready"),
    (b"peek-delayed", "peek-delayed"),
    (b"peek-buried", "peek-buried"),
    (b"reserve-with-timeout ", "reserve-with-timeout"),
    (b"reserve-job ", "reserve-job"),
    (b"reserve", "reserve"),
    (b"delete ", "delete"),
    (b"release ", "release"),
    (b"bury ", "bury"),
    (b"kick ", "kick"),
    (b"kick-job ", "kick-job"),
    (b"touch ", "touch"),
    (b"stats-job ", "stats-job"),
    (b"stats-tube ", "stats-tube"),
    (b"stats", "stats"),
    (b"use ", "use"),
    (b"watch ", "watch"),
    (b"ignore ", "ignore"),
    (b"list-tubes-watched", "list-tubes-watched"),
    (b"list-tube-used", "list-tube-used"),
    (b"list-tubes", "list-tubes"),
    (b"quit", "quit"),
    (b"pause-tube", "pause-tube"),
)
# Fast path: the first word of a well-formed line -> command name.
_EXACT_WORDS: Final = {prefix.strip(): name for prefix, name in _PREFIXES}
# Commands whose line must be exactly the word (no arguments).
_BARE: Final = frozenset({"peek-ready", "peek-delayed", "peek-buried", "reserve", "stats",
                   "list-tubes-watched", "list-tube-used", "list-tubes"})
_ID_ONLY: Final = frozenset({"peek", "reserve-job", "delete", "kick-job", "touch", "stats-job"})
_NAME_ONLY: Final = frozenset({"stats-tube", "use", "watch", "ignore"})


class ParseError(Exception):
    """A malformed command line; ``counted`` names the stats counter beanstalkd still bumps."""

    def __init__(self, reply: bytes, counted: str | None = None) -> None:
        self.reply = reply
        self.counted = counted


def classify(line: bytes) -> str | None:
    """The command a line starts with, by beanstalkd's prefix rules (None if unknown)."""
    for prefix, name in _PREFIXES:
        if line.startswith(prefix):
            return name
    return None


def _skip_spaces(line: bytes, pos: int) -> int:
    n = len(line)
    while pos < n and line[pos] == 32:
        pos += 1
    return pos


def read_uint(line: bytes, pos: int, limit: int, to_end: bool) -> tuple[int, int]:
    """beanstalkd's read_u32/read_u64: spaces, then digits only; returns (value, end)."""
    pos = _skip_spaces(line, pos)
    start = pos
    n = len(line)
    while pos < n and 48 <= line[pos] <= 57:
        pos += 1
    if pos == start:
        raise ParseError(BAD_FORMAT)
    value = int(line[start:pos])
    if value > limit or value > U64_MAX:  # strtoumax's ERANGE, then the width check
        raise ParseError(BAD_FORMAT)
    if to_end and pos != n:
        raise ParseError(BAD_FORMAT)
    return value, pos


def _c_strtol(text: bytes) -> int | None:
    """C strtol/strtoul prefix parse: the signed value, or None when there are no digits."""
    pos = 0
    n = len(text)
    while pos < n and text[pos] in C_SPACE:
        pos += 1
    negative = False
    if pos < n and text[pos] in b"+-":
        negative = text[pos] == 45
        pos += 1
    start = pos
    while pos < n and 48 <= text[pos] <= 57:
        pos += 1
    if pos == start:
        return None
    value = int(text[start:pos])
    return -value if negative else value


def parse_strtoul_u32(text: bytes) -> int:
    """kick's count: strtoul, then stored in a 32-bit unsigned int."""
    value = _c_strtol(text)
    if value is None:
        raise ParseError(BAD_FORMAT)
    magnitude = abs(value)
    if magnitude > ULONG_MAX:
        raise ParseError(BAD_FORMAT)
    if value < 0:
        value = (ULONG_MAX + 1 - magnitude) & ULONG_MAX
    return value & U32_MAX


def parse_strtol_int(text: bytes) -> int:
    """reserve-with-timeout's seconds: strtol (no digits means 0), then a C int."""
    value = _c_strtol(text)
    if value is None:
        return 0
    if not LONG_MIN <= value <= LONG_MAX:
        raise ParseError(BAD_FORMAT)
    value &= 0xFFFFFFFF
    return value - 2**32 if value >= 2**31 else value


def _name_arg(line: bytes, start: int) -> str:
    name = line[start:]
    if not valid_tube_name(name):
        raise ParseError(BAD_FORMAT)
    return name.decode("ascii")


def _fast_parse(parts: list[bytes], name: str, max_job_size: int) -> LineCommand | None:
    """Well-formed lines (single spaces, plain digits) parsed without the character loops.

    Returns None when the line is not in canonical form; the exact parser then decides.
    """
    n = len(parts)
    if name == "put":
        if n == 5 and parts[1].isdigit() and parts[2].isdigit() and parts[3].isdigit() and parts[4].isdigit():
            pri, delay, ttr, size = int(parts[1]), int(parts[2]), int(parts[3]), int(parts[4])
            if pri <= U32_MAX and delay <= U32_MAX and ttr <= U32_MAX and size <= U32_MAX:
                if size > max_job_size:
                    raise TooBig(size + 2)
                return ("put", pri, delay, ttr, size)  # type: ignore[return-value]  # a PutLine, as a plain tuple
        return None
    if name in _ID_ONLY:
        if n == 2 and parts[1].isdigit():
            value = int(parts[1])
            if value <= U64_MAX:
                return _new(IdArg, (name, value))
        return None
    if name in _BARE:
        return Bare(name) if n == 1 else None
    if name in _NAME_ONLY:
        if n == 2 and valid_tube_name(parts[1]):
            return TubeArg(name, parts[1].decode("ascii"))
        return None
    if name == "release":
        if n == 4 and parts[1].isdigit() and parts[2].isdigit() and parts[3].isdigit():
            job_id, pri, delay = int(parts[1]), int(parts[2]), int(parts[3])
            if job_id <= U64_MAX and pri <= U32_MAX and delay <= U32_MAX:
                return _new(Release, (name, job_id, pri, delay))
        return None
    if name == "reserve-with-timeout":
        if n == 2 and parts[1].isdigit() and len(parts[1]) < 10:
            return IntArg(name, int(parts[1]))
        return None
    return None


_UNCACHED: Final = _ID_ONLY | {"release"}


def parse_line(line: bytes, max_job_size: int, cache: LineCache | None = None) -> LineCommand:
    """Parse one command line (without CRLF) into a command record; raises ParseError."""
    if cache is not None:
        cmd = cache.get(line)
        if cmd is not None:
            if cmd[0] == "put":  # a PutLine (a plain tuple: see there)
                _, _, _, _, size = cmd  # type: ignore[misc]
                if size > max_job_size:
                    raise TooBig(size + 2)
            return cmd
    return _parse_uncached(line, max_job_size, cache)


def plain_number(line: bytes, start: i64) -> i64:
    """``int(line[start:])`` when that is 1 to 18 ASCII digits (so below 2**63), else -1.

    Compiled, a C loop over the digits; interpreted, ``isdigit`` and ``int`` (two C calls, cheaper
    there than a Python loop)."""
    n: i64 = len(line)
    if n <= start or n - start > 18:
        return -1
    if not COMPILED:
        digits = line[start:]
        return int(digits) if digits.isdigit() else -1
    value: i64 = 0
    i: i64 = start
    while i < n:
        digit: i64 = line[i] - 48
        if digit < 0 or digit > 9:
            return -1
        value = value * 10 + digit
        i += 1
    return value


def _parse_uncached(line: bytes, max_job_size: int, cache: LineCache | None) -> LineCommand:
    if line.startswith(b"delete "):  # the commonest line the cache cannot hold: no split(), no table
        # Its own name: mypyc would type a shared `job_id` i64 from this line, and a release or bury
        # id of 2**63 or more below would then fail to convert.
        delete_id = plain_number(line, 7)  # longer ids: the exact parser below (read_u64)
        if delete_id >= 0:
            return ("delete", delete_id)  # type: ignore[return-value]  # an IdArg, as a plain tuple (see Put)
    if b"\x00" in line:
        raise ParseError(BAD_FORMAT)
    parts = line.split(b" ")
    name = _EXACT_WORDS.get(parts[0])
    if name is not None:
        cmd = _fast_parse(parts, name, max_job_size)
        if cmd is not None:
            if cache is not None and name not in _UNCACHED:
                if len(cache) >= LINE_CACHE_SIZE:
                    cache.clear()
                cache[line] = cmd
            return cmd
    name = classify(line)
    if name is None:
        raise ParseError(UNKNOWN_COMMAND)
    if name in _ID_ONLY:
        job_id, _ = read_uint(line, len(name) + 1, U64_MAX, True)
        return IdArg(name, job_id)
    if name in _BARE:
        if len(line) != len(name):
            raise ParseError(BAD_FORMAT)
        return Bare(name)
    if name == "put":
        return _parse_put(line, max_job_size)
    if name in _NAME_ONLY:
        return TubeArg(name, _name_arg(line, len(name) + 1))
    if name == "release":
        job_id, pos = read_uint(line, 8, U64_MAX, False)
        pri, pos = read_uint(line, pos, U32_MAX, False)
        delay, _ = read_uint(line, pos, U32_MAX, True)
        return Release(name, job_id, pri, delay)
    if name == "bury":
        job_id, pos = read_uint(line, 5, U64_MAX, False)
        pri, _ = read_uint(line, pos, U32_MAX, True)
        return Bury(name, job_id, pri)
    if name == "reserve-with-timeout":
        return IntArg(name, parse_strtol_int(line[21:]))
    if name == "kick":
        return IntArg(name, parse_strtoul_u32(line[5:]))
    if name == "quit":
        return Bare(name)
    if name == "pause-tube":
        return _parse_pause(line)
    raise ParseError(UNKNOWN_COMMAND)  # pragma: no cover - every name is handled above


class TooBig(Exception):
    """A put whose declared size exceeds the limit: its body must be skipped."""

    def __init__(self, skip: int) -> None:
        self.skip = skip


def _parse_put(line: bytes, max_job_size: int) -> PutLine:
    pri, pos = read_uint(line, 4, U32_MAX, False)
    delay, pos = read_uint(line, pos, U32_MAX, False)
    ttr, pos = read_uint(line, pos, U32_MAX, False)
    size, pos = read_uint(line, pos, U32_MAX, False)
    if size > max_job_size:
        raise TooBig(size + 2)
    if pos != len(line):
        raise ParseError(BAD_FORMAT, counted="put")
    return PutLine("put", pri, delay, ttr, size)


def _parse_pause(line: bytes) -> PauseTube:
    pos = _skip_spaces(line, 10)
    end = pos
    n = len(line)
    while end < n and line[end] in NAME_CHARS:
        end += 1
    if end == pos:
        raise ParseError(BAD_FORMAT)
    delay, _ = read_uint(line, end, U32_MAX, True)
    name = line[pos:end]
    if not valid_tube_name(name):  # every byte is a name byte here: length and leading '-' decide
        raise ParseError(BAD_FORMAT, counted="pause-tube")
    return PauseTube("pause-tube", name.decode("ascii"), delay)


# Decoder modes
_LINE: Final = 0
_ENDLINE: Final = 1
_BODY: Final = 2
_SKIP: Final = 3


class Decoder:
    """Incremental decoder for one connection's input.

    ``feed(data)`` appends bytes; ``next_command()`` returns the next complete item or
    None when more input is needed. Items:

    * a parsed command record (a put comes as :class:`Put`);
    * ``PutLine("put-header", pri, delay, ttr, size)``: a put line whose body has not fully
      arrived yet (beanstalkd assigns the id at this moment); the matching :class:`Put`
      follows with ``header_seen`` True;
    * ``Error("error", reply, counted)``: answer ``reply``;
    * ``Bare("too-big")``: a put over the size limit was parsed (counted as a put); its
      ``Error("error", JOB_TOO_BIG, None)`` comes once the body has been skipped.

    ``line_cache`` is shared by the decoders of one server (a fresh one when not given).
    """

    __slots__ = (
        "auth_enabled",
        "buf",
        "header_sent",
        "last_cmd",
        "last_line",
        "last_put",
        "last_put_line",
        "line_cache",
        "max_job_size",
        "mode",
        "need",
        "pending",
        "pos",
    )

    def __init__(self, max_job_size: int = DEFAULT_MAX_JOB_SIZE, auth_enabled: bool = False,
                 line_cache: LineCache | None = None) -> None:
        self.line_cache: LineCache = {} if line_cache is None else line_cache
        self.auth_enabled = auth_enabled  # the `auth <token>` extension (broker.security)
        self.buf: bytes | bytearray = b""  # see feed()
        self.pos = 0
        self.max_job_size = max_job_size
        self.mode = _LINE
        self.need = 0
        self.pending: PutLine | None = None
        self.header_sent = False
        # The last line parse_packet found in line_cache, and what the cache held for it, one for lines that start
        # with "p" (put) and one for the rest (reserve): a worker sends the same put and reserve lines again and
        # again, and comparing two short bytes costs less than hashing a new one for the look-up (~230
        # instructions of a compiled command). b"": none yet (no line is empty there).
        self.last_put_line = b""
        self.last_put: LineCommand | None = None
        self.last_line = b""
        self.last_cmd: LineCommand | None = None

    def feed(self, data: bytes) -> None:
        """Buffer ``data``. With nothing buffered the packet itself becomes the buffer, so lines
        and bodies are sliced from it as bytes (no copy into a bytearray and out again: two
        allocations and a call per slice); a partial command left in it moves to a bytearray
        when more arrives, which then grows in place (large bodies in many packets stay linear)."""
        buf = self.buf
        pos = self.pos
        if pos >= len(buf):
            self.buf = data if type(data) is bytes else bytes(data)
            self.pos = 0
        elif isinstance(buf, bytes):
            rest = buf[pos:]
            if len(data) >= len(rest):  # one copy, at most twice the new input: linear overall
                self.buf = rest + data
            else:  # a large body arriving in small packets: grow in place
                grown = bytearray(rest)
                grown += data
                self.buf = grown
            self.pos = 0
        else:
            if pos > 65536 and pos * 2 > len(buf):
                del buf[:pos]
                self.pos = 0
            buf += data

    def buffered(self) -> int:
        """Bytes received but not yet consumed."""
        return len(self.buf) - self.pos

    def parse_packet(self, data: bytes) -> Command | None:
        """The command ``data`` holds, if it is exactly one well-formed command and nothing
        is buffered; None otherwise (then :meth:`feed` it).

        A request/response client sends one command per packet: decoding it straight from
        the packet skips the buffer copy and the incremental state machine. Lines with an
        error, and puts without their whole body and CRLF, are left to that exact path.
        """
        if self.pos != len(self.buf) or self.mode != _LINE:
            return None
        end = find_cr(data, 0, LINE_LIMIT - 1) if COMPILED else data.find(b"\r")  # one argument: cheaper
        if end < 0 or end > LINE_LIMIT - 2 or end + 1 == len(data) or data[end + 1] != 10:
            return None
        line = data[:end]
        cmd: LineCommand | None
        first = data[0]
        if first == 100:  # "d": a delete, whose line is never cached (a new id each time): no hash, no missed look-up
            cmd = None
        elif first == 112 and line == self.last_put_line:  # "p"
            cmd = self.last_put
        elif first != 112 and line == self.last_line:
            cmd = self.last_cmd
        else:
            cmd = self.line_cache.get(line)
            if cmd is not None:
                self._remember(line, cmd, first == 112)
        if cmd is None:
            if self.auth_enabled and line.startswith(b"auth "):
                return None
            try:
                cmd = _parse_uncached(line, self.max_job_size, self.line_cache)
            except (ParseError, TooBig):
                return None  # answered by the exact path
        if cmd[0] == "put":  # only a PutLine here (a str compare: compiled, `type(cmd) is PutLine` looks it up)
            _, pri, delay, ttr, size = cmd  # type: ignore[misc]  # a PutLine
            if size > self.max_job_size or len(data) != end + size + 4 or data[-2] != 13 or data[-1] != 10:
                return None
            return ("put", pri, delay, ttr, data[end + 2:-2], False)  # type: ignore[return-value]  # a Put
        return cmd if len(data) == end + 2 else None

    def _remember(self, line: bytes, cmd: LineCommand, put: bool) -> None:
        """Keep a line parse_packet found in the cache as the last put line or the last other one (a call only
        when the line changed: a worker's next packets compare against it)."""
        if put:
            self.last_put_line = line
            self.last_put = cmd
        else:
            self.last_line = line
            self.last_cmd = cmd

    def next_command(self) -> Command | None:
        """The next complete item, None when more input is needed.

        The line path is written out here rather than in a helper, and the shared line cache is
        read before :func:`parse_line`: this runs once per pipelined command, and each Python call
        it saves is a few hundred interpreter instructions (see bench/README.md).
        """
        if self.mode != _LINE:
            return self._next_other()
        raw = self.buf
        buf = raw if isinstance(raw, bytes) else self._as_bytes(raw)  # compiled: bytes primitives below
        start = self.pos
        avail = len(buf) - start
        if avail <= 0:
            return None
        window_end = start + avail if avail < LINE_LIMIT else start + LINE_LIMIT  # not min(): a call
        cr = find_cr(buf, start, window_end - 1) if COMPILED else buf.find(b"\r", start, window_end - 1)
        if cr < 0 or buf[cr + 1] != 10:
            if window_end - start >= LINE_LIMIT:
                self.pos = window_end  # overflow: discard the window
                self.mode = _ENDLINE
                return self._next_endline()
            return None
        line = buf[start:cr]
        self.pos = cr + 2
        cmd = self.line_cache.get(line)  # a hit is a well-formed line (auth lines are never cached)
        if cmd is None:
            if self.auth_enabled and line.startswith(b"auth "):
                return Auth("auth", line[5:])
            try:
                cmd = _parse_uncached(line, self.max_job_size, self.line_cache)
            except ParseError as err:
                return Error("error", err.reply, err.counted)
            except TooBig as big:
                return self._skip(big.skip)
        if cmd[0] != "put":  # only a PutLine is named "put" here (a str compare: no global look-up)
            return cmd
        put_line: PutLine = cmd  # type: ignore[assignment]  # not cast(): interpreted, that is a call
        _, pri, delay, ttr, size = put_line
        if size > self.max_job_size:  # a line cached under a larger limit
            return self._skip(size + 2)
        end = cr + size + 4
        if len(buf) >= end:  # the whole body is here already: the common case
            self.pos = end
            if buf[end - 2] != 13 or buf[end - 1] != 10:
                return ("put", pri, delay, ttr, None, False)  # type: ignore[return-value]  # a Put
            return ("put", pri, delay, ttr, buf[cr + 2:end - 2], False)  # type: ignore[return-value]
        self.pending = PutLine("put", pri, delay, ttr, size)  # the named record: the cached line may be a plain tuple
        self.need = size + 2
        self.header_sent = False
        self.mode = _BODY
        return self._next_body()

    def _as_bytes(self, raw: bytearray) -> bytes:
        """The unread input as bytes, which becomes the buffer until more arrives: lines are cut
        from bytes only (a bytearray's slices would be copied again, and compiled they are generic calls)."""
        buf = bytes(memoryview(raw)[self.pos:])
        self.buf = buf
        self.pos = 0
        return buf

    def _next_other(self) -> Command | None:
        mode = self.mode
        if mode == _BODY:
            return self._next_body()
        if mode == _SKIP:
            return self._next_skip()
        return self._next_endline()

    def _skip(self, need: int) -> Command:
        """A put over the size limit: its body (``need`` bytes with CRLF) is skipped."""
        self.mode = _SKIP
        self.need = need
        return TOO_BIG

    def _find_line_end(self, start: int, window_end: int) -> int:
        """Index of the CR ending a line in buf[start:window_end], -1 if none can end there.

        beanstalkd looks only at the first CR of its window; -2 means that CR is not
        followed by LF, so no line can end in this window.
        """
        buf = self.buf
        cr = buf.find(b"\r", start, window_end - 1) if window_end - start >= 2 else -1
        if cr < 0:
            return -1
        return cr if buf[cr + 1] == 10 else -2

    def _next_body(self) -> Command | None:
        buf = self.buf
        start = self.pos
        need = self.need
        pending = self.pending
        assert pending is not None  # _BODY mode is entered with the put line
        if len(buf) - start < need:
            if not self.header_sent:
                self.header_sent = True
                return pending._replace(name="put-header")
            return None
        end = start + need
        body = bytes(buf[start:end - 2]) if buf[end - 2:end] == b"\r\n" else None
        self.pos = end
        self.mode = _LINE
        self.pending = None
        return Put("put", pending.pri, pending.delay, pending.ttr, body, self.header_sent)

    def _next_skip(self) -> Command | None:
        take = min(self.need, len(self.buf) - self.pos)
        self.pos += take
        self.need -= take
        if self.need:
            return None
        self.mode = _LINE
        return Error("error", JOB_TOO_BIG, None)

    def _next_endline(self) -> Command | None:
        # Discarding an over-long line in 224-byte chunks until a chunk holds CRLF.
        buf = self.buf
        while True:
            start = self.pos
            avail = len(buf) - start
            if avail <= 0:
                return None
            window_end = start + (min(LINE_LIMIT, avail))
            cr = self._find_line_end(start, window_end)
            if cr >= 0:
                self.pos = cr + 2
                self.mode = _LINE
                return Error("error", BAD_FORMAT, None)
            if window_end - start < LINE_LIMIT:
                return None
            self.pos = window_end
