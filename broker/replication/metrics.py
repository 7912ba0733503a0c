"""Prometheus metrics of a replicated member (registered on the broker's --metrics endpoint)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from broker.replication.member import Member


class ReplicationCollector:
    def __init__(self, member: Member) -> None:
        self.member = member

    def collect(self) -> Iterator[Metric]:
        member = self.member
        assert member.applier is not None
        replica = member.role != "leader"
        yield GaugeMetricFamily("beanstalk_replication_leader", "1 while this member leads with a valid lease",
                                value=1 if member.is_leader() else 0)
        yield GaugeMetricFamily("beanstalk_replication_epoch", "Leadership epoch of this member's last record",
                                value=member.position().epoch)
        yield GaugeMetricFamily("beanstalk_replication_lag_records", "Records the leader has that this replica lacks",
                                value=member.applier.lag_records() if replica else 0)
        yield GaugeMetricFamily("beanstalk_replication_lag_seconds", "Seconds since this replica was last caught up",
                                value=member.applier.lag_seconds() if replica else 0.0)
        yield GaugeMetricFamily("beanstalk_replication_replicas", "Replicas streaming from this member",
                                value=len(member.source.sessions))
