"""One broker as the source sees it: its connections, the ONE record of the jobs held on
them, and whether it can be reached.

beanstalkd ties a reservation to the connection that made it, so "which connection holds
job 17, for which batch" is the source's central fact. It lives only in
``BrokerLink.held`` (job id -> ``Lot``); everything else (a connection's job count, a
batch's jobs) is derived or is data, not a second record.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from beanstalk_rules.hosts import BrokerAddress, HostSpec
from spark_beanstalk.batch import Batch
from spark_beanstalk.client import Connection, ConnectionLost
from spark_beanstalk.leader import open_leader
from spark_beanstalk.options import RECONNECT_FIRST, RECONNECT_MAX, SourceOptions

log = logging.getLogger("spark_beanstalk.source")


class BeanstalkSourceError(RuntimeError):
    """A broker the source needs cannot be used (unreachable past the bound, protocol error)."""


@dataclass
class Counters:
    """Per broker, shown in the query's progress."""

    reserved: int = 0
    touched: int = 0
    deleted: int = 0
    buried: int = 0
    replayed: int = 0
    lost: int = 0
    cleaned: int = 0
    reconnects: int = 0
    reacquired: int = 0
    lost_to_restart: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ResConn:
    """A reservation connection; what it holds is found in BrokerLink.held."""

    __slots__ = ("broker", "conn", "count", "dead", "last_touch", "min_ttr")

    def __init__(self, broker: BrokerLink, conn: Connection) -> None:
        self.broker = broker
        self.conn = conn
        self.count = 0              # jobs held on it (kept with BrokerLink.held)
        self.min_ttr = 0            # smallest TTR of what it holds: touches follow it
        self.last_touch = 0.0       # monotonic time every held job was last reserved/touched
        self.dead = False

    def touch_due(self, fraction: float) -> float:
        return self.last_touch + max(self.min_ttr, 1) * fraction


class Lot:
    """Jobs of one batch held on one connection (shared by all their entries in `held`)."""

    __slots__ = ("batch", "rc")

    def __init__(self, rc: ResConn, batch: Batch) -> None:
        self.rc = rc
        self.batch = batch


