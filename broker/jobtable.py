"""The queue's jobs by id, in pages of slots instead of a dict (issue 16 item 4: memory).

A ``dict[int, Job]`` costs ~42 bytes a job for its table and, compiled, 32 more for a boxed
copy of the id as key. Job ids are handed out in increasing order, so a job's id says where
it lives: page ``id >> PAGE_BITS``, slot ``id & PAGE_MASK``. A lookup is two list indexings
with no hashing and no boxed key; a held job costs one 8-byte slot.

The worst case is bounded: a page kept alive by a few long-lived jobs among many deleted
ones would cost a whole page each. So every page except the newest (the one being filled)
holds at least :data:`SPARSE_LIVE` jobs; a page that falls below moves its jobs to the
``overflow`` dict and is freed. Ids that arrive out of order (recovery, a replica) for a
page that does not exist also go to ``overflow``. Page memory is therefore at most
``PAGE_SIZE * 8 / SPARSE_LIVE`` = 128 bytes per paged job, plus one page.

Generic in the value type so this module needs nothing from :mod:`broker.model`.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Final, Generic, TypeVar

T = TypeVar("T")

PAGE_BITS: Final = 10
PAGE_SIZE: Final = 1 << PAGE_BITS
PAGE_MASK: Final = PAGE_SIZE - 1
SPARSE_LIVE: Final = PAGE_SIZE // 16  # a page other than the newest with fewer live jobs is emptied
MAX_GAP_PAGES: Final = 1 << 16  # an id further above the pages than this starts them afresh


class Page(Generic[T]):
    """PAGE_SIZE slots and how many of them hold a job (a native int when compiled)."""

    __slots__ = ("live", "slots")

    def __init__(self) -> None:
        self.slots: list[T | None] = [None] * PAGE_SIZE
        self.live = 0


class JobTable(Generic[T]):
    """A mapping from job id to job, with the part of dict's API the broker uses.

    ``pages[i]`` is page number ``base + i`` or None (freed); the first and last entries
    are never None. ``high_page`` is the highest page number ever made: a page is only made
    above it, and an id goes to ``overflow`` only when its page is gone or was never made
    (so its page is at or below ``high_page``): an id whose page exists is never there.
    """

    __slots__ = ("base", "high_page", "overflow", "paged", "pages")

    def __init__(self) -> None:
        self.pages: list[Page[T] | None] = []
        self.base = 0
        self.high_page = -1
        self.paged = 0  # jobs held in pages
        self.overflow: dict[int, T] = {}

    def __len__(self) -> int:
        return self.paged + len(self.overflow)

    def get(self, job_id: int) -> T | None:
        index = (job_id >> PAGE_BITS) - self.base
        if index >= 0:  # try, not a len() check: cheaper on the hot path, interpreted
            try:
                page = self.pages[index]
            except IndexError:
                page = None
            if page is not None:  # a page's ids are never in overflow (see the class docstring)
                return page.slots[job_id & PAGE_MASK]
        return self.overflow.get(job_id) if self.overflow else None

    def __getitem__(self, job_id: int) -> T:
        job = self.get(job_id)
        if job is None:
            raise KeyError(job_id)
        return job

    def __contains__(self, job_id: object) -> bool:
        return isinstance(job_id, int) and self.get(job_id) is not None

    def __setitem__(self, job_id: int, job: T) -> None:
        self.put(job_id, job)

    def put(self, job_id: int, job: T) -> None:
        """``self[job_id] = job``, as a method: the broker's callers use this (interpreted, a
        subscript store on a Python class goes through the ``__setitem__`` slot wrapper, ~200
        instructions more than a method call)."""
        number = job_id >> PAGE_BITS
        index = number - self.base
        if index >= 0:
            try:
                page = self.pages[index]
            except IndexError:
                page = None
            if page is not None:
                slots = page.slots
                offset = job_id & PAGE_MASK
                if slots[offset] is None:
                    page.live += 1
                    self.paged += 1
                slots[offset] = job
                return
        if number <= self.high_page or job_id < 0:
            self.overflow[job_id] = job  # out of order, for a page that is gone or was never made
            return
        page = self._new_page(number)
        page.slots[job_id & PAGE_MASK] = job
        page.live = 1
        self.paged += 1

    def put_many(self, ids: list[int], jobs: list[T]) -> None:
        """``self.put(ids[i], jobs[i])`` for each i in turn, with the same result; a run of
        consecutive new ids within one page is stored by one slice assignment (recovery
        restores a million jobs in id order)."""
        count = len(ids)
        i = 0
        while i < count:
            first = ids[i]
            self.put(first, jobs[i])  # makes the page if that is its turn, exactly as one put would
            offset = first & PAGE_MASK
            span = min(count - i, PAGE_SIZE - offset)
            index = (first >> PAGE_BITS) - self.base
            page = self.pages[index] if 0 <= index < len(self.pages) else None
            if (page is not None and span > 1 and ids[i + span - 1] == first + span - 1
                    and ids[i:i + span] == list(range(first, first + span))
                    and page.slots[offset + 1:offset + span].count(None) == span - 1):
                page.slots[offset + 1:offset + span] = jobs[i + 1:i + span]
                page.live += span - 1
                self.paged += span - 1
                i += span
                continue
            for k in range(i + 1, i + span):  # not one clean run: one at a time
                self.put(ids[k], jobs[k])
            i += span

    def _new_page(self, number: int) -> Page[T]:
        """Make page ``number``, above every page made so far."""
        pages = self.pages
        if pages:
            newest = pages[-1]
            if newest is not None and newest.live < SPARSE_LIVE:
                self._evict(len(pages) - 1)  # no longer the page being filled: held to the rule
            if number - self.base - len(pages) > MAX_GAP_PAGES:
                for index in range(len(pages)):
                    self._evict(index)
            self._trim()
        if not pages:
            self.base = number
        else:
            pages.extend([None] * (number - self.base - len(pages)))
        page: Page[T] = Page()
        pages.append(page)
        self.high_page = number
        return page

    def pop(self, job_id: int, default: T | None = None) -> T | None:
        index = (job_id >> PAGE_BITS) - self.base
        if index >= 0:
            pages = self.pages
            try:
                page = pages[index]
            except IndexError:
                page = None
            if page is not None:
                slots = page.slots
                offset = job_id & PAGE_MASK
                job = slots[offset]
                if job is not None:
                    slots[offset] = None
                    self.paged -= 1
                    live = page.live - 1
                    page.live = live
                    # Never the newest page, even empty: it is the one being filled, and once it
                    # were gone the next ids of its number would all go to overflow (a queue whose
                    # workers keep up empties it between puts all the time).
                    if live < SPARSE_LIVE and index != len(pages) - 1:
                        self._evict(index)
                        self._trim()
                    return job
        return self.overflow.pop(job_id, default) if self.overflow else default

    def __delitem__(self, job_id: int) -> None:
        if self.pop(job_id) is None:
            raise KeyError(job_id)

    def _evict(self, index: int) -> None:
        """Move page ``index``'s jobs to ``overflow`` and free it."""
        page = self.pages[index]
        if page is None:
            return
        if page.live:
            first = (self.base + index) << PAGE_BITS
            overflow = self.overflow
            for offset, job in enumerate(page.slots):
                if job is not None:
                    overflow[first + offset] = job
            self.paged -= page.live
        self.pages[index] = None

    def _trim(self) -> None:
        """Drop freed pages at either end of ``pages``."""
        pages = self.pages
        while pages and pages[-1] is None:
            pages.pop()
        lead = 0
        while lead < len(pages) and pages[lead] is None:
            lead += 1
        if lead:
            del pages[:lead]
            self.base += lead

    def values(self) -> list[T]:
        """The jobs in id order; a list, so the caller may change the table while it goes through it."""
        extra = sorted(self.overflow)
        overflow = self.overflow
        out: list[T] = []
        k = 0
        first = self.base << PAGE_BITS
        for page in self.pages:
            if page is not None:
                for offset, job in enumerate(page.slots):
                    if job is not None:
                        while k < len(extra) and extra[k] < first + offset:
                            out.append(overflow[extra[k]])
                            k += 1
                        out.append(job)
            first += PAGE_SIZE
        out.extend(overflow[job_id] for job_id in extra[k:])
        return out

    def keys(self) -> list[int]:
        """The ids in id order (a list, as values())."""
        out: list[int] = []
        first = self.base << PAGE_BITS
        for page in self.pages:
            if page is not None:
                out.extend(first + offset for offset, job in enumerate(page.slots) if job is not None)
            first += PAGE_SIZE
        if self.overflow:
            out.extend(self.overflow)
            out.sort()
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self.keys())

    def footprint(self) -> tuple[int, int]:
        """(pages allocated, jobs in overflow): what the memory bound is about."""
        return sum(1 for page in self.pages if page is not None), len(self.overflow)
