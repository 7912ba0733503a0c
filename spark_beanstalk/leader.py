"""Finding the member of a replica set that leads (``cluster:a,b,c`` hosts).

A replica answers reads but refuses changes, so a client of a ``cluster:`` broker talks to
the leader only. Each member says what it is in ``stats`` (``replication-role``, see
docs/replication.md); the source, the writers and the ops CLI all ask here, on connect and
on every reconnect, so the re-acquire and retry machinery they already have carries them
through a failover. A server without the key (stock beanstalkd, an unreplicated broker)
counts as a leader: a one-member "cluster" behaves like a plain host.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from beanstalk_rules.hosts import BrokerAddress, HostSpec
from spark_beanstalk.client import BeanstalkError, Connection, ConnectionLost

ROLE_KEY = "replication-role"
LEADER_ROLE = "leader"


class Leader(NamedTuple):
    """An open connection to the member that leads, and the stats it answered."""

    conn: Connection
    member: HostSpec
    stats: dict[str, Any]


def _stats(conn: Connection) -> dict[str, Any]:
    try:
        return conn.stats()
    except ConnectionLost:
        raise
    except BeanstalkError:          # a server that does not answer stats still takes jobs
        return {}


def open_leader(broker: BrokerAddress, connect: Callable[[HostSpec], Connection],
                hint: HostSpec | None = None) -> Leader:
    """Connect to the broker's leader, trying `hint` (the last leader) first.

    A plain broker's only member is used whatever it says. Raises ConnectionLost naming
    every member's state when none leads (mid-failover, all down): callers treat that like
    a broker that is down and retry with their backoff.
    """
    if not broker.is_cluster:         # a plain host: its own connect error says it best
        conn = connect(broker.members[0])
        try:
            return Leader(conn, broker.members[0], _stats(conn))
        except ConnectionLost:
            conn.close()
            raise
    members = list(broker.members)
    if hint in members:
        members.remove(hint)
        members.insert(0, hint)
    seen: list[str] = []
    for member in members:
        try:
            conn = connect(member)
        except ConnectionLost as exc:
            seen.append(f"{member.address}: {exc}")
            continue
        try:
            stats = _stats(conn)
        except ConnectionLost as exc:
            conn.close()
            seen.append(f"{member.address}: {exc}")
            continue
        role = stats.get(ROLE_KEY)
        if role is None or role == LEADER_ROLE:
            return Leader(conn, member, stats)
        conn.close()
        seen.append(f"{member.address}: {role}")
    raise ConnectionLost("NO_LEADER", "stats", f"no member of {broker.name} leads ({'; '.join(seen)})")
