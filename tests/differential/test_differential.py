"""Each test runs one scripted exchange against real beanstalkd 1.12 and against our broker
(two processes, side by side) and fails with a per-step diff when the bytes differ.

Cases marked ``fresh`` get a new pair of servers; the rest share one pair per module and
stay out of each other's way with per-case tube names (job ids are then renamed #1, #2...
in order of first appearance, which is legitimate because both servers number jobs in
order). Set SPARK_BEANSTALK_DIFF_CANDIDATE=beanstalkd to validate the harness itself
against a second beanstalkd.

The scripted cases live in cases_*.py (each module's docstring lists what real
beanstalkd 1.12 was found to do where the protocol document is silent or differs);
test_random_scripts adds hypothesis-generated scripts of one-reply commands.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_beanstalk.embedded import start_server

from . import (
    cases_basic,
    cases_edge,
    cases_errors,
    cases_framing,
    cases_lifecycle,
    cases_multi,
    cases_order,
    cases_stats,
)
from .harness import case as _case
from .harness import diff_report, run_pair, transcript_text
from .harness import send as _send

CASES = [
    *cases_basic.CASES,
    *cases_errors.CASES,
    *cases_framing.CASES,
    *cases_lifecycle.CASES,
    *cases_multi.CASES,
    *cases_stats.CASES,
    *cases_edge.CASES,
    *cases_order.CASES,
]
CANDIDATE = os.environ.get("SPARK_BEANSTALK_DIFF_CANDIDATE", "ours")

_names = [c.name for c in CASES]
assert len(_names) == len(set(_names)), "duplicate case names"


def _server_args(args, tmp_path_factory):
    """Each server gets its own directory where a case's arguments say {dir} (binlog)."""
    if not any("{dir}" in a for a in args):
        return list(args)
    d = str(tmp_path_factory.mktemp("binlog"))
    return [a.replace("{dir}", d) for a in args]


def _start_pair(args=(), tmp_path_factory=None):
    ref_args, cand_args = _server_args(args, tmp_path_factory), _server_args(args, tmp_path_factory)
    with ThreadPoolExecutor(max_workers=2) as pool:
        ref = pool.submit(start_server, "beanstalkd", extra_args=ref_args)
        cand = pool.submit(start_server, CANDIDATE, extra_args=cand_args)
        procs = []
        try:
            for f in (ref, cand):
                procs.append(f.result())
        except BaseException:
            for p in procs:
                p.stop()
            raise
    return procs[0], procs[1]


@pytest.fixture(scope="module")
def shared_pair():
    ref, cand = _start_pair()
    yield ref, cand
    ref.stop()
    cand.stop()


class _FreshPairs:
    """Starts the server pair of the next selected fresh case in the background while the
    current case runs (our broker takes a few hundred ms to start)."""

    def __init__(self, order: list, tmp_path_factory) -> None:
        self.order = order
        self.tmp = tmp_path_factory
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.stopper = ThreadPoolExecutor(max_workers=2)
        self.pending: dict = {}

    def take(self, case):
        future = self.pending.pop(case.name, None)
        if case in self.order:
            i = self.order.index(case)
            if i + 1 < len(self.order):
                nxt = self.order[i + 1]
                if nxt.name not in self.pending:
                    self.pending[nxt.name] = self.pool.submit(_start_pair, nxt.args, self.tmp)
        return future.result() if future is not None else _start_pair(case.args, self.tmp)

    def release(self, *procs) -> None:
        """Stop servers in the background (a clean stop may take a while)."""
        for proc in procs:
            self.stopper.submit(proc.stop)

    def close(self) -> None:
        self.stopper.shutdown(wait=True)
        for future in self.pending.values():
            try:
                for proc in future.result():
                    proc.stop()
            except Exception:
                pass
        self.pool.shutdown()


@pytest.fixture(scope="module")
def fresh_pairs(request, tmp_path_factory):
    selected = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        c = callspec.params.get("case") if callspec else None
        if c is not None and getattr(c, "fresh", False):
            selected.append(c)
    # The base directory is made on first use, and under xdist that first use empties it: made
    # here, before the prefetch thread's mktemp, two threads cannot race on it (a case then found
    # its binlog directory gone: the flaky binlog_restart_* cases).
    tmp_path_factory.getbasetemp()
    pairs = _FreshPairs(selected, tmp_path_factory)
    yield pairs
    pairs.close()


def test_case_count():
    assert len(CASES) >= 170


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=_names)
def test_differential(case, shared_pair, fresh_pairs):
    if case.fresh:
        ref, cand = fresh_pairs.take(case)
        try:
            ref_tr, cand_tr = run_pair(case, ref, cand, rename_ids=False)
        finally:
            fresh_pairs.release(ref, cand)
    else:
        ref, cand = shared_pair
        ref_tr, cand_tr = run_pair(case, ref, cand, rename_ids=True)

    # The script's own expectations must hold on the reference, or the case is wrong.
    problems = ref_tr.problems()
    assert not problems, (
        f"case {case.name} does not hold on beanstalkd 1.12 itself (fix the case):\n" + transcript_text(ref_tr))

    report = diff_report(case, ref_tr, cand_tr, CANDIDATE)
    if report:
        pytest.fail(report + "\n\nfull beanstalkd transcript:\n" + transcript_text(ref_tr), pytrace=False)


