"""Operator verbs of the `spark-beanstalk` command: look into and act on any beanstalkd-protocol server.

    spark-beanstalk tubes                      # every tube with its job counts
    spark-beanstalk stats [TUBE]               # server or tube statistics
    spark-beanstalk peek 42 | --ready|--delayed|--buried TUBE
    spark-beanstalk put [BODY] --tube T        # body from the argument or stdin
    spark-beanstalk kick [N] --tube T | --job ID
    spark-beanstalk delete ID... | --buried TUBE [--count N|--all]
    spark-beanstalk pause TUBE SECONDS
    spark-beanstalk top                        # live view of tubes and rates
    spark-beanstalk clear TUBE [--state S]     # (ops_tubes.py, with tubeops.py)
    spark-beanstalk move SRC DST [--state S] [-n N]
    spark-beanstalk dashboard -H H:P[,H:P]     # the web dashboard (dashboard/)

Every verb takes ``--host/-H host:port`` (default ``$SPARK_BEANSTALK_HOST`` or
127.0.0.1:11300) and ``--json`` (machine-readable output on stdout). People get rich
tables. Exit codes: 0 done; 1 the server answered "no" (NOT_FOUND, JOB_TOO_BIG, ...);
2 the server is unreachable or the connection was lost (and click's usage errors).
"""
from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from beanstalk_rules.hosts import BrokerAddress, HostSpec, parse_brokers
from beanstalk_rules.numbers import FiniteFloat
from beanstalk_rules.tokens import read_token_text
from spark_beanstalk.client import BeanstalkError, Connection, ConnectionLost, encode, encode_put, parse_yaml
from spark_beanstalk.lag import tube_lag
from spark_beanstalk.leader import open_leader
from spark_beanstalk.ops_cluster import member_rows, members_table

if TYPE_CHECKING:  # rich is imported lazily (start-up time of the CLI)
    from rich.console import Console, Group
    from rich.live import Live
    from rich.table import Table
    from rich.text import Text

DEFAULT_HOST = "127.0.0.1:11300"
HOST_ENV = "SPARK_BEANSTALK_HOST"
TOKEN_ENV = "SPARK_BEANSTALK_TOKEN_FILE"
MAX_PRIORITY = 2**32 - 1
DEFAULT_PRIORITY = 2**31

# stats-tube keys shown as columns by `tubes` and `top`, with their short headers.
_TUBE_COLUMNS = (
    ("current-jobs-ready", "ready"),
    ("current-jobs-reserved", "reserved"),
    ("current-jobs-delayed", "delayed"),
    ("current-jobs-buried", "buried"),
    ("current-jobs-urgent", "urgent"),
    ("total-jobs", "total"),
    ("current-using", "using"),
    ("current-watching", "watching"),
    ("current-waiting", "waiting"),
)


# --- errors ------------------------------------------------------------------------------


