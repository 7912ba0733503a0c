"""The interpreted build's lane: a worker's plain commands served in one Python frame.

Why: interpreted, every Python call costs ~430 instructions before it does anything, and the
general path of a depth-1 command walks 9-13 of them (``data_received`` -> ``parse_packet`` ->
``_execute`` -> ``Queue.put`` -> ``new_job``, ``JobTable.put``, ``_enqueue``, ``push_ready``; a
reserve goes through ``ready_top``, ``drop_ready_top``, ``_remove_ready_top``, ``_reserve``...). That
was most of the gap to the Python floor (bench/README.md, "The interpreted lane").
:class:`LaneConnection` answers the four commands a request/response worker sends most, when
each is in its plainest form, without any of those calls:

* ``put`` of a cached put line with no delay, its whole body and CRLF in the packet;
* ``reserve`` and ``reserve-with-timeout N`` by a client under its reserve cap, while no tube that
  clients wait on has a ready job, and no watched tube with ready jobs is paused or has a stale
  entry on top (tubes with waiting clients have no ready jobs then, and are skipped);
* ``delete`` of a job the client holds.

It serves on a broker without a binlog and without auth (``server.connection_class``), and only
while the connection is *open* to it (``lane_open``: not closing, nothing buffered or half-read, no reserve
waiting, replies not paused, input noted for the idle sweep), which the general path decides after each packet
it serves.
Everything else, and every case with a condition above unmet, goes to
:meth:`BrokerConnection.handle_input` before anything changed: the lane is the same
state change as the general path, written flat, never a different rule. Each branch says
which general-path function it mirrors; ``tests/test_lane.py`` runs random command streams
through both and compares every reply, the queue's stats and every job, and the differential
suite runs against the interpreted broker (the lane) in CI. Compiled, the calls are cheap C
calls: the compiled build keeps the general path (``server.connection_class``).
"""
from __future__ import annotations

from heapq import heappop, heappush
from typing import Final

from broker import protocol as p
from broker.connection import BrokerConnection
from broker.jobtable import PAGE_BITS, PAGE_MASK, SPARSE_LIVE
from broker.model import INVALID, NS, READY, RESERVED, URGENT_THRESHOLD, Job, shared_int
from broker.queue import CREATED_GRAIN
from broker.state import ServerState

_object_new: Final = object.__new__


