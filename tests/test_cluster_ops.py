"""Operating a replica set (issue 15 items 4-5): the ``cluster:`` host spec, the ops CLI and the
dashboard on etcd + 3 real members. `stats` shows each member's role, epoch and lag, verbs go
to the leader whichever member is listed first, and the dashboard's overview has a
role/epoch/lag cell per member.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from click.testing import CliRunner

from beanstalk_rules.hosts import parse_brokers, parse_host_specs
from spark_beanstalk.cli import main
from spark_beanstalk.dashboard.app import create_app
from spark_beanstalk.dashboard.command import tcp_endpoint
from spark_beanstalk.dashboard.guard import Guard
from spark_beanstalk.options import OptionError, SourceOptions, WriterOptions
from tests.helpers import ReplicaSet, TopProcess, wait_until


def test_cluster_spec_is_one_logical_broker():
    (cluster, plain) = parse_brokers("cluster:a:1,b,tls://c:3;d:4")
    assert cluster.is_cluster and not plain.is_cluster
    assert cluster.name == "cluster:a:1,b:11300,c:3"
    assert [m.address for m in cluster.members] == ["a:1", "b:11300", "c:3"]
    assert cluster.members[2].tls and plain.name == "d:4"
    assert [h.address for h in parse_host_specs("cluster:a:1,b:2")] == ["a:1", "b:2"]   # every server
    opts = SourceOptions.parse({"hosts": "cluster:a:1,b:2"})
    assert opts.addresses == ["cluster:a:1,b:2"] and len(opts.links()) == 1
    assert WriterOptions.parse({"hosts": "cluster:a:1,b:2;c:3"}).host_names() == ["cluster:a:1,b:2", "c:3"]
    for bad, says in (("cluster:", "names no member"), ("cluster:a:1,a:1", "twice"), ("cluster:a:x", "not a number")):
        with pytest.raises(ValueError, match=says):
            parse_brokers(bad)
    with pytest.raises(OptionError, match="twice"):
        SourceOptions.parse({"hosts": "cluster:a:1,b:2;b:2"})


def _cli(*argv: str) -> Any:
    result = CliRunner().invoke(main, list(argv), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def _members(hosts: str) -> dict[str, dict[str, Any]]:
    out = json.loads(_cli("stats", "-H", hosts, "--json").output)
    return {row["member"]: row for row in out["members"]}


@pytest.fixture
def replica_set(tmp_path):
    rs = ReplicaSet(str(tmp_path / "rs"))
    yield rs
    rs.stop()


async def _overview(rs: ReplicaSet, want: int) -> list[dict[str, Any]]:
    """The dashboard's server rows once `want` of them report a role; and the page's cells."""
    app = create_app([tcp_endpoint(m.host, m.port, None) for m in rs.members], Guard())
    async with TestServer(app, host="127.0.0.1") as ts, ClientSession(str(ts.make_url(""))) as http:
        for _ in range(100):
            async with http.get("/api/overview") as resp:
                servers: list[dict[str, Any]] = (await resp.json())["servers"]
            if sum(1 for s in servers if s.get("replication")) >= want:
                break
            await asyncio.sleep(0.1)
        async with http.get("/") as resp:
            page = await resp.text()
    assert "role / epoch / lag" in page and "leader · epoch" in page
    return servers


def test_stats_put_and_dashboard_follow_the_leader(replica_set):
    rs = replica_set
    leader = rs.leader()
    assert leader is not None
    # a replica listed first: verbs must still reach the leader
    ordered = sorted(rs.members, key=lambda m: m is leader)
    hosts = "cluster:" + ",".join(m.address for m in ordered)
    put = json.loads(_cli("put", "hello", "-t", "ops", "-H", hosts, "--json").output)
    assert put["id"] > 0
    rows = _members(hosts)
    assert rows[leader.address]["role"] == "leader"
    epoch = rows[leader.address]["epoch"]
    assert sorted(r["role"] for r in rows.values()) == ["leader", "replica", "replica"]
    assert {r["epoch"] for r in rows.values()} == {epoch}
    wait_until(lambda: all(r["lag_records"] == 0 for r in _members(hosts).values()), 10, what="replicas caught up")
    text = _cli("stats", "-H", hosts).output
    assert "members of cluster:" in text and "stats of the leader" in text

    servers = asyncio.run(_overview(rs, 3))
    cells = {s["name"]: s["replication"] for s in servers}
    assert cells[leader.address] == f"leader · epoch {epoch}"
    assert sum(1 for c in cells.values() if c.startswith(f"replica · epoch {epoch} · lag ")) == 2

    rs.kill_leader()
    wait_until(lambda: rs.leader() not in (None, leader), 15, what="a new leader")
    after = _members(hosts)
    assert after[leader.address]["role"] == "unreachable"
    new = [r for r in after.values() if r["role"] == "leader"]
    assert len(new) == 1 and new[0]["epoch"] > epoch
    _cli("put", "after", "-t", "ops", "-H", hosts)                       # taken by the new leader
    tube = json.loads(_cli("stats", "ops", "-H", hosts, "--json").output)
    assert tube["current-jobs-ready"] == 2                              # the first put survived the failover


def test_top_follows_the_leader_through_a_failover(replica_set):
    """`top -H cluster:...` left running shows the leader, then the new leader after the old one is killed."""
    rs = replica_set
    with TopProcess(rs.hosts) as top:
        first = top.wait_for(lambda f: "server" in f, "top's first refresh")
        old = rs.kill_leader()
        assert first["address"] == old.address
        after = top.wait_for(lambda f: "server" in f and f["address"] != old.address, "top on the new leader")
        assert top.running()
    new = rs.leader()
    assert new is not None and after["address"] == new.address
