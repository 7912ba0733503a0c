#!/usr/bin/env python3
"""Chaos soak: a streaming query reading from (or writing to) a broker that is killed and cut off at
random, for as long as you give it; then every job must have arrived, and the counts must add up.

What runs (real processes, loopback): one broker with a binlog (ours, or beanstalkd 1.12 with
``--server beanstalkd``); a TCP proxy in front of it that the query talks through; and one of two
workloads (``--side``):

  read   (default) a producer thread puts uniquely numbered jobs straight to the broker at ``--rate``
         jobs/s; the query (``format("beanstalk")``, ``maxJobsPerTrigger``, a 500 ms trigger) reads them
         into a foreachBatch sink writing one file per batch id, so a replayed batch overwrites its file.
  write  the query reads Spark's ``rate-micro-batch`` source (``--rows-per-batch`` numbered rows a
         batch, every 500 ms; batch b holds exactly the rows b*R .. b*R+R-1, also when replayed) and puts
         them through the proxy with ``foreachBatch(beanstalk_put)`` or, with ``--sink format``, with the
         ``format("beanstalk")`` stream sink.

A chaos thread waits a random 2-10 s, then does one of:

  kill      SIGKILL the broker and start it again (same port, same binlog)
  cut       the proxy drops every connection the query holds
  partition the proxy refuses connections for 1-4 s (every connection dropped first)
  requery   stop the query and start it again from its checkpoint (a driver restart)

With ``--disk faulty`` (ours) the binlog sits on tests/faultfs.py, a FUSE file system that fails
on command, and the broker runs ``-f 0`` (every acknowledged change fsynced); two more actions:

  disk-error  every write (or every fsync) of the binlog fails with EIO for 0.5-3 s, then works again
  power-cut   the pages written since the last fsync are lost (a seeded random half of them, in any
              order), then the broker is SIGKILLed and started again on what reached the "disk"

With ``--server cluster`` the broker is a replica set instead (etcd + 3 of our members,
``--sync-replicas 1``, docs/replication.md), used as ``cluster:a,b,c`` with no proxy; the producer
puts to whichever member leads. Its chaos:

  kill-leader   SIGKILL the leader; after 0.5-5 s start it again (it rejoins as a replica)
  kill-replica  the same for a member that does not lead
  stop-leader   SIGTERM the leader (a planned restart: it hands over first); start it again 0.5-5 s later
  stop-replica  the same for a member that does not lead
  requery       as above

After ``--minutes`` the chaos stops. The read side then stops the producer, waits (``--drain-timeout``)
for every acknowledged job to reach the sink and the tube to be empty, and reports:

  lost        acknowledged (INSERTED) jobs not in any batch            must be 0
  duplicated  jobs in more than one batch                              must be 0
  unexpected  sink rows that were never put                            must be 0
  uncertain   puts whose reply was lost with the connection: each may be in the sink or not
  failures    times the query stopped with an error (it is then restarted from its checkpoint)

The write side waits until the query has committed two more batches, stops it, reads the tube
(straight from the broker, a cluster's leader) and the checkpoint's last committed batch, and reports:

  lost        rows of a committed batch that are not in the tube       must be 0
  unexpected  jobs that no batch holds, or the batch after the last committed one (stopped mid-way)
              does not hold                                           must be 0
  duplicated  rows in the tube more than once: the writer is at-least-once (docs/writer.md), a fault
              can make it put again the rows it had no reply for, or a whole uncommitted batch
  dup_bound   faults x rows-per-batch: duplicated must stay within it   must hold
  tail        rows of the batch the final stop interrupted (uncommitted, may be there or not)
  markers     jobs in the writer's marker tubes (sbw.*)               must be 1 (one per broker)
  failures    as above                                                 must be 0

    python bench/soak.py --minutes 20                  # ours
    python bench/soak.py --minutes 5 --server beanstalkd
    python bench/soak.py --minutes 10 --server cluster
    python bench/soak.py --minutes 20 --actions cut,partition,requery   # one broker process throughout
    python bench/soak.py --minutes 10 --side write [--sink format] [--server beanstalkd|cluster]

Exit status 0 only if every "must" above holds. Writes a JSON summary (``--out``, default
bench/out/soak.json). A verification tool, not a benchmark: no speed figures.
"""
from __future__ import annotations

