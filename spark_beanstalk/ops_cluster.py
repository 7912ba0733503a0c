"""The members of a replica set as operators see them: role, epoch and lag of each.

`spark-beanstalk stats -H cluster:a,b,c` asks every member (a replica answers `stats`),
so an operator sees who leads, in which epoch, and how far each replica is behind, also
mid-failover when no member leads. Keys: docs/replication.md (``replication-*``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from beanstalk_rules.hosts import BrokerAddress, HostSpec
from spark_beanstalk.client import BeanstalkError, Connection

#: (stats key, column) of what the member view shows.
MEMBER_COLUMNS = (
    ("replication-role", "role"),
    ("replication-epoch", "epoch"),
    ("replication-seq", "seq"),
    ("replication-lag-records", "lag_records"),
    ("replication-lag-seconds", "lag_seconds"),
    ("replication-leader", "leader"),
    ("replication-replicas", "replicas"),
)


def member_row(address: str, stats: dict[str, Any]) -> dict[str, Any]:
    """One member's replication state from its stats (role 'single' without replication)."""
    row: dict[str, Any] = {"member": address}
    for key, column in MEMBER_COLUMNS:
        row[column] = stats.get(key)
    if row["role"] is None:
        row["role"] = "single"
    return row


def member_rows(broker: BrokerAddress, connect: Callable[[HostSpec], Connection]) -> list[dict[str, Any]]:
    """Every member's row; an unreachable member is a row saying so, never an error."""
    rows: list[dict[str, Any]] = []
    for member in broker.members:
        try:
            conn = connect(member)
        except BeanstalkError as exc:
            rows.append({"member": member.address, "role": "unreachable", "error": str(exc)})
            continue
        try:
            rows.append(member_row(member.address, conn.stats()))
        except BeanstalkError as exc:
            rows.append({"member": member.address, "role": "unreachable", "error": str(exc)})
        finally:
            conn.close()
    return rows


def members_table(title: str, rows: list[dict[str, Any]]) -> Any:
    """A rich table of member rows."""
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold", title_justify="left")
    columns = ["member"] + [c for _, c in MEMBER_COLUMNS]
    for column in columns:
        table.add_column(column.replace("_", " "), no_wrap=True)
    for row in rows:
        cells = ["" if row.get(c) is None else str(row[c]) for c in columns]
        if "error" in row:
            cells[-1] = str(row["error"])
        table.add_row(*cells)
    return table
