#!/usr/bin/env python3
"""Chaos soak: a streaming query reading while the broker is killed and the network cut, at
random, for as long as you give it; then every acknowledged job must be in the sink exactly once.

What runs (real processes, loopback): one broker with a binlog (ours, or beanstalkd 1.12 with
``--server beanstalkd``); a TCP proxy in front of it that the query reads through; a producer
thread putting uniquely numbered jobs straight to the broker at ``--rate`` jobs/s; the query
(``format("beanstalk")``, ``maxJobsPerTrigger``, a 500 ms trigger, a foreachBatch sink writing
one file per batch id, so a replayed batch overwrites its own file). A chaos thread waits a
random 2-10 s, then does one of:

  kill      SIGKILL the broker and start it again (same port, same binlog)
  cut       the proxy drops every connection the query holds
  partition the proxy refuses connections for 1-4 s (every connection dropped first)
  requery   stop the query and start it again from its checkpoint (a driver restart)

With ``--server cluster`` the broker is a replica set instead (etcd + 3 of our members,
``--sync-replicas 1``, docs/replication.md), read as ``cluster:a,b,c`` with no proxy; the producer
puts to whichever member leads. Its chaos:

  kill-leader   SIGKILL the leader; after 0.5-5 s start it again (it rejoins as a replica)
  kill-replica  the same for a member that does not lead
  requery       as above

After ``--minutes`` the chaos and the producer stop; the soak waits (``--drain-timeout``) for every
acknowledged job to reach the sink and the tube to be empty, then reports:

  lost        acknowledged (INSERTED) jobs not in any batch            must be 0
  duplicated  jobs in more than one batch                              must be 0
  unexpected  sink rows that were never put                            must be 0
  uncertain   puts whose reply was lost with the connection: each may be in the sink or not
  failures    times the query stopped with an error (it is then restarted from its checkpoint)

    python bench/soak.py --minutes 20                  # ours
    python bench/soak.py --minutes 5 --server beanstalkd
    python bench/soak.py --minutes 10 --server cluster
    python bench/soak.py --minutes 20 --actions cut,partition,requery   # one broker process throughout

Exit status 0 only if lost, duplicated, unexpected and failures are all 0. Writes a JSON summary
(``--out``, default bench/out/soak.json). A verification tool, not a benchmark: no speed figures.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (str(ROOT), str(ROOT / "bench")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from broker_bench import proc_status  # noqa: E402

from beanstalk_rules.hosts import parse_brokers  # noqa: E402
from spark_beanstalk.client import BeanstalkError, Connection  # noqa: E402
from spark_beanstalk.embedded import ServerProcess, start_server  # noqa: E402
from spark_beanstalk.leader import open_leader  # noqa: E402
from spark_beanstalk.session import get_spark  # noqa: E402
from tests.helpers import BatchFiles, ReplicaSet, TcpProxy, left_in, start_query, wait_until  # noqa: E402

TUBE = "t"
CHAOS = {  # action -> weight
    "single": {"kill": 4, "cut": 3, "partition": 1, "requery": 2},
    "cluster": {"kill-leader": 4, "kill-replica": 2, "requery": 2},
}


def connect(host: str, port: int) -> Connection:
    return Connection(host, port, timeout=5, connect_timeout=1)


class Producer(threading.Thread):
    """Puts ``s-<n>`` jobs to the broker (a cluster's leader); a put whose reply never came is "uncertain"."""

    def __init__(self, hosts: str, rate: float) -> None:
        super().__init__(name="producer", daemon=True)
        self.broker, self.rate = parse_brokers(hosts)[0], rate
        self.acked: set[str] = set()
        self.uncertain: set[str] = set()
        self.errors = 0
        self.stop = threading.Event()

    def run(self) -> None:
        n, conn = 0, None
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        while not self.stop.is_set():
            body = f"s-{n}"
            try:
                if conn is None:
                    conn = open_leader(self.broker, lambda spec: connect(spec.host, spec.port)).conn
                    conn.use(TUBE)
                conn.put(body.encode(), priority=100, ttr=60)
                self.acked.add(body)
                n += 1
            except (BeanstalkError, OSError):
                self.errors += 1
                if conn is not None:  # the put was sent (or half-sent): it may have been taken
                    self.uncertain.add(body)
                    n += 1
                    conn.close()
                    conn = None
                self.stop.wait(0.2)
            next_at = max(next_at + interval, time.monotonic() - 1.0)
            delay = next_at - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
        if conn is not None:
            conn.close()


class Soak:
    """The broker, the proxy, the query and the chaos; the counts of what happened."""

    def __init__(self, opts: argparse.Namespace, work: Path) -> None:
        self.opts, self.work = opts, work
        self.rng = random.Random(opts.seed)
        weights = CHAOS["cluster" if opts.server == "cluster" else "single"]
        chosen = opts.actions.split(",") if opts.actions else list(weights)
        unknown = sorted(set(chosen) - set(weights))
        if unknown:
            raise SystemExit(f"soak: --actions {','.join(unknown)} not one of {','.join(weights)} here")
        self.chaos_weights = {name: weights[name] for name in chosen}
        self.srv: ServerProcess | None = None
        self.proxy: TcpProxy | None = None
        self.rs: ReplicaSet | None = None
        if opts.server == "cluster":
            self.rs = ReplicaSet(str(work / "rs"))
            self.hosts = self.rs.hosts
            self.producer_hosts = self.rs.hosts
        else:
            binlog = work / "binlog"
            binlog.mkdir(parents=True)
            self.srv = start_server(opts.server, extra_args=["-b", str(binlog)], stderr_path=str(work / "server.log"))
            self.proxy = TcpProxy(self.srv.host, self.srv.port)
            self.hosts = self.proxy.address
            self.producer_hosts = self.srv.address
        self.spark = get_spark("spark-beanstalk-soak")
        self.sink = BatchFiles(work / "out")
        self.query: Any = None
        self.actions: Counter[str] = Counter()
        self.failures: list[str] = []
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.lock = threading.Lock()  # the chaos thread and the watcher both restart the query

    def start_query(self) -> None:
        self.query = start_query(self.spark, self.sink, self.work / "ckpt", self.hosts,
                                 maxJobsPerTrigger=self.opts.max_jobs)

    def restart_query(self, failed: bool) -> None:
        with self.lock:
            if failed:
                exc = self.query.exception()
                if exc is None:
                    return
                self.failures.append(str(exc)[:500])
                print(f"  query failed: {str(exc)[:200]}", flush=True)
            else:
                self.query.stop()
            self.start_query()

    def act(self, action: str) -> None:
        self.actions[action] += 1
        if action == "kill":
            assert self.srv is not None
            self.srv.restart()
        elif action == "cut":
            assert self.proxy is not None
            self.proxy.cut_all()
        elif action == "partition":
            assert self.proxy is not None
            self.proxy.cut()
            time.sleep(self.rng.uniform(1, 4))
            self.proxy.restore()
        elif action == "requery":
            self.restart_query(failed=False)
        elif action in ("kill-leader", "kill-replica"):
            self.kill_member(action == "kill-leader")

    def kill_member(self, leader: bool) -> None:
        """SIGKILL the leader (or another member), and start it again a little later."""
        assert self.rs is not None
        current = wait_until(self.rs.leader, 30, what="a leader")
        others = [m for m in self.rs.members if m is not current]
        victim = current if leader else self.rng.choice(others)
        victim.kill()
        time.sleep(self.rng.uniform(0.5, 5))
        victim.restart()

    def left(self) -> int:
        """Jobs of the tube ready or reserved on the broker (a cluster's leader; -1: none leads now)."""
        if self.rs is None:
            assert self.srv is not None
            return left_in(self.srv, TUBE)
        leader = self.rs.leader()
        return left_in(leader, TUBE) if leader is not None else -1

    def servers(self) -> list[tuple[ServerProcess, Path]]:
        """Each broker process and its binlog directory."""
        if self.rs is not None:
            return [(m, self.work / "rs" / f"m{i}") for i, m in enumerate(self.rs.members)]
        assert self.srv is not None
        return [(self.srv, self.work / "binlog")]

    def sample(self) -> None:
        """Each broker's RSS and binlog disk use (allocated blocks) now: neither may grow with the jobs that
        went through."""
        rss, disk = [], []
        for proc, binlog in self.servers():
            rss.append(round((proc_status(proc.pid, "VmRSS") or 0) / 2**20, 1))  # 0: down right now
            disk.append(round(sum(f.stat().st_blocks * 512 for f in binlog.rglob("*") if f.is_file()) / 2**20, 2))
        self.samples.append({"s": round(time.monotonic() - self.t0), "rss_mib": rss, "binlog_mib": disk,
                             "batches": len(list(self.sink.out.glob("*.json")))})
        print(f"  t={self.samples[-1]['s']}s rss MiB {rss} binlog MiB {disk} batches {self.samples[-1]['batches']}",
              flush=True)

    def chaos(self, until: float) -> None:
        last = time.monotonic()
        self.sample()
        while time.monotonic() < until:
            time.sleep(self.rng.uniform(2, 10))
            if time.monotonic() - last >= self.opts.sample_every:
                last = time.monotonic()
                self.sample()
            if self.query.exception() is not None:
                self.restart_query(failed=True)
            if time.monotonic() >= until:
                break
            names = list(self.chaos_weights)
            self.act(self.rng.choices(names, [self.chaos_weights[n] for n in names])[0])

    def delivered(self, expected: set[str]) -> bool:
        if self.query.exception() is not None:
            self.restart_query(failed=True)
        seen = {body for _, body in self.sink.seen()}
        return expected <= seen and self.left() == 0

    def close(self) -> None:
        if self.query is not None:
            self.query.stop()
        if self.proxy is not None:
            self.proxy.close()
        if self.srv is not None:
            self.srv.stop()
        if self.rs is not None:
            self.rs.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the chaos runs")
    p.add_argument("--server", choices=("ours", "beanstalkd", "cluster"), default="ours")
    p.add_argument("--rate", type=float, default=200.0, help="jobs/s the producer puts")
    p.add_argument("--max-jobs", type=int, default=300, help="the source's maxJobsPerTrigger")
    p.add_argument("--seed", type=int, default=None, help="the chaos schedule's random seed")
    p.add_argument("--drain-timeout", type=float, default=300.0, help="s to wait for the sink after the chaos")
    p.add_argument("--actions", default=None,
                   help="comma list of the chaos actions to use (default all; e.g. cut,partition,requery keeps "
                        "one broker process up throughout, to watch its RSS)")
    p.add_argument("--sample-every", type=float, default=60.0, help="s between RSS / binlog size samples")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "soak.json"))
    opts = p.parse_args(argv)
    if opts.seed is None:
        opts.seed = random.randrange(1 << 30)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        soak = Soak(opts, Path(tmp))
        producer = Producer(soak.producer_hosts, opts.rate)
        try:
            soak.start_query()
            producer.start()
            print(f"soak: {opts.server}, {opts.minutes:g} min, seed {opts.seed}, {opts.rate:g} jobs/s", flush=True)
            soak.chaos(time.monotonic() + opts.minutes * 60)
            producer.stop.set()
            producer.join(30)
            stopped = time.monotonic()
            drained = True
            try:
                wait_until(lambda: soak.delivered(producer.acked), opts.drain_timeout, interval=0.5,
                           what="every acknowledged job in the sink and the tube empty")
            except TimeoutError:
                drained = False
            drain_s = time.monotonic() - stopped
            soak.sample()
            rows = soak.sink.seen()
            batches = len(soak.sink.batches())
        finally:
            producer.stop.set()
            soak.close()
    bodies = Counter(body for _, body in rows.elements())
    seen = set(bodies)
    result = {
        "server": opts.server, "minutes": opts.minutes, "seed": opts.seed, "rate": opts.rate,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "actions": dict(soak.actions), "acked": len(producer.acked), "uncertain": len(producer.uncertain),
        "uncertain_delivered": len(producer.uncertain & seen), "producer_errors": producer.errors,
        "delivered": len(seen), "batches": batches, "drained": drained, "drain_seconds": round(drain_s, 1),
        "lost": sorted(producer.acked - seen)[:20], "lost_count": len(producer.acked - seen),
        "duplicated": sorted(b for b, n in bodies.items() if n > 1)[:20],
        "duplicated_count": sum(1 for n in bodies.values() if n > 1),
        "unexpected_count": len(seen - producer.acked - producer.uncertain),
        "failures": soak.failures, "samples": soak.samples,
    }
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("lost", "duplicated", "samples")}, indent=2))
    ok = drained and not (result["lost_count"] or result["duplicated_count"] or result["unexpected_count"]
                          or soak.failures)
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