import argparse
import contextlib
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
from spark_beanstalk.writer import MARKER_PREFIX, PARTITION_MARK, beanstalk_put  # noqa: E402
from tests.helpers import (  # noqa: E402
    BatchFiles,
    FaultyDisk,
    ReplicaSet,
    TcpProxy,
    drain_tube,
    last_committed,
    left_in,
    start_query,
    tube_jobs,
    wait_until,
)

CHAOS = {  # action -> weight
    "single": {"kill": 4, "cut": 3, "partition": 1, "requery": 2},
    "disk": {"kill": 2, "cut": 2, "partition": 1, "requery": 2, "disk-error": 3, "power-cut": 3},
    "cluster": {"kill-leader": 4, "kill-replica": 2, "stop-leader": 2, "stop-replica": 1, "requery": 2},
}
TRIGGER = "500 milliseconds"


def connect(host: str, port: int) -> Connection:
    return Connection(host, port, timeout=5, connect_timeout=1)


class Producer(threading.Thread):
    """Puts ``s-<n>`` jobs to the broker (a cluster's leader); a put whose reply never came is "uncertain"."""

    def __init__(self, hosts: str, tube: str, rate: float) -> None:
        super().__init__(name="producer", daemon=True)
        self.broker, self.tube, self.rate = parse_brokers(hosts)[0], tube, rate
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
                    conn.use(self.tube)
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
    """The broker (or replica set), the proxy, the chaos and the query's restarts; the counts of what happened.

    What the query does, and what is checked at the end, is the workload's (`ReadSide`, `WriteSide`)."""

    def __init__(self, opts: argparse.Namespace, work: Path) -> None:
        self.opts, self.work = opts, work
        self.rng = random.Random(opts.seed)
        weights = CHAOS["cluster" if opts.server == "cluster" else "disk" if opts.disk == "faulty" else "single"]
        chosen = opts.actions.split(",") if opts.actions else list(weights)
        unknown = sorted(set(chosen) - set(weights))
        if unknown:
            raise SystemExit(f"soak: --actions {','.join(unknown)} not one of {','.join(weights)} here")
        self.chaos_weights = {name: weights[name] for name in chosen}
        self.srv: ServerProcess | None = None
        self.proxy: TcpProxy | None = None
        self.rs: ReplicaSet | None = None
        self.disk: FaultyDisk | None = None
        if opts.disk == "faulty" and opts.server != "ours":
            raise SystemExit("soak: --disk faulty needs --server ours")
        if opts.server == "cluster":
            self.rs = ReplicaSet(str(work / "rs"))
            self.hosts = self.rs.hosts
            self.direct_hosts = self.rs.hosts
        else:
            binlog = work / "binlog"
            flags = ["-b", str(binlog)]
            if opts.disk == "faulty":
                self.disk = FaultyDisk(work / "disk")
                binlog = self.disk.mount / "binlog"
                flags = ["-b", str(binlog), "-f", "0"]
            binlog.mkdir(parents=True)
            self.binlog = binlog
            self.srv = start_server(opts.server, extra_args=flags, stderr_path=str(work / "server.log"))
            self.proxy = TcpProxy(self.srv.host, self.srv.port)
            self.hosts = self.proxy.address
            self.direct_hosts = self.srv.address
        self.spark = get_spark("spark-beanstalk-soak")
        self.workload: ReadSide | WriteSide = ReadSide(self) if opts.side == "read" else WriteSide(self)
        self.query: Any = None
        self.actions: Counter[str] = Counter()
        self.events: list[tuple[float, str, int]] = []  # (s since the start, action, batches done before it)
        self.failures: list[str] = []
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.lock = threading.Lock()  # the chaos thread and the watcher both restart the query

    def start_query(self) -> None:
        self.query = self.workload.start_query(self.work / "ckpt")

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

    def running(self) -> bool:
        """True; a query that failed is counted and started again first."""
        if self.query.exception() is not None:
            self.restart_query(failed=True)
        return True

    def act(self, action: str) -> None:
        self.actions[action] += 1
        self.events.append((round(time.monotonic() - self.t0, 1), action, self.workload.batches()))
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
        elif action == "disk-error":
            assert self.disk is not None
            fault = self.rng.choice(["fail-write", "fail-fsync"])
            self.disk.fail(fault)
            time.sleep(self.rng.uniform(0.5, 3))
            self.disk.heal(fault)
        elif action == "power-cut":
            assert self.disk is not None and self.srv is not None
            self.disk.fail("power-cut", str(self.rng.randrange(1 << 30)))
            self.srv.kill()
            self.disk.heal("power-cut")
            self.srv.restart()
        elif action in ("kill-leader", "kill-replica", "stop-leader", "stop-replica"):
            self.end_member(action.endswith("-leader"), crash=action.startswith("kill"))

    def end_member(self, leader: bool, crash: bool) -> None:
        """SIGKILL (crash) or SIGTERM (a planned restart) the leader or another member; start it again a
        little later."""
        assert self.rs is not None
        current = wait_until(self.rs.leader, 30, what="a leader")
        others = [m for m in self.rs.members if m is not current]
        victim = current if leader else self.rng.choice(others)
        if crash:
            victim.kill()
        else:
            victim.stop()
        time.sleep(self.rng.uniform(0.5, 5))
        victim.restart()

    def broker(self) -> ServerProcess | None:
        """The broker to check against directly: the one process, or the cluster's leader (None: none leads now)."""
        return self.srv if self.rs is None else self.rs.leader()

    def servers(self) -> list[tuple[ServerProcess, Path]]:
        """Each broker process and its binlog directory."""
        if self.rs is not None:
            return [(m, self.work / "rs" / f"m{i}") for i, m in enumerate(self.rs.members)]
        assert self.srv is not None
        return [(self.srv, self.binlog)]

    def sample(self) -> None:
        """Each broker's RSS and binlog disk use (allocated blocks) now: neither may grow with the jobs that
        went through."""
        rss, disk = [], []
        for proc, binlog in self.servers():
            rss.append(round((proc_status(proc.pid, "VmRSS") or 0) / 2**20, 1))  # 0: down right now
            disk.append(round(sum(f.stat().st_blocks * 512 for f in binlog.rglob("*") if f.is_file()) / 2**20, 2))
        self.samples.append({"s": round(time.monotonic() - self.t0), "rss_mib": rss, "binlog_mib": disk,
                             "batches": self.workload.batches()})
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
            self.running()
            if time.monotonic() >= until:
                break
            names = list(self.chaos_weights)
            self.act(self.rng.choices(names, [self.chaos_weights[n] for n in names])[0])

    def close(self) -> None:
        if self.query is not None:
            self.query.stop()
        if self.proxy is not None:
            self.proxy.close()
        if self.srv is not None:
            self.srv.stop()
        if self.disk is not None:
            self.disk.close()
        if self.rs is not None:
            self.rs.stop()


