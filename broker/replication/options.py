"""The broker's replication flags, as one click decorator and one builder.

Kept apart from broker/cli.py so that the broker's own flags and these evolve separately:
``@replication_options`` stores the values in ``ctx.meta``; :func:`build_member` turns them
into a :class:`Member` (or None when replication is off) and says clearly what is wrong.
"""
from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from typing import Any, TypeVar

import click

from broker.queue import QueueListener
from broker.replication.fanout import Fanout
from broker.replication.member import Member, ReplicationConfig, split_address
from broker.replication.source import ReplicationSource

F = TypeVar("F", bound=Callable[..., Any])
_META = "replication"
# conf/broker.toml keys of these flags (merged into broker.cli's table).
CONFIG_KEYS = {key: key for key in ("replica_of", "replication_listen", "sync_replicas", "etcd", "cluster",
                                    "member_name", "lease_ttl", "replication_ca")}


def _store(ctx: click.Context, param: click.Parameter, value: object) -> object:
    ctx.meta.setdefault(_META, {})[param.name] = value
    return value


def replication_options(f: F) -> F:
    opts = [
        click.option("--replica-of", metavar="HOST:PORT", default=None,
                     help="Replicate the member whose --replication-listen is HOST:PORT (needs -b)."),
        click.option("--replication-listen", metavar="ADDR:PORT", default=None,
                     help="Serve the replication stream (and promote/demote) here."),
        click.option("--sync-replicas", type=click.IntRange(0), default=0,
                     help="Replies acknowledging a change wait until this many replicas have it (0: async)."),
        click.option("--etcd", metavar="URL", default=None,
                     help="etcd endpoint (http://HOST:PORT): leadership by lease, automatic failover."),
        click.option("--cluster", default="spark-beanstalk", show_default=True,
                     help="With --etcd: the cluster's key prefix."),
        click.option("--member-name", default=None, help="With --etcd: this member's name (default ADDR:PORT)."),
        click.option("--lease-ttl", type=click.IntRange(1, 60), default=2, show_default=True,
                     help="With --etcd: leader lease in seconds (failover takes about this plus 1 s)."),
        click.option("--replication-ca", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Connect to the leader's stream over TLS, trusting this CA."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    for param in f.__click_params__[-len(opts):]:  # type: ignore[attr-defined]
        param.expose_value = False
        param.callback = _store
    return f


def build_member(binlog_dir: str | None, listen: str, port: int, token: bytes | None,
                 tls_server: ssl.SSLContext | None) -> Member | None:
    """The member for the flags given, or None; raises click.UsageError on a bad combination."""
    values = click.get_current_context().meta.get(_META, {})
    replica_of, repl_listen, etcd = values.get("replica_of"), values.get("replication_listen"), values.get("etcd")
    sync = int(values.get("sync_replicas") or 0)
    if not (replica_of or repl_listen or etcd or sync):
        return None
    if binlog_dir is None:
        raise click.UsageError("replication needs -b DIR (a member keeps its own log)")
    if replica_of and etcd:
        raise click.UsageError("--replica-of and --etcd exclude each other: with etcd the leader is found there")
    if (etcd or sync) and not repl_listen:
        raise click.UsageError("--etcd and --sync-replicas need --replication-listen")
    try:
        repl = split_address(repl_listen) if repl_listen else None
        primary = split_address(replica_of) if replica_of else None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    ca_file = values.get("replication_ca")
    if ca_file is not None:
        try:  # checked here: a bad file failed later, inside the loop, as "cannot listen"
            ssl.create_default_context(cafile=ca_file)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise click.UsageError(f"--replication-ca {ca_file}: not a usable CA file ({exc})") from None
    client = f"{listen}:{port}"
    config = ReplicationConfig(name=values.get("member_name") or client, state_dir=os.path.abspath(binlog_dir),
                               listen=repl, replica_of=primary, sync_replicas=sync, etcd=etcd,
                               cluster=values.get("cluster") or "spark-beanstalk",
                               lease_ttl=int(values.get("lease_ttl") or 2), ca_file=ca_file,
                               token=token, tls_server=tls_server, client_address=client)
    return Member(config, ReplicationSource())


def member_listener(member: Member, binlog: QueueListener) -> QueueListener:
    """The queue's listener for a member: its binlog, then the stream."""
    member.binlog = binlog
    return Fanout(binlog, member.source, before_close=member.shutdown, after_close=member.closed_cleanly)
