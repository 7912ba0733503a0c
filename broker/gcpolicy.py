"""The broker's policy for CPython's cyclic collector: short pauses, and each held job visited once.

Why: a broker holds up to millions of long-lived, acyclic job objects, and the collector tracks every one.
With CPython's default thresholds it re-scans them again and again while a queue fills. The queue breaks
its own reference cycles when connections and tubes go away, so the collector has little to find; what it
costs is visiting. So:

* what exists at start is frozen out of every scan (``gc.freeze``);
* young collections come in small steps (``GC_YOUNG``, ``GC_MIDDLE``): no pause visits more than
  ``GC_YOUNG * (GC_MIDDLE + 2)`` objects (a middle generation that gathered a million jobs stopped every client
  for ~230 ms; bench/README.md, "Pauses while a queue fills");
* what survives a collection is frozen as soon as it ends (a list splice, not a walk), so a job is visited
  by one young collection instead of two (the middle generation's). Interpreted, the collector was ~7% of a
  put's instructions over 100,000 puts, and the second visit more than a third of that (bench/README.md,
  "Each job visited once");
* frozen objects are freed by reference counting like any other: only a reference cycle that outlived a
  young collection waits, for the full collection that comes after ``FULL_AFTER_YOUNG`` young ones (~100
  million allocations: as rare as the oldest generation's collection was before). It unfreezes
  everything, collects, and freezes again; the loop looks whether one is due every ``FULL_CHECK_S``.
"""
from __future__ import annotations

import asyncio
import gc
from typing import Any, Final

GC_YOUNG: Final = 20_000
GC_MIDDLE: Final = 2
GC_OLD: Final = 1_700
# A full collection after this many young ones: GC_YOUNG * FULL_AFTER_YOUNG = ~100 million allocations, the
# interval of the oldest generation's collections under the thresholds above (GC_MIDDLE + 1 young collections
# a middle one, GC_OLD middle ones a full one).
FULL_AFTER_YOUNG: Final = (GC_MIDDLE + 1) * GC_OLD
FULL_CHECK_S: Final = 60.0


class GcPolicy:
    """Installed once per broker process (:func:`tune_gc`); ``start`` hands it the loop for full collections."""

    __slots__ = ("check_s", "full_after", "full_collections", "timer", "young_since_full")

    def __init__(self, full_after: int = FULL_AFTER_YOUNG, check_s: float = FULL_CHECK_S) -> None:
        self.full_after = full_after
        self.check_s = check_s
        self.young_since_full = 0  # young collections since the last full one
        self.full_collections = 0
        self.timer: asyncio.TimerHandle | None = None

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
        """gc.callbacks: freeze what survived (every generation is empty again); count young collections (of
        the youngest generation or the middle one: each comes after GC_YOUNG allocations)."""
        if phase == "stop":
            gc.freeze()
            if info["generation"] < 2:
                self.young_since_full += 1

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
