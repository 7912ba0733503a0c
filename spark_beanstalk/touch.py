"""The touch threads (one per broker): keep every held job from reaching its TTR while its batch runs.

beanstalkd gives a reserved job back after its TTR; a batch can run far longer, so each
connection's jobs are touched once ``touchFraction`` of the smallest TTR it holds has
passed. A connection that fails here drops its broker's connections like anywhere else
(``BrokerLink.reset``) and wakes the worker, which re-acquires.
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

from spark_beanstalk.brokers import BrokerLink, ResConn
from spark_beanstalk.client import ConnectionLost
from spark_beanstalk.source_wire import failed_commands


@dataclass
class Timing:
    """Milliseconds spent, shown in the query's progress."""

    reserve_ms: float = 0.0
    prefetch_ms: float = 0.0
    stats_ms: float = 0.0
    touch_ms: float = 0.0
    delete_ms: float = 0.0
    partitions_ms: float = 0.0

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in asdict(self).items()}


class Toucher:
    """Runs in its own thread (``run``) beside the Spark calls and the worker: one per broker.

    Why one per broker: a touch, a reconnect or a clean-up holds its broker's lock across network
    I/O, up to ``socketTimeout`` (or connect timeouts) when the broker has vanished without a
    reset (a host down, packets dropped). A thread that served every broker waited that long on
    the lost one while the healthy brokers' jobs went past their TTR and were read again.
    """

    def __init__(self, broker: BrokerLink, fraction: float, timing: Timing, work: threading.Event) -> None:
        self.broker = broker
        self.fraction = fraction
        self.timing = timing
        self.wake = threading.Event()   # set when new jobs are held here: the next touch may be due sooner
        self.work = work                # the worker's event: set after a reset so it reconnects
        self.error: str | None = None
        self.stopping = False

    def run(self) -> None:
        fraction = self.fraction
        b = self.broker
        while not self.stopping:
            now = time.monotonic()
            next_due = now + 1.0
            with b.lock:
                groups: dict[ResConn, list[int]] | None = None
                for rc in list(b.conns):
                    if not rc.count or rc.dead:
                        continue
                    due = rc.touch_due(fraction)
                    if due <= now:
                        if groups is None:
                            groups = b.held_by_conn()
                        self._touch_conn(b, rc, groups.get(rc, []))
                        due = rc.touch_due(fraction)
                    next_due = min(next_due, due)
            self.wake.wait(max(0.005, next_due - time.monotonic()))
            self.wake.clear()

    def _touch_conn(self, b: BrokerLink, rc: ResConn, ids: list[int]) -> None:
        t0 = time.perf_counter()
        started = time.monotonic()
        try:
            failed = failed_commands(rc.conn, [b"touch %d\r\n" % j for j in ids], b"TOUCHED")
            b.counters.touched += len(ids) - len(failed)
            for i in failed:
                self.error = f"job {ids[i]} on {b.address} could not be touched; re-acquiring it"
            if failed:
                b.orphan(rc, [ids[i] for i in failed])
                self.work.set()     # the worker re-acquires
            rc.last_touch = started
        except ConnectionLost as exc:
            self.error = f"{b.address}: {exc}"
            b.reset(exc)
            self.work.set()
        self.timing.touch_ms += (time.perf_counter() - t0) * 1000
