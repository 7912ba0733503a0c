"""One member of a replicated broker: its role, the write gate, fencing, the stream listener, stats.

Roles: ``leader`` (changes accepted while its lease is valid; records streamed to replicas)
and ``replica`` (applies the leader's stream; answers reads; refuses changes). Who leads is
decided by etcd (:mod:`broker.replication.election`) or, without etcd, fixed by the flags
(``--replica-of`` follows one address; a member with only ``--replication-listen`` leads).

Fencing: the leader accepts a change only while ``time.monotonic()`` is before
``lease_until`` (the send time of its last successful lease keep-alive plus the TTL, minus a
margin). etcd cannot expire the lease before that instant, so no new leader exists while the
old one still acknowledges. Past it, the gate refuses changes at once; the member tick then
steps down: held replies are dropped, client connections closed, replicas disconnected.

Refusals on a member that does not lead: ``put`` answers ``DRAINING`` (what stock clients get
from a draining beanstalkd); the other commands that change jobs (reserve, reserve-with-timeout,
reserve-job, delete, release, bury, touch, kick, kick-job, pause-tube) answer ``OUT_OF_MEMORY``,
the error beanstalkd may give to any command, which every client surfaces as a server-side
refusal. Reads (peek*, stats*, list-*) and use/watch/ignore work.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from broker import logs, security
from broker import protocol as p
from broker.binlog import Binlog
from broker.queue import QueueListener
from broker.replication import wire
from broker.replication.follower import (
    Applier,
    Follower,
    Position,
    StreamTarget,
    load_position,
    nodelay,
    save_position,
)
from broker.replication.source import Predecessor, ReplicaSession, ReplicationSource, SyncHold

if TYPE_CHECKING:
    from broker.replication.election import EtcdLeadership
    from broker.server import BrokerServer

log = logging.getLogger("broker.replication")
TICK = 0.05
HAND_OFF_POLL = 0.005
HAND_OFF_MAX = 5.0  # a SIGTERM waits at most this (or --lease-ttl, if shorter) for replicas, then for etcd
CHANGES = frozenset({"put", "reserve", "reserve-with-timeout", "reserve-job", "delete", "release", "bury",
                     "touch", "kick", "kick-job", "pause-tube"})
NOT_LEADER = b"NOT_LEADER\r\n"


@dataclass
class ReplicationConfig:
    """The replication flags, checked (see broker.replication.options)."""

    name: str
    state_dir: str
    listen: tuple[str, int] | None = None  # --replication-listen
    replica_of: tuple[str, int] | None = None
    sync_replicas: int = 0
    etcd: str | None = None
    cluster: str = "spark-beanstalk"
    lease_ttl: int = 2
    ca_file: str | None = None
    token: bytes | None = None
    tls_server: ssl.SSLContext | None = None
    client_address: str = ""


class RoleState(NamedTuple):
    """A member's answer to ``role``: what it is, its last record, whether it may lead."""

    role: str
    epoch: int
    seq: int
    candidate: bool


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


