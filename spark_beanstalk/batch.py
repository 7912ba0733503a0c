"""A micro-batch of reserved jobs as the driver-side source holds it: named columns per broker."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from spark_beanstalk.offsets import BrokerJobs, Offset, block_digests, reserved_second


class JobColumns(NamedTuple):
    """The jobs of one batch from one broker, column by column (the schema's order, then digests)."""

    ids: list[int]
    tubes: list[str]
    bodies: list[bytes]
    pris: list[int]
    ttrs: list[int]
    reserves: list[int]
    reserved_at_us: list[int]
    digests: list[int]        # body digests: recognise the job after a reconnect

    @classmethod
    def empty(cls) -> JobColumns:
        return cls([], [], [], [], [], [], [], [])

    def extend(self, other: JobColumns) -> None:
        for mine, theirs in zip(self, other, strict=True):
            mine.extend(theirs)  # type: ignore[attr-defined]

    def keep(self, indexes: list[int]) -> JobColumns:
        """The rows at `indexes`, as new columns."""
        return JobColumns([self.ids[i] for i in indexes], [self.tubes[i] for i in indexes],
                          [self.bodies[i] for i in indexes], [self.pris[i] for i in indexes],
                          [self.ttrs[i] for i in indexes], [self.reserves[i] for i in indexes],
                          [self.reserved_at_us[i] for i in indexes], [self.digests[i] for i in indexes])

    def rows_by_id(self) -> dict[int, int]:
        """job id -> row."""
        return {jid: i for i, jid in enumerate(self.ids)}


@dataclass(eq=False)
class Batch:
    """The jobs of one micro-batch (seq >= 1), or of the read-ahead pool (seq -1) until it becomes one."""

    seq: int
    offset: Offset | None = None
    jobs: dict[str, JobColumns] = field(default_factory=dict)
    committed: bool = False

    def add(self, address: str, columns: JobColumns) -> None:
        mine = self.jobs.get(address)
        if mine is None:
            self.jobs[address] = columns
        else:
            mine.extend(columns)

    def count(self) -> int:
        return sum(len(c.ids) for c in self.jobs.values())

    def drop(self, address: str, ids: set[int]) -> None:
        """Forget jobs (given back, or lost before the batch was planned)."""
        cols = self.jobs.get(address)
        if cols is None or not ids:
            return
        self.jobs[address] = cols.keep([i for i, jid in enumerate(cols.ids) if jid not in ids])

    def broker_jobs(self, address: str, sid: str) -> BrokerJobs:
        cols = self.jobs[address]
        return BrokerJobs(sid, sorted(cols.ids), block_digests(cols.ids, cols.tubes, cols.digests),
                          reserved_second(cols.reserved_at_us))
