"""`spark-beanstalk clear` and `move`: empty a tube, or move its jobs to another one.

The work is done by spark_beanstalk.tubeops (shared with the dashboard); this module is
the terminal side: confirmation, a progress bar on large tubes, Ctrl-C that stops
between two jobs, and a summary.
"""
from __future__ import annotations

import asyncio
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import click

from beanstalk_rules.hosts import parse_hosts
from spark_beanstalk import tubeops
from spark_beanstalk.aio import AsyncConnection, open_tcp
from spark_beanstalk.client import BeanstalkError, ConnectionLost
from spark_beanstalk.ops import (
    HOST_ENV,
    OpsError,
    Target,
    Unreachable,
    _read_token,
    common_options,
    emit_json,
)

PROGRESS_FROM = 200  # jobs: below this no progress bar is worth drawing

Work = Callable[[AsyncConnection, tubeops.Progress, asyncio.Event], Awaitable[tubeops.Outcome]]


async def open_target(target: Target) -> AsyncConnection:
    """An asyncio connection to the verb's --host, with its TLS and token settings."""
    spec, use_tls = target.host, target.tls
    if spec.lower().startswith("tls://"):
        spec, use_tls = spec[len("tls://"):], True
    try:
        hosts = parse_hosts(spec)
    except ValueError as exc:
        raise OpsError(f"bad --host {target.host!r}: {exc}", exit_code=2) from None
    if len(hosts) != 1:
        raise OpsError(f"--host takes one host:port, got {target.host!r}", exit_code=2)
    host, port = hosts[0]
    ctx = None
    if use_tls:
        ctx = ssl.create_default_context(cafile=target.ca_file)
        if target.cert_file:
            ctx.load_cert_chain(target.cert_file, target.key_file)
    token = _read_token(target.token_file) if target.token_file else None
    try:
        conn = await open_tcp(host, port, token, ctx)
    except ConnectionLost as exc:
        raise Unreachable(f"cannot connect to a beanstalkd server at {host}:{port}: {exc} "
                          f"(is it running? set --host or ${HOST_ENV})") from None
    except BeanstalkError as exc:
        raise Unreachable(f"{host}:{port} refused the token from {target.token_file} ({exc.status})") from None
    if token is None and (await conn.call("list-tube-used")).status == b"UNAUTHORIZED":
        await conn.close()
        raise Unreachable(f"{host}:{port} requires authentication: pass --token-file FILE")
    return conn


def _run(target: Target, total_of: Callable[[AsyncConnection], Awaitable[int]], work: Work,
         label: str) -> tuple[tubeops.Outcome, int]:
    """Run one verb: Ctrl-C asks it to stop after the current job; returns (outcome, planned)."""

    async def main() -> tuple[tubeops.Outcome, int]:
        conn = await open_target(target)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        try:
            total = await total_of(conn)
            bar = _Bar(total, label)
            try:
                return await work(conn, bar.advance, stop), total
            finally:
                bar.close()
        except ConnectionLost as exc:
            raise Unreachable(f"lost the connection to {target}: {exc}") from None
        except BeanstalkError as exc:
            raise OpsError(f"{target} answered {exc.status} to {exc.command!r}") from None
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGTERM)
            await conn.close()

    return asyncio.run(main())


class _Bar:
    """A rich progress bar on stderr when it is a terminal and the job count is large."""

    def __init__(self, total: int, label: str) -> None:
        self.progress: Any = None
        self.task: Any = None
        if total >= PROGRESS_FROM and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TimeRemainingColumn,
            )

            self.progress = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self.progress.start()
            self.task = self.progress.add_task(label, total=total)

    def advance(self, n: int) -> None:
        if self.progress is not None:
            self.progress.advance(self.task, n)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


_STATE_OPTION = click.option("--state", "-s", type=click.Choice(tubeops.STATE_CHOICES), default="all",
                             show_default=True, help="Which jobs: ready, delayed, buried, or all of them.")


@click.command("clear", short_help="Delete a tube's jobs (ready, delayed, buried or all).")
@click.argument("tube")
@_STATE_OPTION
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@common_options
def clear_command(tube: str, state: str, yes: bool, host: Target, as_json: bool) -> None:
    """Delete every job of TUBE in --state. Reserved jobs are left to their workers.

    Ctrl-C stops after the current job and prints what was deleted so far.
    """
    states = tubeops.states_for(state)
    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError("clear deletes jobs: confirm with --yes when not on a terminal")
        click.confirm(f"Delete the {state} jobs of tube {tube!r} on {host}?", abort=True)
    outcome, _ = _run(host, lambda c: tubeops.count_jobs(c, tube, states),
                      lambda c, p, s: tubeops.clear(c, tube, states, progress=p, stop=s), f"clearing {tube}")
    if as_json:
        emit_json({"tube": tube, "deleted": outcome.total, "by_state": outcome.done,
                   "skipped": outcome.skipped, "interrupted": outcome.interrupted})
        return
    how = "stopped early: " if outcome.interrupted else ""
    click.echo(f"{how}deleted {outcome.total} job(s) from tube {tube!r} ({outcome.by_state()})"
               + (f"; {outcome.skipped} taken by workers meanwhile" if outcome.skipped else ""))


@click.command("move", short_help="Move a tube's jobs to another tube.")
@click.argument("src")
@click.argument("dst")
@_STATE_OPTION
@click.option("--count", "-n", "count", type=click.IntRange(min=1), default=None,
              help="Move at most this many jobs (default: all).")
@common_options
def move_command(src: str, dst: str, state: str, count: int | None, host: Target, as_json: bool) -> None:
    """Move the --state jobs of SRC to DST, keeping priority, remaining delay and TTR.

    Each job is deleted from SRC only after its copy is in DST; Ctrl-C stops between two
    jobs, so an interrupted move loses and duplicates nothing.
    """
    if src == dst:
        raise click.UsageError("SRC and DST are the same tube")
    states = tubeops.states_for(state)

    async def planned(conn: AsyncConnection) -> int:
        n = await tubeops.count_jobs(conn, src, states)
        return min(n, count) if count is not None else n

    outcome, _ = _run(host, planned, lambda c, p, s: tubeops.move(c, src, dst, states, count, p, s),
                      f"moving {src} -> {dst}")
    if as_json:
        emit_json({"from": src, "to": dst, "moved": outcome.total, "by_state": outcome.done,
                   "skipped": outcome.skipped, "interrupted": outcome.interrupted})
        return
    how = "stopped early: " if outcome.interrupted else ""
    click.echo(f"{how}moved {outcome.total} job(s) from {src!r} to {dst!r} ({outcome.by_state()})"
               + (f"; {outcome.skipped} taken by workers meanwhile" if outcome.skipped else ""))


COMMANDS = (clear_command, move_command)
