"""The shared rules in beanstalk_rules: tube names and token files.

Each rule has one home; these tests pin the rule itself, that every user (broker wire
codec, connector options, writer, operator CLI) answers as the rule does, and, for tube
names, that the rule is beanstalkd 1.12's: generated names go to a real beanstalkd and to
our broker over TCP and both must accept exactly what the rule accepts.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beanstalk_rules.tokens import MAX_TOKEN_BYTES, TokenFileError, parse_token, read_token
from beanstalk_rules.tubes import (
    MAX_TUBE_NAME,
    TUBE_NAME_ALPHABET,
    TubeNameError,
    check_tube_name,
    tube_name_problem,
    valid_tube_name,
)
from tests.helpers import ServerProcess, beanstalkd_process, broker_process

pytestmark = pytest.mark.timeout(90)


# --- tube names: the rule ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a", "default", "a" * MAX_TUBE_NAME, "a-", "()$;+/._", TUBE_NAME_ALPHABET[:200],
                                  "0", "Z9"])
def test_good_tube_names(name: str) -> None:
    assert valid_tube_name(name.encode())
    assert tube_name_problem(name) is None
    assert check_tube_name(name) == name
    assert check_tube_name(name.encode()) == name


@pytest.mark.parametrize(("name", "why"), [
    ("", "must be 1-200 bytes, not 0"),
    ("a" * (MAX_TUBE_NAME + 1), "must be 1-200 bytes, not 201"),
    ("-a", "must not start with '-'"),
    ("a b", "does not allow the characters ' '"),
    ("a\tb", "does not allow the characters '\\t'"),
    ("tube:1", "does not allow the characters ':'"),
    ("caf\u00e9", "does not allow the characters '\u00e9'"),
    ("a\x00", "does not allow the characters '\\x00'"),
    (b"\xe9", "not ASCII"),
    (5, "not a string"),
    (None, "not a string"),
])
def test_bad_tube_names_say_why(name: object, why: str) -> None:
    problem = tube_name_problem(name)
    assert problem is not None and problem.startswith(f"bad tube name {name!r}: ") and why in problem
    with pytest.raises(TubeNameError, match="bad tube name") as err:
        check_tube_name(name)
    assert isinstance(err.value, ValueError)
    if isinstance(name, str):
        assert not valid_tube_name(name.encode("utf-8"))


def test_connector_users_answer_as_the_rule() -> None:
    """Options (source and writer) and the writer's per-row check give the rule's own message."""
    from spark_beanstalk.options import OptionError, SourceOptions, WriterOptions

    with pytest.raises(OptionError, match=r"bad tube name '-x': must not start with '-'"):
        SourceOptions.parse({"tubes": "ok,-x"})
    with pytest.raises(OptionError, match=r"option tube: bad tube name 'a b': beanstalkd does not allow"):
        WriterOptions.parse({"tube": "a b"})
    assert SourceOptions.parse({"tubes": "a-,b"}).tubes == ("a-", "b")


# --- tube names: the rule is what beanstalkd and our broker accept on the wire ------------

class Wire(NamedTuple):
    """One open connection to a running server."""

    proc: ServerProcess
    sock: socket.socket
    rfile: object


def _open(proc: ServerProcess) -> Wire:
    sock = socket.create_connection((proc.host, proc.port), timeout=5)
    return Wire(proc, sock, sock.makefile("rb"))


@pytest.fixture(scope="module")
def wires() -> Iterator[list[Wire]]:
    """Our broker and beanstalkd 1.12, one connection each, for the whole module."""
    procs = [broker_process().start(), beanstalkd_process().start()]
    opened = [_open(p) for p in procs]
    yield opened
    for w in opened:
        w.sock.close()
        w.proc.stop()


def _ask(wire: Wire, line: bytes) -> bytes:
    wire.sock.sendall(line + b"\r\n")
    reply = wire.rfile.readline()  # type: ignore[attr-defined]
    assert reply.endswith(b"\r\n"), f"{wire.proc.argv[0]} closed or cut the reply to {line!r}: {reply!r}"
    return bytes(reply[:-2])


# Names drawn independently of the rule under test (beanstalkd is the oracle): a run of
# letters and digits with up to three arbitrary bytes put in anywhere (every byte but CR
# and LF, which are framing, not names), and lengths around the 200-byte limit.
_any_byte = st.integers(0, 255).filter(lambda b: b not in (10, 13))


@st.composite
def _names(draw: st.DrawFn) -> bytes:
    name = bytearray(draw(st.sampled_from([b"", b"a", b"Z9", b"tube", b"x" * 199, b"y" * 200, b"z" * 201])))
    name += bytes(draw(st.lists(st.sampled_from(b"abcXYZ0189"), max_size=8)))
    for _ in range(draw(st.integers(0, 3))):
        name.insert(draw(st.integers(0, len(name))), draw(_any_byte))
    return bytes(name[:MAX_TUBE_NAME + 5])  # every command line stays within beanstalkd's 224 bytes


def _check_on_wire(wire: Wire, name: bytes) -> None:
    good = valid_tube_name(name)
    where = (wire.proc.argv[0], name)
    assert _ask(wire, b"use " + name) == (b"USING " + name if good else b"BAD_FORMAT"), where
    watch = _ask(wire, b"watch " + name)
    assert watch.startswith(b"WATCHING ") if good else watch == b"BAD_FORMAT", where
    if good:
        assert _ask(wire, b"ignore " + name).startswith(b"WATCHING "), where
    if b" " not in name and b"\t" not in name:  # else the delay is read from inside the "name"
        assert _ask(wire, b"pause-tube " + name + b" 0") == (b"PAUSED" if good else b"BAD_FORMAT"), where


def test_every_byte_on_the_wire(wires: list[Wire]) -> None:
    """Each byte value inside, at the start and alone: the character set is beanstalkd's, exactly."""
    for byte in bytes(b for b in range(256) if b not in (10, 13)):
        one = bytes([byte])
        for name in (b"a" + one + b"b", one + b"a", one):
            assert valid_tube_name(name) == (tube_name_problem(name) is None)
            for wire in wires:
                _check_on_wire(wire, name)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=_names())
