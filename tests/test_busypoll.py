"""Busy polling after a command (``--busy-poll-us``, broker/busypoll.py).

In-process, over a loop stand-in and a clock the test moves: when a poll starts, goes on,
ends, and how it backs off after polls that caught nothing or lost the CPU to another
process. Then real broker processes: a client that sends one command at a time is caught
by the poll, a client slower than the window turns polling off almost at once, a CPU-bound
process beside the broker does not make polling hurt, and ``--busy-poll-us 0`` never polls.
"""
from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.busypoll import AWAY_LIMIT_NS, MAX_WINDOW_US, BusyPoll
from tests.helpers import broker_process, free_port, sample, scrape, wait_for_port


class FakeLoop:
    """call_soon recorded; ``turn()`` runs what one loop iteration would."""

    def __init__(self) -> None:
        self.soon: list[Callable[[], None]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.soon.append(callback)

    def turn(self) -> None:
        callbacks, self.soon = self.soon, []
        for callback in callbacks:
            callback()


class Rig:
    def __init__(self, window_us: int = 50) -> None:
        self.now = 1_000_000
        self.yields = 0
        self.away_ns = 0  # how long a sched_yield gives the CPU away (another process runs)
        self.loop = FakeLoop()
        self.poll = BusyPoll(window_us, self.loop, lambda: self.now, self._yield)  # type: ignore[arg-type]

    def _yield(self) -> None:
        self.yields += 1
        self.now += self.away_ns

    def idle_until_end(self, step_us: int = 10) -> int:
        """Loop iterations with no input until the poll ends; how many ran."""
        turns = 0
        while self.poll.spinning:
            self.now += step_us * 1000
            self.loop.turn()
            turns += 1
            assert turns < 10_000
        return turns


def test_a_command_starts_a_poll_that_ends_a_window_after_the_last_command() -> None:
    rig = Rig(window_us=50)
    poll = rig.poll
    poll.note_input()
    assert poll.spinning and poll.polls == 1 and len(rig.loop.soon) == 1
    # commands keep coming 30 us apart: the poll goes on, each one pushes the deadline
    for _ in range(5):
        rig.now += 30_000
        poll.note_input()
        rig.loop.turn()
        assert poll.spinning
    assert poll.polls == 1 and poll.caught_total() == 1
    turns = rig.idle_until_end(step_us=10)
    assert turns == 5  # 50 us of idle turns, 10 us each
    assert rig.yields == 4  # every idle turn but the last gives the CPU away
    assert poll.caught == 1 and poll.misses == 0 and poll.skip == 0
    assert poll.spun_ns == 50_000
    assert rig.loop.soon == []  # nothing left scheduled: the loop may sleep



def test_the_window_counts_from_when_held_replies_leave() -> None:
    """With a binlog, replies wait for the end of the loop iteration (group commit): the time
    they were held must not eat into the window the client has to send its next command."""
    rig = Rig(window_us=50)
    poll = rig.poll
    poll.note_input()
    rig.now += 40_000  # the held reply leaves 40 us after the command came (the binlog's write)
    poll.replied()
    rig.now += 30_000  # 70 us after the command, 30 us after its reply
    rig.loop.turn()
    assert poll.spinning, "the poll ended 50 us after the command, 10 us after its reply"
    assert rig.idle_until_end(step_us=10) == 2  # the window ends 50 us after the reply
    poll.replied()  # no poll on: nothing happens
    assert not poll.spinning and rig.loop.soon == []

def test_a_poll_ends_at_its_next_turn_once_no_client_is_left() -> None:
    """The last client connection closed (a producer that connects per job): nothing can send the
    next command, so the poll stops at its next turn instead of spinning out its window."""
    rig = Rig(window_us=1000)
    poll = rig.poll
    poll.no_clients()  # no poll on: nothing happens
    assert not poll.spinning and rig.loop.soon == []
    poll.note_input()  # the client's `use`
    rig.now += 30_000
    poll.note_input()  # its `put`, caught by the poll
    rig.loop.turn()
    poll.no_clients()  # then it hangs up
    rig.now += 10_000
    rig.loop.turn()
    assert not poll.spinning and rig.loop.soon == []  # one more turn, not the 1 ms window
    assert poll.caught == 1 and poll.misses == 0 and poll.skip == 0  # it caught the put: no back-off
    assert poll.spun_ns == 10_000
    # a command noted in the very turn the last client left still counts as caught
    poll.note_input()
    poll.note_input()
    poll.no_clients()
    rig.now += 10_000
    rig.loop.turn()
    assert not poll.spinning and poll.caught == 2 and rig.loop.soon == []


def test_polls_that_catch_nothing_back_off_exponentially_and_one_catch_resets() -> None:
    rig = Rig(window_us=50)
    poll = rig.poll
    started: list[int] = []
    for command in range(3000):
        before = poll.polls
        poll.note_input()
        if poll.polls > before:
            started.append(command)
        rig.idle_until_end()
    # a poll after command 0, then after skipping 1, 3, 7, ... commands, capped at 1,023
    assert started[:8] == [0, 2, 6, 14, 30, 62, 126, 254]
    gaps = [b - a for a, b in zip(started, started[1:], strict=False)]
    assert max(gaps) == 1024 and gaps[-1] == 1024
    assert poll.caught == 0 and len(started) == poll.polls <= 13
    # the next poll catches a command: polling is back at full rate
    while not poll.spinning:
        poll.note_input()
    rig.now += 20_000
    poll.note_input()
    rig.loop.turn()
    rig.idle_until_end()
    assert poll.caught == 1 and poll.misses == 0 and poll.skip == 0
    poll.note_input()
    assert poll.spinning


def test_a_poll_that_gives_the_cpu_to_another_process_ends_and_backs_off() -> None:
    rig = Rig(window_us=50)
    poll = rig.poll
    rig.away_ns = 30_000  # a client on the same CPU sends its next command and blocks: not contention
    poll.note_input()
    rig.now += 5_000
    rig.loop.turn()
    assert poll.spinning and poll.contended == 0
    poll.note_input()
    rig.loop.turn()
    rig.away_ns = AWAY_LIMIT_NS + 1_000  # a CPU-bound neighbour ran for a slice
    rig.now += 5_000
    rig.loop.turn()
    # it ends at once as a miss, though it had caught a command, so polling backs off
    assert not poll.spinning and poll.contended == 1
    assert poll.caught == 0 and poll.misses == 1 and poll.skip == 1
    assert rig.loop.soon == []


def test_the_window_is_checked() -> None:
    for bad in (0, -1, MAX_WINDOW_US + 1):
        with pytest.raises(ValueError, match="busy-poll window"):
            BusyPoll(bad, FakeLoop(), lambda: 0)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------
# real broker processes
# ----------------------------------------------------------------------------------------
@pytest.fixture
def polled_broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A broker with /metrics and the given extra flags ("{binlog}": a fresh directory); yields a
    connected client socket and the HTTP address."""
    http = f"127.0.0.1:{free_port()}"
    flags = [str(tmp_path / "binlog") if flag == "{binlog}" else flag for flag in getattr(request, "param", [])]
    proc = broker_process(extra_args=["--http", http, *flags]).start()
    try:
        wait_for_port("127.0.0.1", int(http.rsplit(":", 1)[1]), 10, proc.proc)
        with socket.create_connection((proc.host, proc.port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            yield sock, http
    finally:
        proc.stop()


def _put(sock: socket.socket) -> None:
    sock.sendall(b"put 0 0 60 1\r\nx\r\n")
    reply = b""
    while not reply.endswith(b"\r\n"):
        chunk = sock.recv(64)
        assert chunk, "the broker hung up"
        reply += chunk
    assert reply.startswith(b"INSERTED "), reply


def _poll_counts(http: str) -> tuple[float | None, float | None, float | None]:
    """Polls started, polls that caught a command, seconds spent polling idle (None: no poll)."""
    _, samples = scrape(http)
    return (sample(samples, "beanstalk_busy_polls_total"), sample(samples, "beanstalk_busy_polls_caught_total"),
            sample(samples, "beanstalk_busy_poll_idle_seconds_total"))


@pytest.mark.parametrize("polled_broker", [["--busy-poll-us", "1000"]], indirect=True)
def test_a_client_sending_one_command_at_a_time_is_caught_by_the_poll(polled_broker) -> None:
    # a 1 ms window: this Python client answers each reply in ~40 us on a quiet machine
    sock, http = polled_broker
    for _ in range(3000):
        _put(sock)
    polls, caught, idle = _poll_counts(http)
    assert polls is not None and caught is not None and idle is not None, "no busy-poll metrics"
    _, samples = scrape(http)
    contended = sample(samples, "beanstalk_busy_polls_contended_total")
    assert polls >= 1 and contended is not None
    # polls catch commands and go on across many of them. On a machine whose other CPU-bound
    # processes take the broker's core (CI running tests beside it), polls are crowded out
    # instead and back off, which is right: then none may catch anything.
    assert caught >= 1 or contended >= 1, f"{polls} polls caught nothing and none was crowded out"
    assert polls < 1500, f"{polls} polls for 3000 commands: the poll neither carried over nor backed off"


def test_a_client_slower_than_the_window_turns_polling_off(polled_broker) -> None:
    sock, http = polled_broker
    for _ in range(300):
        _put(sock)
        time.sleep(0.002)  # the traffic under test: a command every ~2 ms, 40x the window
    polls, caught, idle = _poll_counts(http)
    assert polls is not None and caught is not None and idle is not None
    # polls after command 0, 2, 6, ..., 254: eight (more if the machine stalls the broker
    # for 2 ms mid-poll, and a catch resets the back-off), where a poll per command is 300
    assert polls <= 30, f"{polls} polls: polling did not back off"
    assert caught <= 5
    assert idle < 0.05


@pytest.mark.parametrize("polled_broker", [["--busy-poll-us", "1000"]], indirect=True)
def test_a_producer_that_connects_per_job_leaves_no_poll_spinning(polled_broker) -> None:
    """Connect, `use`, `put`, close, each after the last has closed. The poll that catches the put
    (so no back-off) spun its whole 1 ms window after the client hung up; now it stops at the close."""
    sock, http = polled_broker
    host, port = sock.getpeername()
    sock.close()  # the fixture's own connection: none may stay open, or the others' closes are not the last
    # 200 producers; more while fewer than 20 polls caught their put (a loaded machine makes the client
    # slower than the window, and a poll that catches nothing rightly spins it out)
    deadline = time.monotonic() + 10
    for count in itertools.count(1):
        with socket.create_connection((host, port), timeout=10) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(b"use default\r\n")
            assert conn.recv(64) == b"USING default\r\n"
            _put(conn)
        time.sleep(0.003)  # the next producer comes later than the window
        if count >= 200 and count % 50 == 0 and (time.monotonic() > deadline
                                                 or (_poll_counts(http)[1] or 0) >= 20):
            break
    polls, caught, idle = _poll_counts(http)
    assert polls is not None and caught is not None and idle is not None
    # A poll that caught nothing spins its window (up to 1.5 ms with a late turn); one that caught the
    # put spun a window after the close without the stop, and stops at once with it (0.4 ms allowed).
    allowed = (polls - caught) * 0.0015 + caught * 0.0004
    assert idle < allowed, f"{polls} polls ({caught} caught a command) spun {idle:.3f} s idle"


@pytest.mark.parametrize("polled_broker", [["--busy-poll-us", "0"]], indirect=True)
def test_busy_poll_us_0_never_polls(polled_broker) -> None:
    sock, http = polled_broker
    for _ in range(100):
        _put(sock)
    assert _poll_counts(http) == (None, None, None)


@pytest.mark.parametrize("polled_broker", [["-b", "{binlog}", "-f", "0"], ["-b", "{binlog}", "-f", "50"]],
                         indirect=True, ids=["f0", "f50"])
def test_a_binlog_that_fsyncs_every_reply_turns_polling_off(polled_broker, request) -> None:
    """-f 0: a round trip takes an fsync, longer than any window, and polling through it cost
    throughput (bench/README.md, "Group writes"). Other -f modes poll as without a binlog."""
    sock, http = polled_broker
    for _ in range(100):
        _put(sock)
    polls = _poll_counts(http)[0]
    if request.node.callspec.id == "f0":
        assert polls is None, f"{polls} polls with -f 0"
    else:
        assert polls is not None and polls >= 1, "no poll with -f 50"


def _round_trips_beside_a_cpu_hog(extra_args: list[str], seconds: float = 1.5) -> tuple[float, float | None]:
    """Broker and a CPU-bound process pinned to CPU 0, this client on CPU 1 (if there is one):
    put round trips a second, and the broker's contended-poll count (None: it does not poll)."""
    http = f"127.0.0.1:{free_port()}"
    proc = broker_process(extra_args=["--http", http, *extra_args]).start()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    mine = os.sched_getaffinity(0)
    try:
        wait_for_port("127.0.0.1", int(http.rsplit(":", 1)[1]), 10, proc.proc)
        os.sched_setaffinity(proc.pid, {0})
        os.sched_setaffinity(hog.pid, {0})
        os.sched_setaffinity(0, {1} if os.cpu_count() and os.cpu_count() > 1 else {0})  # type: ignore[operator]
        with socket.create_connection((proc.host, proc.port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            done = 0
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                _put(sock)
                done += 1
        _, samples = scrape(http)
        return done / seconds, sample(samples, "beanstalk_busy_polls_contended_total")
    finally:
        os.sched_setaffinity(0, mine)
        hog.kill()
        hog.wait()
        proc.stop()


def test_polling_gives_way_to_a_cpu_bound_process_on_the_same_cpu() -> None:
    """A polling broker is always runnable, so a command cannot wake it ahead of a CPU-bound
    neighbour: without the contention check one client fell from ~10.8k round trips a second
    to ~0.3k beside such a process. With it, polling ends when sched_yield comes back late."""
    without, _ = _round_trips_beside_a_cpu_hog(["--busy-poll-us", "0"])
    with_poll, contended = _round_trips_beside_a_cpu_hog([])
    assert with_poll >= 0.4 * without, f"{with_poll:.0f}/s polling against {without:.0f}/s not polling"
    assert contended is not None and contended >= 1
