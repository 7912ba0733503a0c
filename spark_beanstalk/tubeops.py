"""Clear and move a tube's jobs: what the protocol lacks (beanstalkd issue #25, since 2009).

One home for the CLI verbs (`spark-beanstalk clear` / `move`) and the dashboard's
actions. Both work on any beanstalkd-protocol server, one job at a time, and stop only
between two jobs, so an interrupt loses and duplicates nothing:

* clear: peek the next job of a state, delete it. A job a worker reserved in between
  is left alone (it is no longer in that state).
* move: peek, read its stats-job, ``reserve-job`` it (from then on no worker can take
  it), put a copy into the destination with the same priority, remaining delay and
  TTR (a buried job is buried again there), and only then delete the original.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from spark_beanstalk.aio import AsyncConnection

STATES = ("ready", "delayed", "buried")
STATE_CHOICES = (*STATES, "all")
# How long a moved buried job waits delayed in the destination before we bury it again:
# long enough that no worker can reserve it in between.
_HOLD_DELAY = 2**31 - 1
_MAX_MISSES = 100  # jobs in a row that workers took before we could act: give up on the state

Progress = Callable[[int], None]  # called with 1 after each job handled


def states_for(choice: str) -> tuple[str, ...]:
    if choice == "all":
        return STATES
    if choice not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATE_CHOICES)}, not {choice!r}")
    return (choice,)


@dataclass
class Outcome:
    """What clear or move did, by state; ``skipped``: jobs workers took meanwhile."""

    done: dict[str, int] = field(default_factory=lambda: {s: 0 for s in STATES})
    skipped: int = 0
    interrupted: bool = False
    new_ids: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.done.values())

    def by_state(self) -> str:
        return ", ".join(f"{state} {count}" for state, count in self.done.items() if count) or "none"


async def count_jobs(conn: AsyncConnection, tube: str, states: tuple[str, ...]) -> int:
    """Jobs of the tube in these states now (0 if the tube does not exist)."""
    stats = await conn.stats_tube(tube)
    if stats is None:
        return 0
    return sum(int(stats.get(f"current-jobs-{state}", 0)) for state in states)


def _stopped(stop: asyncio.Event | None) -> bool:
    return stop is not None and stop.is_set()


async def clear(conn: AsyncConnection, tube: str, states: tuple[str, ...], limit: int | None = None,
                progress: Progress | None = None, stop: asyncio.Event | None = None) -> Outcome:
    """Delete the tube's jobs in ``states`` (at most ``limit``); reserved jobs stay."""
    out = Outcome()
    await conn.use(tube)
    for state in states:
        misses = 0
        while not _stopped(stop) and (limit is None or out.total < limit):
            job = await conn.peek(f"peek-{state}", with_stats=False)
            if job is None:
                break
            if await conn.delete(job.id):
                out.done[state] += 1
                if progress is not None:
                    progress(1)
            else:
                out.skipped += 1
                misses += 1
                if misses > _MAX_MISSES:
                    break
    out.interrupted = _stopped(stop)
    return out


async def move(conn: AsyncConnection, src: str, dst: str, states: tuple[str, ...], limit: int | None = None,
               progress: Progress | None = None, stop: asyncio.Event | None = None) -> Outcome:
    """Move jobs from ``src`` to ``dst``; each is deleted from src only after its copy is in dst."""
    if src == dst:
        raise ValueError("source and destination are the same tube")
    out = Outcome()
    for state in states:
        misses = 0
        while not _stopped(stop) and (limit is None or out.total < limit):
            await conn.use(src)
            job = await conn.peek(f"peek-{state}")
            if job is None:
                break
            if job.stats is None or not await conn.reserve_job(job.id):
                out.skipped += 1  # a worker took it, or it was deleted, between peek and now
                misses += 1
                if misses > _MAX_MISSES:
                    break
                continue
            try:
                new_id = await _put_copy(conn, dst, state, job.body, job.stats)
            except BaseException:
                await _give_back(conn, job.id, state, job.stats)
                raise
            await conn.delete(job.id)  # ours (reserved): cannot fail but for a lost connection
            out.done[state] += 1
            out.new_ids.append(new_id)
            if progress is not None:
                progress(1)
    out.interrupted = _stopped(stop)
    return out


async def _put_copy(conn: AsyncConnection, dst: str, state: str, body: bytes, stats: dict[str, object]) -> int:
    priority = _int(stats.get("pri"))
    ttr = _int(stats.get("ttr"))
    delay = _int(stats.get("time-left")) if state == "delayed" else 0
    await conn.use(dst)
    if state != "buried":
        return await conn.put(body, priority, delay, ttr)
    new_id = await conn.put(body, priority, _HOLD_DELAY, ttr)
    if not (await conn.reserve_job(new_id) and await conn.bury(new_id, priority)):
        raise RuntimeError(f"could not bury the copy {new_id} in {dst!r}")
    return new_id


async def _give_back(conn: AsyncConnection, job_id: int, state: str, stats: dict[str, object]) -> None:
    """The copy could not be put: return the original to the state it was in."""
    if conn.closed:
        return  # the server gives a lost connection's reservations back itself
    priority = _int(stats.get("pri"))
    if state == "buried":
        await conn.bury(job_id, priority)
    else:
        delay = _int(stats.get("time-left")) if state == "delayed" else 0
        await conn.call(f"release {job_id} {priority} {delay}")


def _int(value: object) -> int:
    return int(value) if isinstance(value, (int, float, str)) else 0
