"""Prometheus metrics for the broker (``--metrics ADDR:PORT``), which beanstalkd lacks.

prometheus_client does the text format; the values are read from the queue when a
scrape arrives. The HTTP endpoint is a few lines of asyncio on the broker's own loop
(not prometheus_client's threaded server), so a scrape never reads queue state while
a command is changing it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from broker.limits import REASONS

if TYPE_CHECKING:
    from broker.server import BrokerServer

log = logging.getLogger("broker.metrics")


class BrokerCollector:
    """Reads the queue at scrape time."""

    def __init__(self, server: "BrokerServer") -> None:
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
        yield GaugeMetricFamily("beanstalk_job_bytes", "Total size of held job bodies", value=queue.held_bytes)
        yield GaugeMetricFamily("beanstalk_tubes", "Tubes that exist", value=len(queue.tubes))
        commands = CounterMetricFamily("beanstalk_commands", "Commands received, by command", labels=["command"])
        for name, count in queue.op_counts.items():
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
        binlog = queue.listener.stats()
        if "bytes" in binlog:
            yield GaugeMetricFamily("beanstalk_binlog_bytes", "Binlog size on disk", value=binlog["bytes"])
        if "fsync-count" in binlog:
            yield SummaryMetricFamily("beanstalk_binlog_fsync_seconds", "Binlog fsync latency",
                                      count_value=binlog["fsync-count"],
                                      sum_value=binlog.get("fsync-seconds", 0.0))


class MetricsServer:
    """GET /metrics over HTTP/1.0-style one-shot connections."""

    def __init__(self, server: "BrokerServer") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(BrokerCollector(server))
        self._server: asyncio.base_events.Server | None = None

    async def start(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self._server = await asyncio.start_server(self._handle, host or "127.0.0.1", int(port))

    def address(self) -> str:
        name = self._server.sockets[0].getsockname()
        return f"{name[0]}:{name[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b""
            if path.split(b"?")[0] in (b"/metrics", b"/"):
                body = generate_latest(self.registry)
                head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            else:
                body = b"not found\n"
                head = b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n"
            writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
