"""How far behind the source is: per broker and tube, the jobs ready, delayed and buried and
the age of the job next in line, from ``stats-tube``, ``peek-ready`` and ``stats-job``.

Spark polls an idle source about every 12 ms, so the figures are refreshed at most once per
``max_age`` seconds (one pipelined round trip per broker for the counts, a second one for
the ages) and reused in between. They are what the broker says at the moment of the refresh:
jobs the source holds itself (planned, read ahead) are reserved, not ready, so they are not
in ``backlog``.
"""
from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spark_beanstalk.brokers import BrokerLink
from spark_beanstalk.client import Connection, ConnectionLost, parse_yaml

__all__ = ["Lag", "TubeLag", "tube_lag"]

_AGE = re.compile(rb"\nage: (\d+)")


@dataclass
class TubeLag:
    """One tube on one broker at the last refresh."""

    ready: int = 0
    delayed: int = 0
    buried: int = 0
    oldest_ready_age: int = 0     # seconds; the job peek-ready names (next in line), 0 if none

    def as_dict(self) -> dict[str, int]:
        return {"buried": self.buried, "delayed": self.delayed, "oldestReadyAgeSeconds": self.oldest_ready_age,
                "ready": self.ready}


@dataclass
class Lag:
    """The last figures per broker address and tube, and when each broker was last asked."""

    tubes: Sequence[str]
    per_broker: dict[str, dict[str, TubeLag]] = field(default_factory=dict)
    refreshed: dict[str, float] = field(default_factory=dict)   # address -> time.monotonic()

    def refresh(self, brokers: Sequence[BrokerLink], max_age: float) -> None:
        """Ask the brokers whose figures are older than `max_age` seconds (skipping those down)."""
        now = time.monotonic()
        for b in brokers:
            if now - self.refreshed.get(b.address, -1e18) < max_age:
                continue
            with b.lock:
                if b.control is None:
                    continue
                try:
                    self.per_broker[b.address] = tube_lag(b.control, self.tubes)
                except ConnectionLost as exc:
                    b.reset(exc)
                    continue
            self.refreshed[b.address] = now

    def ready(self) -> int:
        return sum(t.ready for tubes in self.per_broker.values() for t in tubes.values())

    def report(self) -> dict[str, Any]:
        """Totals and the per broker/tube figures, as shown in the query's progress."""
        rows = [t for tubes in self.per_broker.values() for t in tubes.values()]
        return {
            "backlog": sum(t.ready + t.delayed for t in rows),
            "oldestReadyAgeSeconds": max((t.oldest_ready_age for t in rows), default=0),
            "ready": sum(t.ready for t in rows),
            "delayed": sum(t.delayed for t in rows),
            "buried": sum(t.buried for t in rows),
            "tubes": {addr: {name: t.as_dict() for name, t in sorted(tubes.items())}
                      for addr, tubes in sorted(self.per_broker.items())},
        }


def tube_lag(conn: Connection, tubes: Sequence[str]) -> dict[str, TubeLag]:
    """The lag of each tube, in two pipelined round trips (`conn` uses "default" afterwards).

    The one rule for the source's progress and ``spark-beanstalk top``.
    """
    cmds: list[bytes] = []
    for t in tubes:
        cmds += [b"stats-tube %s\r\n" % t.encode(), b"use %s\r\n" % t.encode(), b"peek-ready\r\n"]
    # back to "default": a tube exists while a connection uses it, and the last one must not linger
    replies = conn.pipeline_replies(cmds + [b"use default\r\n"])
    out: dict[str, TubeLag] = {}
    heads: dict[str, int] = {}
    for k, t in enumerate(tubes):
        (_, stats), _use, (peek_line, _) = replies[3 * k], replies[3 * k + 1], replies[3 * k + 2]
        counts = parse_yaml(stats) if stats is not None else {}
        assert isinstance(counts, dict)
        out[t] = TubeLag(int(counts.get("current-jobs-ready", 0)), int(counts.get("current-jobs-delayed", 0)),
                         int(counts.get("current-jobs-buried", 0)))
        if peek_line.startswith(b"FOUND "):
            heads[t] = int(peek_line.split()[1])
    if heads:
        names = list(heads)
        replies = conn.pipeline_replies([b"stats-job %d\r\n" % heads[n] for n in names])
        for name, (_, body) in zip(names, replies, strict=True):
            match = _AGE.search(body or b"")
            if match is not None:      # None: reserved or deleted in between; age stays 0
                out[name].oldest_ready_age = int(match.group(1))
    return out