def test_wire_acceptance_equals_the_rule(wires: list[Wire], name: bytes) -> None:
    """use / watch / pause-tube: our broker and beanstalkd accept a name exactly when the rule does."""
    assert valid_tube_name(name) == (tube_name_problem(name) is None)
    for wire in wires:
        _check_on_wire(wire, name)


# --- token files ---------------------------------------------------------------------------

class TokenCase(NamedTuple):
    content: bytes
    token: bytes | None  # None: refused
    why: str = ""


TOKEN_CASES = [
    TokenCase(b"s3cr3t", b"s3cr3t"),
    TokenCase(b"s3cr3t\n", b"s3cr3t"),  # echo s3cr3t > file
    TokenCase(b"s3cr3t\r\n", b"s3cr3t"),  # an editor's CRLF
    TokenCase(b"  s3cr3t \n\n", b"s3cr3t"),
    TokenCase(b"!#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", b"!#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
    TokenCase(b"t" * MAX_TOKEN_BYTES + b"\n", b"t" * MAX_TOKEN_BYTES),
    TokenCase(b"", None, "holds no token"),
    TokenCase(b" \n\r\n", None, "holds no token"),
    TokenCase(b"two words\n", None, "one token on one line"),
    TokenCase(b"line1\nline2\n", None, "one token on one line"),
    TokenCase(b"t" * (MAX_TOKEN_BYTES + 1), None, "201 bytes; at most 200"),
    TokenCase("caf\u00e9".encode(), None, "printable ASCII"),
    TokenCase(b"nul\x00byte", None, "printable ASCII"),
    TokenCase(b"bell\x07", None, "printable ASCII"),
]


@pytest.mark.parametrize("case", TOKEN_CASES, ids=lambda c: repr(c.content[:16]))
def test_token_rule(case: TokenCase, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(case.content)
    if case.token is not None:
        assert parse_token(case.content) == case.token
        assert read_token(path) == case.token
    else:
        with pytest.raises(TokenFileError, match=case.why) as err:
            read_token(path)
        assert str(path) in str(err.value) and isinstance(err.value, ValueError)


def test_missing_and_unreadable_token_files(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="no such token file"):
        read_token(tmp_path / "absent")
    with pytest.raises(TokenFileError, match="cannot read the token file: Is a directory"):
        read_token(tmp_path)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 100_000)
    with pytest.raises(TokenFileError, match="too large"):
        read_token(big)


def test_token_file_that_is_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO with no writer blocked the reader (a broker, a Spark task) for good."""
    fifo = tmp_path / "fifo.tok"
    os.mkfifo(fifo)
    with pytest.raises(TokenFileError, match="not a regular file"):
        read_token(fifo)


@pytest.mark.parametrize("case", TOKEN_CASES, ids=lambda c: repr(c.content[:16]))
def test_broker_connector_and_cli_read_token_files_alike(case: TokenCase, tmp_path: Path) -> None:
    """The broker's --auth-token-file, the connector's authTokenFile and the CLI's --token-file."""
    from broker.security import load_token
    from spark_beanstalk.ops import OpsError, _read_token
    from spark_beanstalk.options import OptionError, Security

    path = tmp_path / "token"
    path.write_bytes(case.content)
    if case.token is not None:
        assert load_token(str(path)) == case.token
        assert Security.parse({"authTokenFile": str(path)}).auth_token == case.token.decode()
        assert _read_token(str(path)) == case.token.decode()
        return
    with pytest.raises(ValueError, match=case.why):
        load_token(str(path))
    with pytest.raises(OptionError, match=f"option authTokenFile: .*{case.why}"):
        Security.parse({"authTokenFile": str(path)})
    with pytest.raises(OpsError, match=case.why) as err:
        _read_token(str(path))
    assert err.value.exit_code == 2


# --- listener addresses --------------------------------------------------------------------

@pytest.mark.parametrize("address", ["127.0.0.1:65536", "127.0.0.1:99999", ":70000"])
def test_listen_port_beyond_65535_is_refused(address: str) -> None:
    from beanstalk_rules.hosts import parse_listen

    with pytest.raises(ValueError, match="out of range"):
        parse_listen(address)
