"""The one home of test helpers: waiting, free ports, server processes.

Tests import from here (`from tests.helpers import wait_until`); the implementations live
in `spark_beanstalk.embedded` so that jobs/ and bench/ share them too.
"""
from __future__ import annotations

from spark_beanstalk.embedded import (
    ServerExitedEarly,
    ServerProcess,
    beanstalkd_process,
    broker_process,
    free_port,
    start_server,
    wait_for_port,
    wait_until,
)

__all__ = [
    "ServerExitedEarly",
    "ServerProcess",
    "beanstalkd_process",
    "drain_tube",
    "broker_process",
    "free_port",
    "start_server",
    "tube_jobs",
    "wait_for_port",
    "wait_until",
]


def drain_tube(proc: ServerProcess, tube: str) -> list[bytes]:
    """Reserve and delete every ready job of `tube`; returns their bodies (pipelined: 100k jobs in a second or two)."""
    from spark_beanstalk.client import Connection

    out: list[bytes] = []
    with Connection(proc.host, proc.port, timeout=30) as conn:
        conn.watch_only([tube])
        while True:
            ids, bodies, _ = conn.reserve_many(1000)
            if not ids:
                return out
            out.extend(bodies)
            for reply in conn.pipeline([b"delete %d\r\n" % i for i in ids]):
                assert reply.status == b"DELETED", reply


def tube_jobs(proc: ServerProcess, tube: str) -> dict[str, int]:
    """The tube's current ready/reserved/delayed/buried counts (all 0 for a tube that does not exist)."""
    from spark_beanstalk.client import Connection

    with Connection(proc.host, proc.port, timeout=10) as conn:
        st = conn.stats_tube(tube) or {}
    return {k: int(st.get(f"current-jobs-{k}", 0)) for k in ("ready", "reserved", "delayed", "buried")}
