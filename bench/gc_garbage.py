#!/usr/bin/env python3
"""What the collector policy leaves for the full collection: cyclic garbage frozen while still alive.

``broker.gcpolicy`` freezes what survives each young collection, so a reference cycle that is still
referenced when one runs and becomes garbage later waits for the full collection (~100 million
allocations apart). This runs the real broker (``broker.cli``, with ``--http``) in this process under
mixed load for ``--seconds``: workers putting, reserving, deleting, sending a bad command and
``stats-tube`` each round; a client connecting per job; threads fetching ``/metrics``, ``/healthz``,
``/readyz``, the dashboard's pages and a 404 back to back. Then it runs the full collection and prints
how many objects it freed, and how many young collections came meanwhile.

    python bench/gc_garbage.py                 # 30 s
    python bench/gc_garbage.py --seconds 120

In-process on purpose: the figures are of the collector's own lists, which no other process can read.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from broker import gcpolicy  # noqa: E402
from broker.cli import broker_command  # noqa: E402
from spark_beanstalk.client import Connection  # noqa: E402
from spark_beanstalk.embedded import free_port, wait_for_port  # noqa: E402

PAGES = ("/metrics", "/healthz", "/readyz", "/", "/api/overview", "/tube?name=default", "/nope")


class Load:
    """The mixed load, on threads of this process; ``rounds`` counts what each kind of thread did."""

    def __init__(self, port: int, http_port: int) -> None:
        self.port, self.http_port = port, http_port
        self.stop = threading.Event()
        self.rounds = {"worker": 0, "connect": 0, "http": 0}
        self.lock = threading.Lock()

    def _count(self, kind: str) -> None:
        with self.lock:
            self.rounds[kind] += 1

    def worker(self) -> None:
        conn = Connection("127.0.0.1", self.port, timeout=10)
        try:
            while not self.stop.is_set():
                conn.put(b"hello", priority=100, ttr=60)
                job = conn.reserve(timeout=0)
                if job is not None:
                    conn.delete(job.id)
                conn.call("no-such-command")
                conn.stats_tube("default")
                self._count("worker")
        finally:
            conn.close()

    def connector(self) -> None:
        while not self.stop.is_set():
            conn = Connection("127.0.0.1", self.port, timeout=10)
            try:
                conn.use("gc-garbage")
                conn.put(b"abc", priority=0, ttr=60)
            finally:
                conn.close()
            self._count("connect")

    def scraper(self) -> None:
        while not self.stop.is_set():
            for page in PAGES:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{page}", timeout=10) as res:
                        res.read()
                except urllib.error.HTTPError:
                    pass  # the 404, and the dashboard's answers to a page it refuses: garbage all the same
            self._count("http")

    def run(self, seconds: float) -> None:
        threads = [threading.Thread(target=f, daemon=True) for f in
                   [self.worker] * 4 + [self.connector, self.scraper, self.scraper]]
        for t in threads:
            t.start()
        self.stop.wait(seconds)
        self.stop.set()
        for t in threads:
            t.join(30)


def measure(port: int, http_port: int, seconds: float, result: dict) -> None:
    """The driver thread: wait for the broker, load it, collect, report, stop the broker."""
    try:
        for listener in (port, http_port):
            wait_for_port("127.0.0.1", listener, 30)
        policy = gcpolicy.tune_gc()  # the broker installed it already: this returns the same policy
        load = Load(port, http_port)
        frozen_before, young_before = gc.get_freeze_count(), policy.young_since_full
        visited_before, skipped_before = policy.visited, policy.skipped
        load.run(seconds)
        frozen, young = gc.get_freeze_count(), policy.young_since_full - young_before
        visited, skipped = policy.visited - visited_before, policy.skipped - skipped_before
        freed = policy.collect_all()
        result.update(seconds=seconds, gc_young=gcpolicy.GC_YOUNG, rounds=load.rounds,
                      frozen_before=frozen_before, frozen_after_load=frozen, young_collections=young,
                      young_visited=visited, young_skipped=skipped,
                      freed_by_full_collection=freed, frozen_after_full=gc.get_freeze_count(),
                      full_after_young=policy.full_after)
    except Exception as exc:  # noqa: BLE001 - reported, then the broker is stopped all the same
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "gc_garbage.json"))
    opts = ap.parse_args()
    port, http_port = free_port(), free_port()
    result: dict = {}
    threading.Thread(target=measure, args=(port, http_port, opts.seconds, result), daemon=True).start()
    with contextlib.suppress(SystemExit):  # the driver thread's SIGTERM stops the broker
        broker_command.main(["-l", "127.0.0.1", "-p", str(port), "--http", f"127.0.0.1:{http_port}"],
                            standalone_mode=False)
    if "error" in result or "freed_by_full_collection" not in result:
        print(f"gc_garbage: {result.get('error', 'the broker stopped before the measurement ended')}",
              file=sys.stderr)
        return 1
    rate = result["young_collections"] / opts.seconds
    hours = result["full_after_young"] / rate / 3600 if rate else float("inf")
    print(f"{opts.seconds:.0f} s of mixed load (rounds: {result['rounds']}), young collections of "
          f"{result['gc_young']}: {result['young_collections']} young collections ({rate:.1f} a second; "
          f"{result['young_visited']} visited the young generation, {result['young_skipped']} froze it); frozen "
          f"objects {result['frozen_before']:,} -> {result['frozen_after_load']:,}; the full collection freed "
          f"**{result['freed_by_full_collection']:,}** objects ({result['freed_by_full_collection'] / opts.seconds:.1f}"
          f" a second); at this load the full collection comes every ~{hours:.1f} h")
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
