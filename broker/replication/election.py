"""Leadership through etcd: a lease per member, one leader key, elections by log position.

Keys under ``/<cluster>/`` (values JSON):

* ``members/<name>`` - {name, client, repl}: a member is alive while its lease is;
* ``leader`` - {name, client, repl}, put with the leader's lease only if absent (one etcd
  transaction); its create revision is the leader's **epoch** (etcd revisions only grow, so
  every epoch is higher than any before it);
* ``handover`` - {target, granted}: ``spark-beanstalk promote`` asks for ``target`` to lead
  next; the leader grants it (and steps down) once the target has every record, and only a
  granted handover lets the target win without the position check.

Election: a member that sees no leader stops following and asks every other live member
(over its replication listener, ``role``) for its position, the (epoch, seq) of its last
record. It tries to create the leader key only if no live candidate is ahead of it (epoch,
then seq, then name), or if it is the handover target. A live member that cannot be asked
blocks the election until it answers or its lease lapses: no deadline ever lets a member
with an older log win. Why this keeps acknowledged records: a replica acknowledges a record
only after applying it, the old leader acknowledges to clients only before its lease ends,
and the leader key disappears only after that; so every record a client was told about is
already in the position a surviving replica reports. With ``--sync-replicas N`` such a
replica exists while one of the N that acknowledged survives.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from broker import logs
from broker.replication.etcd import EtcdClient, EtcdError, KeyValue
from broker.replication.member import split_address

if TYPE_CHECKING:
    from broker.replication.member import Member

log = logging.getLogger("broker.replication")
POLL = 0.1
ASK_TIMEOUT = 0.5


class EtcdLeadership:
    def __init__(self, member: Member) -> None:
        cfg = member.config
        assert cfg.etcd is not None
        self.member = member
        self.etcd = EtcdClient(cfg.etcd, timeout=max(0.5, cfg.lease_ttl / 2))
        base = f"/{cfg.cluster}/"
        self.k_leader = base + "leader"
        self.k_members = base + "members/"
        self.k_handover = base + "handover"
        self.lease = 0
        self.margin = min(0.25, cfg.lease_ttl * 0.2)
        repl = cfg.listen
        self.me = json.dumps({"name": cfg.name, "client": cfg.client_address,
                              "repl": f"{repl[0]}:{repl[1]}" if repl else ""}).encode()
        self._last_error = ""
        self._member_loop: asyncio.AbstractEventLoop | None = None
        self._resigning = asyncio.Event()
        self._ended = asyncio.Event()

    async def run(self) -> None:
        self._member_loop = asyncio.get_running_loop()
        keeper = LeaseKeeper(self)
        keeper.start()
        try:
            while not self._resigning.is_set():
                try:
                    if not self.lease:
                        await self._register()
                    await self._step()
                    self._last_error = ""
                except EtcdError as exc:
                    if str(exc) != self._last_error:
                        logs.event(log, logging.WARNING, "etcd", str(exc))
                    self._last_error = str(exc)
                except Exception:  # a bug must not end elections for good: log it, go on
                    log.exception("leadership step failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._resigning.wait(), POLL)
            await self._drop_lease()
        finally:
            keeper.stop()
            await self.etcd.close()
            self._ended.set()

    async def resign(self, timeout: float) -> None:
        """The member is shutting down: end the polls and give the lease back. The leader key and the
        member key go with it, so the replicas elect one of them at their next poll instead of after
        the lease lapses (they would wait up to --lease-ttl for a leader that is gone)."""
        self._resigning.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ended.wait(), timeout)

    # -- the lease -------------------------------------------------------------------------
    async def _register(self) -> None:
        """A lease, then this member's key under it. The lease counts as ours only once the key is
        written: a member without a key is one elections never ask, so it must not keep a lease
        (and go on as if registered) after a failed put; the next poll registers afresh."""
        sent = time.monotonic()
        lease, ttl = await self.etcd.grant(self.member.config.lease_ttl)
        try:
            await self.etcd.put(self.k_members + self.member.config.name, self.me, lease)
        except EtcdError:
            with contextlib.suppress(EtcdError):  # unreachable: it expires by itself
                await self.etcd.revoke(lease)
            raise
        self.lease = lease
        self.member.lease_until = sent + ttl - self.margin

    def renewed(self, lease: int, sent: float, ttl: int) -> None:
        """A keep-alive sent at `sent` came back (on the keeper's thread): extend the lease, or, if etcd
        no longer knows it, step down (on the member's loop)."""
        if lease != self.lease:
            return
        if ttl > 0:
            self.member.lease_until = sent + ttl - self.margin
        else:
            self._loop_call(self._lease_lost, lease)

    def _lease_lost(self, lease: int) -> None:
        if lease == self.lease:
            self.lease = 0
            self.member.step_down("lease lost")

    def _loop_call(self, func: Any, *args: Any) -> None:
        loop = self._member_loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(func, *args)

    async def _drop_lease(self) -> None:
        lease, self.lease = self.lease, 0
        if lease:
            with contextlib.suppress(EtcdError):  # unreachable: it expires by itself
                await self.etcd.revoke(lease)

    # -- one poll --------------------------------------------------------------------------
    async def _step(self) -> None:
        member = self.member
        leader = await self.etcd.get(self.k_leader)
        if member.role == "leader":
            if leader is None or leader.lease != self.lease:
                member.step_down("the leader key is gone")
                await self._drop_lease()
            else:
                await self._maybe_hand_over()
            return
        if member.lease_until and member.lease_until < time.monotonic() and self.lease:
            await self._drop_lease()  # a lease we could not renew in time: start afresh
            return
        if leader is not None and leader.lease == self.lease:
            await self._drop_lease()  # we stepped down (demote, fencing) but still hold the key: let it go
            return
        if member.promote_requested:
            member.promote_requested = False
            await self.etcd.put(self.k_handover, json.dumps({"target": member.config.name, "granted": False}).encode(),
                                self.lease)
        if leader is not None:
            info = _json(leader)
            if info.get("name") != member.config.name and info.get("repl"):
                host, port = split_address(str(info["repl"]))
                member.follow(str(info.get("name", "")), host, port)
            return
        await self._elect()

    async def _maybe_hand_over(self) -> None:
        handover = await self.etcd.get(self.k_handover)
        if handover is None:
            return
        request = _json(handover)
        target = str(request.get("target", ""))
        if target == self.member.config.name or request.get("granted"):
            await self.etcd.delete(self.k_handover)  # stale: a finished handover, or one to us
            return
        source = self.member.source
        if any(s.name == target and s.acked >= source.seq for s in source.sessions):
            # The target has every record: step down at once, in the same step as that check, so no
            # change can be acknowledged after it (another replica's acks would otherwise release
            # replies while the grant is written, and the target, skipping the position check, would
            # win without those records). Then grant: it may skip the check. If writing the grant
            # fails, the lease goes back and an ordinary election follows.
            self.member.no_candidacy_until = time.monotonic() + 3 * self.member.config.lease_ttl
            self.member.step_down(f"handing over to {target}")
            granted = json.dumps({"target": target, "granted": True}).encode()
            try:
                await self.etcd.put(self.k_handover, granted, handover.lease)
            finally:
                await self._drop_lease()

    # -- elections ---------------------------------------------------------------------------
    async def _elect(self) -> None:
        member = self.member
        await member.stop_following()
        if not member.may_lead():
            await self._await_leader()
            return
        pos = member.position()
        name = member.config.name
        handover = await self.etcd.get(self.k_handover)
        request = _json(handover) if handover is not None else {}
        wanted = str(request.get("target", "")) if request.get("granted") else ""
        for kv in await self.etcd.get_prefix(self.k_members):
            other = kv.key[len(self.k_members):]
            if other == name:
                continue
            info = _json(kv)
            state = await member.ask_role(str(info.get("repl", "")), ASK_TIMEOUT)
            if state is None:
                return  # a live member we cannot ask: decide nothing without it (next poll asks again)
            ahead = (state.epoch, state.seq, other) > (pos.epoch, pos.seq, name)
            if state.role == "leader" or (state.candidate and (other == wanted or (wanted != name and ahead))):
                await self._await_leader()
                return
        epoch = await self.etcd.create(self.k_leader, self.me, self.lease)
        if epoch is not None and time.monotonic() < member.lease_until:
            member.become_leader(epoch)
            if wanted == name:
                await self.etcd.delete(self.k_handover)

    async def _await_leader(self) -> None:
        deadline = time.monotonic() + self.member.config.lease_ttl + 1.0
        while time.monotonic() < deadline:
            if await self.etcd.get(self.k_leader) is not None:
                return
            await asyncio.sleep(POLL / 2)


class LeaseKeeper(threading.Thread):
    """Renews the member's lease from a thread of its own, with its own event loop and etcd client.

    Why not a task on the member's loop: a leader whose loop is busy for longer than the lease
    TTL (sending a snapshot of many jobs to a replica that rejoins) lost its lease, was fenced,
    and the next leader, snapshotting the same replicas, lost its own: the replica set changed
    leaders every second and acknowledged almost nothing (bench/soak.py --side write --server
    cluster). A busy loop is not a partition; a member cut off from etcd still loses its lease
    and fences itself (the gate checks ``lease_until``), as before.
    """

    def __init__(self, leadership: EtcdLeadership) -> None:
        super().__init__(name="etcd-lease-keeper", daemon=True)
        self.leadership = leadership
        cfg = leadership.member.config
        assert cfg.etcd is not None
        self.endpoint, self.ttl = cfg.etcd, cfg.lease_ttl
        self._stopping = threading.Event()

    def run(self) -> None:
        asyncio.run(self._renew())

    async def _renew(self) -> None:
        etcd = EtcdClient(self.endpoint, timeout=max(0.5, self.ttl / 2))
        try:
            while not self._stopping.wait(self.ttl / 4):
                lease = self.leadership.lease
                if not lease:
                    continue
                sent = time.monotonic()
                try:
                    ttl = await etcd.keepalive(lease)
                except EtcdError:
                    continue  # etcd unreachable: the gate fences at lease_until by itself
                except Exception:
                    log.exception("lease keep-alive failed")
                    continue
                self.leadership.renewed(lease, sent, ttl)
        finally:
            await etcd.close()

    def stop(self) -> None:
        self._stopping.set()


def _json(kv: KeyValue) -> dict[str, Any]:
    try:
        value = json.loads(kv.value)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
