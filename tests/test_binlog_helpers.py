"""Shared helpers of the binlog tests (no tests here): in-process harness, broker processes, state snapshots."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from broker import queue_verbs
from broker.binlog import Binlog, open_binlog
from broker.queue import Queue
from spark_beanstalk.client import Connection
from spark_beanstalk.embedded import broker_process, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- in-process harness
class Harness:
    """A Queue with a real Binlog on a real directory, driven without sockets.

    ``crash()`` drops the listener the way SIGKILL does: what ``sync_point`` wrote is in the
    files, what was still buffered is lost, nothing is fsynced or trimmed.
    """

    def __init__(self, directory: str, fsync_ms: int | None = 0, segment_size: int = 4096,
                 ignore_damage: bool = False) -> None:
        self.dir = directory
        self.args = dict(fsync_ms=fsync_ms, segment_size=segment_size, ignore_damage=ignore_damage)
        self.log: Binlog = open_binlog(directory, **self.args)
        self.queue = Queue(time.monotonic_ns, listener=self.log)
        self.log.recover(self.queue)
        self.client = queue_verbs.connect(self.queue, lambda reply: None)

    def sync(self) -> None:
        self.log.sync_point()

    def put(self, body: bytes, pri: int = 100, delay: int = 0, ttr: int = 60, tube: str = "default") -> int:
        if self.client.use.name != tube:
            queue_verbs.use(self.queue, self.client, tube)
        reply = self.queue.put(self.client, pri, delay, ttr, body)
        self.sync()
        assert reply.startswith(b"INSERTED"), reply
        return int(reply.split()[1])

    def reserve(self, job_id: int) -> None:
        assert queue_verbs.reserve_job(self.queue, self.client, job_id).startswith(b"RESERVED")
        self.sync()

    def do(self, method: str, *args) -> bytes:
        verb = getattr(queue_verbs, method, None)  # release, bury, kick_job...: functions over the queue
        if verb is not None:
            reply = verb(self.queue, self.client, *args)
        else:
            reply = getattr(self.queue, method)(self.client, *args)
        self.sync()
        return reply

    def state(self) -> dict[int, tuple]:
        """id -> (state name, tube, pri, body, releases, buries, kicks, timeouts)."""
        from broker.queue import RESERVED, STATE_NAMES
        out = {}
        for job in self.queue.jobs.values():
            state = "ready" if job.state == RESERVED else STATE_NAMES[job.state]
            out[job.id] = (state, job.tube.name, job.pri, job.body, job.releases, job.buries, job.kicks, job.timeouts)
        return out

    def close(self) -> None:
        self.log.close()

    def crash(self) -> None:
        self.log.abandon()

    def reopen(self, **overrides) -> Harness:
        args = {**self.args, **overrides}
        return Harness(self.dir, **args)


def segment_files(directory: str) -> list[str]:
    return sorted((n for n in os.listdir(directory) if n.endswith(".sbl")),
                  key=lambda n: int(n.split(".")[1]))


# ---------------------------------------------------------------- processes
def start_ours(directory: str, *args: str, stderr_path: str | None = None, env: dict | None = None,
               timeout: float = 30.0):
    proc = broker_process(extra_args=["-b", directory, *args], stderr_path=stderr_path,
                          env={**os.environ, **env} if env else None)
    return proc.start(timeout=timeout)


def run_ours_expect_exit(directory: str, *args: str, timeout: float = 30.0,
                         env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the broker on ``directory`` when it is expected to refuse to start (or die at a crash point)."""
    argv = [sys.executable, "-m", "broker", "-l", "127.0.0.1", "-p", str(free_port()), "-b", directory, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **env} if env else None)


def job_snapshot(conn: Connection, ids) -> dict[int, dict | None]:
    """stats-job + peek of every id (pipelined): id -> {state, tube, pri, body, counters} or None."""
    ids = list(ids)
    if not ids:
        return {}
    cmds = []
    for job_id in ids:
        cmds.append(b"stats-job %d\r\n" % job_id)
        cmds.append(b"peek %d\r\n" % job_id)
    replies = list(conn.pipeline(cmds, window=256))
    from spark_beanstalk.client import parse_yaml
    out = {}
    for n, job_id in enumerate(ids):
        st, pk = replies[2 * n], replies[2 * n + 1]
        if st.status == b"NOT_FOUND":
            assert pk.status == b"NOT_FOUND", (job_id, pk)
            out[job_id] = None
            continue
        assert st.status == b"OK" and pk.status == b"FOUND", (job_id, st, pk)
        y = parse_yaml(st.body)
        out[job_id] = {"state": y["state"], "tube": str(y["tube"]), "pri": y["pri"], "body": pk.body,
                       "ttr": y["ttr"], "delay": y["delay"], "releases": y["releases"], "buries": y["buries"],
                       "kicks": y["kicks"], "timeouts": y["timeouts"], "reserves": y["reserves"],
                       "time-left": y["time-left"], "age": y["age"]}
    return out
