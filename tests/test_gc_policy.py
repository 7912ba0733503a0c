"""The broker's cyclic-GC policy (broker.gcpolicy): short pauses while a queue fills, each job visited once.

A held job is an object the collector tracks. With the old thresholds (50,000, 20, 100) the middle
generation gathered a million of them while a queue filled, and its collection stopped every client
for ~230 ms (bench/bench_fill.py). Then each job was still visited twice, by a young collection and a
middle one, until survivors were frozen at the end of each collection. Here the held jobs are stood in
for by a million and more empty lists (tracked, acyclic, long-lived, as jobs are): what is measured is
how many objects the collections below the oldest generation visit, one by one and in all.
"""
from __future__ import annotations

import asyncio
import gc
import sys
import weakref
from collections.abc import Iterator

import pytest

from broker.gcpolicy import FULL_AFTER_YOUNG, GC_MIDDLE, GC_YOUNG, MAX_SKIP, GcPolicy, tune_gc
from broker.jobtable import JobTable
from broker.model import READY, Tube, new_job
from tests.helpers import wait_until_async

# ~0.1-0.25 us an object visited: 100,000 is a pause of 10-25 ms, against ~230 ms before.
MAX_VISITED = 100_000
# Half the smallest per-core L2 measured on (512 KiB, the AMD EPYC VM): room left for 500 connections' state.
CACHE_BUDGET = 256 * 1024
HELD = 1_200_000  # past one million allocations: the old middle generation's whole cycle


@pytest.fixture
def broker_gc() -> Iterator[list[int]]:
    """tune_gc applied for the test, with what every young collection visits recorded; undone after."""
    visited: list[int] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] < 2:
            visited.append(sum(len(gc.get_objects(generation)) for generation in range(info["generation"] + 1)))

    policy = tune_gc()
    gc.callbacks.append(watch)  # after the policy's own callback, which may freeze the young generation at "start"
    try:
        yield visited
    finally:
        gc.callbacks.remove(watch)
        policy.uninstall()


class Cyclic:
    """A reference cycle with itself, as an aiohttp error reply leaves one with its traceback."""

    def __init__(self) -> None:
        self.me = self


class CountedCycle:
    """A reference cycle with itself that counts how many of its kind are alive (not yet freed by a collection)."""

    alive = 0

    def __init__(self) -> None:
        self.me = self
        CountedCycle.alive += 1

    def __del__(self) -> None:
        CountedCycle.alive -= 1


def test_young_collections_stay_small_while_a_million_jobs_pile_up(broker_gc: list[int]) -> None:
    held = [[] for _ in range(HELD)]  # type: ignore[var-annotated]
    assert len(held) == HELD
    assert len(broker_gc) >= 0.9 * HELD // GC_YOUNG, "the young generation was not collected as the jobs came"
    assert max(broker_gc) <= MAX_VISITED, f"a collection visited {max(broker_gc):,} objects"


def test_each_held_job_is_visited_by_one_young_collection(broker_gc: list[int]) -> None:
    """Without the freeze at the end of a collection, a middle collection visits each job a second time:
    ~1.75 visits a job in all with (20,000, 2)."""
    held = [[] for _ in range(HELD)]  # type: ignore[var-annotated]
    assert len(held) == HELD
    assert sum(broker_gc) <= 1.05 * HELD, f"{sum(broker_gc):,} objects visited for {HELD:,} held"