class Member:
    """Glue between the server, the source, the follower and leadership."""

    commands = CHANGES

    def __init__(self, config: ReplicationConfig, source: ReplicationSource) -> None:
        self.config = config
        self.source = source
        self.role = "replica"
        self.epoch = 0
        self.lease_until = 0.0
        self.server: BrokerServer | None = None
        self.applier: Applier | None = None
        self.hold: SyncHold | None = None
        self.follower: Follower | None = None
        self.leader_name = ""
        self.no_candidacy_until = 0.0
        self.failovers = 0
        self._follow_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._listener: asyncio.base_events.Server | None = None
        self.binlog: QueueListener | None = None  # this member's own binlog (member_listener)
        self.leadership: EtcdLeadership | None = None
        self._ssl: ssl.SSLContext | None = None  # made once: contexts compare by identity (follow())
        # Why the member stopped the broker at start (the replication port could not be bound);
        # the CLI turns it into a non-zero exit: a member without its stream is no member.
        self.fatal: str | None = None

    # -- installation --------------------------------------------------------------------
    def install(self, server: BrokerServer) -> None:
        """Called by run_server before the first client: gate, hold, stats, tasks."""
        self.server = server
        queue = server.queue
        saved = load_position(self.config.state_dir)
        self.applier = Applier(queue, saved.pos)
        if saved.exact:  # a clean shutdown: unless the binlog lost something, the queue is exactly at pos
            self.applier.exact = self.binlog_intact()
            self._save()  # from now on a crash may leave the binlog ahead of the file
        server.state.write_gate = self
        if self.config.sync_replicas:
            self.hold = SyncHold(self.source, self.config.sync_replicas, self.is_leader)
            server.state.replication_hold = self.hold
            server.state.group_commit = True
        from broker.replication.metrics import ReplicationCollector

        server.extra_collectors.append(ReplicationCollector(self))
        previous = queue.extra_stats
        queue.extra_stats = lambda: {**(previous() if previous else {}), **self.stats()}
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._tick()))
        if self.config.listen is not None:
            self._tasks.append(loop.create_task(self._serve()))
        server.before_close = self.hand_off
        if self.config.etcd is not None:
            from broker.replication.election import EtcdLeadership

            self.leadership = EtcdLeadership(self)
            self._tasks.append(loop.create_task(self.leadership.run()))
        elif self.config.replica_of is not None:
            self.follow("primary", *self.config.replica_of)
        else:
            self.become_leader(self.applier.pos.epoch + 1, static=True)


    # -- the gate ----------------------------------------------------------------------------
    def is_leader(self) -> bool:
        """True while this member may accept changes (for /readyz and load balancers)."""
        return self.role == "leader" and time.monotonic() < self.lease_until

    def refuse(self, name: str) -> bytes | None:
        if self.role == "leader" and time.monotonic() < self.lease_until:
            return None
        return p.DRAINING if name == "put" else p.OUT_OF_MEMORY

    def may_lead(self) -> bool:
        return time.monotonic() >= self.no_candidacy_until

    def position(self) -> Position:
        if self.role == "leader":
            return Position(self.epoch, self.source.seq)
        assert self.applier is not None
        return self.applier.pos

    # -- role changes ------------------------------------------------------------------------
    def become_leader(self, epoch: int, static: bool = False) -> None:
        assert self.server is not None and self.applier is not None
        self.role = "leader"
        self.epoch = epoch
        self.leader_name = self.config.name
        if static:
            self.lease_until = math.inf
        else:
            # ids never repeat across failovers: a new epoch's ids start above any earlier leader's
            queue = self.server.queue
            queue.next_id = max(queue.next_id, epoch << 32)
        applier = self.applier
        before = Predecessor(applier.pos.epoch, applier.pos.seq, tuple(applier.tail)) if applier.exact else None
        self.source.start(epoch, before)
        applier.pos = Position(epoch, 0)
        applier.clear_tail()
        self._save()
        self.failovers += 1
        logs.event(log, logging.WARNING, "leader", f"{self.config.name} leads, epoch {epoch}")

    def step_down(self, reason: str) -> None:
        """Fenced or deposed: acknowledge nothing more, drop replicas and clients, become a replica."""
        if self.role != "leader":
            return
        assert self.server is not None and self.applier is not None
        server = self.server
        self.role = "replica"
        self.lease_until = 0.0
        server.state.drop_held()  # replies not sent yet: their changes are not acknowledged
        if self.hold is not None:
            self.hold.abort()
        self.applier.pos = Position(self.epoch, self.source.seq)
        self.applier.exact = True  # every change this member made while leading is one of its records
        self.applier.exact_at = None
        self.source.stop()
        self._save()
        for conn in list(server.connections):
            conn.close()
        logs.event(log, logging.WARNING, "step-down", f"{self.config.name} no longer leads: {reason}")

    def follow(self, name: str, host: str, port: int) -> None:
        """Stream from the leader at host:port (restarting the follower if it moved)."""
        assert self.server is not None and self.applier is not None
        target = StreamTarget(host, port, self.config.token, self._client_ssl())
        if self.follower is not None and self.follower.target == target and self._follow_task is not None \
                and not self._follow_task.done():
            return
        if self.follower is not None:
            self.follower.stopped = True
        if self._follow_task is not None:
            self._follow_task.cancel()
        self.leader_name = name
        self.follower = Follower(target, self.config.name, self.applier, self._after_batch, self.config.state_dir)
        self._follow_task = asyncio.get_running_loop().create_task(self.follower.run())

    async def stop_following(self) -> None:
        task, self._follow_task = self._follow_task, None
        if self.follower is not None:
            self.follower.stopped = True
        self.follower = None
        if task is not None:
            task.cancel()
            # bounded: a cancellation swallowed by wait_for must not stall the election; the flag ends it
            await asyncio.wait({task}, timeout=2.0)

    async def hand_off(self) -> None:
        """SIGTERM: a leader hands its last records to the replicas, then every member gives its lease back.

        The server reads no client any more (BrokerServer.close). Waiting until every connected
        replica acknowledged the last record lets the replies held for --sync-replicas go out, and
        leaves this member exactly where its replicas are: after a restart it follows the next leader
        from the backlog, not by snapshot. Giving up the lease lets a replica lead at its next poll.
        Bounded by --lease-ttl (at most 5 s): a replica that does not keep up is left behind, as on a crash. A replica
        only gives its lease back: an election waits for every member that holds one.
        """
        self.no_candidacy_until = math.inf
        if self.role == "leader" and self.server is not None:
            deadline = min(time.monotonic() + min(self.config.lease_ttl, HAND_OFF_MAX), self.lease_until)
            listener = self.server.queue.listener
            while True:
                listener.sync_point()  # what the last commands logged goes out now
                behind = sum(1 for s in self.source.sessions if not s.closed and s.acked < self.source.seq)
                if not behind or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(HAND_OFF_POLL)
            self.step_down(f"shutting down ({behind} replica(s) behind)" if behind
                           else "shutting down, replicas in step")
        if self.leadership is not None:  # a replica too: an election waits for every member that holds a lease
            await self.leadership.resign(min(self.config.lease_ttl, HAND_OFF_MAX))

    def shutdown(self) -> None:
        """The server is closing: stop every task before the binlog closes."""
        self.closed = True
        self.step_down("shutting down")
        if self.follower is not None:
            self.follower.closed = True
        for task in [*self._tasks, self._follow_task]:
            if task is not None:
                task.cancel()
        if self._listener is not None:
            self._listener.close()

    closed = False

    def binlog_intact(self) -> bool:
        """Whether the binlog was read whole at start (no damage skipped, no torn tail)."""
        return isinstance(self.binlog, Binlog) and self.binlog.intact

    def closed_cleanly(self) -> None:
        """The binlog closed (written, fsynced): it holds exactly the state at our position. Saying so lets
        the member take a new leader's epoch without a snapshot after a restart (wire.M_NEW_EPOCH)."""
        assert self.applier is not None
        with contextlib.suppress(OSError):
            save_position(self.config.state_dir, self.position(), exact=self.applier.exact)

    def _after_batch(self) -> bool:
        """The applied records go to the binlog; False when it could not keep them (no ack then)."""
        assert self.server is not None
        if self.closed:
            return True
        listener = self.server.queue.listener
        durable = listener.sync_point() and not listener.failing()  # failing: what an earlier batch left unwritten
        self.server.timer.check()
        return durable

    def _client_ssl(self) -> ssl.SSLContext | None:
        """One context for the member's life: follow() keeps a stream whose target is unchanged,
        and a new context on every poll made every target new (a TLS replica reconnected every
        0.1 s and never finished a snapshot)."""
        if self.config.ca_file is None:
            return None
        if self._ssl is None:
            self._ssl = ssl.create_default_context(cafile=self.config.ca_file)
        return self._ssl

    def _save(self) -> None:
        with contextlib.suppress(OSError):
            save_position(self.config.state_dir, self.position())

    # -- periodic work -------------------------------------------------------------------------
    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            if self.role == "leader":
                if time.monotonic() >= self.lease_until:
                    self.step_down("lease expired (fenced)")
                else:
                    self.source.heartbeat()

    # -- the replication listener ------------------------------------------------------------------
    async def _serve(self) -> None:
        assert self.config.listen is not None
        host, port = self.config.listen
        try:
            self._listener = await asyncio.start_server(self._handle, host, port, ssl=self.config.tls_server,
                                                        reuse_address=True)
        except OSError as exc:
            self.fatal = f"--replication-listen: cannot listen on {host}:{port}: {exc.strerror or exc}"
            logs.event(log, logging.ERROR, "replication-listen", self.fatal)
            if self.server is not None:
                self.server.request_stop()
            return
        await self._listener.serve_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nodelay(writer)
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            token = self.config.token
            if token is not None:
                offered = line[5:].strip() if line.startswith(b"auth ") else b""
                if not security.token_matches(token, offered):
                    writer.write(security.UNAUTHORIZED)
                    return
                writer.write(security.AUTH_OK)
                line = await asyncio.wait_for(reader.readline(), 10)
            words = line.split()
            verb = words[0].decode("ascii", "replace") if words else ""
            if verb == "replicate" and len(words) in (4, 5) and words[2].isdigit() and words[3].isdigit() \
                    and words[4:] in ([], [b"exact"]):
                await self._serve_replica(words[1].decode("ascii", "replace"), int(words[2]), int(words[3]),
                                          len(words) == 5, reader, writer)
            elif verb in ("demote", "promote", "role"):
                writer.write(await self._admin(verb))
                await writer.drain()
            else:
                writer.write(p.UNKNOWN_COMMAND)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async def _serve_replica(self, name: str, epoch: int, seq: int, exact: bool, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        if not self.is_leader():
            writer.write(NOT_LEADER)
            return
        writer.write(b"STREAMING %d\r\n" % self.epoch)
        session = ReplicaSession(name, writer)
        how = "backlog" if self.source.attach(session, epoch, seq, exact) else "snapshot"
        logs.event(log, logging.INFO, "replica", f"{name} streams from ({epoch}, {seq}) by {how}")
        try:
            if how == "snapshot" and not await self.source.send_snapshot(session):
                return
            while not session.closed:
                data = await reader.readexactly(wire.ACK.size)
                ack_epoch, ack_seq = wire.ACK.unpack(data)
                self.source.acknowledged(session, ack_epoch, ack_seq)
        finally:
            self.source.detach(session)

    async def _admin(self, verb: str) -> bytes:
        if verb == "role":
            pos = self.position()
            role = b"leader" if self.is_leader() else b"replica"
            return b"OK %s %d %d %d\r\n" % (role, pos.epoch, pos.seq, self.may_lead())
        if self.config.etcd is None:
            return b"ERROR promote and demote need --etcd\r\n"
        if verb == "demote":
            if self.role != "leader":
                return NOT_LEADER
            self.no_candidacy_until = time.monotonic() + 3 * self.config.lease_ttl
            self.step_down("demoted by an operator")
            return b"DEMOTED\r\n"
        if self.role == "leader":
            return b"OK already the leader\r\n"
        self.promote_requested = True
        return b"PROMOTING\r\n"

    promote_requested = False

    async def ask_role(self, address: str, timeout: float) -> RoleState | None:
        """Another member's role and position (its ``role`` answer), or None if it cannot be asked."""
        try:
            host, port = split_address(address)
            ssl_ctx = self._client_ssl()
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                host, port, ssl=ssl_ctx, server_hostname=host if ssl_ctx is not None else None), timeout)
        except (TimeoutError, OSError, ValueError):
            return None
        try:
            if self.config.token is not None:
                writer.write(b"auth %s\r\n" % self.config.token)
            writer.write(b"role\r\n")
            line = await asyncio.wait_for(reader.readline(), timeout)
            if self.config.token is not None and line == security.AUTH_OK:
                line = await asyncio.wait_for(reader.readline(), timeout)
            words = line.split()
            if len(words) != 5 or words[0] != b"OK":
                return None
            return RoleState(words[1].decode(), int(words[2]), int(words[3]), words[4] == b"1")
        except (TimeoutError, OSError, ValueError):
            return None
        finally:
            writer.close()

    # -- stats -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        assert self.applier is not None
        pos = self.position()
        replica = self.role != "leader"
        return {
            "replication-role": self.role if self.is_leader() or replica else "fenced",
            "replication-name": self.config.name,
            "replication-leader": self.leader_name,
            "replication-epoch": pos.epoch,
            "replication-seq": pos.seq,
            "replication-lag-records": self.applier.lag_records() if replica else 0,
            "replication-lag-seconds": f"{self.applier.lag_seconds() if replica else 0.0:.3f}",
            "replication-replicas": len(self.source.sessions),
            "replication-sync-replicas": self.config.sync_replicas,
            "replication-joined-by-backlog": self.source.catch_ups["backlog"],
            "replication-joined-by-snapshot": self.source.catch_ups["snapshot"],
            "replication-stream-connected": "true" if (self.follower is not None and self.follower.connected)
            else "false",
        }