class LaneConnection(BrokerConnection):
    """A :class:`BrokerConnection` whose ``data_received`` serves the lane's commands itself."""

    __slots__ = ("lane_open", "put_line", "put_prepared", "reserve_packet", "reserve_timed")

    def __init__(self, state: ServerState) -> None:
        super().__init__(state)
        # This client's last put line and reserve packet the lane served, with what the server's caches
        # (ServerState.lane_puts, lane_reserves) hold for them: a client sends the same ones again and again,
        # and a bytes compare costs less than hashing a new packet for a dict look-up. The line and packet
        # are the caches' own objects, which every connection shares: with 500 connections a copy of each
        # connection's own was out of the CPU cache by its next command (bench/instructions.py --cache-sim).
        # b"": none yet (a put line starts with "p", a reserve packet with "r").
        self.put_line = b""
        self.put_prepared = (b"", 0, 0, 0)
        self.reserve_packet = b""
        self.reserve_timed = False
        # True only while the lane may serve the next packet: not closing, nothing buffered or half-read, no
        # reserve waiting, replies not paused, and the packet's arrival already noted for the idle sweep. Set
        # after each packet of the general path (_general), which is the only one that can change those
        # within a packet; cleared when the connection closes (mark_closing), the transport pauses our writes
        # (pause_writing) or the idle sweep asks for activity (take_activity). One slot read per packet
        # instead of seven checks over four objects.
        self.lane_open = False

    def mark_closing(self) -> None:
        self.lane_open = False
        BrokerConnection.mark_closing(self)

    def pause_writing(self) -> None:
        self.lane_open = False
        BrokerConnection.pause_writing(self)

    def take_activity(self) -> bool:
        # The lane notes no input (a store a packet): the next packet goes through _general, which does.
        self.lane_open = False
        return BrokerConnection.take_activity(self)

    def _general(self, data: bytes) -> None:
        """The general path for this packet (BrokerConnection.data_received after the busy poll's note),
        then whether the lane may serve the next one."""
        if self.closing:
            return
        self.activity = True
        self.handle_input(data)
        decoder = self.decoder
        self.lane_open = not (self.closing or self.client.waiting or decoder.pos != len(decoder.buf) or decoder.mode
                              or self.flow.write_paused)

    def data_received(self, data: bytes) -> None:  # noqa: C901 - one frame is the point (see the module)
        poll = self.poll
        if poll is not None and not poll.fresh:  # BusyPoll.note_input, as BrokerConnection.data_received
            if poll.spinning:
                poll.fresh = True
            else:
                poll.note_input()
        if not self.lane_open:
            self._general(data)
            return
        # self.out is empty here: every path of the general one writes out what it gathered before it returns.
        client = self.client
        queue = self.queue
        job: Job | None  # put's new job; reserve's least top so far
        first = data[0]
        if first == 112:  # "p": put (Decoder.parse_packet + Queue.put + _enqueue + JobTable.put)
            line, _, rest = data.partition(b"\r\n")  # a cached line holds no CR: this is its first one
            prepared: tuple[bytes, int, int, int] | None
            if line == self.put_line:
                prepared = self.put_prepared
            else:
                prepared = self.state.lane_puts.get(line)
                if prepared is None:
                    self._general(data)
                    self._prepare_put(line)
                    return
                self.put_line = prepared[0]
                self.put_prepared = prepared
            _, pri, ttr, size = prepared
            # The body and the CRLF ending the packet: nothing after the last CRLF, and size + 2 bytes in all
            # (which a rest without any CRLF, whose "body" is empty, cannot have).
            body, _, tail = rest.rpartition(b"\r\n")
            job_id = queue.next_id
            tube = client.use
            if (tail or len(rest) != size + 2
                    or queue.draining or queue.puts_capped or job_id >> tube.ready_shift):
                self._general(data)
                return
            if not client.producer:  # Queue._set_producer: the client's first put (a connection per job: its only)
                client.producer = True
                queue.producers += 1
            queue.next_id = job_id + 1
            now = queue.clock()
            created = queue.recent_now
            if now >= queue.recent_until or now < created:
                created = queue.recent_now = now
                queue.recent_until = now + CREATED_GRAIN
            job = _object_new(Job)  # model.new_job, every slot
            job.id = job_id
            job.tube = tube
            job.pri = pri
            job.ttr = ttr
            job.body = body
            job.state = READY
            job.created = created
            job.deadline = 0
            job.reserver = None
            job.reserves = 0
            job.rare = None
            job.file = 0
            jobs = queue.jobs  # JobTable.put: a new id in an existing page without lazy jobs
            index = (job_id >> PAGE_BITS) - jobs.base
            page = None
            if index >= 0:  # (a negative index would read the list from its end)
                try:  # noqa: SIM105 - contextlib.suppress is two calls
                    page = jobs.pages[index]
                except IndexError:  # the id opens a new page
                    pass
            if page is not None:  # (a new id has no lazy job: its slot is empty, lazy or not)
                page.slots[job_id & PAGE_MASK] = job
                page.live += 1
                jobs.paged += 1
            else:
                jobs.put(job_id, job)
            queue.held_bytes += size
            tube.total_jobs += 1  # and the queue's put and job counts (Queue.dropped_jobs, jobs_created)
            entry = (pri << tube.ready_shift) | job_id  # Tube.push_ready
            run = tube.ready_run
            if not run or entry > run[-1]:
                run.append(entry)
            else:
                heappush(tube.ready, entry)
            tube.ready_count += 1
            if pri < URGENT_THRESHOLD:
                tube.urgent_count += 1
            reply = b"INSERTED %d\r\n" % job_id
            if queue.waiting_ct:
                queue._process_queue(now)  # may reserve for a waiting client: its TTR goes on the timer heap
                self.transport.write(reply)
                self._after_write()
                return
            self.transport.write(reply)
            if not self.lane_open:  # the write paused (pause_writing): as the general path after a write
                self._check_output()  # type: ignore[unreachable]  # mypy cannot see write() call pause_writing
            return
        elif first == 114:  # "r": reserve (Queue.reserve + _fast_reserve + Tube.ready_top + _reserve)
            timed: bool
            if data == self.reserve_packet:
                timed = self.reserve_timed
            else:
                kept = self.state.lane_reserves.get(data)
                if kept is None:
                    self._general(data)
                    self._prepare_reserve(data)
                    return
                self.reserve_packet, timed = kept
                self.reserve_timed = timed
            if not client.worker:
                self._general(data)
                return
            now = queue.clock()
            holds = client.held
            if holds:
                # Queue.reserve's checks for a client holding jobs: its reserve cap, and DEADLINE_SOON, which
                # is answered only when no watched tube has a ready job (then the lane falls back below); its
                # look at the soonest deadline drops stale entries, so the lane needs a live one on top, or an
                # empty heap (one job held, without an entry: Client.hold).
                if queue.reserve_cap and holds >= queue.reserve_cap:
                    self._general(data)
                    return
                deadlines = client.deadlines
                if deadlines:
                    job = client.holding(deadlines[0][1])  # Client.soonest_held's test of the top entry
                    if job is None or job.deadline != deadlines[0][0]:
                        self._general(data)
                        return
            if queue.waiting_ct:  # as _fast_reserve: a waiting client may be owed a ready job first
                for tube in queue.waited_tubes:
                    if tube.ready_count:
                        self._general(data)
                        return
            jobs = queue.jobs
            job = None  # the least (pri, id) among the watched tubes' tops, as _fast_reserve
            in_run = False
            for tube in client.watching:
                if not tube.ready_count:
                    continue
                if tube.pause:
                    self._general(data)
                    return
                heap = tube.ready  # Tube.ready_top, when its top entry is live
                run = tube.ready_run
                at = tube.ready_run_at
                top_in_run = at < len(run) and (not heap or run[at] < heap[0])
                entry = run[at] if top_in_run else heap[0] if heap else -1  # (top_in_run is ready_top's scratch)
                job_id = entry & tube.ready_mask
                index = (job_id >> PAGE_BITS) - jobs.base  # JobTable.get, but for a page with lazy jobs
                page = None
                if index >= 0:
                    try:  # noqa: SIM105 - contextlib.suppress is two calls
                        page = jobs.pages[index]
                    except IndexError:
                        pass
                # No page: evicted (a drained page's last jobs) or never made; entry -1 finds no job. A lazy job not
                # made yet reads None from its slot too: the general path makes it.
                top = jobs.overflow.get(job_id) if page is None else page.slots[job_id & PAGE_MASK]
                # Tube.ready_live. Not its `job.tube is self`: the slot of an id holds that job only, and a
                # job's tube never changes (ids are never reused). Nor the rest on a clean tube, whose every
                # entry is a ready job's (Tube.ready_clean): only a lazy job not made yet reads None there.
                if top is None or (not tube.ready_clean
                                   and (top.state != READY or top.pri != entry >> tube.ready_shift)):
                    self._general(data)  # a stale entry on top: the general path drops it
                    return
                if job is None or top.pri < job.pri or (top.pri == job.pri and top.id < job.id):
                    job = top
                    in_run = top_in_run
            if job is None:
                self._general(data)
                return
            if job.tube is not tube:  # the best top is not the last watched tube's: its tube's lists
                tube = job.tube
                heap = tube.ready
                run = tube.ready_run
                at = tube.ready_run_at
            if timed:
                queue.cmd_reserve_timeout += 1
            else:
                queue.cmd_reserve += 1
            tube.waiting.last_use = 1
            if in_run:  # Tube.drop_ready_top
                at += 1
                if at == len(run):
                    run.clear()
                    at = 0
                elif at >= 1024 and 2 * at >= len(run):
                    del run[:at]
                    at = 0
                tube.ready_run_at = at
            else:
                heappop(heap)
            ready_count = tube.ready_count - 1  # Queue._remove_ready_top
            tube.ready_count = ready_count
            if job.pri < URGENT_THRESHOLD:
                tube.urgent_count -= 1
            if not tube.ready_clean:  # Tube.prune_ready (its test on the lists in place, then a call if it fires)
                if len(heap) + len(run) - at > 2 * ready_count + 64:
                    tube.prune_ready()
                elif not (run or heap):
                    tube.ready_clean = True
            job.state = RESERVED  # Queue._reserve
            job.reserver = client
            job.reserves += 1
            job.deadline = deadline = now + job.ttr * NS
            if holds:
                client.hold(job)
            else:  # Client.hold, holding none: the job is its first, and keeps its deadline on itself
                client.first = job
                client.held = 1
            tube.reserved_count += 1
            client.pending_timeout = -1
            armed = client.ttr_armed
            body = job.body
            reply = b"RESERVED %d %d\r\n%s\r\n" % (job.id, len(body), body)
            if not armed or deadline < armed:  # Queue.arm_ttr: the only timer this branch pushes
                queue.arm_ttr(client, deadline)
                self.transport.write(reply)
                self._after_write()  # its LoopTimer.check
                return
            self.transport.write(reply)
            if not self.lane_open:  # the write paused (pause_writing)
                self._check_output()  # type: ignore[unreachable]  # mypy cannot see write() call pause_writing
            return
        elif first == 100:  # "d": delete of a job this client holds (Queue.delete + _unreserve)
            line = data[7:-2]
            # "delete ", a plain number below 2**63 (protocol.plain_number), CRLF: nothing else in the packet
            if data != b"delete %s\r\n" % line or not line.isdigit() or len(line) > 18:
                self._general(data)
                return
            job_id = int(line)
            held = client.first  # Client.holding and drop_hold
            if held is not None and held.id == job_id:
                client.first = None
            else:
                more = client.more
                held = more.get(job_id) if client.held else None
                if held is None:
                    self._general(data)
                    return
                del more[job_id]
            holds = client.held - 1
            client.held = holds
            if holds:
                client.prune_deadlines()
            held.reserver = None
            tube = held.tube
            tube.reserved_count -= 1
            tube.total_deletes += 1  # and the queue's cmd-delete (Queue.deletes_made, counted_ops)
            held.state = INVALID
            jobs = queue.jobs  # JobTable.pop, when its page stays (not sparse, or the newest) and has no lazy jobs
            index = (job_id >> PAGE_BITS) - jobs.base
            page = None
            if index >= 0:
                try:  # noqa: SIM105 - contextlib.suppress is two calls
                    page = jobs.pages[index]
                except IndexError:
                    pass
            # A held job is made and in its page's slot whenever that page exists (a page's ids are never in
            # overflow), lazy jobs beside it or not.
            if page is not None and (page.live > SPARSE_LIVE or index == len(jobs.pages) - 1):
                page.slots[job_id & PAGE_MASK] = None
                page.live -= 1
                jobs.paged -= 1
            else:
                jobs.pop(job_id)
            queue.held_bytes -= len(held.body)
            if not tube.watching:  # Queue.drop_if_unused (a watched tube stays)
                queue.drop_if_unused(tube)
            self.transport.write(p.DELETED)
            if not self.lane_open:  # the write paused (pause_writing): as the general path after a write
                self._check_output()  # type: ignore[unreachable]  # mypy cannot see write() call pause_writing
            return
        self._general(data)

    def _after_write(self) -> None:
        """What the general path does after a reply that may have pushed a deadline: back-pressure, the loop timer
        (the reserve branch's tail, as a call: a put that woke a waiting worker is rare)."""
        if not self.lane_open:  # the write paused (pause_writing)
            self._check_output()
        timer = self.timer
        if timer.heap.earliest_pushed < timer.when:  # LoopTimer.check
            timer.reschedule()

    def _prepare_reserve(self, data: bytes) -> None:
        """After the general path served a packet starting with "r": keep it if it is one reserve command in
        canonical form (its line in the line cache), with whether it counts as reserve-with-timeout."""
        if len(data) < 9 or data[-2:] != b"\r\n" or data.find(b"\r") != len(data) - 2:
            return
        cmd = self.decoder.line_cache.get(data[:-2])
        if cmd is None or cmd[0] not in ("reserve", "reserve-with-timeout"):
            return
        packets = self.state.lane_reserves
        if len(packets) >= p.LINE_CACHE_SIZE:
            packets.clear()
        packets[data] = (data, cmd[0] == "reserve-with-timeout")

    def _prepare_put(self, line: bytes) -> None:
        """After the general path served a put line: keep what the lane needs of it, if it may serve it.

        Only a line in the decoders' line cache (well-formed, parsed once) with no delay and a size within
        the limit; its priority and TTR as the job will hold them (the queue's shared ints, TTR 0 as 1)."""
        cmd = self.decoder.line_cache.get(line)
        if cmd is None or cmd[0] != "put":
            return
        _, pri, delay, ttr, size = cmd  # type: ignore[misc]  # a PutLine, as a plain tuple
        if delay or size > self.decoder.max_job_size:
            return
        pool = self.queue.int_pool
        lines = self.state.lane_puts
        if len(lines) >= p.LINE_CACHE_SIZE:
            lines.clear()
        lines[line] = (line, shared_int(pool, pri) if pri > 256 else pri,
                       (shared_int(pool, ttr) if ttr > 256 else ttr) or 1, size)
