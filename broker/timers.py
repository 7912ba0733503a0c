"""One heap of deadlines for everything that happens at a time.

Delayed jobs becoming ready, a connection's soonest TTR deadline, blocked reserves timing
out or entering DEADLINE_SOON, paused tubes resuming: all are entries here, not a task
or timer handle each. Entries are never removed when their owner changes its mind;
instead each entry carries the deadline it was pushed with and the owner says, when
the entry comes due, whether that deadline is still current (lazy invalidation). The
heap is rebuilt when stale entries outnumber live ones, so churn (touch in a loop)
cannot grow it without bound.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Final

from broker.model import heappop, heappush

NEVER: Final = 4611686018427387904  # 1 << 62 (a literal: mypyc compiles Final literals in)

# Entry kinds; the queue decides what each means.
DELAYED_READY: Final = 0
TTR_EXPIRY: Final = 1
CLIENT_TICK: Final = 2
TUBE_UNPAUSE: Final = 3


class TimerHeap:
    """A min-heap of (when_ns, seq, kind, owner) with lazy invalidation."""

    __slots__ = ("_heap", "_is_current", "_seq", "earliest_pushed")

    def __init__(self, is_current: Callable[[int, int, object], bool]) -> None:
        self._heap: list[tuple[int, int, int, object]] = []
        self._seq = 0
        self._is_current = is_current
        # The earliest deadline pushed since the owner last looked (NEVER: none). A new TTR is
        # rarely the earliest deadline, so the owner can usually skip re-examining the heap.
        self.earliest_pushed = NEVER

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, when: int, kind: int, owner: object) -> None:
        self._seq += 1
        heappush(self._heap, (when, self._seq, kind, owner))
        self.earliest_pushed = min(self.earliest_pushed, when)

    def next_deadline(self) -> int | None:
        """The earliest live deadline, dropping stale entries on the way."""
        heap = self._heap
        is_current = self._is_current
        while heap:
            when, _, kind, owner = heap[0]
            if is_current(when, kind, owner):
                return when
            heappop(heap)
        return None

    def pop_due(self, now: int) -> Iterator[tuple[int, int, object]]:
        """Yield (when, kind, owner) for every live entry due at or before now, earliest first."""
        heap = self._heap
        is_current = self._is_current
        while heap and heap[0][0] <= now:
            when, _, kind, owner = heappop(heap)
            if is_current(when, kind, owner):
                yield when, kind, owner

    def compact(self, live_estimate: int) -> None:
        """Drop stale entries when they dominate (called now and then by the owner)."""
        if len(self._heap) > 2 * live_estimate + 1024:
            self.prune()

    def prune(self) -> None:
        """Drop every stale entry now, and what it held (a closed client, a tube, a deleted delayed job's id)."""
        is_current = self._is_current
        self._heap = [e for e in self._heap if is_current(e[0], e[2], e[3])]
        heapq.heapify(self._heap)
