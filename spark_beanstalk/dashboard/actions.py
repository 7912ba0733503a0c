"""The tube page's actions, each a short conversation with one server.

Every action returns the sentence the page shows; bad input and refusals raise
ActionError with a sentence too, never a traceback.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from spark_beanstalk import tubeops
from spark_beanstalk.aio import AsyncConnection, PeekedJob

MAX_SHOWN_BYTES = 4096
MAX_PUT_BYTES = 1 << 20
MAX_PRIORITY = 2**32 - 1


class ActionError(Exception):
    """Bad input or a server's refusal, as one sentence for the page."""


@dataclass(frozen=True)
class BodyView:
    """A job body ready for the page: the kind decides how it is shown."""

    kind: str  # "json", "text" or "hex"
    text: str
    size: int
    truncated: bool


def body_view(body: bytes, limit: int = MAX_SHOWN_BYTES) -> BodyView:
    shown = body[:limit]
    truncated = len(body) > limit
    try:
        text = shown.decode("utf-8")
    except UnicodeDecodeError:
        if not truncated or len(body) - limit > 3:
            return BodyView("hex", _hexdump(shown), len(body), truncated)
        text = shown.decode("utf-8", "replace")
    if not truncated:
        try:
            return BodyView("json", json.dumps(json.loads(text), indent=2, ensure_ascii=False), len(body), False)
        except ValueError:
            pass
    return BodyView("text", text, len(body), truncated)


def _hexdump(data: bytes) -> str:
    lines = []
    for off in range(0, len(data), 16):
        chunk = data[off:off + 16]
        ascii_part = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{off:08x}  {chunk.hex(' '):<47}  {ascii_part}")
    return "\n".join(lines)


def _int(form: dict[str, str], key: str, low: int, high: int, default: int | None = None) -> int:
    raw = form.get(key, "").strip()
    if not raw and default is not None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ActionError(f"{key} must be a whole number, not {raw!r}") from None
    if not low <= value <= high:
        raise ActionError(f"{key} must be between {low} and {high}")
    return value


Action = Callable[[AsyncConnection, str, dict[str, str]], Awaitable[str]]


async def _kick(conn: AsyncConnection, tube: str, form: dict[str, str]) -> str:
    await conn.use(tube)
    kicked = await conn.kick(_int(form, "bound", 1, 2**31, 1))
    return f"kicked {kicked} job(s) in {tube!r}"


async def _kick_job(conn: AsyncConnection, tube: str, form: dict[str, str]) -> str:
    job_id = _int(form, "job", 1, 2**63)
    if not await conn.kick_job(job_id):
        raise ActionError(f"job {job_id} not found, or not buried or delayed")
    return f"kicked job {job_id}"


async def _delete_job(conn: AsyncConnection, tube: str, form: dict[str, str]) -> str:
    job_id = _int(form, "job", 1, 2**63)
    if not await conn.delete(job_id):
        raise ActionError(f"job {job_id} not found (gone, or reserved by a worker)")
    return f"deleted job {job_id}"


async def _pause(conn: AsyncConnection, tube: str, form: dict[str, str]) -> str:
    seconds = _int(form, "seconds", 0, 2**31, 0) if form.get("action") == "pause" else 0
    if not await conn.pause_tube(tube, seconds):
        raise ActionError(f"tube {tube!r} not found")
    return f"paused {tube!r} for {seconds}s" if seconds else f"resumed {tube!r}"


async def _clear(conn: AsyncConnection, tube: str, form: dict[str, str]) -> str:
    if form.get("confirm") != "yes":
        raise ActionError("clear deletes jobs: tick the confirmation box first")
    states = _states(form)
    out = await tubeops.clear(conn, tube, states)
    return f"cleared {tube!r}: deleted {out.total} job(s) ({out.by_state()})" + _skipped(out)


async def _move(conn: AsyncConnection, tube: str, form: dict[str, str]) -> str:
    dst = form.get("dst", "").strip()
    if not dst:
        raise ActionError("say which tube to move the jobs to")
    if dst == tube:
        raise ActionError("the destination is this tube")
    limit = _int(form, "count", 1, 2**31, 0) or None
    await _check_tube_name(conn, dst)
    out = await tubeops.move(conn, tube, dst, _states(form), limit)
    return f"moved {out.total} job(s) from {tube!r} to {dst!r} ({out.by_state()})" + _skipped(out)


async def _put(conn: AsyncConnection, tube: str, form: dict[str, str]) -> str:
    body = form.get("body", "").encode()
    if len(body) > MAX_PUT_BYTES:
        raise ActionError(f"the body is larger than {MAX_PUT_BYTES} bytes")
    priority = _int(form, "priority", 0, MAX_PRIORITY, 2**31)
    delay = _int(form, "delay", 0, 2**31, 0)
    ttr = _int(form, "ttr", 0, 2**31, 120)
    await conn.use(tube)
    job_id = await conn.put(body, priority, delay, ttr)
    return f"put job {job_id} into {tube!r}"


async def _check_tube_name(conn: AsyncConnection, tube: str) -> None:
    reply = await conn.call(f"use {tube}")
    if reply.status != b"USING":
        raise ActionError(f"bad tube name {tube!r}")


def _states(form: dict[str, str]) -> tuple[str, ...]:
    try:
        return tubeops.states_for(form.get("state", ""))
    except ValueError as exc:
        raise ActionError(str(exc)) from None


def _skipped(out: tubeops.Outcome) -> str:
    return f"; {out.skipped} taken by workers meanwhile" if out.skipped else ""


ACTIONS: dict[str, Action] = {
    "kick": _kick, "kick-job": _kick_job, "delete-job": _delete_job, "pause": _pause, "resume": _pause,
    "clear": _clear, "move": _move, "put": _put,
}


async def tube_details(conn: AsyncConnection, tube: str) -> dict[str, Any]:
    """stats-tube and the next ready, delayed and buried job (None when the tube is unknown)."""
    stats = await conn.stats_tube(tube)
    if stats is None:
        return {"stats": None, "jobs": {}}
    await conn.use(tube)
    jobs: dict[str, tuple[PeekedJob, BodyView] | None] = {}
    for state in tubeops.STATES:
        job = await conn.peek(f"peek-{state}")
        jobs[state] = (job, body_view(job.body)) if job is not None else None
    return {"stats": stats, "jobs": jobs}