def test_young_collections_visit_almost_nothing_while_no_cycles_are_dropped(broker_gc: list[int]) -> None:
    """A queue that only holds jobs drops no reference cycles, so a young collection that visits finds nothing:
    after each such one the policy freezes the young generation at the start of the next 1, 2, 4... up to
    MAX_SKIP collections instead of visiting it (each job visited was ~700 instructions and ~16 first-level
    cache misses of an interpreted put; bench/README.md)."""
    held = [[] for _ in range(HELD)]  # type: ignore[var-annotated]
    assert len(held) == HELD
    young = len(broker_gc)
    assert young >= 0.9 * HELD // GC_YOUNG, "the young generation was not collected as the jobs came"
    assert sum(broker_gc) <= 3 * HELD // MAX_SKIP + 10 * GC_YOUNG, f"{sum(broker_gc):,} objects visited"
    visits = sum(1 for size in broker_gc if size > GC_YOUNG // 4)  # (a frozen one still sees the callbacks' own few)
    assert visits <= 2 * young // MAX_SKIP + 10, f"{visits} of {young} young collections visited the young generation"


def test_dropped_cycles_bring_back_a_visit_of_every_young_generation(broker_gc: list[int]) -> None:
    """Once young collections find cycles again, each one visits: the cycles dropped while they were skipped
    (at most MAX_SKIP + 1 young generations' worth) wait for the full collection, the rest are freed young."""
    policy = tune_gc()
    held = [[] for _ in range(HELD // 4)]  # type: ignore[var-annotated]  # no cycles: the skipped spans grow
    assert len(held) == HELD // 4
    skipped = policy.skipped
    made = 200 * GC_YOUNG
    start = CountedCycle.alive
    for _ in range(made):
        CountedCycle()
    left = CountedCycle.alive - start
    assert left <= (MAX_SKIP + 2) * GC_YOUNG, f"{left:,} of {made:,} dropped cycles were not freed young"
    assert policy.skip_span == 0, "young collections found cycles, yet some are still skipped"
    assert policy.skipped > skipped, "no young collection was skipped before the cycles came"
    policy.collect_all()
    assert CountedCycle.alive == start, "the full collection did not free the cycles frozen in a skipped span"


def test_the_policy_bounds_a_young_collection_and_keeps_full_ones_rare() -> None:
    assert GC_YOUNG * (GC_MIDDLE + 2) <= MAX_VISITED
    # A full collection visits every held job: no more often than the old thresholds allowed (~100 million
    # allocations between them, before the collector's own rule of 25% growth).
    assert GC_YOUNG * FULL_AFTER_YOUNG >= 100_000_000


def test_a_young_collection_visits_jobs_still_in_the_cache() -> None:
    """What a put row leaves between two young collections (a job and its 100-byte body a put) fits the cache
    budget: at 20,000 a collection walked ~6 MB, and each job visited was an L2 miss or more."""
    body = b"x" * 100
    job = new_job(1, Tube("default", JobTable()), 1024, 60, body, 0, READY, 0)
    per_put = sys.getsizeof(job) + sys.getsizeof(body)
    assert GC_YOUNG * per_put <= CACHE_BUDGET, f"{GC_YOUNG:,} puts leave {GC_YOUNG * per_put:,} bytes"


def test_a_cycle_that_outlived_a_young_collection_waits_for_the_full_one() -> None:
    policy = GcPolicy(full_after=2)
    policy.install()
    try:
        kept = Cyclic()
        gone = weakref.ref(kept)
        gc.collect(0)  # a young collection: the cycle survives it (still referenced) and is frozen
        assert policy.young_since_full == 1 and not policy.full_due()
        del kept
        gc.collect(1)  # a middle collection, which would have freed it
        assert gone() is not None, "a frozen cycle was visited by a young collection"
        assert policy.full_due()
        assert policy.collect_all() >= 1
        assert gone() is None, "the full collection did not free the cycle"
        assert policy.young_since_full == 0 and policy.full_collections == 1 and gc.get_freeze_count() > 0
    finally:
        policy.uninstall()


def test_the_loop_runs_the_full_collection_once_it_is_due() -> None:
    async def body() -> None:
        policy = GcPolicy(full_after=1, check_s=0.01)
        policy.install()
        try:
            policy.start(asyncio.get_running_loop())
            kept = Cyclic()
            gone = weakref.ref(kept)
            gc.collect(1)  # a young collection (the middle generation's)
            del kept
            await wait_until_async(lambda: policy.full_collections >= 1, 10, "a full collection")
            assert gone() is None
        finally:
            policy.uninstall()
        assert policy.timer is None

    asyncio.run(body())
