"""Leadership through etcd: a lease per member, one leader key, elections by log position.

Keys under ``/<cluster>/`` (values JSON):

* ``members/<name>`` - {client, repl}: a member is alive while its lease is;
* ``leader`` - {name, client, repl}, put with the leader's lease only if absent (one etcd
  transaction); its create revision is the leader's **epoch** (etcd revisions only grow, so
  every epoch is higher than any before it);
* ``pos/<name>`` - {round, epoch, seq, candidate}: a member's last record, posted when it
  sees no leader; ``round`` is the epoch of the last leader it saw;
* ``handover`` - a member's name: ``spark-beanstalk promote`` asks for it to lead next.

Election: a member that sees no leader stops following, posts its position, and waits
until every live member has posted for the same round (or ``SETTLE`` seconds). The
candidate with the newest position (epoch, then seq, then name) - or the handover target -
creates the leader key; the others wait for it, and go again if it does not appear. With
``--sync-replicas N``, an acknowledged record is on at least N replicas, so while one of
those lives the winner has every acknowledged change.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from broker import logs
from broker.replication.etcd import EtcdClient, EtcdError, KeyValue
from broker.replication.member import split_address

if TYPE_CHECKING:
    from broker.replication.member import Member

log = logging.getLogger("broker.replication")
POLL = 0.1
SETTLE = 0.6


class EtcdLeadership:
    def __init__(self, member: Member) -> None:
        cfg = member.config
        assert cfg.etcd is not None
        self.member = member
        self.etcd = EtcdClient(cfg.etcd, timeout=max(0.5, cfg.lease_ttl / 2))
        self.keepalive_etcd = EtcdClient(cfg.etcd, timeout=max(0.5, cfg.lease_ttl / 2))
        base = f"/{cfg.cluster}/"
        self.k_leader = base + "leader"
        self.k_members = base + "members/"
        self.k_pos = base + "pos/"
        self.k_handover = base + "handover"
        self.lease = 0
        self.round = 0
        self.margin = min(0.25, cfg.lease_ttl * 0.2)
        repl = cfg.listen
        self.me = json.dumps({"name": cfg.name, "client": cfg.client_address,
                              "repl": f"{repl[0]}:{repl[1]}" if repl else ""}).encode()
        self._last_error = ""

    async def run(self) -> None:
        keepalive = asyncio.get_running_loop().create_task(self._keepalive())
        try:
            while True:
                try:
                    if not self.lease:
                        await self._register()
                    await self._step()
                    self._last_error = ""
                except EtcdError as exc:
                    if str(exc) != self._last_error:
                        logs.event(log, logging.WARNING, "etcd", str(exc))
                    self._last_error = str(exc)
                await asyncio.sleep(POLL)
        finally:
            keepalive.cancel()
            await self.etcd.close()
            await self.keepalive_etcd.close()

    # -- the lease -------------------------------------------------------------------------
    async def _register(self) -> None:
        sent = time.monotonic()
        lease, ttl = await self.etcd.grant(self.member.config.lease_ttl)
        self.lease = lease
        self.member.lease_until = sent + ttl - self.margin
        await self.etcd.put(self.k_members + self.member.config.name, self.me, lease)

    async def _keepalive(self) -> None:
        interval = self.member.config.lease_ttl / 4
        while True:
            await asyncio.sleep(interval)
            lease = self.lease
            if not lease:
                continue
            sent = time.monotonic()
            try:
                ttl = await self.keepalive_etcd.keepalive(lease)
            except EtcdError:
                continue  # the gate fences at lease_until by itself
            if lease != self.lease:
                continue
            if ttl <= 0:
                self.lease = 0
                self.member.step_down("lease lost")
            else:
                self.member.lease_until = sent + ttl - self.margin

    async def _drop_lease(self) -> None:
        lease, self.lease = self.lease, 0
        if lease:
            try:
                await self.etcd.revoke(lease)
            except EtcdError:
                pass  # unreachable: it expires by itself

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
            await self.etcd.put(self.k_handover, member.config.name.encode(), self.lease)
        if leader is not None:
            info = _json(leader)
            self.round = leader.create_revision
            if info.get("name") != member.config.name and info.get("repl"):
                host, port = split_address(str(info["repl"]))
                member.follow(str(info.get("name", "")), host, port)
            return
        await self._elect()

    async def _maybe_hand_over(self) -> None:
        handover = await self.etcd.get(self.k_handover)
        if handover is None:
            return
        target = handover.value.decode()
        if target == self.member.config.name:
            await self.etcd.delete(self.k_handover)
            return
        source = self.member.source
        if any(s.name == target and s.acked >= source.seq for s in source.sessions):
            self.member.no_candidacy_until = time.monotonic() + 3 * self.member.config.lease_ttl
            self.member.step_down(f"handing over to {target}")
            await self._drop_lease()

    # -- elections ---------------------------------------------------------------------------
    async def _elect(self) -> None:
        member = self.member
        await member.stop_following()
        pos = member.position()
        name = member.config.name
        mine = {"round": self.round, "epoch": pos.epoch, "seq": pos.seq, "candidate": member.may_lead()}
        await self.etcd.put(self.k_pos + name, json.dumps(mine).encode(), self.lease)
        posted = await self._gather()
        if posted is None:
            return  # a leader appeared meanwhile
        handover = await self.etcd.get(self.k_handover)
        wanted = handover.value.decode() if handover is not None else ""
        candidates = {n: v for n, v in posted.items() if v.get("candidate")}
        if not candidates:
            return
        best = wanted if wanted in candidates else max(
            candidates, key=lambda n: (int(candidates[n]["epoch"]), int(candidates[n]["seq"]), n))
        if best != name:
            await self._await_leader()
            return
        epoch = await self.etcd.create(self.k_leader, self.me, self.lease)
        if epoch is not None and time.monotonic() < member.lease_until:
            member.become_leader(epoch)
            self.round = epoch
            if wanted == name:
                await self.etcd.delete(self.k_handover)

    async def _gather(self) -> dict[str, dict[str, Any]] | None:
        deadline = time.monotonic() + SETTLE
        while True:
            live = {kv.key[len(self.k_members):] for kv in await self.etcd.get_prefix(self.k_members)}
            posted = {}
            for kv in await self.etcd.get_prefix(self.k_pos):
                value = _json(kv)
                who = kv.key[len(self.k_pos):]
                if who in live and value.get("round") == self.round:
                    posted[who] = value
            if live <= posted.keys() or time.monotonic() > deadline:
                return posted
            if await self.etcd.get(self.k_leader) is not None:
                return None
            await asyncio.sleep(POLL / 2)

    async def _await_leader(self) -> None:
        deadline = time.monotonic() + self.member.config.lease_ttl + 1.0
        while time.monotonic() < deadline:
            if await self.etcd.get(self.k_leader) is not None:
                return
            await asyncio.sleep(POLL / 2)


def _json(kv: KeyValue) -> dict[str, Any]:
    try:
        value = json.loads(kv.value)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
