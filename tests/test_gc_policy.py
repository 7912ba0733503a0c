"""The broker's cyclic-GC policy (broker.server.tune_gc): short pauses while a queue fills.

A held job is an object the collector tracks. With the old thresholds (50,000, 20, 100) the middle
generation gathered a million of them while a queue filled, and its collection stopped every client
for ~230 ms (bench/bench_fill.py). Here the held jobs are stood in for by a million and more empty lists
(tracked, acyclic, long-lived, as jobs are): what is measured is how many objects one collection
below the oldest generation has to visit.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from broker.server import GC_MIDDLE, GC_OLD, GC_YOUNG, tune_gc

# ~0.1-0.25 us an object visited: 100,000 is a pause of 10-25 ms, against ~230 ms before.
MAX_VISITED = 100_000
HELD = 1_200_000  # past one million allocations: the old middle generation's whole cycle


@pytest.fixture
def broker_gc() -> Iterator[list[int]]:
    """tune_gc applied for the test, with the size of every young collection recorded; restored after."""
    before = gc.get_threshold()
    visited: list[int] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] < 2:
            visited.append(sum(len(gc.get_objects(generation)) for generation in range(info["generation"] + 1)))

    tune_gc()
    gc.callbacks.append(watch)
    try:
        yield visited
    finally:
        gc.callbacks.remove(watch)
        gc.unfreeze()
        gc.set_threshold(*before)


def test_young_collections_stay_small_while_a_million_jobs_pile_up(broker_gc: list[int]) -> None:
    held = [[] for _ in range(HELD)]  # type: ignore[var-annotated]
    assert len(held) == HELD
    assert len(broker_gc) >= HELD // GC_YOUNG - 1, "the young generation was not collected as the jobs came"
    assert max(broker_gc) <= MAX_VISITED, f"a collection visited {max(broker_gc):,} objects"


def test_the_policy_bounds_a_young_collection_and_keeps_full_ones_rare() -> None:
    assert GC_YOUNG * (GC_MIDDLE + 2) <= MAX_VISITED
    # A full collection visits every held job: no more often than the old thresholds allowed (~100 million
    # allocations between them, before the collector's own rule of 25% growth).
    assert GC_YOUNG * (GC_MIDDLE + 1) * GC_OLD >= 100_000_000
