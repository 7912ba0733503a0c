"""Property tests (hypothesis): random operation sequences, then a crash or a clean stop, then recovery.

The recovered state must equal the state the client expects: every job with its tube,
body, priority, last logged state (a reserved job comes back in the state it was reserved
from) and release/bury/kick counters; no deleted job; new ids above every id issued.

Two versions: many examples in-process (Queue + Binlog on real files, restarts by dropping
the listener as SIGKILL would, or closing it), and fewer through real broker processes.
"""
from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_binlog_helpers import Harness, job_snapshot, start_ours

from spark_beanstalk.client import Connection

TUBES = ("default", "t1", "t2")

op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 2), st.integers(0, 3000), st.sampled_from([0, 0, 500]),
              st.integers(0, 300)),
    st.tuples(st.just("delete"), st.integers(0, 10**6)),
    st.tuples(st.just("reserve"), st.integers(0, 10**6)),
    st.tuples(st.just("release"), st.integers(0, 10**6), st.integers(0, 3000), st.sampled_from([0, 500])),
    st.tuples(st.just("bury"), st.integers(0, 10**6), st.integers(0, 3000)),
    st.tuples(st.just("kick"), st.integers(0, 10**6)),
    st.tuples(st.just("restart"), st.booleans()),
)
ops_strategy = st.lists(op, min_size=1, max_size=60)


class Expected:
    """The client's model: id -> [tube, body, state, pri, releases, buries, kicks, logged state, logged pri]."""

    def __init__(self) -> None:
        self.jobs: dict[int, list] = {}
        self.max_id = 0

    def pick(self, k: int, states=None):
        ids = sorted(i for i, j in self.jobs.items() if states is None or j[2] in states)
        return ids[k % len(ids)] if ids else None

    def after_restart(self) -> None:
        for job in self.jobs.values():
            if job[2] == "reserved":
                job[2], job[3] = job[7], job[8]

    def view(self) -> dict:
        return {i: (j[0], j[1], j[2], j[3], j[4], j[5], j[6]) for i, j in self.jobs.items()}


def _apply(model: Expected, step, do) -> None:
    """Run one step through ``do(command, *args) -> reply status`` and update the model."""
    kind = step[0]
    if kind == "put":
        _, t, pri, delay, size = step
        body = bytes([65 + (model.max_id % 26)]) * size
        job_id = do("put", TUBES[t], pri, delay, body)
        assert job_id > model.max_id
        model.max_id = job_id
        state = "delayed" if delay else "ready"
        model.jobs[job_id] = [TUBES[t], body, state, pri, 0, 0, 0, state, pri]
    elif kind == "delete":
        job_id = model.pick(step[1])
        if job_id is not None:
            assert do("delete", job_id) == b"DELETED"
            del model.jobs[job_id]
    elif kind == "reserve":
        job_id = model.pick(step[1], ("ready", "delayed", "buried"))
        if job_id is not None:
            assert do("reserve-job", job_id) == b"RESERVED"
            model.jobs[job_id][2] = "reserved"
    elif kind == "release":
        job_id = model.pick(step[1], ("reserved",))
        if job_id is not None:
            _, _, pri, delay = step
            assert do("release", job_id, pri, delay) == b"RELEASED"
            job = model.jobs[job_id]
            job[2] = job[7] = "delayed" if delay else "ready"
            job[3] = job[8] = pri
            job[4] += 1
    elif kind == "bury":
        job_id = model.pick(step[1], ("reserved",))
        if job_id is not None:
            assert do("bury", job_id, step[2]) == b"BURIED"
            job = model.jobs[job_id]
            job[2] = job[7] = "buried"
            job[3] = job[8] = step[2]
            job[5] += 1
    elif kind == "kick":
        job_id = model.pick(step[1], ("buried", "delayed"))
        if job_id is not None:
            assert do("kick-job", job_id) == b"KICKED"
            job = model.jobs[job_id]
            job[2] = job[7] = "ready"
            job[6] += 1


# ---------------------------------------------------------------- in-process, many examples
def _harness_do(h: Harness):
    def do(cmd, *args):
        if cmd == "put":
            tube, pri, delay, body = args
            return h.put(body, pri=pri, delay=delay, tube=tube)
        method = {"reserve-job": "reserve_job", "kick-job": "kick_job"}.get(cmd, cmd)
        return h.do(method, *args).split(b" ")[0].rstrip(b"\r\n")
    return do


def _harness_view(h: Harness) -> dict:
    return {i: (s[1], s[3], s[0], s[2], s[4], s[5], s[6]) for i, s in h.state().items()}


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy, final_kill=st.booleans())
def test_recovered_state_matches_model_in_process(ops, final_kill):
    d = tempfile.mkdtemp(prefix="binlog-prop-")
    try:
        h = Harness(d, segment_size=2048)
        model = Expected()
        for step in ops:
            if step[0] == "restart":
                h.crash() if step[1] else h.close()
                h = h.reopen()
                model.after_restart()
                assert _harness_view(h) == model.view()
            else:
                _apply(model, step, _harness_do(h))
        h.crash() if final_kill else h.close()
        h = h.reopen()
        model.after_restart()
        assert _harness_view(h) == model.view()
        assert h.put(b"after") > model.max_id
        h.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- real broker processes
def _conn_do(conn: Connection, state: dict):
    def do(cmd, *args):
        if cmd == "put":
            tube, pri, delay, body = args
            if state.get("use") != tube:
                conn.use(tube)
                state["use"] = tube
            return conn.put(body, priority=pri, delay=delay, ttr=1000)
        line = " ".join([cmd, *map(str, args)])
        return conn.call(line).status
    return do


def _process_view(conn: Connection, model: Expected) -> dict:
    snap = job_snapshot(conn, range(1, model.max_id + 2))
    return {i: (s["tube"], s["body"], s["state"], s["pri"], s["releases"], s["buries"], s["kicks"])
            for i, s in snap.items() if s is not None}


@pytest.mark.timeout(150)
@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op.filter(lambda s: s[0] != "restart"), min_size=5, max_size=60), kill=st.booleans())
def test_recovered_state_matches_model_real_broker(ops, kill):
    d = tempfile.mkdtemp(prefix="binlog-prop-proc-")
    proc = None
    try:
        proc = start_ours(d, "-f", "0", "-s", "2048")
        model = Expected()
        with Connection(proc.host, proc.port) as conn:
            do = _conn_do(conn, {})
            for step in ops:
                _apply(model, step, do)
        proc.kill() if kill else proc.stop()
        proc = start_ours(d, "-f", "0", "-s", "2048")
        model.after_restart()
        with Connection(proc.host, proc.port) as conn:
            assert _process_view(conn, model) == model.view()
            assert conn.put(b"after") > model.max_id
    finally:
        if proc is not None:
            proc.kill()
        shutil.rmtree(d, ignore_errors=True)