class ReadSide:
    """The source under faults: a producer puts numbered jobs, the query reads them into one file per batch;
    every acknowledged job must reach the files exactly once."""

    tube = "t"

    def __init__(self, soak: Soak) -> None:
        self.soak = soak
        self.sink = BatchFiles(soak.work / "out")
        self.producer = Producer(soak.direct_hosts, self.tube, soak.opts.rate)

    def start_query(self, ckpt: Path) -> Any:
        return start_query(self.soak.spark, self.sink, ckpt, self.soak.hosts, maxJobsPerTrigger=self.soak.opts.max_jobs)

    def begin(self) -> None:
        self.producer.start()

    def batches(self) -> int:
        return len(list(self.sink.out.glob("*.json")))

    def delivered(self) -> bool:
        seen = {body for _, body in self.sink.seen()}
        broker = self.soak.broker()
        return self.soak.running() and self.producer.acked <= seen and broker is not None and \
            left_in(broker, self.tube) == 0

    def stop(self) -> None:
        self.producer.stop.set()
        if self.producer.is_alive():
            self.producer.join(30)

    def finish(self) -> tuple[dict[str, Any], bool]:
        """Stop putting, wait for every acknowledged job in the sink, and count."""
        self.stop()
        stopped = time.monotonic()
        drained = True
        try:
            wait_until(self.delivered, self.soak.opts.drain_timeout, interval=0.5,
                       what="every acknowledged job in the sink and the tube empty")
        except TimeoutError:
            drained = False
        drain_s = time.monotonic() - stopped
        self.soak.sample()
        rows = self.sink.seen()
        bodies = Counter(body for _, body in rows.elements())
        seen, acked, uncertain = set(bodies), self.producer.acked, self.producer.uncertain
        result = {
            "rate": self.soak.opts.rate, "acked": len(acked), "uncertain": len(uncertain),
            "uncertain_delivered": len(uncertain & seen), "producer_errors": self.producer.errors,
            "delivered": len(seen), "batches": len(self.sink.batches()), "drained": drained,
            "drain_seconds": round(drain_s, 1),
            "lost": sorted(acked - seen)[:20], "lost_count": len(acked - seen),
            "duplicated": sorted(b for b, n in bodies.items() if n > 1)[:20],
            "duplicated_count": sum(1 for n in bodies.values() if n > 1),
            "unexpected_count": len(seen - acked - uncertain),
        }
        ok = drained and not (result["lost_count"] or result["duplicated_count"] or result["unexpected_count"])
        return result, ok


