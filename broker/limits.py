"""Resource limits and the counters of what they refused.

beanstalkd has none of these: a client can exhaust memory, descriptors or tubes. Every
limit here is off (0) by default so stock behaviour is unchanged; a refused command
answers OUT_OF_MEMORY, the protocol's word for "the server will not take this", which
every client already handles. Each refusal is counted (``stats`` keys after
beanstalkd's own, and the metrics endpoint) and logged with the client's address, at
most a few times per second per reason so a misbehaving client cannot flood the log.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Final

from broker.logs import event

log = logging.getLogger("broker.limits")

DEFAULT_MAX_OUTPUT_BYTES: Final = 16 << 20  # unsent replies per connection before it is closed
OUTPUT_HIGH_WATER: Final = 1 << 20  # stop reading a connection whose replies are not being read
DEFAULT_SLOW_READER_TIMEOUT: Final = 10.0  # seconds a connection may leave replies unread past the high water

# Refusal reasons, in the order their stats keys are printed.
REASONS: Final = ("connections", "jobs", "job_bytes", "tubes", "reserves", "slow_reader", "idle", "auth",
           "accept_errors")
_STATS_KEYS: Final = {
    "connections": "limit-refused-connections",
    "jobs": "limit-refused-jobs",
    "job_bytes": "limit-refused-job-bytes",
    "tubes": "limit-refused-tubes",
    "reserves": "limit-refused-reserves",
    "slow_reader": "closed-slow-readers",
    "idle": "closed-idle",
    "auth": "auth-failures",
    "accept_errors": "accept-errors",
}


@dataclass(frozen=True)
class Limits:
    """0 means unlimited for every count and size. Frozen: the queue keeps native copies of a few."""

    max_connections: int = 0
    max_jobs: int = 0
    max_job_bytes: int = 0
    max_tubes: int = 0
    max_reserved_per_connection: int = 0
    idle_timeout: float = 0.0
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    slow_reader_timeout: float = DEFAULT_SLOW_READER_TIMEOUT


@dataclass
class Refusals:
    """How often each limit refused something; logs each refusal, rate-limited per reason."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    _window: dict[str, tuple[float, int]] = field(default_factory=dict)
    log_per_second: int = 5

    def refuse(self, reason: str, peer: str, detail: str = "") -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        start, logged = self._window.get(reason, (now, 0))
        if now - start >= 1.0:
            start, logged = now, 0
        if logged < self.log_per_second:
            event(log, logging.WARNING, "refused", reason=reason, peer=peer, detail=detail)
        self._window[reason] = (start, logged + 1)

    def stats_items(self, current_job_bytes: int) -> dict[str, int]:
        items = {"current-job-bytes": current_job_bytes}
        for reason in REASONS:
            items[_STATS_KEYS[reason]] = self.counts[reason]
        return items
