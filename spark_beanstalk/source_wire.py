"""The source's batched protocol paths: stats-job, delete, touch, release, bury and
identity checks for runs of jobs, each a few round trips whatever the number of jobs.

The source pays these for every job it reads, so they avoid per-reply Python work where
they can (one regex pass, one ``bytes.count``) and fall back to reply-by-reply parsing.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from spark_beanstalk.client import REFUSED_FOR_NOW, Connection, ConnectionLost, split_replies
from spark_beanstalk.offsets import body_digest

PIPELINE_WINDOW = 1024


def _field(body: bytes, key: bytes) -> bytes | None:
    i = body.find(key)
    if i < 0:
        return None
    i += len(key)
    j = body.find(b"\n", i)
    return body[i:] if j < 0 else body[i:j]


def parse_stats_job(body: bytes) -> tuple[str, int, int, int, str]:
    """(tube, pri, ttr, reserves, state) from a stats-job YAML body, without a general parser."""
    tube = _field(body, b"\ntube: ")
    pri = _field(body, b"\npri: ")
    ttr = _field(body, b"\nttr: ")
    reserves = _field(body, b"\nreserves: ")
    state = _field(body, b"\nstate: ")
    if tube is not None and pri is not None and ttr is not None and reserves is not None and state is not None:
        try:
            return tube.strip(b'"').decode(), int(pri), int(ttr), int(reserves), state.decode()
        except ValueError:
            pass
    return _parse_stats_job_slow(body)


def _parse_stats_job_slow(body: bytes) -> tuple[str, int, int, int, str]:
    tube, pri, ttr, reserves, state = "", 0, 0, 0, ""
    for line in body.split(b"\n"):
        key, _, value = line.partition(b": ")
        if key == b"tube":
            tube = value.strip(b'"').decode()
        elif key == b"pri":
            pri = int(value)
        elif key == b"ttr":
            ttr = int(value)
        elif key == b"reserves":
            reserves = int(value)
        elif key == b"state":
            state = value.decode()
    return tube, pri, ttr, reserves, state


# One whole stats-job reply as beanstalkd 1.12 and our broker print it (fields in this order).
# Groups: id, tube, state, pri, ttr, reserves. Replies in another layout take the slow path.
_STATS_JOB = re.compile(
    rb"OK \d+\r\n---\nid: (\d+)\ntube: ([^\n]*)\nstate: ([a-z]+)\npri: (\d+)\nage: [^\n]*\ndelay: [^\n]*\n"
    rb"ttr: (\d+)\ntime-left: [^\n]*\nfile: [^\n]*\nreserves: (\d+)\n[^\r]*\r\n")


class JobStats(NamedTuple):
    """Columns of the stats of the jobs that still exist, in the order asked; `missing` = the others."""

    ids: list[int]
    tubes: list[str]
    pris: list[int]
    ttrs: list[int]
    reserves: list[int]
    states: list[str]
    missing: list[int]

    def extend(self, other: JobStats) -> None:
        self.ids.extend(other.ids)
        self.tubes.extend(other.tubes)
        self.pris.extend(other.pris)
        self.ttrs.extend(other.ttrs)
        self.reserves.extend(other.reserves)
        self.states.extend(other.states)
        self.missing.extend(other.missing)


def stats_jobs(conn: Connection, ids: Sequence[int]) -> JobStats:
    """stats-job every id, one round trip per PIPELINE_WINDOW ids, each parsed with one regex pass.

    The source pays this for every job it reads, so it avoids per-reply Python work: the
    replies of a run are matched at once, checked against the ids asked for, and only if
    that fails (a job gone, an unexpected layout) parsed one by one.
    """
    if len(ids) <= PIPELINE_WINDOW:
        return _stats_run(conn, ids)
    out = JobStats([], [], [], [], [], [], [])
    for lo in range(0, len(ids), PIPELINE_WINDOW):
        out.extend(_stats_run(conn, ids[lo:lo + PIPELINE_WINDOW]))
    return out


def _stats_run(conn: Connection, ids: Sequence[int]) -> JobStats:
    raw = conn.bulk(b"".join([b"stats-job %d\r\n" % j for j in ids]))
    rows = _STATS_JOB.findall(raw)
    found = [int(r[0]) for r in rows]
    if len(rows) != len(ids) or found != list(ids):
        return _stats_jobs_slow(raw, ids)
    names: dict[bytes, str] = {}
    for r in rows:
        if r[1] not in names:
            names[r[1]] = r[1].strip(b'"').decode()
    states = {b"reserved": "reserved"}
    return JobStats(found, [names[r[1]] for r in rows], [int(r[3]) for r in rows], [int(r[4]) for r in rows],
                    [int(r[5]) for r in rows], [states.get(r[2]) or r[2].decode() for r in rows], [])


def _stats_jobs_slow(raw: bytes, ids: Sequence[int]) -> JobStats:
    out = JobStats([], [], [], [], [], [], [])
    for jid, (_line, body) in zip(ids, split_replies(raw), strict=False):
        if body is None:
            out.missing.append(jid)
            continue
        tube, pri, ttr, reserves, state = parse_stats_job(body)
        out.ids.append(jid)
        out.tubes.append(tube)
        out.pris.append(pri)
        out.ttrs.append(ttr)
        out.reserves.append(reserves)
        out.states.append(state)
    return out


def not_leading(conn: Connection, line: bytes, command: str) -> ConnectionLost:
    """The member on `conn` no longer leads: as good as a lost connection (find the leader again,
    re-acquire what was held there), never a sign that a job is gone."""
    return ConnectionLost("NOT_LEADING", command,
                          f"{conn.host}:{conn.port} answered {line.decode()}: it does not lead (now)")


def failed_commands(conn: Connection, commands: Sequence[bytes], ok: bytes) -> list[int]:
    """Send commands with one-line replies (delete, touch, release, bury) in runs of
    PIPELINE_WINDOW; returns the indexes of those whose reply was not `ok` (usually none).

    ConnectionLost if the member refused them as one that does not lead (REFUSED_FOR_NOW).
    """
    failed: list[int] = []
    want = ok + b"\r\n"
    for lo in range(0, len(commands), PIPELINE_WINDOW):
        run = commands[lo:lo + PIPELINE_WINDOW]
        raw = conn.bulk(b"".join(run))
        if raw.count(want) != len(run):
            for i, line in enumerate(raw.split(b"\r\n")[:len(run)]):
                if line in REFUSED_FOR_NOW:
                    raise not_leading(conn, line, run[i].split(b" ", 1)[0].decode())
                if line != ok:
                    failed.append(lo + i)
    return failed


def delete_jobs(conn: Connection, ids: Sequence[int]) -> int:
    """Delete the jobs; returns how many were deleted (the rest were gone or not ours)."""
    return len(ids) - len(failed_commands(conn, [b"delete %d\r\n" % j for j in ids], b"DELETED"))


class Identity(NamedTuple):
    """What identifies a job across reconnects: its tube and body digest, and its state now."""

    tube: str
    digest: int
    state: str
    age: int = -1     # seconds since the put (stats-job "age"); -1 = not known


def inspect_jobs(conn: Connection, ids: Sequence[int]) -> dict[int, Identity]:
    """peek + stats-job each id on `conn`; the jobs that exist -> their identity.

    Done on the connection that acts next (reserve-job, delete), so the check and the
    action see the same broker process.
    """
    cmds: list[bytes] = []
    for j in ids:
        cmds.append(b"peek %d\r\n" % j)
        cmds.append(b"stats-job %d\r\n" % j)
    replies = conn.pipeline_replies(cmds)
    found: dict[int, Identity] = {}
    for k, jid in enumerate(ids):
        (peek_line, body), (_stats_line, stats) = replies[2 * k], replies[2 * k + 1]
        if body is None or stats is None or not peek_line.startswith(b"FOUND "):
            continue
        tube, _pri, _ttr, _reserves, state = parse_stats_job(stats)
        age = _field(stats, b"\nage: ")
        found[jid] = Identity(tube, body_digest(body), state, int(age) if age is not None and age.isdigit() else -1)
    return found
