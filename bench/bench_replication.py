#!/usr/bin/env python3
"""Replication benchmark: what replicas cost a put, and how long a failover takes.

1. put throughput (loadgen, 100-byte bodies) in the same run, configurations alternating
   per repetition: a single broker with ``-b -f 0`` and ``-b -f 50``; a leader with one
   replica, asynchronous (``-f 50``); the same with ``--sync-replicas 1`` (``-f 50`` and
   ``-f 0``). Medians over --reps.
2. failover: etcd + 3 members (``--sync-replicas 1``, lease TTL --ttl s), holding --jobs ready
   jobs; the leader is SIGKILLed (``--how stop``: SIGTERMed, a planned restart) --rounds times;
   each round measures kill -> first put
   acknowledged by a new leader (probing every member; with --sync-replicas 1 that put waits
   for a replica to catch up with the new leader), kill -> the surviving replica in step with
   it, and how the replicas joined (backlog or snapshot); then it restarts the killed member as
   a replica and waits until it has caught up.

    python bench/bench_replication.py                       # ~2 min on 2 cores
    python bench/bench_replication.py --only failover --rounds 10 --jobs 150000
    python bench/bench_replication.py --only failover --rounds 10 --how stop

Prints a markdown summary and writes bench/out/replication.json.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import BENCH, OUT, ROOT, broker_bench  # noqa: F401 (puts the repository on sys.path)

from spark_beanstalk.client import BeanstalkError, Connection
from spark_beanstalk.embedded import (
    ServerProcess,
    broker_process,
    etcd_process,
    member_process,
    wait_until,
)
from tests.helpers import ReplicaSet, member_stats

bb = broker_bench()

CONFIGS = ("single -f 0", "single -f 50", "async -f 50", "sync1 -f 50", "sync1 -f 0")


def _role(proc: ServerProcess) -> str:
    return str((member_stats(proc) or {}).get("replication-role", ""))


def _start_config(name: str, tmp: str) -> list[ServerProcess]:
    """The processes of one configuration; the first one takes the puts."""
    kind, fsync = name.split(" ", 1)
    flags = fsync.split()
    if kind == "single":
        return [broker_process(extra_args=["-b", f"{tmp}/a", *flags]).start(timeout=60)]
    sync = 1 if kind == "sync1" else 0
    leader = member_process(f"{tmp}/a", sync_replicas=sync, extra_args=flags).start(timeout=60)
    replica = member_process(f"{tmp}/b", replica_of=leader.repl_address, extra_args=flags).start(timeout=60)
    wait_until(lambda: _role(replica) == "replica", 30, what="the replica")
    return [leader, replica]


def put_throughput(opts) -> list[dict]:
    shapes = [tuple(int(x) for x in s.split("x")) for s in opts.shapes.split(",")]
    rows = []
    for conns, depth in shapes:
        runs: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for rep in range(opts.reps):
            for name in (CONFIGS if rep % 2 == 0 else tuple(reversed(CONFIGS))):
                tmp = tempfile.mkdtemp(prefix="bench-repl-")
                procs = _start_config(name, tmp)
                try:
                    srv = procs[0]
                    data = bb.run_loadgen(["-h", srv.host, "-p", str(srv.port), "-P", str(srv.pid), "-s", "100",
                                           "-w", "put", "-c", str(conns), "-d", str(depth), "-t", str(opts.seconds),
                                           "-W", "0.5", "-T", "bench"], None, timeout=opts.seconds + 120)
                    runs[name].append(data["ops_per_s"])
                finally:
                    for proc in reversed(procs):
                        proc.stop()
                    shutil.rmtree(tmp, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in runs.items()}
        rows.append({"conns": conns, "depth": depth, "puts_per_s": med, "runs": runs})
        print(f"  {conns}x{depth}: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in med.items()), flush=True)
    return rows


def _load(leader: ServerProcess, jobs: int) -> None:
    from spark_beanstalk.client import encode_put

    with Connection(leader.host, leader.port, timeout=120) as conn:
        for start in range(0, jobs, 10_000):
            for reply in conn.pipeline([encode_put(b"x" * 100, 100, 0, 60)] * min(10_000, jobs - start)):
                if reply.status != b"INSERTED":
                    raise RuntimeError(f"loading jobs: {reply}")


def failover(opts) -> dict:
    tmp = tempfile.mkdtemp(prefix="bench-failover-")
    etcd = etcd_process(f"{tmp}/etcd").start()
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    members = [member_process(f"{tmp}/m{n}", etcd=f"http://{etcd.address}", name=f"m{n}", sync_replicas=1,
                              lease_ttl=opts.ttl, stderr_path=str(OUT / "logs" / f"failover-m{n}.log"),
                              extra_args=["-V"]) for n in range(3)]
    times, in_step, joins = [], [], []
    try:
        for m in members:
            m.start(timeout=60)
        leader = wait_until(lambda: next((m for m in members if _role(m) == "leader"), None), 30, what="a leader")
        if opts.jobs:
            _load(leader, opts.jobs)
        for _ in range(opts.rounds):
            leader = wait_until(lambda: next((m for m in members if _role(m) == "leader"), None), 30, what="a leader")
            for m in members:
                if m is not leader:
                    wait_until(lambda m=m, leader=leader: ReplicaSet.caught_up(leader, m), 120, what="replicas in step")
            t_kill = time.monotonic()
            if opts.how == "stop":
                leader.stop()  # SIGTERM: a planned restart (the leader hands over before it exits)
            else:
                leader.kill()
            times.append(_first_put(members, t_kill))
            new = wait_until(lambda: next((m for m in members if _role(m) == "leader"), None), 30, what="a leader")
            other = next(m for m in members if m is not new and m is not leader)
            wait_until(lambda new=new, other=other: ReplicaSet.caught_up(new, other), 120, what="the replica in step")
            in_step.append(time.monotonic() - t_kill)
            stats = member_stats(new) or {}
            joins.append({"backlog": stats.get("replication-joined-by-backlog"),
                          "snapshot": stats.get("replication-joined-by-snapshot")})
            print(f"  failover {len(times)}: first put {times[-1]:.2f} s, replica in step {in_step[-1]:.2f} s, "
                  f"joined by {joins[-1]}", flush=True)
            leader.start(timeout=60)
    finally:
        for m in members:
            m.stop()
        etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"seconds": times, "median": statistics.median(times), "max": max(times), "min": min(times),
            "in_step_seconds": in_step, "in_step_median": statistics.median(in_step), "joins": joins,
            "jobs": opts.jobs, "lease_ttl": opts.ttl, "how": opts.how}


def _first_put(members: list[ServerProcess], t_kill: float) -> float:
    while time.monotonic() - t_kill < 30:
        for m in members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            try:
                with Connection(m.host, m.port, timeout=2, connect_timeout=0.3) as conn:
                    conn.put(b"probe")
                    return time.monotonic() - t_kill
            except (BeanstalkError, OSError):
                pass
        time.sleep(0.01)
    raise RuntimeError("no new leader within 30 s")


def markdown(res: dict) -> str:
    lines = []
    if "put" in res:
        lines += ["| shape | " + " | ".join(CONFIGS) + " |", "|---|" + "---:|" * len(CONFIGS)]
        for row in res["put"]:
            lines.append(f"| {row['conns']}x{row['depth']} | "
                         + " | ".join(f"{row['puts_per_s'][c]:,.0f}" for c in CONFIGS) + " |")
    if "failover" in res:
        f = res["failover"]
        lines.append("")
        how = "SIGTERM" if f.get("how") == "stop" else "kill"
        lines.append(f"failover with {f['jobs']:,} jobs ({how} -> first acknowledged put, "
                     f"lease TTL {f['lease_ttl']} s, {len(f['seconds'])} rounds): "
                     f"min {f['min']:.2f} s, median {f['median']:.2f} s, max {f['max']:.2f} s; "
                     + ", ".join(f"{t:.2f}" for t in f["seconds"]))
        lines.append(f"{how} -> the other replica in step with the new leader: median {f['in_step_median']:.2f} s; "
                     + ", ".join(f"{t:.2f}" for t in f["in_step_seconds"]))
        lines.append("how the replicas joined each new leader: "
                     + ", ".join(f"{j['backlog']} backlog / {j['snapshot']} snapshot" for j in f["joins"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="put,failover", help="comma list of: put, failover")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--shapes", default="1x1,50x1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ttl", type=int, default=1)
    p.add_argument("--jobs", type=int, default=0, help="ready jobs in the queue during the failovers")
    p.add_argument("--how", choices=("kill", "stop"), default="kill",
                   help="end the leader with SIGKILL (a crash) or SIGTERM (a planned restart)")
    p.add_argument("--out", default=str(OUT / "replication.json"))
    opts = p.parse_args(argv)
    only = set(opts.only.split(","))
    res: dict = {"meta": {"started_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                          "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "args": vars(opts)}}
    if "put" in only:
        bb.build_loadgen()
        print("put throughput:", flush=True)
        res["put"] = put_throughput(opts)
    if "failover" in only:
        print("failover:", flush=True)
        res["failover"] = failover(opts)
    res["meta"]["loadavg_end"] = os.getloadavg()
    res["table_md"] = markdown(res)
    OUT.mkdir(exist_ok=True)
    Path(opts.out).write_text(json.dumps(res, indent=1))
    print()
    print(res["table_md"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