# -- the harness itself (no servers) -------------------------------------------------------
def test_harness_normalises_only_volatile_values():
    from .harness import IdBook, normalise_reply

    body = b"---\nid: 7\ntube: x\nstate: ready\npri: 1\nage: 3\ndelay: 0\nttr: 5\ntime-left: 0\n"
    reply = b"OK %d\r\n%s\r\n" % (len(body), body)
    book = IdBook()
    out = normalise_reply(b"INSERTED 7\r\n", book, rename_ids=True)
    assert out == b"INSERTED #1\r\n"
    out = normalise_reply(reply, book, rename_ids=True)
    assert out.startswith(b"OK <bytes>\r\n---\nid: #1\ntube: x\nstate: ready\npri: 1\nage: <age>\n")
    wrong = b"OK %d\r\n%s\r\n" % (len(body) - 1, body[:-1] + b"xx")
    assert b"OK <bytes WRONG" in normalise_reply(wrong, IdBook(), rename_ids=True)  # a count that lies is shown
    lying = b"OK 5\r\n" + body[:5] + b"\r\n"
    assert normalise_reply(lying, IdBook(), rename_ids=True) == lying  # no volatile key: compared as is
    stats = b"---\npid: 12\ncmd-put: 3\nversion: \"1.12\"\n"
    out = normalise_reply(b"OK %d\r\n%s\r\n" % (len(stats), stats), IdBook(), rename_ids=False)
    assert out == b"OK <bytes>\r\n---\npid: <pid>\ncmd-put: 3\nversion: <version>\n\r\n"


def test_harness_reports_a_one_byte_difference():
    from .harness import Record, Transcript, case, diff_report, send

    c = case("demo", send("c1", b"list-tube-used\r\n"))
    ref = Transcript([Record(0, "c1 send", b"USING default\r\n")])
    same = Transcript([Record(0, "c1 send", b"USING default\r\n")])
    other = Transcript([Record(0, "c1 send", b"USING defaulT\r\n")])
    assert diff_report(c, ref, same, "ours") is None
    report = diff_report(c, ref, other, "ours")
    assert report and "USING default" in report and "step 0" in report


# -- random scripts: model-free differential testing ---------------------------------------
_JOB = st.sampled_from([b"{j1}", b"{j2}", b"{j3}", b"{j4}", b"{j5}"])
_TUBE = st.sampled_from([b"{t}", b"{t}-b"])
_PRI = st.sampled_from([b"0", b"1", b"1023", b"1024", b"4294967295"])


@st.composite
def _command(draw) -> bytes:
    """One command that gets exactly one reply and never waits on a clock."""
    kind = draw(st.sampled_from([
        "put", "put", "put", "reserve", "reserve", "reserve-job", "delete", "release", "bury", "touch",
        "kick", "kick-job", "peek", "peek-ready", "peek-delayed", "peek-buried", "stats-job", "stats-tube",
        "use", "watch", "ignore", "list-tube-used", "list-tubes-watched", "pause-tube", "bad",
    ]))
    if kind == "put":
        body = draw(st.binary(max_size=12))
        delay = draw(st.sampled_from([b"0", b"0", b"100"]))
        ttr = draw(st.sampled_from([b"0", b"60", b"4294967295"]))  # 0 means 1 s, but nothing here waits that long
        return b"put %s %s %s %d\r\n%s\r\n" % (draw(_PRI), delay, ttr, len(body), body)
    if kind == "reserve":
        return b"reserve-with-timeout 0\r\n"
    if kind in ("reserve-job", "delete", "touch", "kick-job", "peek", "stats-job"):
        return b"%s %s\r\n" % (kind.encode(), draw(_JOB))
    if kind == "release":
        return b"release %s %s %s\r\n" % (draw(_JOB), draw(_PRI), draw(st.sampled_from([b"0", b"100"])))
    if kind == "bury":
        return b"bury %s %s\r\n" % (draw(_JOB), draw(_PRI))
    if kind == "kick":
        return b"kick %d\r\n" % draw(st.integers(min_value=0, max_value=3))
    if kind in ("stats-tube", "use", "watch"):
        return b"%s %s\r\n" % (kind.encode(), draw(_TUBE))
    if kind == "ignore":
        return b"ignore %s\r\n" % draw(st.sampled_from([b"{t}", b"{t}-b", b"default"]))
    if kind == "pause-tube":
        return b"pause-tube %s %s\r\n" % (draw(_TUBE), draw(st.sampled_from([b"0", b"100"])))
    if kind == "bad":
        return draw(st.sampled_from([
            b"delete x\r\n", b"kick\r\n", b"use -x\r\n", b"\r\n", b"bury {j1}\r\n", b"peek-ready \r\n",
            b"release {j1} 0 4294967296\r\n", b"touch -1\r\n", b"stats-tube\r\n",
        ]))
    return kind.encode() + b"\r\n"


_counter = iter(range(10**9))


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(script=st.lists(st.tuples(st.sampled_from(["c1", "c2"]), st.lists(_command(), min_size=1, max_size=4)),
                       min_size=1, max_size=12))
def test_random_scripts(shared_pair, script):
    """Random sequences of one-reply commands (pipelined in random groups) on two
    connections give byte-identical replies on both servers."""
    ref, cand = shared_pair
    steps = [_send("c1", b"use {t}\r\nwatch {t}\r\nignore default\r\n", n=3),
             _send("c2", b"use {t}\r\nwatch {t}-b\r\nignore default\r\n", n=3)]
    steps += [_send(conn, b"".join(cmds), n=len(cmds)) for conn, cmds in script]
    c = _case(f"random-{next(_counter)}", *steps)
    ref_tr, cand_tr = run_pair(c, ref, cand, rename_ids=True)
    assert not ref_tr.problems(), "generator produced a script beanstalkd does not answer as expected:\n" + \
        transcript_text(ref_tr)
    report = diff_report(c, ref_tr, cand_tr, CANDIDATE)
    assert report is None, report + "\n\nfull beanstalkd transcript:\n" + transcript_text(ref_tr)
