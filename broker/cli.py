"""`spark-beanstalk broker` / `python -m broker`: flags as in beanstalkd, plus a config file.

Differences from beanstalkd, on purpose: ``-l`` defaults to 127.0.0.1 (beanstalkd binds
every address), and ``--config FILE`` reads the same settings from TOML (flags given on
the command line win over the file).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import tomllib
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from beanstalk_rules.numbers import FiniteFloat
from broker import _build, logs
from broker import protocol as p
from broker.busypoll import DEFAULT_WINDOW_US, MAX_WINDOW_US
from broker.connection import BrokerConnection
from broker.limits import DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_SLOW_READER_TIMEOUT, Limits
from broker.queue import QueueListener
from broker.replication.options import CONFIG_KEYS as REPLICATION_CONFIG_KEYS
from broker.replication.options import (
    build_member,
    member_listener,
    replication_options,
)
from broker.security import TlsConfig, TlsFileError, load_token
from broker.server import (
    BrokerServer,
    ServerConfig,
    install_uvloop,
    run_server,
)

if TYPE_CHECKING:
    from broker.http import HttpListener

# TOML key -> click parameter name (both spellings accepted in the file).
_CONFIG_KEYS = {
    "listen": "listen", "port": "port", "max_job_size": "max_job_size", "verbose": "verbose",
    "binlog_dir": "binlog_dir", "fsync_ms": "fsync_ms", "no_fsync": "no_fsync",
    "binlog_segment_size": "binlog_size",
    "max_connections": "max_connections", "max_jobs": "max_jobs", "max_job_bytes": "max_job_bytes",
    "max_tubes": "max_tubes", "max_reserved_per_connection": "max_reserved_per_connection",
    "idle_timeout": "idle_timeout", "max_output_bytes": "max_output_bytes",
    "slow_reader_timeout": "slow_reader_timeout",
    "tls_cert": "tls_cert", "tls_key": "tls_key", "tls_client_ca": "tls_client_ca", "tls_port": "tls_port",
    "auth_token_file": "auth_token_file", "metrics": "metrics", "http": "metrics", "no_dashboard": "no_dashboard",
    "extended_stats": "extended_stats", "busy_poll_us": "busy_poll_us",
    **REPLICATION_CONFIG_KEYS,
}


def _load_config(ctx: click.Context, _param: click.Parameter, path: str | None) -> str | None:
    """Eager callback: the file's values become defaults, so explicit flags override them."""
    if not path:
        return path
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise click.BadParameter(f"{path} is not valid TOML: it is not UTF-8 text") from None
    section = data.get("broker", data)
    if not isinstance(section, dict):
        raise click.BadParameter(f"{path}: broker must be a table ([broker]), not {section!r}")
    params = {param.name: param for param in ctx.command.params}
    defaults = {}
    for key, value in section.items():
        name = _CONFIG_KEYS.get(key.replace("-", "_"))
        if name is None:
            known = ", ".join(sorted(_CONFIG_KEYS))
            raise click.BadParameter(f"unknown key {key!r} in {path}; known keys: {known}")
        want = _config_type_problem(params[name], value)
        if want is not None:
            raise click.BadParameter(f"{key} in {path} must be {want}, not {value!r}")
        defaults[name] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


def _config_type_problem(param: click.Parameter, value: object) -> str | None:
    """What a TOML value for ``param`` must be, or None when its type fits.

    click converts what it is given: 21399.7 became port 21399, and a list or a number where a
    path belongs ended in a traceback. The file's types must match the flag's.
    """
    if isinstance(param, click.Option) and param.is_flag and not param.count:
        return None if isinstance(value, bool) else "true or false"
    if isinstance(value, bool):  # a bool is an int to Python, never a number here
        return "a whole number" if isinstance(param.type, click.types.IntParamType) else \
            "a number" if isinstance(param.type, click.types.FloatParamType) else "a string"
    if isinstance(param.type, click.types.IntParamType):
        return None if isinstance(value, int) else "a whole number"
    if isinstance(param.type, click.types.FloatParamType):
        return None if isinstance(value, (int, float)) else "a number"
    return None if isinstance(value, str) else "a string"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(None, "-v", "--version", package_name="spark-beanstalk",
                      message="spark-beanstalk broker %(version)s (beanstalkd 1.12 protocol)")
@click.option("--config", type=click.Path(dir_okay=False), callback=_load_config, is_eager=True,
              expose_value=False, help="Read settings from this TOML file (flags override it).")
@click.option("-l", "--listen", default="127.0.0.1", show_default=True,
              help="Address to listen on, or unix:PATH for a Unix socket. beanstalkd's default is 0.0.0.0.")