class OpsError(click.ClickException):
    """A one-line error for the operator, no traceback. exit_code 1 unless told otherwise."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Unreachable(OpsError):
    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=2)


def _reason(exc: BaseException) -> str:
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    if cause is not None:
        return str(cause) or type(cause).__name__
    return str(exc)


@dataclass(frozen=True)
class Target:
    """The server a verb talks to: host:port, plus TLS and token-auth settings."""

    host: str = DEFAULT_HOST
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token_file: str | None = None

    def __str__(self) -> str:
        return self.host


def _read_token(path: str) -> str:
    """--token-file, read by the rule the broker uses (beanstalk_rules.tokens)."""
    try:
        return read_token_text(path)
    except ValueError as exc:
        raise OpsError(f"--token-file: {exc}", exit_code=2) from None


def _member_connector(target: Target, timeout: float) -> Callable[[HostSpec], Connection]:
    """Opens a connection to one server of the target with its TLS and token settings."""
    token = _read_token(target.token_file) if target.token_file else None

    def open_member(member: HostSpec) -> Connection:
        return Connection(member.host, member.port, timeout=timeout, connect_timeout=min(timeout, 5.0),
                          tls=target.tls or member.tls, ca_file=target.ca_file, certfile=target.cert_file,
                          keyfile=target.key_file, auth_token=token)

    return open_member


def target_broker(target: Target) -> BrokerAddress:
    """The one logical broker --host names (a plain host, or a ``cluster:`` replica set)."""
    try:
        brokers = parse_brokers(target.host)
    except ValueError as exc:
        raise OpsError(f"bad --host {target.host!r}: {exc}", exit_code=2) from None
    if len(brokers) != 1:
        raise OpsError(f"--host takes one host:port (or one cluster:...), got {target.host!r}", exit_code=2)
    return brokers[0]


def _open(target: Target, timeout: float) -> Connection:
    """Connect (a cluster: to its leader); failures become one-line operator errors."""
    broker = target_broker(target)
    address = broker.members[0].address
    try:
        return open_leader(broker, _member_connector(target, timeout)).conn
    except ConnectionLost as exc:
        if exc.status == "TLS_FAILED":
            raise Unreachable(f"TLS handshake with {address} failed: {_reason(exc)} "
                              "(check --ca-file, --cert-file/--key-file, or drop --tls)") from None
        if exc.status == "NO_LEADER":
            raise Unreachable(f"{exc} (mid-failover? try again)") from None
        raise Unreachable(
            f"cannot connect to a beanstalkd server at {address}: {_reason(exc)} "
            f"(is it running? set --host or ${HOST_ENV})"
        ) from None
    except BeanstalkError as exc:  # the auth extension refused the token
        raise Unreachable(f"{address} refused the token from {target.token_file} ({exc.status})") from None


@contextlib.contextmanager
def connect(target: Target | str, timeout: float = 10.0) -> Iterator[Connection]:
    """A connection to the target (a cluster's leader) whose failures become one-line operator errors."""
    if isinstance(target, str):
        target = Target(host=target)
    conn = _open(target, timeout)
    address = conn.address
    try:
        # A broker with token auth answers UNAUTHORIZED to everything: say so once, clearly.
        if target.token_file is None and conn.call("list-tube-used").status == b"UNAUTHORIZED":
            raise Unreachable(f"{address} requires authentication: pass --token-file FILE "
                              f"(or set ${TOKEN_ENV})")
        yield conn
    except ConnectionLost as exc:
        raise Unreachable(f"lost the connection to {address}: {exc}") from None
    except BeanstalkError as exc:
        raise OpsError(f"{address} answered {exc.status} to {exc.command!r}") from None
    finally:
        conn.close()


# --- output helpers ----------------------------------------------------------------------


def _console() -> Console:
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal and console.width < 120:
        # Piped or captured output: no terminal to fit, so do not squeeze tables into 80 columns.
        console = Console(highlight=False, soft_wrap=False, width=120)
    return console


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def body_for_json(body: bytes) -> dict[str, Any]:
    """A job body in JSON: text when it is UTF-8, base64 otherwise."""
    try:
        return {"body": body.decode("utf-8"), "body_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"body": base64.b64encode(body).decode("ascii"), "body_encoding": "base64"}


def _kv_table(title: str, data: dict[str, Any]) -> Table:
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold", title_justify="left")
    table.add_column("key", style="cyan", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in data.items():
        table.add_row(str(key), str(value))
    return table


def common_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--host/-H, --json, and TLS/token settings on every verb; the verb gets `host` as a Target."""

    @click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
    @click.option(
        "--host", "-H", default=DEFAULT_HOST, envvar=HOST_ENV, show_default=True, show_envvar=True,
        metavar="HOST:PORT", help="The beanstalkd-protocol server to talk to (tls://HOST:PORT for TLS).",
    )
    @click.option("--tls", is_flag=True, envvar="SPARK_BEANSTALK_TLS", help="Speak TLS to the server.")
    @click.option("--ca-file", type=click.Path(exists=True, dir_okay=False), envvar="SPARK_BEANSTALK_CA_FILE",
                  help="With TLS: trust this CA (PEM) instead of the system's.")
    @click.option("--cert-file", type=click.Path(exists=True, dir_okay=False), envvar="SPARK_BEANSTALK_CERT_FILE",
                  help="With TLS: present this client certificate (PEM).")
    @click.option("--key-file", type=click.Path(exists=True, dir_okay=False), envvar="SPARK_BEANSTALK_KEY_FILE",
                  help="With TLS: the client certificate's private key (PEM).")
    @click.option("--token-file", type=click.Path(dir_okay=False), envvar=TOKEN_ENV,
                  help="Send `auth <token>` first (brokers started with --auth-token-file).")
    @functools.wraps(func)
    def wrapper(*args: Any, host: str, tls: bool, ca_file: str | None, cert_file: str | None, key_file: str | None,
                token_file: str | None, **kwargs: Any) -> Any:
        target = Target(host=host, tls=tls or bool(cert_file), ca_file=ca_file, cert_file=cert_file,
                        key_file=key_file, token_file=token_file)
        return func(*args, host=target, **kwargs)

    return wrapper


def _use(conn: Connection, tube: str) -> None:
    reply = conn.call(f"use {tube}")
    if reply.status != b"USING":
        raise OpsError(f"bad tube name {tube!r} ({reply.status.decode('latin-1')})")


def _tube_stats(conn: Connection, tubes: list[str]) -> dict[str, dict[str, Any]]:
    """stats-tube for each tube, pipelined; tubes that vanished meanwhile are left out."""
    result: dict[str, dict[str, Any]] = {}
    commands = [encode(f"stats-tube {tube}") for tube in tubes]
    for tube, reply in zip(tubes, conn.pipeline(commands), strict=True):
        if reply.status == b"OK":
            stats = parse_yaml(reply.body or b"")
            if isinstance(stats, dict):
                stats["name"] = tube  # parse_yaml would turn a tube named "123" into an int
                result[tube] = stats
    return result


def _list_tubes(conn: Connection) -> list[str]:
    return sorted(str(t) for t in conn.list_tubes())


# --- stats -------------------------------------------------------------------------------


@click.command("stats", short_help="Server statistics, or one tube's.")
@click.argument("tube", required=False)
@common_options
def stats_command(tube: str | None, host: Target, as_json: bool) -> None:
    """Server statistics, or one TUBE's statistics (beanstalkd's stats / stats-tube).

    With a ``cluster:`` host: each member's role, epoch and lag, then the leader's stats."""
    broker = target_broker(host)
    if tube is None and broker.is_cluster:
        _cluster_stats(host, broker, as_json)
        return
    with connect(host) as conn:
        if tube is None:
            data = conn.stats()
            title = f"stats of {conn.address}"
        else:
            tube_data = conn.stats_tube(tube)
            if tube_data is None:
                raise OpsError(f"tube {tube!r} not found on {conn.address}")
            data = tube_data
            data["name"] = tube
            title = f"tube {tube!r} on {conn.address}"
    if as_json:
        emit_json(data)
    else:
        _console().print(_kv_table(title, data))


def _cluster_stats(host: Target, broker: BrokerAddress, as_json: bool) -> None:
    rows = member_rows(broker, _member_connector(host, 5.0))
    leader: dict[str, Any] | None = None
    with contextlib.suppress(Unreachable), connect(host) as conn:   # mid-failover: the rows say why
        leader = conn.stats()
    if as_json:
        emit_json({"members": rows, "leader": leader})
        return
    console = _console()
    console.print(members_table(f"members of {broker.name}", rows))
    if leader is None:
        console.print("no member leads now (a failover takes about the lease TTL + 0.5 s)")
    else:
        console.print(_kv_table("stats of the leader", leader))


# --- tubes -------------------------------------------------------------------------------


# `top` leaves out the slow-moving columns so the rates fit in 100 columns.
_TOP_COLUMNS = tuple(c for c in _TUBE_COLUMNS if c[1] not in ("urgent", "using", "watching", "waiting"))


def _tubes_table(title: str, stats: dict[str, dict[str, Any]], rates: dict[str, tuple[float, float]] | None = None,
                 columns: tuple[tuple[str, str], ...] = _TUBE_COLUMNS) -> Table:
    from rich import box
    from rich.table import Table

    compact = rates is not None
    table = Table(title=title or None, header_style="bold", title_justify="left",
                  box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD)
    table.add_column("tube", style="cyan", no_wrap=True, min_width=7)
    for _, header in columns:
        table.add_column(header, justify="right", overflow="fold", min_width=len(header))
    table.add_column("paused", justify="right", no_wrap=True, min_width=6)
    if rates is not None:
        table.add_column("put/s", justify="right", style="green", no_wrap=True, min_width=5)
        table.add_column("delete/s", justify="right", style="magenta", no_wrap=True, min_width=8)
    for name in sorted(stats):
        st = stats[name]
        row = [name] + [str(st.get(key, "")) for key, _ in columns]
        left = st.get("pause-time-left", 0)
        row.append(f"{left}s" if st.get("pause") else "")
        if rates is not None:
            put_rate, delete_rate = rates.get(name, (None, None))
            row += [_rate(put_rate), _rate(delete_rate)]
        table.add_row(*row)
    return table


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


@click.command("tubes", short_help="Every tube with its job counts by state.")
@common_options
def tubes_command(host: Target, as_json: bool) -> None:
    """Every tube with its ready/reserved/delayed/buried counts."""
    with connect(host) as conn:
        stats = _tube_stats(conn, _list_tubes(conn))
        address = conn.address
    if as_json:
        emit_json([stats[name] for name in sorted(stats)])
    else:
        _console().print(_tubes_table(f"tubes on {address}", stats))


# --- peek --------------------------------------------------------------------------------


@click.command("peek", short_help="Show a job by id, or the next ready/delayed/buried one.")
@click.argument("job_id", required=False, type=click.IntRange(min=0))
@click.option("--ready", "ready_tube", metavar="TUBE", help="Peek the next ready job of TUBE.")
@click.option("--delayed", "delayed_tube", metavar="TUBE", help="Peek the delayed job of TUBE that is due first.")
@click.option("--buried", "buried_tube", metavar="TUBE", help="Peek the next buried job of TUBE.")
@click.option("--raw", is_flag=True, help="Write only the body's exact bytes to stdout.")
@click.option("--max-bytes", default=4096, show_default=True, type=click.IntRange(min=0),
              help="Show at most this many bytes of the body in the table view (0: all).")
@common_options
def peek_command(job_id: int | None, ready_tube: str | None, delayed_tube: str | None, buried_tube: str | None,
                 raw: bool, max_bytes: int, host: Target, as_json: bool) -> None:
    """Show a job (its stats and body) without reserving it.

    By JOB_ID, or the next --ready, --delayed or --buried job of a TUBE.
    """
    chosen = [(state, tube) for state, tube in
              (("ready", ready_tube), ("delayed", delayed_tube), ("buried", buried_tube)) if tube]
    if (job_id is None) == (not chosen) or len(chosen) > 1:
        raise click.UsageError("give exactly one of: a job ID, --ready TUBE, --delayed TUBE, --buried TUBE")
    with connect(host) as conn:
        if job_id is not None:
            job = conn.peek(job_id)
            if job is None:
                raise OpsError(f"job {job_id} not found on {conn.address}")
        else:
            state, tube = chosen[0]
            _use(conn, tube)
            job = {"ready": conn.peek_ready, "delayed": conn.peek_delayed, "buried": conn.peek_buried}[state]()
            if job is None:
                raise OpsError(f"no {state} job in tube {tube!r} on {conn.address}")
        stats = conn.stats_job(job.id) or {}  # None if it was deleted in between
        if "tube" in stats:
            stats["tube"] = str(stats["tube"])
    if raw:
        sys.stdout.flush()
        out = click.get_binary_stream("stdout")
        out.write(job.body)
        out.flush()
        return
    if as_json:
        emit_json({"id": job.id, "tube": stats.get("tube"), "state": stats.get("state"), "bytes": len(job.body),
                   **body_for_json(job.body), "stats": stats})
        return
    from rich.panel import Panel
    from rich.text import Text

    console = _console()
    console.print(_kv_table(f"job {job.id} on {conn.address}", stats or {"id": job.id, "state": "gone"}))
    shown = job.body if not max_bytes else job.body[:max_bytes]
    try:
        text = shown.decode("utf-8")
    except UnicodeDecodeError:
        text = repr(shown)
    note = f"body, {len(job.body)} bytes" + (f" (first {max_bytes} shown)" if len(shown) < len(job.body) else "")
    console.print(Panel(Text(text), title=note, title_align="left"))


# --- put ---------------------------------------------------------------------------------


_PUT_ERRORS = {
    b"JOB_TOO_BIG": "the body is larger than the server's max job size (its -z)",
    b"DRAINING": "the server is in drain mode and accepts no new jobs",
    b"OUT_OF_MEMORY": "the server is out of memory (or at its job limit)",
    b"EXPECTED_CRLF": "the server expected CRLF after the body",
    b"BAD_FORMAT": "the server rejected the put command as badly formatted",
}


@click.command("put", short_help="Put a job (body from the argument or stdin).")
@click.argument("body", required=False)
@click.option("--tube", "-t", default="default", show_default=True, help="Tube to put into.")
@click.option("--priority", "-p", default=DEFAULT_PRIORITY, show_default=True,
              type=click.IntRange(0, MAX_PRIORITY), help="0 is most urgent; < 1024 counts as urgent.")
@click.option("--delay", "-d", default=0, show_default=True, type=click.IntRange(min=0),
              help="Seconds before the job becomes ready.")
@click.option("--ttr", default=120, show_default=True, type=click.IntRange(min=0),
              help="Seconds a worker may hold the job before it is released (0 means 1).")
@click.option("--each-line", is_flag=True, help="Read stdin and put every non-empty line as its own job.")
@click.option("--keep-newline", is_flag=True, help="Keep the trailing newline of a body read from stdin.")
@common_options
def put_command(body: str | None, tube: str, priority: int, delay: int, ttr: int, each_line: bool,
                keep_newline: bool, host: Target, as_json: bool) -> None:
    """Put a job. BODY is the argument; without it (or with '-') the body is read from stdin.

    A body read from stdin loses one trailing newline (as `echo` adds one) unless
    --keep-newline is given.
    """
    if body is not None and body != "-":
        if each_line:
            raise click.UsageError("--each-line reads stdin; do not give a BODY")
        # The argument's bytes as given: bytes that are not UTF-8 reach us as surrogate escapes
        # (os.fsdecode of argv), which str.encode("utf-8") refused with a traceback.
        bodies = [os.fsencode(body)]
    else:
        data = click.get_binary_stream("stdin").read()
        if each_line:
            bodies = [line.rstrip(b"\r") for line in data.split(b"\n") if line.strip()]
        else:
            if not keep_newline:
                data = data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data
            bodies = [data]
    with connect(host) as conn:
        _use(conn, tube)
        ids: list[int] = []
        buried: list[int] = []
        commands = [encode_put(b, priority, delay, ttr) for b in bodies]
        for index, reply in enumerate(conn.pipeline(commands)):
            if reply.status == b"INSERTED":
                ids.append(reply.int_arg())
            elif reply.status == b"BURIED" and reply.args:
                buried.append(reply.int_arg())
                ids.append(reply.int_arg())
            else:
                reason = _PUT_ERRORS.get(reply.status, "unexpected reply")
                which = f"line {index + 1}" if each_line else "the job"
                done = f" ({len(ids)} put before it)" if ids else ""
                raise OpsError(f"{which} ({len(bodies[index])} bytes) was not put: "
                               f"{reply.status.decode('latin-1')}: {reason}{done}")
        address = conn.address
    if as_json:
        if each_line:
            emit_json({"tube": tube, "count": len(ids), "ids": ids, "buried": buried})
        else:
            emit_json({"id": ids[0], "tube": tube, "status": "buried" if buried else "inserted"})
        return
    if not each_line:
        state = "buried (server out of memory)" if buried else "inserted"
        click.echo(f"job {ids[0]} {state} into tube {tube!r} on {address}")
    else:
        span = f" (ids {ids[0]}..{ids[-1]})" if ids else ""
        click.echo(f"put {len(ids)} job(s) into tube {tube!r} on {address}{span}")
        if buried:
            click.echo(f"{len(buried)} of them were buried (server out of memory)")


# --- kick --------------------------------------------------------------------------------


@click.command("kick", short_help="Kick buried (or delayed) jobs back to ready.")
@click.argument("bound", required=False, type=click.IntRange(min=1))
@click.option("--tube", "-t", default="default", show_default=True, help="Tube whose jobs to kick.")
@click.option("--all", "kick_all", is_flag=True, help="Kick every buried (or, if none, every delayed) job of the tube.")
@click.option("--job", "job_id", type=click.IntRange(min=0), help="Kick this one buried or delayed job.")
@common_options
def kick_command(bound: int | None, tube: str, kick_all: bool, job_id: int | None, host: Target, as_json: bool) -> None:
    """Move up to BOUND (default 1) buried jobs of a tube back to ready; if it has none buried, delayed ones."""
    if job_id is not None and (bound is not None or kick_all):
        raise click.UsageError("--job kicks one job; do not combine it with BOUND or --all")
    if kick_all and bound is not None:
        raise click.UsageError("give BOUND or --all, not both")
    with connect(host) as conn:
        if job_id is not None:
            if not conn.kick_job(job_id):
                raise OpsError(f"job {job_id} not kicked: it does not exist or is not buried or delayed")
            result: dict[str, Any] = {"id": job_id, "kicked": 1}
            message = f"kicked job {job_id}"
        else:
            _use(conn, tube)
            if kick_all:
                st = conn.stats_tube(tube) or {}
                bound = max(1, int(st.get("current-jobs-buried", 0)) or int(st.get("current-jobs-delayed", 0)))
            kicked = conn.kick(bound or 1)
            result = {"tube": tube, "kicked": kicked}
            message = f"kicked {kicked} job(s) in tube {tube!r}"
    if as_json:
        emit_json(result)
    else:
        click.echo(message)


# --- delete ------------------------------------------------------------------------------


@click.command("delete", short_help="Delete jobs by id, or a tube's ready/delayed/buried ones.")
@click.argument("job_ids", nargs=-1, type=click.IntRange(min=0))
@click.option("--ready", "ready_tube", metavar="TUBE", help="Delete ready jobs of TUBE (next first).")
@click.option("--delayed", "delayed_tube", metavar="TUBE", help="Delete delayed jobs of TUBE (due first).")
@click.option("--buried", "buried_tube", metavar="TUBE", help="Delete buried jobs of TUBE (next first).")
@click.option("--count", "-n", default=1, show_default=True, type=click.IntRange(min=1),
              help="With --ready/--delayed/--buried: how many jobs to delete.")
@click.option("--all", "delete_all", is_flag=True, help="With --ready/--delayed/--buried: delete all of them.")
@common_options
def delete_command(job_ids: tuple[int, ...], ready_tube: str | None, delayed_tube: str | None,
                   buried_tube: str | None, count: int, delete_all: bool, host: Target, as_json: bool) -> None:
    """Delete jobs by ID, or the next --count (or --all) ready/delayed/buried jobs of a tube.

    A job reserved by a worker cannot be deleted from here (beanstalkd lets only the
    reserving connection do that): it reports as not found.
    """
    chosen = [(state, tube) for state, tube in
              (("ready", ready_tube), ("delayed", delayed_tube), ("buried", buried_tube)) if tube]
    if bool(job_ids) == bool(chosen) or len(chosen) > 1:
        raise click.UsageError("give job IDs, or exactly one of --ready/--delayed/--buried TUBE")
    deleted: list[int] = []
    missing: list[int] = []
    with connect(host) as conn:
        if job_ids:
            for job_id in job_ids:
                (deleted if conn.delete(job_id) else missing).append(job_id)
        else:
            state, tube = chosen[0]
            _use(conn, tube)
            peek = {"ready": conn.peek_ready, "delayed": conn.peek_delayed, "buried": conn.peek_buried}[state]
            limit = None if delete_all else count
            misses = 0
            while limit is None or len(deleted) < limit:
                job = peek()
                if job is None:
                    break
                if conn.delete(job.id):
                    deleted.append(job.id)
                else:  # reserved by a worker between peek and delete; try the next one
                    misses += 1
                    if misses > 100:
                        break
    if as_json:
        emit_json({"deleted": deleted, "not_found": missing})
    else:
        if job_ids:
            for job_id in deleted:
                click.echo(f"deleted job {job_id}")
        else:
            click.echo(f"deleted {len(deleted)} {chosen[0][0]} job(s) from tube {chosen[0][1]!r}")
    if missing:
        ids = ", ".join(str(i) for i in missing)
        raise OpsError(f"not found (or reserved by another connection): job {ids}")


# --- pause -------------------------------------------------------------------------------


@click.command("pause", short_help="Pause a tube for N seconds (0 resumes it).")
@click.argument("tube")
@click.argument("seconds", type=click.IntRange(min=0))
@common_options
def pause_command(tube: str, seconds: int, host: Target, as_json: bool) -> None:
    """Stop handing out jobs of TUBE for SECONDS (0 lifts a pause at once)."""
    with connect(host) as conn:
        if not conn.pause_tube(tube, seconds):
            raise OpsError(f"tube {tube!r} not found on {conn.address}")
    if as_json:
        emit_json({"tube": tube, "paused": seconds})
    else:
        click.echo(f"tube {tube!r} paused for {seconds}s" if seconds else f"tube {tube!r} unpaused")


# --- top ---------------------------------------------------------------------------------


_SERVER_RATE_KEYS = ("cmd-put", "cmd-reserve", "cmd-delete")


class TopSampler:
    """Takes stats + stats-tube snapshots and turns consecutive ones into rates."""

    def __init__(self, conn: Connection, tube_filter: tuple[str, ...] = ()) -> None:
        self.conn = conn
        self.tube_filter = set(tube_filter)
        self.prev: tuple[float, dict[str, Any], dict[str, dict[str, Any]]] | None = None

    def sample(self) -> dict[str, Any]:
        now = time.monotonic()
        server = self.conn.stats()
        tubes = _list_tubes(self.conn)
        if self.tube_filter:
            tubes = [t for t in tubes if t in self.tube_filter]
        tube_stats = _tube_stats(self.conn, tubes)
        lag = tube_lag(self.conn, list(tube_stats))
        rates: dict[str, tuple[float | None, float | None]] = {}
        server_rates: dict[str, float | None] = {key: None for key in _SERVER_RATE_KEYS}
        if self.prev is not None:
            then, prev_server, prev_tubes = self.prev
            elapsed = max(now - then, 1e-6)
            for key in _SERVER_RATE_KEYS:
                server_rates[key] = max(0, int(server.get(key, 0)) - int(prev_server.get(key, 0))) / elapsed
            for name, st in tube_stats.items():
                old = prev_tubes.get(name)
                if old is None:  # a new tube: everything in it arrived since the last sample
                    old = {"total-jobs": 0, "cmd-delete": 0}
                rates[name] = (
                    max(0, int(st.get("total-jobs", 0)) - int(old.get("total-jobs", 0))) / elapsed,
                    max(0, int(st.get("cmd-delete", 0)) - int(old.get("cmd-delete", 0))) / elapsed,
                )
        self.prev = (now, server, tube_stats)
        return {"server": server, "server_rates": server_rates, "tubes": tube_stats, "rates": rates, "lag": lag}


def _top_json(sample: dict[str, Any]) -> dict[str, Any]:
    server = sample["server"]
    keys = ("version", "pid", "uptime", "current-connections", "current-jobs-ready", "current-jobs-reserved",
            "current-jobs-delayed", "current-jobs-buried", "total-jobs")
    tubes = []
    for name in sorted(sample["tubes"]):
        st = sample["tubes"][name]
        put_rate, delete_rate = sample["rates"].get(name, (None, None))
        tubes.append({
            "name": name,
            **{header: st.get(key) for key, header in _TUBE_COLUMNS},
            "pause_time_left": st.get("pause-time-left", 0),
            "put_rate": put_rate,
            "delete_rate": delete_rate,
            # what a streaming query reading this tube has not reserved yet (its progress "backlog")
            "backlog": lag.ready + lag.delayed if (lag := sample["lag"].get(name)) else None,
            "oldest_ready_age": lag.oldest_ready_age if lag else None,
        })
    return {
        "time": time.time(),
        "server": {k: server.get(k) for k in keys},
        "rates": {k.replace("cmd-", "") + "_rate": v for k, v in sample["server_rates"].items()},
        "tubes": tubes,
    }


def _top_view(address: str, sample: dict[str, Any], interval: float) -> Group:
    from rich.console import Group
    from rich.text import Text

    server = sample["server"]
    rates = sample["server_rates"]
    head = Text()
    head.append(f"{address}", style="bold")
    head.append(f"  beanstalkd {server.get('version', '?')}  up {server.get('uptime', '?')}s  "
                f"connections {server.get('current-connections', '?')}  "
                f"jobs ready {server.get('current-jobs-ready', '?')} "
                f"reserved {server.get('current-jobs-reserved', '?')} "
                f"delayed {server.get('current-jobs-delayed', '?')} "
                f"buried {server.get('current-jobs-buried', '?')}")
    if "replication-role" in server:   # a member of a replica set: where it stands
        head.append(f"  {server['replication-role']} epoch {server.get('replication-epoch')} "
                    f"lag {server.get('replication-lag-records')} records", style="bold")
    head.append("\n")
    lags = sample["lag"].values()
    head.append(f"backlog (ready+delayed, a query's lag) {sum(t.ready + t.delayed for t in lags)}  "
                f"oldest ready {max((t.oldest_ready_age for t in lags), default=0)}s\n")
    head.append(f"put/s {_rate(rates['cmd-put'])}  reserve/s {_rate(rates['cmd-reserve'])}  "
                f"delete/s {_rate(rates['cmd-delete'])}  (every {interval:g}s; Ctrl-C to quit)", style="dim")
    return Group(head, _tubes_table("", sample["tubes"], sample["rates"], _TOP_COLUMNS))


def _outage_view(message: str, lost_for: float, retry: float) -> Text:
    from rich.text import Text

    return Text(f"{message}; reconnecting ({lost_for:.0f}s of --retry {retry:g}s; Ctrl-C to quit)", style="bold red")


class TopLoop:
    """`top`'s refreshes: sample, show, wait; and, when the connection is lost (a restart, a failover),
    reconnect (a cluster: to whichever member leads now) for up to ``retry`` seconds before giving up.

    A view left running on an operator's screen should outlast the broker's restarts, as ``top`` and
    ``watch`` outlast a busy machine: the outage is shown instead of the figures, and the rates start
    again from the next two samples (a restarted broker's counters start again from 0)."""

    def __init__(self, host: Target, tubes: tuple[str, ...], interval: float, retry: float, as_json: bool) -> None:
        self.host, self.tubes, self.interval, self.retry, self.as_json = host, tubes, interval, retry, as_json
        self.console = _console()
        self.live: Live | None = None
        self.samples = 0
        self.next_at = time.monotonic()

    def run(self, iterations: int) -> None:
        if not self.as_json and self.console.is_terminal:
            from rich.live import Live

            self.live = Live(console=self.console, auto_refresh=False, screen=False, transient=False)
            self.live.start()
        connected_once, lost_since = False, None
        try:
            while True:
                try:
                    with connect(self.host) as conn:
                        connected_once, lost_since = True, None
                        if self._watch(conn, iterations):
                            return
                    time.sleep(min(1.0, self.interval))   # lost: a server that accepts then drops is not spun on
                except Unreachable as exc:
                    if not connected_once:   # not there at the start: say so at once, as every verb does
                        raise
                    lost_since = lost_since if lost_since is not None else time.monotonic()
                    lost_for = time.monotonic() - lost_since
                    if lost_for >= self.retry:
                        raise Unreachable(f"{exc.message} (still after --retry {self.retry:g}s)") from None
                    self._show_outage(exc.message, lost_for)
                    time.sleep(min(1.0, self.interval, max(0.05, self.retry - lost_for)))
        except KeyboardInterrupt:
            pass
        finally:
            if self.live is not None:
                self.live.stop()

    def _watch(self, conn: Connection, iterations: int) -> bool:
        """Refresh until done (True) or the connection is lost (False)."""
        sampler = TopSampler(conn, self.tubes)
        while True:
            try:
                sample = sampler.sample()
            except ConnectionLost:
                return False
            self.samples += 1
            if self.as_json:
                click.echo(json.dumps({**_top_json(sample), "address": conn.address}, default=str))
            elif self.live is not None:
                self.live.update(_top_view(conn.address, sample, self.interval), refresh=True)
            else:
                self.console.print(_top_view(conn.address, sample, self.interval))
            if iterations and self.samples >= iterations:
                return True
            self.next_at = max(self.next_at + self.interval, time.monotonic() - self.interval)
            time.sleep(max(0.0, self.next_at - time.monotonic()))

    def _show_outage(self, message: str, lost_for: float) -> None:
        if self.as_json:
            click.echo(json.dumps({"time": time.time(), "error": message, "lost_for": round(lost_for, 1)}))
        elif self.live is not None:
            self.live.update(_outage_view(message, lost_for, self.retry), refresh=True)
        else:
            self.console.print(_outage_view(message, lost_for, self.retry))


@click.command("top", short_help="Live view of tubes, job counts and put/delete rates.")
@click.option("--interval", "-i", default=1.0, show_default=True, type=FiniteFloat(min=0.05),
              help="Seconds between refreshes.")
@click.option("--iterations", "-n", default=0, show_default=True, type=click.IntRange(min=0),
              help="Stop after this many refreshes (0: run until Ctrl-C).")
@click.option("--tube", "-t", "tubes", multiple=True, help="Show only this tube (repeatable).")
@click.option("--retry", default=300.0, show_default=True, type=FiniteFloat(min=0),
              help="When the connection is lost (a restart, a failover), keep reconnecting this many seconds "
                   "before giving up with exit 2 (0: give up at once).")
@common_options
def top_command(interval: float, iterations: int, tubes: tuple[str, ...], retry: float, host: Target,
                as_json: bool) -> None:
    """A live, refreshing view of tubes: job counts by state and put/delete rates.

    With --json it prints one JSON object per refresh (JSON lines; while the connection is down, one
    {"error": ...} object per attempt); when stdout is not a terminal each refresh is printed below the
    last instead of redrawn. A lost connection is retried (see --retry); with a cluster: host the view
    follows the leader.
    """
    TopLoop(host, tubes, interval, retry, as_json).run(iterations)


COMMANDS = (stats_command, tubes_command, peek_command, put_command, kick_command, delete_command,
            pause_command, top_command)


def register(group: click.Group) -> None:
    """Add every operator verb to the `spark-beanstalk` group."""
    for command in COMMANDS:
        group.add_command(command)
