"""The in-flight manager: the only owner of the source's connections, reservations,
touches, read-ahead and deletes.

The Spark reader (source.py) asks it for a batch (``next_batch``), tells it which batches
Spark committed (``commit`` + ``flush_deletes``), has it rebuild a batch after a query
restart (``replay``) and clean up after one (``cleanup``), and reads its counters
(``report``). Threads run beside the Spark calls: a touch thread per broker (keeps held jobs
from timing out; one per broker, so a broker that hangs cannot hold up the touches of the
others) and the worker (owed deletes, reconnecting, read-ahead). Each broker's
state is guarded by its own lock (``BrokerLink.lock``); the read-ahead pool by
``pool_lock``.

A connection that fails drops every connection of its broker (``BrokerLink.reset``); the
next use of the broker reconnects with backoff and re-acquires what was held
(``recovery.reacquire``) before reserving anything new, so a job released by the broker
is never read into another batch. A broker down longer than ``brokerRetrySeconds`` fails
the query (``check_health``); until then the others are read.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from spark_beanstalk.batch import Batch, JobColumns
from spark_beanstalk.brokers import BeanstalkSourceError, BrokerLink, ResConn
from spark_beanstalk.client import REFUSED_FOR_NOW, ConnectionLost
from spark_beanstalk.offsets import (
    BrokerJobs,
    Offset,
    block_digests,
    body_digest,
    make_offset,
    offset_jobs,
    offset_pending,
    reserved_second,
)
from spark_beanstalk.options import SourceOptions
from spark_beanstalk.recovery import reacquire, settle_already_held
from spark_beanstalk.restart import cleanup_broker, replay_broker
from spark_beanstalk.source_wire import (
    PIPELINE_WINDOW,
    delete_jobs,
    failed_commands,
    not_leading,
    stats_jobs,
)
from spark_beanstalk.touch import Timing, Toucher

log = logging.getLogger("spark_beanstalk.source")

_RESETS_PER_CALL = 3      # reconnects one call may do before it leaves the broker for later
_JOIN_SECONDS = 2.0       # stop waits this long for the touch thread and the worker to end


class InFlight:
    """What the source holds on its brokers, and every command that changes it."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self.brokers = [BrokerLink.of(broker, opts) for broker in opts.links()]
        self.batches: dict[int, Batch] = {}      # planned, not committed yet
        self.committed: list[Batch] = []         # committed, deletes not finished
        self.pool = Batch(-1)                     # read-ahead: reserved, in no batch yet
        self.pool_lock = threading.Lock()
        self.delete_lock = threading.Lock()
        self.prefetch_cap = 0
        self.an_budget: dict[str, int] | None = None   # Trigger.AvailableNow: jobs left per broker
        self.timing = Timing()
        self.polls = 0
        self.stopping = False
        self.worker_error: BaseException | None = None
        self.work = threading.Event()     # worker
        self.touchers = {b.address: Toucher(b, opts.touch_fraction, self.timing, self.work) for b in self.brokers}
        self._threads: list[threading.Thread] = []

    # --- life cycle -----------------------------------------------------------------------
    def start(self, resuming: bool = False) -> None:
        """Connect to every broker. A new query fails at once when none can be reached (a wrong
        'hosts' is the likely cause). A query resuming from its checkpoint reached them before, so
        a broker down now is a fault like any other: retried up to brokerRetrySeconds (a driver
        restarted by a supervisor while the broker restarts too must not fail for it)."""
        for b in self.brokers:
            with b.lock:
                b.open()
        if not any(b.connected() for b in self.brokers):
            b = self.brokers[0]
            if not resuming:
                raise BeanstalkSourceError(f"beanstalk source: cannot reach broker {b.address} ({b.last_error}); "
                                           "check the 'hosts' option")
            log.warning("beanstalk source: resuming from the checkpoint with no broker reachable (%s: %s); "
                        "retrying for up to brokerRetrySeconds=%g", b.address, b.last_error,
                        self.opts.broker_retry_seconds)
        runs = [(t.run, f"beanstalk-touch-{n}") for n, t in enumerate(self.touchers.values())]
        for target, name in (*runs, (self._worker_loop, "beanstalk-worker")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        try:
            self.flush_deletes()    # committed batches must not come back
        except Exception as exc:  # noqa: BLE001  (stop must go on closing)
            log.warning("beanstalk source: deletes at stop failed: %s", exc)
        self.abandon()

    def abandon(self) -> None:
        """Close every connection without deleting anything (what a crash looks like to the brokers).

        The links are closed for good under their locks, so the touch thread and the worker, which
        may be half-way through a read-ahead, a re-acquire or a delete, cannot reconnect after it
        (they did: a worker that lost its socket mid-read-ahead re-reserved the batch on new
        connections that nobody closed). Then waits briefly for both threads to end."""
        self.stopping = True
        self.work.set()
        for toucher in self.touchers.values():
            toucher.stopping = True
            toucher.wake.set()
        for b in self.brokers:
            with b.lock:
                b.close()
        me = threading.current_thread()
        deadline = time.monotonic() + _JOIN_SECONDS
        for thread in self._threads:
            if thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))

    def link(self, address: str) -> BrokerLink | None:
        return next((b for b in self.brokers if b.address == address), None)

    def check_health(self) -> None:
        """Raise what the worker hit, or for a broker unreachable past brokerRetrySeconds."""
        if self.worker_error is not None:
            err, self.worker_error = self.worker_error, None
            raise err
        for toucher in self.touchers.values():
            if toucher.error:
                log.warning("beanstalk source: touch thread: %s", toucher.error)
                toucher.error = None
        bound = self.opts.broker_retry_seconds
        for b in self.brokers:
            if b.down_since is not None and b.down_for() > bound:
                since = time.strftime("%H:%M:%S", time.gmtime(b.down_since_wall))
                raise BeanstalkSourceError(
                    f"beanstalk source: cannot reach broker {b.address} for {b.down_for():.0f}s (down since {since} "
                    f"UTC; brokerRetrySeconds={bound:g}): {b.last_error}; check the broker or the 'hosts' option")

    def wait_up(self, b: BrokerLink) -> None:
        """Block until b is connected and settled, or raise once it is down past the bound (or stopped)."""
        while True:
            if self.stopping:
                raise BeanstalkSourceError("beanstalk source: the reader was stopped")
            with b.lock:
                if reacquire(b, self.opts.replay_wait_seconds):
                    return
            self.check_health()
            time.sleep(max(0.02, min(0.5, b.next_try - time.monotonic())))

    # --- reserving ---------------------------------------------------------------------------
    def next_batch(self, seq: int, budget: int, may_block: bool) -> Batch:
        """The read-ahead pool plus fresh reserves, up to `budget` jobs, as batch `seq` (not planned yet)."""
        t0 = time.perf_counter()
        with self.pool_lock:
            batch, self.pool = self.pool, Batch(-1)
            batch.seq = seq
            if batch.count() > budget:
                self._give_back(batch, batch.count() - budget)
            got = self.fill(batch, budget - batch.count())
            if got == 0 and batch.count() == 0 and may_block:
                self._wait_for_one(batch, budget)
        self.timing.reserve_ms += (time.perf_counter() - t0) * 1000
        return batch

    def plan(self, batch: Batch) -> Offset:
        """Name the batch in an offset (with the deletes still owed) and keep it until it commits."""
        jobs = {addr: batch.broker_jobs(addr, b.sid) for addr in batch.jobs
                if (b := self.link(addr)) is not None and batch.jobs[addr].ids}
        batch.offset = make_offset(batch.seq, jobs, self.owed_deletes())
        self.batches[batch.seq] = batch
        return batch.offset

    def fill(self, batch: Batch, budget: int) -> int:
        """Reserve (without blocking) up to `budget` jobs into `batch`, spread over the brokers."""
        if budget <= 0:
            return 0
        self.polls += 1
        n = len(self.brokers)
        first = self.polls % n
        order = self.brokers[first:] + self.brokers[:first]
        total = 0
        for k, b in enumerate(order):
            share = -(-budget // (n - k))   # ceil: what is left, spread over the brokers left
            if self.an_budget is not None:
                share = min(share, self.an_budget.get(b.address, 0))
            if share <= 0:
                continue
            got = self._reserve_from(b, batch, share)
            budget -= got
            total += got
            if self.an_budget is not None:
                self.an_budget[b.address] -= got
        return total

    def _reserve_from(self, b: BrokerLink, batch: Batch, want: int) -> int:
        got_total, idx, resets = 0, 0, 0
        cap = self.opts.jobs_per_connection
        while got_total < want:
            with b.lock:
                if not reacquire(b, self.opts.replay_wait_seconds):
                    break
                try:
                    idx, rc = b.conn_with_room(idx)
                    window = min(b.probe, want - got_total, cap - rc.count, PIPELINE_WINDOW)
                    got, asked_for = self._reserve_window(b, rc, batch, window)
                except ConnectionLost as exc:
                    b.reset(exc)
                    idx, resets = 0, resets + 1
                    if resets >= _RESETS_PER_CALL:
                        break
                    continue
            got_total += got
            if asked_for < window:
                # The tubes ran dry: next poll starts with a window the size of what came now.
                b.probe = max(1, min(PIPELINE_WINDOW, got_total))
                break
            b.probe = min(b.probe * 2, PIPELINE_WINDOW)
        return got_total

    def _reserve_window(self, b: BrokerLink, rc: ResConn, batch: Batch, window: int) -> tuple[int, int]:
        """Pipeline `window` reserves on rc, then stats-job for what came. Returns (kept, reserved)."""
        ids, bodies, others = rc.conn.reserve_many(window)
        for line in others:
            if line in (b"TIMED_OUT", b"DEADLINE_SOON"):
                continue
            if line in REFUSED_FOR_NOW and b.broker.is_cluster:
                raise not_leading(rc.conn, line, "reserve")  # a fenced leader: find the leader again
            hint = " (a replica: list the set as cluster:...)" if line in REFUSED_FOR_NOW else ""
            raise BeanstalkSourceError(f"beanstalk source: {b.address} answered reserve with {line!r}{hint}")
        if not ids:
            return 0, 0
        return self._admit(b, rc, batch, ids, bodies), len(ids)

    def _admit(self, b: BrokerLink, rc: ResConn, batch: Batch, ids: list[int], bodies: list[bytes],
               check_poison: bool = True) -> int:
        """stats-job the jobs just reserved on rc, settle ones we already held, bury poison,
        add the rest to the batch and hold them."""
        t0 = time.perf_counter()
        now_wall_us = int(time.time() * 1_000_000)
        st = stats_jobs(rc.conn, ids)
        b.counters.reserved += len(ids)
        if st.missing:
            b.counters.lost += len(st.missing)     # vanished between reserve and stats (someone deleted it)
            gone = set(st.missing)
            bodies = [body for jid, body in zip(ids, bodies, strict=True) if jid not in gone]
        n = len(st.ids)
        cols = JobColumns(st.ids, st.tubes, bodies, st.pris, st.ttrs, st.reserves, [now_wall_us] * n,
                          [body_digest(x) for x in bodies])
        if not b.held.keys().isdisjoint(cols.ids):
            cols = settle_already_held(b, rc, cols)
        max_reserves = self.opts.max_reserves if check_poison else 0
        if max_reserves and cols.reserves and max(cols.reserves) > max_reserves:
            cols = self._bury_poison(b, rc, cols, max_reserves)
        batch.add(b.address, cols)
        b.hold(rc, batch, cols.ids, cols.ttrs, time.monotonic())
        self.timing.stats_ms += (time.perf_counter() - t0) * 1000
        if cols.ids:
            self.touchers[b.address].wake.set()
        return len(cols.ids)

    def _admit_replayed(self, b: BrokerLink, rc: ResConn, batch: Batch, ids: list[int], bodies: list[bytes]) -> int:
        """A replayed batch is replayed whole: no poison check (it was planned with these jobs)."""
        return self._admit(b, rc, batch, ids, bodies, check_poison=False)

    def _bury_poison(self, b: BrokerLink, rc: ResConn, cols: JobColumns, max_reserves: int) -> JobColumns:
        """Bury the jobs reserved more than max_reserves times; returns the others."""
        poison = [i for i, r in enumerate(cols.reserves) if r > max_reserves]
        failed = set(failed_commands(rc.conn, [b"bury %d %d\r\n" % (cols.ids[i], cols.pris[i]) for i in poison],
                                     b"BURIED"))
        for k, i in enumerate(poison):
            if k in failed:
                b.counters.lost += 1
            else:
                b.counters.buried += 1
                log.warning("beanstalk source: buried poison job %s on %s (reserved more than %d times)",
                            cols.ids[i], b.address, max_reserves)
        return cols.keep([i for i, r in enumerate(cols.reserves) if r <= max_reserves])

    def _wait_for_one(self, batch: Batch, budget: int) -> None:
        """Wait up to reserveTimeout seconds for one job, so an idle query does not spin."""
        b = self.brokers[self.polls % len(self.brokers)]
        with b.lock:
            if not reacquire(b, self.opts.replay_wait_seconds):
                return
            try:
                _, rc = b.conn_with_room(0)
                reply = rc.conn.call(f"reserve-with-timeout {self.opts.reserve_timeout}")
                if reply.status == b"RESERVED":
                    self._admit(b, rc, batch, [int(reply.args[0])], [reply.body or b""])
            except ConnectionLost as exc:
                b.reset(exc)
                return
        if batch.count() and budget > 1:    # more may have come meanwhile: take them in the same batch
            self._reserve_from(b, batch, budget - 1)

    def _give_back(self, batch: Batch, excess: int) -> None:
        """Release the last `excess` jobs of a (read-ahead) batch: the limit shrank."""
        for addr in sorted(batch.jobs, key=lambda a: -len(batch.jobs[a].ids)):
            cols = batch.jobs[addr]
            k = min(excess, len(cols.ids))
            if k <= 0:
                break
            excess -= k
            gone = dict(zip(cols.ids[-k:], cols.pris[-k:], strict=True))
            batch.jobs[addr] = cols.keep(list(range(len(cols.ids) - k)))
            b = self.link(addr)
            if b is None:
                continue
            with b.lock:
                try:
                    for rc, ids in b.held_by_conn().items():
                        mine = [j for j in ids if j in gone]
                        if mine:
                            failed_commands(rc.conn, [b"release %d %d 0\r\n" % (j, gone[j]) for j in mine],
                                            b"RELEASED")
                except ConnectionLost as exc:
                    b.reset(exc)
                b.unhold(list(gone))

    # --- committing and deleting ------------------------------------------------------------------
    def commit(self, upto_seq: int) -> None:
        """Spark committed every batch up to `upto_seq`: their jobs are owed a delete."""
        with self.delete_lock:
            for seq in sorted(s for s in self.batches if s <= upto_seq):
                batch = self.batches.pop(seq)
                batch.committed = True
                self.committed.append(batch)

    def flush_deletes(self) -> None:
        """Delete the jobs of committed batches on every broker that can be reached."""
        t0 = time.perf_counter()
        with self.delete_lock:
            self.committed = [batch for batch in self.committed if not self._delete_batch(batch)]
        self.timing.delete_ms += (time.perf_counter() - t0) * 1000

    def _delete_batch(self, batch: Batch) -> bool:
        """Delete what is left of a committed batch; True when nothing of it is held any more."""
        done = True
        for addr in batch.jobs:
            b = self.link(addr)
            if b is None:
                continue
            with b.lock:
                for _ in range(_RESETS_PER_CALL):
                    if not reacquire(b, self.opts.replay_wait_seconds):   # deletes the orphans too
                        break
                    try:
                        for rc, ids in b.held_by_conn(batch).items():
                            ok = delete_jobs(rc.conn, ids)
                            b.counters.deleted += ok
                            b.counters.lost += len(ids) - ok
                            b.unhold(ids)
                        break
                    except ConnectionLost as exc:
                        b.reset(exc)
                if b.holds_for(batch):
                    done = False
        return done

    def owed_deletes(self) -> dict[str, BrokerJobs]:
        """Per broker, the jobs of committed batches not deleted yet (carried in the next offset)."""
        owed: dict[str, tuple[list[int], list[str], list[int], list[int]]] = {}
        with self.delete_lock:
            committed = list(self.committed)
        for batch in committed:
            for addr, cols in batch.jobs.items():
                b = self.link(addr)
                if b is None:
                    continue
                with b.lock:
                    for i, jid in enumerate(cols.ids):
                        lot = b.held.get(jid)
                        if lot is not None and lot.batch is batch:
                            ids, tubes, digests, times = owed.setdefault(addr, ([], [], [], []))
                            ids.append(jid)
                            tubes.append(cols.tubes[i])
                            digests.append(cols.digests[i])
                            times.append(cols.reserved_at_us[i])
        return {addr: BrokerJobs("", sorted(ids), block_digests(ids, tubes, digests), reserved_second(times))
                for addr, (ids, tubes, digests, times) in owed.items()}

    # --- after a query restart ---------------------------------------------------------------------
    def cleanup(self, start: Offset) -> None:
        """Delete the jobs of the committed batch `start` (and the deletes it carries) that are
        back in ready: the previous run died between Spark's commit and its deletes."""
        self._clean("the committed batch", offset_jobs(start))
        self._clean("earlier committed batches", offset_pending(start))

    def _clean(self, what: str, entries: dict[str, BrokerJobs]) -> None:
        for addr, bj in sorted(entries.items()):
            b = self.link(addr)
            if b is not None:
                self._through_drops(b, partial(cleanup_broker, b, bj, what, self.opts.replay_wait_seconds))

    def _through_drops(self, b: BrokerLink, step: Callable[[], None]) -> None:
        """Run a restart step (replay, clean-up) on b once it is up; a connection lost meanwhile (the
        broker restarted too) is ridden through like anywhere else: reset, wait until b is back
        (re-acquiring what this step already holds), run the step again. Each step skips what it
        already did, so running it again is safe."""
        for attempt in range(_RESETS_PER_CALL + 1):
            self.wait_up(b)
            with b.lock:
                try:
                    step()
                    return
                except ConnectionLost as exc:
                    b.reset(exc)
                    b.mark_down(exc)
                    if attempt == _RESETS_PER_CALL:
                        raise

    def replay(self, end: Offset) -> Batch:
        """Rebuild a planned-but-uncommitted batch from its offset alone (restart from a checkpoint)."""
        seq = int(end.get("seq", 0))
        batch = Batch(seq)
        for addr, bj in sorted(offset_jobs(end).items()):
            b = self.link(addr)
            if b is None:
                log.warning("beanstalk source: batch %d names broker %s, which is not in 'hosts'; skipping its %d "
                            "jobs", seq, addr, len(bj.ids))
                continue
            if not bj.digests and bj.sid:
                self.wait_up(b)
                with b.lock:
                    if b.sid and bj.sid != b.sid:
                        log.warning("beanstalk source: broker %s restarted since batch %d was planned (server id "
                                    "%s -> %s); its jobs will be read again as new jobs", addr, seq, bj.sid, b.sid)
                        continue

            def step(b: BrokerLink = b, bj: BrokerJobs = bj) -> None:
                held = {j for j, lot in b.held.items() if lot.batch is batch}  # replayed before a drop
                replay_broker(b, batch, bj, self.opts.replay_wait_seconds, self._admit_replayed, skip=held)

            self._through_drops(b, step)
        # The deletes `end` carries are owed by batches before it, committed when it was planned (a
        # broker was down then). The run that owed them is gone: do them now, before anything can
        # reserve those jobs again (latestOffset's cleanup skips a replayed batch).
        self._clean("earlier committed batches", offset_pending(end))
        batch.offset = end
        self.batches[seq] = batch
        return batch

    # --- the worker: owed deletes, reconnecting, read-ahead -------------------------------------------
    def _worker_loop(self) -> None:
        while not self.stopping:
            got = 0
            try:
                self.flush_deletes()
                self._maintain()
                cap = self.prefetch_cap
                if cap > 0 and not self.stopping:
                    with self.pool_lock:
                        room = cap - self.pool.count()
                        if room > 0:
                            t0 = time.perf_counter()
                            got = self.fill(self.pool, room)
                            self.timing.prefetch_ms += (time.perf_counter() - t0) * 1000
            except BaseException as exc:  # noqa: BLE001  (surfaced by the next latestOffset)
                self.worker_error = exc
                self.prefetch_cap = 0
            if got:
                continue
            unsettled = any(b.dirty or not b.connected() for b in self.brokers)
            self.work.wait(0.05 if unsettled else self.opts.prefetch_poll_ms / 1000.0 if self.prefetch_cap else 1.0)
            self.work.clear()

    def _maintain(self) -> None:
        """Reconnect brokers that lost their connections and re-acquire what they held."""
        for b in self.brokers:
            if b.dirty or not b.connected():
                with b.lock:
                    reacquire(b, self.opts.replay_wait_seconds)

    # --- progress --------------------------------------------------------------------------------------
    def report(self, batches_held: int) -> dict[str, Any]:
        per_broker = {b.address: b.state() for b in self.brokers}
        keys = ("held", "reserved", "touched", "deleted", "buried", "replayed", "lost", "cleaned", "connections",
                "reconnects", "reacquired", "lost_to_restart")
        report: dict[str, Any] = {k: sum(int(e[k]) for e in per_broker.values()) for k in keys}
        report["brokers"] = per_broker
        report["batches_held"] = batches_held
        report["prefetched"] = self.pool.count()
        report["timing_ms"] = self.timing.rounded()
        if self.an_budget is not None:
            report["available_now_left"] = sum(self.an_budget.values())
        return report
