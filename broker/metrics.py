"""Prometheus metrics for the broker (``--http/--metrics ADDR:PORT``), which beanstalkd lacks.

prometheus_client does the text format; the values are read from the queue when a
scrape arrives. broker/http.py serves them from the broker's own loop (not
prometheus_client's threaded server), so a scrape never reads queue state while a
command is changing it.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from broker import _build
from broker.busypoll import BusyPoll
from broker.limits import REASONS
from broker.queue import Queue


class Collector(Protocol):
    def collect(self) -> Iterator[Metric]: ...


class HasQueue(Protocol):
    """What the metrics read from the broker (broker.server.BrokerServer has it)."""

    @property
    def queue(self) -> Queue: ...

    @property
    def extra_collectors(self) -> list[Collector]: ...  # e.g. replication's

    @property
    def busy_poll(self) -> BusyPoll | None: ...  # None: --busy-poll-us 0

    @property
    def transport_name(self) -> str: ...  # "c" (broker/_netio.c) or "uvloop"


class BrokerCollector:
    """Reads the queue at scrape time."""

    def __init__(self, server: HasQueue) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        queue = self.server.queue
        jobs = GaugeMetricFamily("beanstalk_jobs", "Jobs held, by tube and state", labels=["tube", "state"])
        for tube in queue.tubes.items:
            jobs.add_metric([tube.name, "ready"], tube.ready_count)
            jobs.add_metric([tube.name, "delayed"], tube.delayed_count)
            jobs.add_metric([tube.name, "reserved"], tube.reserved_count)
            jobs.add_metric([tube.name, "buried"], len(tube.buried))
        yield jobs
        # which core this process runs: an install without a C compiler runs ~2x slower, silently otherwise
        yield InfoMetricFamily("beanstalk_build", "The broker core this process runs",
                               value={"core": _build.core_name(), "transport": self.server.transport_name})
        yield GaugeMetricFamily("beanstalk_job_bytes", "Total size of held job bodies", value=queue.held_bytes)
        yield GaugeMetricFamily("beanstalk_tubes", "Tubes that exist", value=len(queue.tubes))
        commands = CounterMetricFamily("beanstalk_commands", "Commands received, by command", labels=["command"])
        for name, count in queue.counted_ops().items():
            commands.add_metric([name], count)
        yield commands
        yield GaugeMetricFamily("beanstalk_connections", "Open client connections", value=queue.cur_conns)
        yield CounterMetricFamily("beanstalk_connections", "Client connections accepted", value=queue.tot_conns)
        yield GaugeMetricFamily("beanstalk_waiting_clients", "Clients blocked in reserve", value=queue.waiting_ct)
        yield CounterMetricFamily("beanstalk_job_timeouts", "Reserved jobs whose TTR ran out", value=queue.timeout_ct)
        refusals = CounterMetricFamily("beanstalk_refusals", "Commands or connections refused by a limit",
                                       labels=["reason"])
        for reason in REASONS:
            refusals.add_metric([reason], queue.refusals.counts[reason])
        yield refusals
        poll = self.server.busy_poll
        if poll is not None:
            yield CounterMetricFamily("beanstalk_busy_polls", "Busy polls started after a command (--busy-poll-us)",
                                      value=poll.polls)
            yield CounterMetricFamily("beanstalk_busy_polls_caught", "Busy polls that caught a next command",
                                      value=poll.caught_total())
            yield CounterMetricFamily("beanstalk_busy_polls_contended",
                                      "Busy polls ended because another process wanted the CPU", value=poll.contended)
            yield CounterMetricFamily("beanstalk_busy_poll_idle_seconds",
                                      "CPU time spent busy polling with nothing to do", value=poll.spun_ns / 1e9)
        binlog = queue.listener.stats()
        if "bytes" in binlog:
            yield GaugeMetricFamily("beanstalk_binlog_bytes", "Binlog size on disk", value=binlog["bytes"])
        if "writes" in binlog:
            yield CounterMetricFamily("beanstalk_binlog_writes", "Writes of binlog records to the current "
                                      "segment (one per batch of replies)", value=binlog["writes"])
        if "io-errors" in binlog:
            yield CounterMetricFamily("beanstalk_binlog_io_errors", "Binlog writes and fsyncs that failed "
                                      "(no change is acknowledged until the log is rebuilt)", value=binlog["io-errors"])
            yield CounterMetricFamily("beanstalk_binlog_rebuilds", "Binlogs rebuilt from memory into a new base "
                                      "segment after an I/O error", value=binlog["rebuilds"])
        if "fsync-count" in binlog:
            yield SummaryMetricFamily("beanstalk_binlog_fsync_seconds", "Binlog fsync latency",
                                      count_value=binlog["fsync-count"],
                                      sum_value=binlog.get("fsync-seconds", 0.0))


def metrics_text(server: HasQueue) -> bytes:
    """The Prometheus text exposition of the broker's state now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(server))
    for extra in server.extra_collectors:
        registry.register(extra)
    return generate_latest(registry)