@click.option("-p", "--port", default=11300, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port.")
@click.option("-z", "--max-job-size", default=p.DEFAULT_MAX_JOB_SIZE, show_default=True,
              type=click.IntRange(0, 2**30), help="Largest job body in bytes.")
@click.option("-V", "--verbose", count=True, help="Log connections and commands (repeat for more).")
@click.option("-b", "--binlog-dir", type=click.Path(file_okay=False), default=None,
              help="Write-ahead log directory: jobs survive a crash or restart.")
@click.option("-f", "--fsync-ms", type=click.IntRange(0), default=50, show_default=True,
              help="With -b: fsync at most every MS milliseconds (0: before every reply that acknowledges a change).")
@click.option("-F", "--no-fsync", is_flag=True, default=False, help="With -b: never fsync.")
@click.option("-s", "--binlog-size", type=click.IntRange(1), default=10485760, show_default=True,
              help="With -b: binlog segment file size in bytes.")
@click.option("--binlog-ignore-damage", is_flag=True, default=False, expose_value=False,
              callback=lambda ctx, _param, value: ctx.meta.__setitem__("binlog_ignore_damage", value),
              help="With -b: start even if the binlog is damaged in the middle, keeping every job that can "
                   "still be read (damaged files are kept as *.damaged).")
@click.option("--max-connections", type=click.IntRange(0), default=0,
              help="Refuse connections beyond this many open ones (0: no limit).")
@click.option("--max-jobs", type=click.IntRange(0), default=0, help="put answers OUT_OF_MEMORY beyond this many jobs.")
@click.option("--max-job-bytes", type=click.IntRange(0), default=0,
              help="put answers OUT_OF_MEMORY beyond this many bytes of job bodies held.")
@click.option("--max-tubes", type=click.IntRange(0), default=0, help="use/watch of a new tube beyond this many.")
@click.option("--max-reserved-per-connection", type=click.IntRange(0), default=0,
              help="Reserves beyond this many jobs held by one connection answer OUT_OF_MEMORY.")
@click.option("--idle-timeout", type=FiniteFloat(0), default=0.0,
              help="Close connections silent for this many seconds (not those blocked in reserve).")
@click.option("--max-output-bytes", type=click.IntRange(1 << 16), default=DEFAULT_MAX_OUTPUT_BYTES,
              show_default=True, help="Close a connection whose unread replies pass this size.")
@click.option("--slow-reader-timeout", type=FiniteFloat(0), default=DEFAULT_SLOW_READER_TIMEOUT,
              show_default=True,
              help="Close a connection that leaves over 1 MiB of replies unread this long (0: never).")
@click.option("--tls-cert", type=click.Path(exists=True, dir_okay=False), help="TLS certificate (PEM).")
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="TLS private key (PEM).")
@click.option("--tls-client-ca", type=click.Path(exists=True, dir_okay=False),
              help="Require client certificates signed by this CA.")
@click.option("--tls-port", type=click.IntRange(0, 65535), default=None,
              help="Serve TLS on this second port (default: the main listener speaks TLS).")
@click.option("--auth-token-file", type=click.Path(exists=True, dir_okay=False),
              help="Require `auth <token>` first (protocol extension; off by default).")
@click.option("--http", "--metrics", "metrics", metavar="ADDR:PORT", default=None,
              help="Serve HTTP on ADDR:PORT: /metrics (Prometheus), /healthz, /readyz and the web dashboard at /. "
                   "--metrics is the old name.")
@click.option("--no-dashboard", is_flag=True, default=False,
              help="With --http: serve only /metrics, /healthz and /readyz.")
@click.option("--extended-stats", is_flag=True, default=False,
              help="Add our counters after beanstalkd's stats keys (on when any limit, TLS or auth is set).")
@click.option("--busy-poll-us", type=click.IntRange(0, MAX_WINDOW_US), default=DEFAULT_WINDOW_US,
              show_default=True,
              help="After a command, poll for the next one this many microseconds before sleeping: a faster "
                   "round trip for clients that send one command at a time, for CPU time (0: never poll, as "
                   "beanstalkd). Backs off by itself when clients are slower than the window. Off with -f 0 "
                   "(a round trip then takes an fsync).")