class BrokerLink:
    """A broker's connections, the jobs held on them, and its reachability.

    Every method expects the caller to hold ``lock`` (an RLock shared by the Spark calls,
    the touch thread and the background worker).
    """

    def __init__(self, host: str, port: int, opts: SourceOptions, broker: BrokerAddress | None = None) -> None:
        self.host = host                           # the server connected to (a cluster's leader)
        self.port = port
        self.broker = broker or BrokerAddress(f"{host}:{port}", (HostSpec(host, port, False),))
        self.address = self.broker.name            # stable across failovers: batches key on it
        self.member = self.broker.members[0]       # the member connected to (a cluster's last leader)
        self.opts = opts
        self.lock = threading.RLock()
        self.sid = ""
        self.control: Connection | None = None     # stats, identity checks, clean-up deletes
        self.conns: list[ResConn] = []
        self.held: dict[int, Lot] = {}             # THE record of what is held: job id -> (connection, batch)
        self.dirty = False                         # connections died holding jobs: re-acquire before reserving
        self.probe = 1                             # next reserve window (grows while jobs keep coming)
        self.counters = Counters()
        self.down_since: float | None = None       # monotonic
        self.down_since_wall = 0.0
        self.last_error = ""
        self.next_try = 0.0
        self.backoff = RECONNECT_FIRST
        self.was_up = False
        self.waiting_since: dict[int, float] = {}  # orphans still reserved elsewhere -> first seen
        self.closed = False                        # closed for good (the query stopped): never reconnect

    # --- connecting ------------------------------------------------------------------------
    @classmethod
    def of(cls, broker: BrokerAddress, opts: SourceOptions) -> BrokerLink:
        first = broker.members[0]
        return cls(first.host, first.port, opts, broker)

    def _connect_to(self, member: HostSpec) -> Connection:
        return Connection(member.host, member.port, timeout=self.opts.socket_timeout, connect_timeout=10.0,
                          **self.opts.security.connect_kwargs())

    def _connect(self) -> Connection:
        return self._connect_to(self.member)

    def connected(self) -> bool:
        return self.control is not None

    def open(self) -> bool:
        """Connect (control + numPartitions reservation connections); False and marked down on failure,
        False for good once closed: a thread still running after stop must not reconnect and re-reserve."""
        now = time.monotonic()
        if self.closed or now < self.next_try:
            return False
        try:
            # a cluster: follow its leader (found again on every reconnect); re-acquire then
            # finds the jobs held on the old leader ready on the new one, same ids and bodies
            leader = open_leader(self.broker, self._connect_to, self.member)
            self.control = leader.conn
            if leader.member != self.member and self.was_up:
                log.warning("beanstalk source: %s now leads %s", leader.member.address, self.address)
            self.member = leader.member
            self.host, self.port = leader.member.host, leader.member.port
            self.sid = str(leader.stats.get("id", ""))
            for _ in range(self.opts.num_partitions):
                self.conns.append(self.new_res_conn())
        except ConnectionLost as exc:
            self.reset(exc, quiet=True)
            self.mark_down(exc)
            return False
        if self.was_up:
            self.counters.reconnects += 1
            down = f" after {now - self.down_since:.1f}s down" if self.down_since is not None else ""
            log.warning("beanstalk source: reconnected to %s%s (reconnect %d; %d held jobs to re-acquire)",
                        self.address, down, self.counters.reconnects,
                        sum(1 for lot in self.held.values() if lot.rc.dead))
        self.was_up = True
        self.down_since = None
        self.backoff = RECONNECT_FIRST
        self.next_try = 0.0
        return True

    def mark_down(self, exc: Exception) -> None:
        self.last_error = str(exc)
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.down_since_wall = time.time()
            log.warning("beanstalk source: broker %s is down (%s); retrying", self.address, exc)
        self.next_try = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, RECONNECT_MAX)

    def down_for(self) -> float:
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def new_res_conn(self) -> ResConn:
        conn = self._connect()
        tubes = list(self.opts.tubes)
        cmds = [f"watch {t}\r\n".encode() for t in tubes]
        if "default" not in tubes:
            cmds.append(b"ignore default\r\n")
        for reply in conn.pipeline(cmds):
            if reply.status != b"WATCHING":
                conn.close()
                raise BeanstalkSourceError(
                    f"beanstalk source: {self.address} refused to watch {tubes}: {reply.status!r}")
        return ResConn(self, conn)

    def conn_with_room(self, start: int) -> tuple[int, ResConn]:
        """The first reservation connection at index >= start with room; opens one if none."""
        cap = self.opts.jobs_per_connection
        for i in range(start, len(self.conns)):
            if self.conns[i].count < cap:
                return i, self.conns[i]
        rc = self.new_res_conn()
        self.conns.append(rc)
        return len(self.conns) - 1, rc

    def reset(self, exc: Exception, quiet: bool = False) -> None:
        """A connection failed: drop them all. Whatever they held is back to ready in the broker
        (or gone, if it restarted without its binlog) and must be re-acquired before reading on."""
        for rc in self.conns:
            rc.dead = True
            rc.conn.close()
        if self.control is not None:
            self.control.close()
        orphans = sum(1 for lot in self.held.values() if lot.rc.dead)
        self.conns = []
        self.control = None
        self.dirty = bool(self.held)
        if not quiet:
            log.warning("beanstalk source: lost the connections to %s (%s) holding %d jobs; reconnecting",
                        self.address, exc, orphans)

    def close(self) -> None:
        """Close every connection for good (the broker releases what they held); see ``open``."""
        self.closed = True
        for rc in self.conns:
            rc.dead = True
            rc.conn.close()
        if self.control is not None:
            self.control.close()
        self.conns = []
        self.control = None

    # --- the held record --------------------------------------------------------------------
    def hold(self, rc: ResConn, batch: Batch, ids: list[int], ttrs: list[int], now: float) -> None:
        """Jobs just reserved (or re-acquired) on rc for `batch`."""
        if not ids:
            return
        lot = Lot(rc, batch)
        self.held.update(dict.fromkeys(ids, lot))
        if rc.count == 0:
            rc.last_touch = now
            rc.min_ttr = min(ttrs)
        else:
            rc.min_ttr = min(rc.min_ttr, min(ttrs))
        rc.count += len(ids)

    def unhold(self, ids: list[int]) -> None:
        """Jobs no longer held (deleted, released, lost)."""
        for jid in ids:
            lot = self.held.pop(jid, None)
            if lot is not None:
                lot.rc.count -= 1
                if lot.rc.count <= 0:
                    lot.rc.count = 0
                    lot.rc.min_ttr = 0
            self.waiting_since.pop(jid, None)

    def orphan(self, rc: ResConn, ids: list[int]) -> None:
        """Jobs that `rc`, though alive, no longer holds (a touch answered NOT_FOUND: their TTR
        passed). Re-acquired like those of a dead connection (identity-checked reserve-job, or a
        delete for a committed batch) instead of let go, which read them again into a later batch
        while this one delivered them."""
        lost = ResConn(self, rc.conn)
        lost.dead = True            # never touched or used: only marks the jobs for re-acquiring
        for jid in ids:
            lot = self.held.get(jid)
            if lot is not None and lot.rc is rc:
                rc.count = max(0, rc.count - 1)
                self.held[jid] = Lot(lost, lot.batch)
        self.dirty = True

    def held_by_conn(self, batch: Batch | None = None) -> dict[ResConn, list[int]]:
        """Live connection -> ids it holds (of `batch` only, if given)."""
        out: dict[ResConn, list[int]] = {}
        if batch is not None:
            cols = batch.jobs.get(self.address)
            for jid in cols.ids if cols else ():
                lot = self.held.get(jid)
                if lot is not None and lot.batch is batch and not lot.rc.dead:
                    out.setdefault(lot.rc, []).append(jid)
            return out
        for jid, lot in self.held.items():
            if not lot.rc.dead:
                out.setdefault(lot.rc, []).append(jid)
        return out

    def holds_for(self, batch: Batch) -> bool:
        cols = batch.jobs.get(self.address)
        return any((lot := self.held.get(jid)) is not None and lot.batch is batch for jid in (cols.ids if cols else ()))

    def orphans(self) -> dict[Batch, list[int]]:
        """Held jobs whose connection died, by batch."""
        out: dict[Batch, list[int]] = {}
        for jid, lot in self.held.items():
            if lot.rc.dead:
                out.setdefault(lot.batch, []).append(jid)
        return out

    def state(self) -> dict[str, Any]:
        entry: dict[str, Any] = dict(self.counters.as_dict(), held=len(self.held), connections=len(self.conns))
        if self.down_since is None and self.connected():
            entry["state"] = "up"
        else:
            entry["state"] = "down"
            entry["down_since"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.down_since_wall or time.time()))
            entry["down_seconds"] = round(self.down_for(), 1)
            entry["last_error"] = self.last_error
        return entry
