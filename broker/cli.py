"""`spark-beanstalk broker` / `python -m broker`: flags as in beanstalkd, plus a config file.

Differences from beanstalkd, on purpose: ``-l`` defaults to 127.0.0.1 (beanstalkd binds
every address), and ``--config FILE`` reads the same settings from TOML (flags given on
the command line win over the file).
"""
from __future__ import annotations

import asyncio
import logging
import sys
import tomllib

import click

from broker import protocol as p
from broker.server import ServerConfig, install_uvloop, run_server

# TOML key -> click parameter name (both spellings accepted in the file).
_CONFIG_KEYS = {
    "listen": "listen", "port": "port", "max_job_size": "max_job_size", "verbose": "verbose",
    "binlog_dir": "binlog_dir", "fsync_ms": "fsync_ms", "no_fsync": "no_fsync",
    "binlog_segment_size": "binlog_size",
}


def _load_config(ctx: click.Context, _param, path: str | None) -> str | None:
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
    section = data.get("broker", data)
    defaults = {}
    for key, value in section.items():
        name = _CONFIG_KEYS.get(key.replace("-", "_"))
        if name is None:
            known = ", ".join(sorted(_CONFIG_KEYS))
            raise click.BadParameter(f"unknown key {key!r} in {path}; known keys: {known}")
        defaults[name] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option("-s", "--binlog-size", type=click.IntRange(1024), default=10485760, show_default=True,
              help="With -b: binlog segment file size in bytes.")
def broker_command(listen: str, port: int, max_job_size: int, verbose: int, binlog_dir: str | None,
                   fsync_ms: int, no_fsync: bool, binlog_size: int) -> None:
    """Run the beanstalkd-compatible work-queue broker."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    listener = None
    if binlog_dir is not None:
        listener = _open_binlog(binlog_dir, fsync_ms, no_fsync, binlog_size)
    config = ServerConfig(listen=listen, port=port, max_job_size=max_job_size, verbose=verbose)
    install_uvloop()

    def ready(server) -> None:
        if verbose:
            logging.getLogger("broker").info("listening on %s", ", ".join(server.addresses()))

    try:
        asyncio.run(run_server(config, listener, on_ready=ready))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen}:{port}: {exc.strerror or exc}") from None


def _open_binlog(directory: str, fsync_ms: int, no_fsync: bool, segment_size: int):
    try:
        from broker.binlog import open_binlog  # filled in by the persistence work
    except ImportError:
        raise click.ClickException(
            "-b/--binlog-dir: persistence is not available in this build yet; run without -b"
        ) from None
    return open_binlog(directory, fsync_ms=None if no_fsync else fsync_ms, segment_size=segment_size)


if __name__ == "__main__":
    broker_command()