@replication_options
def broker_command(listen: str, port: int, max_job_size: int, verbose: int, binlog_dir: str | None,
                   fsync_ms: int, no_fsync: bool, binlog_size: int, max_connections: int, max_jobs: int,
                   max_job_bytes: int, max_tubes: int, max_reserved_per_connection: int, idle_timeout: float,
                   max_output_bytes: int, slow_reader_timeout: float, tls_cert: str | None, tls_key: str | None,
                   tls_client_ca: str | None, tls_port: int | None, auth_token_file: str | None, metrics: str | None,
                   no_dashboard: bool, extended_stats: bool, busy_poll_us: int) -> None:
    """Run the beanstalkd-compatible work-queue broker."""
    logs.setup(verbose)
    tls = None
    tls_server = None
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise click.UsageError("--tls-cert and --tls-key go together")
        tls = TlsConfig(cert=tls_cert, key=tls_key, client_ca=tls_client_ca, port=tls_port)
        try:  # before anything starts: a bad PEM file is one line, not a traceback from the loop
            tls_server = tls.server_context()
        except TlsFileError as exc:
            raise click.UsageError(str(exc)) from None
    elif tls_client_ca or tls_port is not None:
        raise click.UsageError("--tls-client-ca and --tls-port need --tls-cert and --tls-key")
    listener = None
    if binlog_dir is not None:
        listener = _open_binlog(binlog_dir, fsync_ms, no_fsync, binlog_size)
    limits = Limits(max_connections=max_connections, max_jobs=max_jobs, max_job_bytes=max_job_bytes,
                    max_tubes=max_tubes, max_reserved_per_connection=max_reserved_per_connection,
                    idle_timeout=idle_timeout, max_output_bytes=max_output_bytes,
                    slow_reader_timeout=slow_reader_timeout)
    token = None
    if auth_token_file:
        try:
            token = load_token(auth_token_file)
        except (OSError, ValueError) as exc:
            raise click.UsageError(f"--auth-token-file: {exc}") from None
    http_sock = None
    if metrics is not None:
        from broker import http  # aiohttp is imported only by brokers that serve HTTP

        try:
            http_sock = http.bind(metrics)
        except http.HttpAddressError as exc:
            raise click.UsageError(f"--http/--metrics {exc}") from None
    hardened = limits != Limits() or tls is not None or token is not None or metrics is not None
    config = ServerConfig(listen=listen, port=port, max_job_size=max_job_size, verbose=verbose, limits=limits,
                          tls=tls, auth_token=token, metrics=metrics, extended_stats=extended_stats or hardened,
                          binlog_max_size=binlog_size, busy_poll_us=busy_poll_us)
    # replication (broker.replication): a member wraps the binlog and hooks into the server
    member = build_member(binlog_dir, listen, port, token, tls_server)
    if member is not None:
        assert listener is not None
        listener = member_listener(member, listener)
        config.extended_stats = True
    install_uvloop()

    def ready(server: BrokerServer) -> None:
        if verbose:
            logs.event(logging.getLogger("broker"), logging.INFO, "listening", addresses=",".join(server.addresses()),
                       core=_build.core_name(), transport=server.transport_reason)

    try:
        asyncio.run(_serve(config, listener, ready, http_sock, not no_dashboard,
                           before_start=member.install if member is not None else None))
    except OSError as exc:
        where = listen if listen.startswith("unix:") else f"{listen}:{port}"
        raise click.ClickException(f"cannot listen on {where}: {exc.strerror or exc}") from None
    if member is not None and member.fatal is not None:
        raise click.ClickException(member.fatal)


async def _serve(config: ServerConfig, listener: QueueListener | None, ready: Callable[[BrokerServer], None],
                 http_sock: socket.socket | None, dashboard: bool,
                 before_start: Callable[[BrokerServer], None] | None = None) -> None:
    """run_server, plus the HTTP listener once the broker is up (stopped after it)."""
    listeners: list[HttpListener] = []

    def on_ready(server: BrokerServer) -> None:
        ready(server)
        if http_sock is not None:
            from broker.http import HttpListener

            local = (lambda: BrokerConnection(server.state, internal=True)) if dashboard else None
            listeners.append(HttpListener(server, http_sock, local))
            listeners[0].start_soon()

    try:
        await run_server(config, listener, on_ready=on_ready, before_start=before_start)
    finally:
        for item in listeners:
            await item.close()


def _open_binlog(directory: str, fsync_ms: int, no_fsync: bool, segment_size: int) -> QueueListener:
    from broker.binlog import BinlogError, open_binlog  # only brokers started with -b load the binlog

    ignore_damage = click.get_current_context().meta.get("binlog_ignore_damage", False)
    try:
        return open_binlog(directory, fsync_ms=None if no_fsync else fsync_ms, segment_size=segment_size,
                           ignore_damage=ignore_damage)
    except BinlogError as exc:
        raise click.ClickException(str(exc)) from None


if __name__ == "__main__":
    broker_command()
