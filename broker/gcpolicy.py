"""The broker's policy for CPython's cyclic collector: short pauses, and each held job visited once at most.

Why: a broker holds up to millions of long-lived, acyclic job objects, and the collector tracks every one.
With CPython's default thresholds it re-scans them again and again while a queue fills. The queue breaks
its own reference cycles when connections and tubes go away, so the collector has little to find; what it
costs is visiting. So:

* what exists at start is frozen out of every scan (``gc.freeze``);
* young collections come in small steps (``GC_YOUNG``), small enough that the jobs they visit are still in
  the core's cache: at the 20,000 of before, a young collection walked ~6 MB of jobs a put row had left
  behind since the last one, and a put missed the L2 cache 16-24 more times than it does now (a 512 KiB L2;
  bench/README.md, "The collector visits each job while it is in the cache");
* what survives a collection is frozen as soon as it ends (a list splice, not a walk), so a job is visited
  by one young collection instead of two (the middle generation's, which then finds nothing);
* while young collections find no garbage, most of them visit nothing: after ``CLEAN_BEFORE_SKIP`` visits
  in a row that found none, the young generation is frozen at the *start* of the next 1, 2, 4... up to
  ``MAX_SKIP`` collections, and one visits between spans; the first that finds a cycle ends the skipping.
  A queue that only holds jobs drops no cycles, and a visit cost an interpreted put ~700 instructions and
  ~16 first-level cache misses (a compiled one ~250 instructions), its job's 12 slots walked twice. With a
  dashboard scraped back to back, which does drop cycles, nearly every young collection still visits
  (bench/gc_garbage.py);
* frozen objects are freed by reference counting like any other: only a reference cycle that outlived a
  young collection, or was dropped in a skipped span, waits, for the full collection that comes every
  ``FULL_EVERY`` allocations (~100 million: as rare as the oldest generation's collection was before). It
  unfreezes everything, collects, and freezes again; the loop looks whether one is due every ``FULL_CHECK_S``.
"""
from __future__ import annotations

import asyncio
import gc
from typing import Any, Final

# 400 puts of 100 bytes leave ~100 KB of jobs and bodies: a young collection finds them in a 512 KiB L2, even
# beside 500 connections' state. A collection costs ~6,000 instructions of its own, ~15 a put at this size
# (1,000 left a put at 500 connections ~2 more L2 misses for ~9 fewer instructions).
GC_YOUNG: Final = 400
GC_MIDDLE: Final = 2  # the middle generation is empty after every collection (frozen): its collections are young ones
GC_OLD: Final = 1_700  # CPython's own oldest-generation collections, which the freeze leaves as small as young ones
FULL_EVERY: Final = 100_000_000  # allocations between full collections, each of which visits every held job
FULL_AFTER_YOUNG: Final = FULL_EVERY // GC_YOUNG
FULL_CHECK_S: Final = 60.0
# A dashboard scraped back to back drops cycles in ~9 of 10 young generations: 16 clean visits in a row are
# then rare, and what a skipped span freezes is a one-off (bench/gc_garbage.py). Skipped spans of up to 63
# leave one visit in 64 where no cycles are dropped.
CLEAN_BEFORE_SKIP: Final = 16
MAX_SKIP: Final = 63


class GcPolicy:
    """Installed once per broker process (:func:`tune_gc`); ``start`` hands it the loop for full collections."""

    __slots__ = ("check_s", "clean_visits", "frozen_at_start", "full_after", "full_collections", "skip_left",
                 "skip_span", "skipped", "timer", "visited", "young_since_full")

    def __init__(self, full_after: int = FULL_AFTER_YOUNG, check_s: float = FULL_CHECK_S) -> None:
        self.full_after = full_after
        self.check_s = check_s
        self.young_since_full = 0  # young collections since the last full one
        self.full_collections = 0
        self.timer: asyncio.TimerHandle | None = None
        self.clean_visits = 0  # visiting young collections in a row that found no garbage
        self.skip_span = 0  # young collections skipped after the next one that visits and finds no garbage
        self.skip_left = 0  # of the current span: the young collections still to skip
        self.frozen_at_start = False  # the collection under way visits nothing
        self.skipped = 0  # young collections that visited nothing (frozen at their start), since install
        self.visited = 0  # young collections that visited the young generation, since install

    def install(self) -> None:
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG, GC_MIDDLE, GC_OLD)
        if self.after_collection not in gc.callbacks:
            gc.callbacks.append(self.after_collection)

    def uninstall(self) -> None:
        """Undo :meth:`install` (tests): no callback, nothing frozen, CPython's default thresholds."""
        self.stop()
        if self.after_collection in gc.callbacks:
            gc.callbacks.remove(self.after_collection)
        gc.unfreeze()
        gc.set_threshold(700, 10, 10)

    def after_collection(self, phase: str, info: dict[str, Any]) -> None:
        """gc.callbacks. At the start of a young collection (of the youngest generation or the middle one: each
        comes after GC_YOUNG allocations) in a skipped span: freeze, so that it visits nothing. At the end of
        every collection: freeze what survived (every generation is empty again), and size the next span from
        what a visiting young collection found."""
        if info["generation"] == 2:  # the full collection, or CPython's own oldest (on what the last freeze left)
            if phase == "stop":
                gc.freeze()
            return
        if phase == "start":
            self.frozen_at_start = self.skip_left > 0
            if self.frozen_at_start:
                self.skip_left -= 1
                self.skipped += 1
                gc.freeze()
            else:
                self.visited += 1
            return
        gc.freeze()
        self.young_since_full += 1
        if self.frozen_at_start:
            return
        if info["collected"] or info["uncollectable"]:
            self.clean_visits = 0  # reference cycles are being dropped: visit every young generation again
            self.skip_span = 0
        else:
            self.clean_visits += 1
            if self.clean_visits >= CLEAN_BEFORE_SKIP:
                self.skip_span = min(MAX_SKIP, 2 * self.skip_span or 1)
        self.skip_left = self.skip_span

    def full_due(self) -> bool:
        return self.young_since_full >= self.full_after

    def collect_all(self) -> int:
        """The full collection: every object visited once, the cycles among frozen ones freed. Returns what it freed."""
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        self.young_since_full = 0
        self.full_collections += 1
        return found

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Look every ``check_s`` whether a full collection is due (not from the callback: a collection
        cannot start another)."""
        self.timer = loop.call_later(self.check_s, self._check, loop)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.full_due():
            self.collect_all()
        self.start(loop)


_POLICY: Final = GcPolicy()


def tune_gc() -> GcPolicy:
    """Install the broker's collector policy in this process (once; again is harmless) and return it."""
    _POLICY.install()
    return _POLICY
