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

A page may also hold *lazy* jobs (the interpreted recovery, see :meth:`JobTable.put_lazy`):
a slot that is None with an entry ``>= 0`` in the page's ``lazy`` array is a job not yet
made, known by a number its ``loader`` makes it from on first use. Looking it up, popping
it or listing the values makes it; until then it costs 8 bytes. A lookup of a made job
never looks at ``lazy`` (it is only read when the slot is None).

Generic in the value type so this module needs nothing from :mod:`broker.model`.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from typing import Final, Generic, TypeVar

T = TypeVar("T")

PAGE_BITS: Final = 10
PAGE_SIZE: Final = 1 << PAGE_BITS
PAGE_MASK: Final = PAGE_SIZE - 1
SPARSE_LIVE: Final = PAGE_SIZE // 16  # a page other than the newest with fewer live jobs is emptied
MAX_GAP_PAGES: Final = 1 << 16  # an id further above the pages than this starts them afresh
# A page pinned by a few long-lived jobs (buried ones, say) kept every entry of ``pages`` between
# it and the newest page, 8 bytes per 1,024 ids forever: ~200 MB a month at 10,000 jobs a second.
# So the oldest page goes to overflow once the freed entries (8 bytes each) cost more than its jobs
# would there (~100 bytes each): more than GAP_PER_JOB per live job of it, plus SPAN_SLACK.
GAP_PER_JOB: Final = 16
SPAN_SLACK: Final = 1024


NOT_LAZY: Final = -1  # a ``lazy`` entry with no job behind it
_NO_LAZY_PAGE: Final = array("q", [NOT_LAZY]) * PAGE_SIZE


class Page(Generic[T]):
    """PAGE_SIZE slots and how many of them hold a job (made or lazy; a native int when
    compiled); ``lazy`` exists while some of its jobs are not made yet, ``unmade`` of them."""

    __slots__ = ("lazy", "live", "slots", "unmade")

    def __init__(self) -> None:
        self.slots: list[T | None] = [None] * PAGE_SIZE
        self.live = 0
        self.lazy: array[int] | None = None
        self.unmade = 0


class JobTable(Generic[T]):
    """A mapping from job id to job, with the part of dict's API the broker uses.

    ``pages[i]`` is page number ``base + i`` or None (freed); the first and last entries
    are never None. ``high_page`` is the highest page number ever made: a page is only made
    above it, and an id goes to ``overflow`` only when its page is gone or was never made
    (so its page is at or below ``high_page``): an id whose page exists is never there.
    """

    __slots__ = ("base", "high_page", "live_pages", "loader", "overflow", "paged", "pages", "unmade")

    def __init__(self) -> None:
        self.pages: list[Page[T] | None] = []
        self.live_pages = 0  # entries of ``pages`` that are not None
        self.base = 0
        self.high_page = -1
        self.paged = 0  # jobs held in pages (lazy ones included)
        self.overflow: dict[int, T] = {}
        self.unmade = 0  # lazy jobs not made yet
        self.loader: Callable[[int, int], T] | None = None  # (id, its lazy number) -> the job

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
                job = page.slots[job_id & PAGE_MASK]
                if job is None and page.lazy is not None:
                    return self._make(page, job_id)
                return job
        return self.overflow.get(job_id) if self.overflow else None

    def _make(self, page: Page[T], job_id: int) -> T | None:
        """The lazy job ``job_id`` of ``page``, made and put in its slot (None: there is none)."""
        lazy = page.lazy
        offset = job_id & PAGE_MASK
        if lazy is None or lazy[offset] == NOT_LAZY or self.loader is None:
            return None
        number = lazy[offset]
        lazy[offset] = NOT_LAZY
        page.unmade -= 1
        if not page.unmade:
            page.lazy = None
        self.unmade -= 1
        job = self.loader(job_id, number)
        page.slots[offset] = job
        return job

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
                if slots[offset] is None and (page.lazy is None or self._make(page, job_id) is None):
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

    def put_lazy(self, ids: list[int], numbers: list[int]) -> None:
        """Hold job ``ids[i]`` as lazy, made by ``loader(ids[i], numbers[i])`` when first used
        (numbers ``>= 0``); a run of consecutive ids that are new to one page is stored as one
        slice of its ``lazy`` array. Any other id is made now and stored as ``self[id]``."""
        loader = self.loader
        assert loader is not None, "put_lazy needs a loader"
        count = len(ids)
        i = 0
        while i < count:
            first = ids[i]
            offset = first & PAGE_MASK
            span = min(count - i, PAGE_SIZE - offset)
            page = self._page_for(first)
            if (page is not None and ids[i + span - 1] == first + span - 1
                    and ids[i:i + span] == list(range(first, first + span))
                    and page.slots[offset:offset + span].count(None) == span
                    and (page.lazy is None or page.lazy[offset:offset + span].count(NOT_LAZY) == span)):
                if page.lazy is None:
                    page.lazy = array("q", _NO_LAZY_PAGE)
                page.lazy[offset:offset + span] = array("q", numbers[i:i + span])
                page.live += span
                page.unmade += span
                self.paged += span
                self.unmade += span
            else:
                for k in range(i, i + span):
                    self.put(ids[k], loader(ids[k], numbers[k]))
            i += span

    def _page_for(self, job_id: int) -> Page[T] | None:
        """The page ``job_id`` belongs in, made if that is its turn; None when the id goes to overflow."""
        number = job_id >> PAGE_BITS
        index = number - self.base
        if 0 <= index < len(self.pages):
            return self.pages[index]
        if number <= self.high_page or job_id < 0:
            return None
        return self._new_page(number)

    def make_all(self) -> None:
        """Make every lazy job (before a walk over all values, or freeing a page)."""
        if self.unmade:
            first = self.base << PAGE_BITS
            for page in self.pages:
                if page is not None and page.lazy is not None:
                    self._make_page(page, first)
                first += PAGE_SIZE

    def _make_page(self, page: Page[T], first: int) -> None:
        lazy = page.lazy
        if lazy is not None:
            for offset, number in enumerate(lazy):
                if number != NOT_LAZY:
                    self._make(page, first + offset)

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
            while pages:
                oldest = pages[0]  # never None (see _trim)
                if oldest is None or number - self.base - self.live_pages <= GAP_PER_JOB * oldest.live + SPAN_SLACK:
                    break
                self._evict(0)
                self._trim()
        if not pages:
            self.base = number
        else:
            pages.extend([None] * (number - self.base - len(pages)))
        page: Page[T] = Page()
        pages.append(page)
        self.live_pages += 1
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
                if job is None and page.lazy is not None:
                    job = self._make(page, job_id)
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
        self._make_page(page, (self.base + index) << PAGE_BITS)
        if page.live:
            first = (self.base + index) << PAGE_BITS
            overflow = self.overflow
            for offset, job in enumerate(page.slots):
                if job is not None:
                    overflow[first + offset] = job
            self.paged -= page.live
        self.pages[index] = None
        self.live_pages -= 1

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
        """The jobs in id order (every lazy one made); a list, so the caller may change the
        table while it goes through it."""
        self.make_all()
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
                lazy = page.lazy
                if lazy is None:
                    out.extend(first + offset for offset, job in enumerate(page.slots) if job is not None)
                else:
                    out.extend(first + offset for offset, job in enumerate(page.slots)
                               if job is not None or lazy[offset] != NOT_LAZY)
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
