"""`spark-beanstalk dashboard`: the web dashboard for any beanstalkd-protocol servers."""
from __future__ import annotations

import asyncio
import ipaddress
import signal
from typing import TYPE_CHECKING

import click

from beanstalk_rules.hosts import parse_hosts, parse_listen
from beanstalk_rules.httplog import quiet_bad_requests
from spark_beanstalk.aio import AsyncConnection, open_tcp
from spark_beanstalk.ops import DEFAULT_HOST, HOST_ENV, TOKEN_ENV, _read_token

if TYPE_CHECKING:  # aiohttp and jinja2 load only when the dashboard runs, not for every CLI verb
    from aiohttp import web

    from spark_beanstalk.dashboard.sampler import Endpoint


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tcp_endpoint(host: str, port: int, token: str | None) -> Endpoint:
    from spark_beanstalk.dashboard.sampler import Endpoint

    async def connect() -> AsyncConnection:
        return await open_tcp(host, port, token, auth_optional=True)

    return Endpoint(f"{host}:{port}", connect)


def split_listen(listen: str) -> tuple[str, int]:
    try:
        return parse_listen(listen, default_host=None)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None


async def serve(app: web.Application, host: str, port: int) -> None:
    from aiohttp import web

    quiet_bad_requests()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        click.echo(f"dashboard on http://{host}:{port}/ (Ctrl-C to stop)", err=True)
        await stop.wait()
    finally:
        await runner.cleanup()


@click.command("dashboard", short_help="Web dashboard for beanstalkd-protocol servers.")
@click.option("--host", "-H", "hosts", default=DEFAULT_HOST, envvar=HOST_ENV, show_default=True,
              metavar="HOST:PORT[,HOST:PORT...]", help="The servers to show (ours or stock beanstalkd).")
@click.option("--listen", default="127.0.0.1:8080", show_default=True, metavar="ADDR:PORT",
              help="Where the dashboard listens (loopback by default).")
@click.option("--token-file", type=click.Path(dir_okay=False), envvar=TOKEN_ENV,
              help="Token for the servers' `auth` (servers without auth, such as stock beanstalkd, are used "
                   "without it); the page then needs it too before any action.")
@click.option("--read-only", is_flag=True, help="Show, never act: no action forms, every action refused.")
def dashboard_command(hosts: str, listen: str, token_file: str | None, read_only: bool) -> None:
    """Serve a live web dashboard of HOSTS: servers, tubes, charts, and actions on jobs."""
    try:
        addresses = parse_hosts(hosts)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--host") from None
    host, port = split_listen(listen)
    token = _read_token(token_file) if token_file else None
    if not is_loopback(host) and token is None and not read_only:
        raise click.UsageError(f"--listen {listen} is reachable from other machines: "
                               "give --token-file (actions then need the token) or --read-only")
    from spark_beanstalk.dashboard.app import create_app
    from spark_beanstalk.dashboard.guard import Guard

    guard = Guard(action_token=token.encode() if token else None, read_only=read_only)
    app = create_app([tcp_endpoint(h, p, token) for h, p in addresses], guard)
    try:
        asyncio.run(serve(app, host, port))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen}: {exc.strerror or exc}") from None
