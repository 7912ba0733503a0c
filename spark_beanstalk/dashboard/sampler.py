"""Samples every server once a second: stats, tubes, rates, and 15 minutes of history.

One task per server keeps one connection open; pages and the JSON API only read what it
sampled, so any number of open browser tabs cost the servers nothing extra.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from spark_beanstalk.aio import AsyncConnection
from spark_beanstalk.client import BeanstalkError

log = logging.getLogger("spark_beanstalk.dashboard")
HISTORY_SECONDS = 15 * 60
MAX_CHARTED_TUBES = 24
IDLE_AFTER = 60.0  # seconds without a page view before sampling slows down
TUBE_KEYS = (("current-jobs-ready", "ready"), ("current-jobs-reserved", "reserved"),
             ("current-jobs-delayed", "delayed"), ("current-jobs-buried", "buried"),
             ("current-jobs-urgent", "urgent"), ("current-waiting", "waiting"))
STATE_KEYS = ("ready", "reserved", "delayed", "buried")


@dataclass
class Endpoint:
    """A server the dashboard shows: how to connect, and extra facts only we know (binlog size)."""

    name: str
    connect: Callable[[], Awaitable[AsyncConnection]]
    extra: Callable[[], dict[str, Any]] | None = None


@dataclass
class Sample:
    at: float
    stats: dict[str, Any]
    tubes: dict[str, dict[str, Any]]


@dataclass
class ServerView:
    """What the last samples of one server say; ``error`` is set while it is down."""

    index: int
    endpoint: Endpoint
    last: Sample | None = None
    previous: Sample | None = None
    error: str | None = "not sampled yet"
    history: deque[tuple[float, dict[str, tuple[int, int, int]]]] = field(default_factory=deque)

    def summary(self) -> dict[str, Any]:
        st = self.last.stats if self.last else {}
        extra = self.endpoint.extra() if self.endpoint.extra is not None else {}
        return {
            "id": self.index, "name": self.endpoint.name, "up": self.error is None, "error": self.error,
            "version": st.get("version"), "uptime": st.get("uptime"),
            "connections": st.get("current-connections"),
            "jobs": {k: st.get(f"current-jobs-{k}") for k in STATE_KEYS},
            "cmd_rate": self._rate(lambda s: sum(v for k, v in s.stats.items()
                                                 if k.startswith("cmd-") and isinstance(v, int))),
            "binlog_bytes": extra.get("binlog_bytes"),
            "replication": replication_text(st),
        }

    def tube_rows(self) -> list[dict[str, Any]]:
        if self.last is None or self.error is not None:
            return []
        rows = []
        for name, st in sorted(self.last.tubes.items()):
            row: dict[str, Any] = {"server": self.index, "name": name}
            row.update({short: st.get(key, 0) for key, short in TUBE_KEYS})
            row["paused"] = int(st.get("pause-time-left", 0) or 0)
            row["put_rate"] = self._rate(functools.partial(_tube_int, tube=name, key="total-jobs"))
            row["delete_rate"] = self._rate(functools.partial(_tube_int, tube=name, key="cmd-delete"))
            rows.append(row)
        return rows

    def _rate(self, value: Callable[[Sample], int]) -> float | None:
        if self.last is None or self.previous is None:
            return None
        elapsed = max(self.last.at - self.previous.at, 1e-6)
        return round(max(0, value(self.last) - value(self.previous)) / elapsed, 2)

    def history_json(self) -> dict[str, list[list[float]]]:
        """Per tube: [times, ready, reserved, buried] for uPlot (None where the tube was absent)."""
        tubes: list[str] = sorted({t for _, point in self.history for t in point})[:MAX_CHARTED_TUBES]
        out: dict[str, list[list[Any]]] = {t: [[], [], [], []] for t in tubes}
        for at, point in self.history:
            for tube in tubes:
                values = point.get(tube)
                series = out[tube]
                series[0].append(round(at, 3))
                for i in range(3):
                    series[i + 1].append(values[i] if values else None)
        return out


def replication_text(stats: dict[str, Any]) -> str | None:
    """'leader · epoch 7' / 'replica · epoch 7 · lag 3 (0.012 s)' for a replicated member, None otherwise."""
    role = stats.get("replication-role")
    if role is None:
        return None
    text = f"{role} · epoch {stats.get('replication-epoch')}"
    if role != "leader":
        text += f" · lag {stats.get('replication-lag-records')} ({stats.get('replication-lag-seconds')} s)"
    return text


def _tube_int(sample: Sample, tube: str, key: str) -> int:
    value = sample.tubes.get(tube, {}).get(key, 0)
    return value if isinstance(value, int) else 0


class Sampler:
    """Runs one sampling task per server until stopped."""

    def __init__(self, endpoints: list[Endpoint], interval: float = 1.0, idle_interval: float = 5.0) -> None:
        self.views = [ServerView(i, e) for i, e in enumerate(endpoints)]
        self.interval = interval
        # Nobody looked for a minute: sample less often (the broker serves its own
        # dashboard, and every sample is a stats-tube per tube).
        self.idle_interval = idle_interval
        self.last_viewed = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []
        # Checked by each task after every attempt: a cancel that lands as a connect fails is
        # lost (Python 3.11's wait_for returns the connect's OSError instead), and the task
        # would sample on forever while stop() waits for it.
        self._stopping = False

    def viewed(self) -> None:
        self.last_viewed = time.monotonic()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(view), name=f"sample {view.endpoint.name}")
                       for view in self.views]

    def stopping(self) -> bool:
        return self._stopping

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, view: ServerView) -> None:
        conn: AsyncConnection | None = None
        try:
            while not self.stopping():
                try:
                    if conn is None or conn.closed:
                        conn = await view.endpoint.connect()
                    await self.sample_once(view, conn)
                except (BeanstalkError, OSError) as exc:
                    view.error = f"unreachable: {exc}"
                    if conn is not None:
                        await conn.close()
                    conn = None
                except Exception as exc:
                    log.exception("sampling %s failed", view.endpoint.name)
                    view.error = f"sampling failed: {exc!r}"
                    if conn is not None:
                        await conn.close()
                    conn = None
                if self.stopping():  # a cancel swallowed above
                    break
                idle = time.monotonic() - self.last_viewed > IDLE_AFTER
                await asyncio.sleep(self.idle_interval if idle else self.interval)
        finally:
            if conn is not None:
                await conn.close()

    async def sample_once(self, view: ServerView, conn: AsyncConnection) -> None:
        stats = await conn.stats()
        if not stats:
            raise BeanstalkError("BAD_REPLY", "stats", "the server did not answer stats (token needed?)")
        tubes: dict[str, dict[str, Any]] = {}
        for name in await conn.list_tubes():
            st = await conn.stats_tube(name)
            if st is not None:
                tubes[name] = st
        now = time.time()
        view.previous, view.last = view.last, Sample(now, stats, tubes)
        view.error = None
        # Only the tubes a chart can show are kept (15 minutes of a point a second): a point for
        # every tube held ~100 MB for 3,000 tubes, for charts that draw 24 of them.
        point = {name: (int(tubes[name].get("current-jobs-ready", 0)), int(tubes[name].get("current-jobs-reserved", 0)),
                        int(tubes[name].get("current-jobs-buried", 0))) for name in sorted(tubes)[:MAX_CHARTED_TUBES]}
        view.history.append((now, point))
        while view.history and view.history[0][0] < now - HISTORY_SECONDS:
            view.history.popleft()
