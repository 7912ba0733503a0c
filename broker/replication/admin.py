"""``spark-beanstalk promote`` / ``demote``: planned leadership changes, for maintenance.

Both talk to a member's replication listener (``--replication-listen``), with the broker's
token when it has one. ``demote`` makes the leader step down at once (it fences itself,
gives up its lease and does not stand in the next election for 3 lease TTLs): a caught-up
replica takes over. ``promote`` asks for one replica to lead next: it records a handover
in etcd; the leader steps down once that replica has every record, and the election picks it.
"""
from __future__ import annotations

import socket
import time

import click

from beanstalk_rules.numbers import FiniteFloat
from broker.replication.member import split_address
from broker.security import load_token


def _ask(member: str, verb: str, token_file: str | None, timeout: float = 5.0) -> str:
    try:
        host, port = split_address(member)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    lines = []
    if token_file:
        try:
            lines.append(b"auth %s\r\n" % load_token(token_file))
        except (OSError, ValueError) as exc:
            raise click.UsageError(f"--auth-token-file: {exc}") from None
    lines.append(verb.encode() + b"\r\n")
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"".join(lines))
            reader = sock.makefile("rb")
            reply = b""
            for _ in lines:
                reply = reader.readline()
                if reply != b"OK\r\n" or len(lines) == 1:
                    break
            if len(lines) == 2 and reply == b"OK\r\n":
                reply = reader.readline()
    except OSError as exc:
        raise click.ClickException(f"cannot reach the member at {member}: {exc}") from None
    text = reply.decode("latin-1").strip()
    if not text:
        raise click.ClickException(f"{member} closed the connection without answering")
    return text


def _role(member: str, token_file: str | None) -> str:
    words = _ask(member, "role", token_file).split()
    return words[1] if len(words) > 1 and words[0] == "OK" else "?"


_member = click.option("--member", "-m", required=True, metavar="HOST:PORT",
                       help="The member's replication address (its --replication-listen).")
_token = click.option("--auth-token-file", type=click.Path(exists=True, dir_okay=False), default=None,
                      help="The broker's token file, when it has one.")


@click.command("promote")
@_member
@_token
@click.option("--wait", type=FiniteFloat(0), default=15.0, show_default=True,
              help="Seconds to wait until the member leads (0: do not wait).")
def promote_command(member: str, auth_token_file: str | None, wait: float) -> None:
    """Make this replica the next leader (the current leader hands over once it is caught up)."""
    reply = _ask(member, "promote", auth_token_file)
    if reply.startswith("OK"):
        click.echo(f"{member} already leads")
        return
    if reply != "PROMOTING":
        raise click.ClickException(f"{member}: {reply}")
    deadline = time.monotonic() + wait
    while wait and time.monotonic() < deadline:
        if _role(member, auth_token_file) == "leader":
            click.echo(f"{member} leads")
            return
        time.sleep(0.1)
    if wait:
        raise click.ClickException(f"{member} does not lead after {wait:g}s (is it caught up? see its stats)")
    click.echo(f"{member}: handover requested")


@click.command("demote")
@_member
@_token
def demote_command(member: str, auth_token_file: str | None) -> None:
    """Make the leader step down now; a caught-up replica takes over."""
    reply = _ask(member, "demote", auth_token_file)
    if reply == "NOT_LEADER":
        raise click.ClickException(f"{member} is not the leader")
    if reply != "DEMOTED":
        raise click.ClickException(f"{member}: {reply}")
    click.echo(f"{member} stepped down")


def register(group: click.Group) -> None:
    group.add_command(promote_command)
    group.add_command(demote_command)
