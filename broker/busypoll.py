"""Busy polling: after a client's command, look for the next one for a few microseconds
instead of going to sleep.

Why: with one client sending one command at a time, most of a round trip is not work but
waking up. A server asleep in ``epoll_wait`` is woken by an interrupt and a trip through
the scheduler (on a VM an inter-processor interrupt, tens of microseconds); a server still
polling sees the command at once. Measured on a 2-core VM: a put round trip fell from ~80
to ~25 us (see bench/README.md, "Busy polling").

How: while a poll is on, one callback keeps itself scheduled with ``call_soon``, so every
loop iteration polls the sockets with a zero timeout instead of blocking. It ends when no
command has come for ``window_ns``. Each idle turn gives the CPU away (``sched_yield``)
if another task of this machine is waiting for it, so a poll never holds a core that a
client on the same machine needs.

What it costs, and the guards: a poll that ends without a command is wasted CPU. After
such a miss, the next polls are skipped: 1, then 3, 7... up to 1,023 commands after
consecutive misses, so a server whose clients pause longer than the window stops
polling almost at once; one poll that catches a command resets this. A poll whose
``sched_yield`` comes back late (another process had the CPU) ends at once and counts as a
miss: a polling process is runnable, so a command cannot wake it ahead of a CPU-bound
neighbour, while a sleeping one is woken at once. When the last client connection closes, a poll on
ends at its next turn: no command can come until a new connection wakes the loop anyway. A broker with
``--busy-poll-us 0`` never polls (beanstalkd's behaviour).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Final

# 100, not 50: the gap a client in a tight loop leaves is its own wake-up plus the reply's trip, ~40-60 us
# on a 2-core VM, and 50 us caught it only some of the time (1 x 1 rows of 12-38k round trips a second
# from one repetition to the next, 37-39k every time at 100; bench/README.md, "The lane, tightened, and
# the busy-poll window").
DEFAULT_WINDOW_US: Final = 100
MAX_WINDOW_US: Final = 10_000
_MAX_BACKOFF: Final = 10  # at most 2**10 - 1 commands without a poll after misses in a row
# A sched_yield that comes back later than this gave the CPU to another process for a while (a
# scheduler slice is ~1-3 ms): longer than a client on the same CPU takes to send its next
# command and block again (tens of us), far shorter than a CPU-bound process's turn.
AWAY_LIMIT_NS: Final = 200_000


class BusyPoll:
    """One per server, shared by its client connections (the loop is one thread)."""

    __slots__ = ("caught", "clock", "contended", "deadline", "fresh", "hit", "loop", "misses", "polls", "since",
                 "skip", "spinning", "spun_ns", "window_ns", "yield_cpu")

    def __init__(self, window_us: int, loop: asyncio.AbstractEventLoop, clock: Callable[[], int],
                 yield_cpu: Callable[[], None] = os.sched_yield) -> None:
        if not 0 < window_us <= MAX_WINDOW_US:
            raise ValueError(f"busy-poll window must be 1..{MAX_WINDOW_US} us, not {window_us}")
        self.window_ns = window_us * 1000
        self.clock = clock
        self.yield_cpu = yield_cpu
        self.loop = loop
        self.spinning = False  # a poll is on: its callback is scheduled
        self.fresh = False  # a command came since the callback last ran
        self.hit = False  # this poll has caught a command
        self.deadline = 0  # the poll ends at this clock reading unless a command comes
        self.since = 0  # when the callback last ran
        self.misses = 0  # polls in a row that caught nothing
        self.skip = 0  # commands to let pass without starting a poll (after misses)
        # For /metrics and the tests: polls started, polls that caught a command, polls ended
        # because another process wanted this CPU, and the nanoseconds spent polling with nothing to do.
        self.polls = 0
        self.caught = 0
        self.contended = 0
        self.spun_ns = 0

    def note_input(self) -> None:
        """A client's command arrived: keep the poll on, or start one (unless backing off)."""
        if self.spinning:
            self.fresh = True
        elif self.skip:
            self.skip -= 1
        else:
            self.start()

    def start(self) -> None:
        now = self.clock()
        self.spinning = True
        self.fresh = False
        self.hit = False
        self.since = now
        self.deadline = now + self.window_ns
        self.polls += 1
        self.loop.call_soon(self.turn)

    def turn(self) -> None:
        """One loop iteration of a poll: the loop has just polled the sockets without blocking."""
        now = self.clock()
        if self.fresh:
            self.fresh = False
            self.hit = True
            self.deadline = now + self.window_ns
        else:
            self.spun_ns += now - self.since
            if now >= self.deadline:
                self.end(self.hit)
                return
            self.yield_cpu()
            if self.clock() - now > AWAY_LIMIT_NS:
                # Another process ran on this CPU in the meantime. Polling on would make this
                # broker a runnable task that commands cannot wake, only wait behind that one
                # (measured: a co-located CPU-bound process cut one client from 10.8k round
                # trips a second to 0.3k): sleep, so that the next command wakes us.
                self.contended += 1
                self.end(False)
                return
        self.since = now
        self.loop.call_soon(self.turn)

    def replied(self) -> None:
        """Held replies just left (group commit, broker.state): the window counts from now, as it
        does from a reply written at once, so the time spent holding does not shorten it."""
        if self.spinning:
            self.deadline = self.clock() + self.window_ns

    def no_clients(self) -> None:
        """The last client connection closed: no command can come on one, so a poll on ends at its next turn
        instead of spinning out its window. A producer that connects per job (send, close) left every poll
        spinning a window after its close; the next connection wakes the loop as any would."""
        if self.spinning:
            self.hit = self.hit or self.fresh  # a command noted in this turn still counts as caught
            self.fresh = False
            self.deadline = 0

    def caught_total(self) -> int:
        """Polls that caught a command, the one still on included."""
        return self.caught + (1 if self.spinning and self.hit else 0)

    def end(self, hit: bool) -> None:
        """Sleep again. A poll that caught nothing (or was crowded out) is a miss: skip the next polls."""
        self.spinning = False
        if hit:
            self.caught += 1
            self.misses = 0
        else:
            self.misses = misses = min(self.misses + 1, _MAX_BACKOFF)
            self.skip = (1 << misses) - 1