class WriteSide:
    """The writers under faults: the query puts Spark's ``rate-micro-batch`` rows (batch b = rows b*R .. b*R+R-1)
    through the proxy; every row of a committed batch must be in the tube, duplicates only as many as the faults
    can explain."""

    tube = "w"

    def __init__(self, soak: Soak) -> None:
        self.soak = soak
        self.rows = soak.opts.rows_per_batch
        self.ckpt = soak.work / "ckpt"

    def start_query(self, ckpt: Path) -> Any:
        spark, hosts = self.soak.spark, self.soak.hosts
        rows = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", self.rows).load()
                .selectExpr("cast(value as string) as body"))
        if self.soak.opts.sink == "foreachbatch":
            writer = rows.writeStream.foreachBatch(beanstalk_put.options(hosts=hosts, tube=self.tube))
        else:
            writer = rows.writeStream.format("beanstalk").option("hosts", hosts).option("tube", self.tube)
        return writer.option("checkpointLocation", str(ckpt)).trigger(processingTime=TRIGGER).start()

    def begin(self) -> None:
        """Nothing: the query makes its own rows."""

    def committed(self) -> int:
        """The last batch id the checkpoint records as committed (-1: none yet)."""
        return last_committed(self.ckpt)

    def end_offset(self, batch_id: int) -> int:
        """The rate-micro-batch offset a batch ended at: rows 0 .. offset-1 are in batches 0 .. batch_id."""
        if batch_id < 0:
            return 0
        last = (self.ckpt / "offsets" / str(batch_id)).read_text().strip().splitlines()[-1]
        return int(json.loads(last)["offset"])

    def batches(self) -> int:
        return self.committed() + 1

    def markers(self, broker: ServerProcess) -> tuple[int, int]:
        """Jobs in the writer's batch-marker tubes on the broker (one writer: one), and in its partition-marker
        tubes (left only by a batch that did not complete: the last one, stopped)."""
        with connect(broker.host, broker.port) as conn:
            tubes = [t for t in conn.list_tubes() if t.startswith(MARKER_PREFIX)]
        jobs = {t: sum(tube_jobs(broker, t).values()) for t in tubes}
        partition = sum(n for t, n in jobs.items() if PARTITION_MARK.search(t))
        return sum(jobs.values()) - partition, partition

    def finish(self) -> tuple[dict[str, Any], bool]:
        """Let the query commit two batches with no fault, stop it, and compare the tube with the checkpoint."""
        target = self.committed() + 2
        settled = True
        try:
            wait_until(lambda: self.soak.running() and self.committed() >= target, self.soak.opts.drain_timeout,
                       interval=0.25, what="two batches committed after the chaos")
        except TimeoutError:
            settled = False
        self.soak.query.stop()
        committed = self.committed()
        end = self.end_offset(committed)
        broker = wait_until(self.soak.broker, 30, what="a broker to read the tube from")
        self.soak.sample()
        bodies = drain_tube(broker, self.tube)
        markers, partition_markers = self.markers(broker)
        counts = Counter(int(b) if b.isdigit() else -1 for b in bodies)
        faults = sum(self.soak.actions.values())
        result = {
            "sink": self.soak.opts.sink, "rows_per_batch": self.rows, "settled": settled,
            "committed_batches": committed + 1, "rows_committed": end, "jobs_in_tube": len(bodies),
            "lost_count": sum(1 for v in range(end) if v not in counts),
            "lost": [v for v in range(end) if v not in counts][:20],
            "tail": sum(1 for v in counts if end <= v < end + self.rows),
            "unexpected_count": sum(1 for v in counts if v < 0 or v >= end + self.rows),
            "duplicated_count": sum(n - 1 for n in counts.values()),
            "dup_bound": faults * self.rows, "markers": markers, "partition_markers": partition_markers,
        }
        # which batches the duplicates are in: a whole batch put again is a completed batch whose replay was not
        # recognised; part of one, the rows without a reply when a connection was lost, or the rows a batch
        # stopped half-way had put before it ran again
        per_batch: Counter[int] = Counter()
        for v, n in counts.items():
            if n > 1 and v >= 0:
                per_batch[v // self.rows] += n - 1
        result["dup_batches"] = len(per_batch)
        result["dup_whole_batches"] = sum(1 for n in per_batch.values() if n >= self.rows)
        result["dup_batch_ids"] = {b: n for b, n in sorted(per_batch.items())[:20]}
        ok = settled and not (result["lost_count"] or result["unexpected_count"]) and markers == 1 and \
            result["duplicated_count"] <= result["dup_bound"]
        return result, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the chaos runs")
    p.add_argument("--server", choices=("ours", "beanstalkd", "cluster"), default="ours")
    p.add_argument("--disk", choices=("plain", "faulty"), default="plain",
                   help="ours: the binlog on a FUSE file system with I/O errors and power cuts (-f 0)")
    p.add_argument("--side", choices=("read", "write"), default="read",
                   help="the source reading (default) or a writer putting, through the faults")
    p.add_argument("--sink", choices=("foreachbatch", "format"), default="foreachbatch",
                   help="write side: foreachBatch(beanstalk_put) or the format(\"beanstalk\") stream sink")
    p.add_argument("--rate", type=float, default=200.0, help="read side: jobs/s the producer puts")
    p.add_argument("--max-jobs", type=int, default=300, help="read side: the source's maxJobsPerTrigger")
    p.add_argument("--rows-per-batch", type=int, default=1000, help="write side: rows each 500 ms batch puts")
    p.add_argument("--seed", type=int, default=None, help="the chaos schedule's random seed")
    p.add_argument("--drain-timeout", type=float, default=300.0, help="s to wait for the query after the chaos")
    p.add_argument("--actions", default=None,
                   help="comma list of the chaos actions to use (default all; e.g. cut,partition,requery keeps "
                        "one broker process up throughout, to watch its RSS)")
    p.add_argument("--sample-every", type=float, default=60.0, help="s between RSS / binlog size samples")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "soak.json"))
    p.add_argument("--work", default=None,
                   help="a new directory to run in and keep (server logs, binlogs, checkpoint); default: temporary")
    opts = p.parse_args(argv)
    if opts.seed is None:
        opts.seed = random.randrange(1 << 30)
    started = time.time()
    with contextlib.ExitStack() as stack:
        if opts.work:   # kept: the brokers' logs and binlogs, the checkpoint, for a post-mortem
            work = Path(opts.work)
            work.mkdir(parents=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        soak = Soak(opts, work)
        try:
            soak.start_query()
            soak.workload.begin()
            print(f"soak: {opts.side} side, {opts.server}, {opts.minutes:g} min, seed {opts.seed}", flush=True)
            soak.chaos(time.monotonic() + opts.minutes * 60)
            outcome, ok = soak.workload.finish()
        finally:
            if isinstance(soak.workload, ReadSide):
                soak.workload.stop()
            soak.close()
    result = {
        "side": opts.side, "server": opts.server, "disk": opts.disk, "minutes": opts.minutes, "seed": opts.seed,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "actions": dict(soak.actions),
        **outcome, "failures": soak.failures, "samples": soak.samples, "events": soak.events,
    }
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(result, indent=2))
    shown = {k: v for k, v in result.items() if k not in ("lost", "duplicated", "samples", "events")}
    print(json.dumps(shown, indent=2))
    ok = ok and not soak.failures
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
