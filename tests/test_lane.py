"""The interpreted lane (broker/lane.py) is the general path written flat, never another rule.

Random streams of commands from three clients go to two in-process brokers over fake
transports: one whose connections are the general :class:`BrokerConnection`, one whose are the
lane's :class:`LaneConnection`. Every reply must be the same bytes, and afterwards every job,
tube and counter the same. The lane subclasses the interpreted connection class, so these run
on the interpreted core; in the compiled pass the module runs itself again under
``SPARK_BEANSTALK_PURE=1`` (one test, which fails if any of them fails there).
"""
from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import _build, queue_timers
from broker import connection as connection_module
from broker.connection import BrokerConnection
from broker.limits import Limits
from broker.queue import QueueListener
from broker.server import BrokerServer, ServerConfig, connection_class
from tests.helpers import FakeTransport, connect

INTERPRETED = not _build.is_compiled_file(str(connection_module.__file__))

if not INTERPRETED:

    def test_the_lane_suite_passes_on_the_interpreted_core() -> None:
        env = dict(os.environ, SPARK_BEANSTALK_PURE="1")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               __file__], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]

else:
    from broker.lane import LaneConnection

    class Clock:
        """The queue's clock, moved by the script only: both brokers see the same times."""

        def __init__(self) -> None:
            self.now = 1_000_000_000_000

        def __call__(self) -> int:
            return self.now

    class Pair:
        """The same script against a general-path broker and a lane broker."""

        def __init__(self, clients: int = 3, limits: Limits | None = None) -> None:
            self.clock = Clock()
            self.sides: list[tuple[BrokerServer, list[tuple[BrokerConnection, FakeTransport]]]] = []
            for cls in (BrokerConnection, LaneConnection):
                server = BrokerServer(ServerConfig(busy_poll_us=0, limits=limits or Limits()), clock=self.clock)
                self.sides.append((server, [connect(server, cls) for _ in range(clients)]))

        def send(self, client: int, packet: bytes) -> None:
            replies = []
            for _, conns in self.sides:
                conn, transport = conns[client]
                conn.data_received(packet)
                replies.append(transport.take())
            general, lane = replies
            assert general == lane, f"client {client} sent {packet!r}: general {general!r}, lane {lane!r}"

        def delete_oldest_held(self, client: int) -> None:
            """The worker ``client`` deletes the oldest job it holds (the same id on both sides)."""
            self.send(client, b"delete %d\r\n" % min(job.id for job in self.sides[0][1][client][0].client.held_jobs()))

        def state(self, index: int) -> dict[str, Any]:
            server, conns = self.sides[index]
            queue = server.queue
            who = {id(conn.client): n for n, (conn, _) in enumerate(conns)}
            jobs = {}
            for job_id in range(1, queue.next_id):
                job = queue.jobs.get(job_id)
                if job is not None:
                    jobs[job_id] = (job.tube.name, job.pri, job.ttr, job.body, job.state, job.created, job.deadline,
                                    who.get(id(job.reserver)), job.reserves, job.rare, job.file)
            tubes = {t.name: (t.ready_count, t.urgent_count, t.reserved_count, t.delayed_count, t.total_jobs,
                              t.total_deletes, list(t.buried), t.pause, t.unpause_at, t.using, t.watching,
                              len(t.waiting.items), t.waiting.last_use, t.ready_entries(), t.ready_run_at,
                              t.ready_clean)
                     for t in queue.tubes.items}
            counters = {name: getattr(queue, name) for name in (
                "next_id", "held_bytes", "cmd_reserve", "cmd_reserve_timeout", "waiting_ct", "producers", "workers")}
            counters.update(total_jobs=queue.jobs_created(), cmd_put=queue.counted_ops()["put"],
                            cmd_delete=queue.counted_ops()["delete"])
            clients = [(sorted(job.id for job in conn.client.held_jobs()), conn.client.waiting, conn.client.ttr_armed,
                        sorted(conn.client.deadlines)) for conn, _ in conns]
            return {"jobs": jobs, "tubes": tubes, "counters": counters, "ops": dict(queue.op_counts),
                    "len": len(queue.jobs), "table": queue.jobs.footprint(), "clients": clients}

        def check_state(self) -> None:
            general, lane = self.state(0), self.state(1)
            assert general == lane

        def drain_order(self) -> None:
            """What is left comes out in the same order from both (the ready heaps and runs agree)."""
            for tube in ("default", "a", "b"):
                self.send_fresh(b"watch %s\r\n" % tube.encode())
            got: list[bytes] = []
            while True:
                replies = self.send_fresh(b"reserve-with-timeout 0\r\n")
                if not replies.startswith(b"RESERVED"):
                    break
                got.append(replies)
                self.send_fresh(b"delete %s\r\n" % replies.split()[1])
                assert len(got) < 500

        def send_fresh(self, packet: bytes) -> bytes:
            """From one more client on each side (made on first use)."""
            replies = []
            for server, conns in self.sides:
                if len(conns) == 3:
                    conns.append(connect(server, type(conns[0][0])))
                conn, transport = conns[3]
                conn.data_received(packet)
                replies.append(transport.take())
            assert replies[0] == replies[1], f"{packet!r}: {replies[0]!r} != {replies[1]!r}"
            return replies[0]

    def run(body: Callable[[], None]) -> None:
        async def main() -> None:  # the loop timer needs a running loop
            body()

        asyncio.run(main())

    # Small domains, so that put lines repeat (the lane serves a line once it is cached) and jobs of
    # equal priority meet in different tubes (the tie-break of a reserve across tubes).
    PRIS = (0, 1023, 1024, 1024, 5000, 4294967295)
    TUBES = (b"default", b"a", b"b")
    ODD = (b"delete 01\r\n", b"delete 1 \r\n", b"delete\r\n", b"delete 99999999999999999999\r\n", b"d", b"r", b"p",
           b"delete 1\r", b"reserve\r\nreserve\r\n", b"reserve-with-timeout 1\r\n", b"reserve-with-timeout 00\r\n",
           b"reserve-with-timeout  0\r\n", b"pause-tube a 1\r\n", b"pause-tube default 0\r\n", b"peek-ready\r\n",
           b"kick 3\r\n", b"put 1024 0 120 5\r\nhel", b"lo\r\n", b"put 1024 0 120 2\r\nhixx",
           b"put 1024 0 120 4\r\na\r\nb\r\n", b"put 1024 0 120 5\r\nhello\r\r\n", b"put 1024 0 120 5\r",
           b"delete " + b"1" * 5000 + b"\r\n")

    def command(draw: Callable[[list[Any]], Any]) -> bytes:
        """One packet, drawn by ``draw(options)`` (hypothesis or a seeded random.choice)."""
        kind = draw(["put", "put", "put", "put", "reserve", "reserve", "rwt0", "delete", "delete", "delete",
                     "release", "bury", "touch", "kick-job", "reserve-job", "peek", "use", "watch", "ignore", "odd",
                     "tick"])
        job_id = draw(list(range(1, 13)))
        if kind == "put":
            body = draw([b"", b"x", b"hello"])
            end = draw([b"\r\n"] * 6 + [b"xx", b"\r\nreserve-with-timeout 0\r\n"])
            pri, delay, ttr = draw(PRIS), draw([0, 0, 0, 0, 1]), draw([0, 120, 120])
            return b"put %d %d %d %d\r\n%s%s" % (pri, delay, ttr, len(body), body, end)
        if kind == "reserve":
            return b"reserve\r\n"
        if kind == "rwt0":
            return b"reserve-with-timeout 0\r\n"
        if kind == "delete" and draw([True, True, False]):
            return b"DELETE-HELD"  # a worker deleting what it reserved: the oldest job it holds, at play time
        if kind in ("delete", "touch", "kick-job", "reserve-job", "peek"):
            return b"%s %d\r\n" % (kind.encode(), job_id)
        if kind == "release":
            return b"release %d %d %d\r\n" % (job_id, draw(PRIS), draw([0, 0, 1]))
        if kind == "bury":
            return b"bury %d %d\r\n" % (job_id, draw(PRIS))
        if kind in ("use", "watch", "ignore"):
            return b"%s %s\r\n" % (kind.encode(), draw(list(TUBES)))
        if kind == "odd":
            return bytes(draw(list(ODD)))
        return b"TICK"  # the clock moves on 0.6 s: delays and pauses end, TTRs come due

    def play(script: list[tuple[int, bytes]], lane_served: dict[bytes, int] | None = None) -> None:
        """Run ``script`` on a Pair; count in ``lane_served`` the packets the lane answered itself."""
        pair = Pair()
        for client, packet in script:
            if packet == b"TICK":
                pair.clock.now += 600_000_000
                for server, _ in pair.sides:
                    queue_timers.tick(server.queue)
                continue
            if packet == b"DELETE-HELD":
                held = sorted(job.id for job in pair.sides[0][1][client][0].client.held_jobs())
                packet = b"delete %d\r\n" % (held[0] if held else 1)
            if lane_served is not None:
                lane_conn = pair.sides[1][1][client][0]
                if not calls_during_named(lambda c=client, b=packet: pair.send(c, b), lane_conn, "handle_input"):
                    lane_served[packet[:1]] = lane_served.get(packet[:1], 0) + 1
            else:
                pair.send(client, packet)
        pair.check_state()
        pair.drain_order()
        pair.check_state()

    def calls_during_named(action: Callable[[], None], conn: BrokerConnection, name: str) -> bool:
        """Whether ``conn`` ran its method ``name`` during ``action``."""
        seen = False

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal seen
            if event == "call" and frame.f_code.co_name == name and frame.f_locals.get("self") is conn:
                seen = True

        sys.setprofile(profile)
        try:
            action()
        finally:
            sys.setprofile(None)
        return seen

    @st.composite
    def scripts(draw: st.DrawFn) -> list[tuple[int, bytes]]:
        size = draw(st.integers(1, 80))

        def pick(options: list[Any]) -> Any:
            return draw(st.sampled_from(options))

        return [(draw(st.integers(0, 2)), command(pick)) for _ in range(size)]

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(scripts())
    def test_the_lane_answers_and_changes_state_as_the_general_path(script: list[tuple[int, bytes]]) -> None:
        run(lambda: play(script))

    def test_long_seeded_scripts_go_through_the_lane() -> None:
        """Longer streams, and proof that they exercise the lane: it must have answered many puts,
        reserves and deletes itself (a lane that fell back every time would pass the test above)."""
        served: dict[bytes, int] = {}
        for seed in range(12):
            rng = random.Random(seed)
            script = [(rng.randrange(3), command(rng.choice)) for _ in range(400)]
            run(lambda script=script: play(script, served))  # type: ignore[misc]
        assert served.get(b"p", 0) > 200 and served.get(b"r", 0) > 120 and served.get(b"d", 0) > 200, served

    def calls_during(conn: BrokerConnection, packet: bytes) -> list[str]:
        """The broker's Python functions a packet's handling called (beyond data_received itself)."""
        seen: list[str] = []
        package = os.path.dirname(str(connection_module.__file__))

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_filename.startswith(package):
                seen.append(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            conn.data_received(packet)
        finally:
            sys.setprofile(None)
        return seen[1:] if seen and seen[0] == "data_received" else seen

    def test_the_plain_commands_run_in_one_frame() -> None:
        """The point of the lane: a worker's put, reserve and delete call no Python function of the
        broker, where the general path walks 9-13 of them."""
        def body() -> None:
            server = BrokerServer(ServerConfig(busy_poll_us=0))
            assert connection_class(server.state) is LaneConnection
            conn, transport = connect(server, LaneConnection)
            # A client's first packet and first reserve, and each packet's first time, take the general path
            # (it notes the input, makes the client a worker, and parses the line the lane then keeps)
            for packet in (b"put 1024 0 60 5\r\nhello\r\n", b"reserve\r\n", b"delete 1\r\n",
                           b"put 1024 0 60 5\r\nhello\r\n", b"reserve-with-timeout 0\r\n", b"delete 2\r\n"):
                conn.data_received(packet)
            assert transport.take().endswith(b"DELETED\r\n")
            for _ in range(3):
                assert calls_during(conn, b"put 1024 0 60 5\r\nhello\r\n") == []
                assert transport.take().startswith(b"INSERTED")
                assert calls_during(conn, b"reserve\r\n") == []
                reply = transport.take()
                assert reply.startswith(b"RESERVED") and reply.endswith(b"hello\r\n")
                assert calls_during(conn, b"delete %s\r\n" % reply.split()[1]) == []
                assert transport.take() == b"DELETED\r\n"
            conn.data_received(b"put 1024 0 60 5\r\nhello\r\n")
            assert transport.take().startswith(b"INSERTED")
            assert calls_during(conn, b"reserve-with-timeout 0\r\n") == []
            assert transport.take().startswith(b"RESERVED")
            # The client's last put line and reserve packet are kept on its connection (no hashing next time)
            assert conn.put_line == b"put 1024 0 60 5" and conn.put_prepared[1:] == (1024, 60, 5)
            assert conn.reserve_packet == b"reserve-with-timeout 0\r\n" and conn.reserve_timed
            # ... as the server's own objects, which every connection shares: a copy of each connection's own
            # was out of the CPU cache by its next command when hundreds of connections took turns
            other, other_transport = connect(server, LaneConnection)
            for packet in (b"put 1024 0 60 5\r\nhello\r\n", b"reserve-with-timeout 0\r\n") * 2:  # general, then lane
                other.data_received(bytes(bytearray(packet)))  # a fresh object, as each read makes one
                assert other_transport.take().startswith((b"INSERTED", b"RESERVED"))
            assert other.put_line is conn.put_line and other.reserve_packet is conn.reserve_packet
            general, _ = connect(server, BrokerConnection)
            assert len(calls_during(general, b"put 1024 0 60 5\r\nhello\r\n")) >= 5

        run(body)

    def test_a_new_clients_first_put_takes_the_lane() -> None:
        """A producer that connects for each job sends `use` and one put: that put, its first, is served
        by the lane (made a producer there, as Queue._set_producer does), not by the general path."""
        def body() -> None:
            server = BrokerServer(ServerConfig(busy_poll_us=0))
            put = b"put 1024 0 60 5\r\nhello\r\n"
            first, transport = connect(server, LaneConnection)
            first.data_received(b"use default\r\n")
            first.data_received(put)  # parsed once by the general path, and its line kept for the lane
            assert transport.take().endswith(b"INSERTED 1\r\n") and server.queue.producers == 1
            for n in (2, 3):
                conn, transport = connect(server, LaneConnection)
                conn.data_received(b"use default\r\n")  # a connection's first packet: the general path
                assert calls_during(conn, put) == []
                assert transport.take() == b"USING default\r\nINSERTED %d\r\n" % n
                assert conn.client.producer and server.queue.producers == 2  # current-producers
                conn.connection_lost(None)
                assert server.queue.producers == 1

        run(body)

    def test_a_put_wakes_a_waiting_worker_through_the_lane() -> None:
        """A put while a worker waits: the lane hands the job over as the general path does."""
        def body() -> None:
            pair = Pair()
            pair.send(1, b"reserve\r\n")  # waits
            pair.send(0, b"put 7 0 60 2\r\nhi\r\n")
            for _, conns in pair.sides:
                assert not conns[1][0].client.waiting
            pair.check_state()

        run(body)

    def test_a_job_reserved_by_id_off_the_top_is_not_reserved_again() -> None:
        """reserve-job of the ready top leaves its entry stale with the job alive (RESERVED): the lane's next
        reserve must not hand it out again, and the tube is no longer clean (Tube.ready_clean)."""
        def body() -> None:
            pair = Pair()
            for _ in range(4):
                pair.send(0, b"put 5 0 60 1\r\nx\r\n")
            for _ in range(2):  # a worker, and its reserve packet known to the lane
                pair.send(1, b"reserve\r\n")
                pair.delete_oldest_held(1)
            pair.send(2, b"reserve-job 3\r\n")
            for server, conns in pair.sides:
                assert not [t for t in server.queue.tubes.items if t.name == "default"][0].ready_clean
                conn, transport = conns[1]
                conn.data_received(b"reserve\r\n")
                assert transport.take() == b"RESERVED 4 1\r\nx\r\n"
            pair.check_state()

        run(body)

    def test_puts_and_deletes_in_a_forgotten_tube_still_count() -> None:
        """The lane counts a put or a delete in its tube only; the queue's total-jobs, cmd-put and cmd-delete sum
        the tubes. A tube forgotten once its last client and job go (drop_if_unused) must leave its counts in them."""
        def body() -> None:
            pair = Pair()
            pair.send(0, b"use gone\r\n")
            pair.send(1, b"watch gone\r\n")
            for _ in range(3):
                pair.send(0, b"put 5 0 60 1\r\nx\r\n")
                pair.send(1, b"reserve\r\n")
                pair.delete_oldest_held(1)
            pair.send(0, b"use default\r\n")
            pair.send(1, b"ignore gone\r\n")
            pair.send(0, b"put 5 0 60 1\r\nx\r\n")
            pair.send(1, b"delete 99\r\n")  # NOT_FOUND: a delete command all the same
            for server, _ in pair.sides:
                queue = server.queue
                assert "gone" not in [t.name for t in queue.tubes.items]
                assert queue.jobs_created() == 4 and queue.counted_ops()["put"] == 4
                assert queue.counted_ops()["delete"] == 4
            pair.check_state()

        run(body)

    def test_long_queues_compact_and_prune_as_the_general_path() -> None:
        """What only long queues reach: the ready run's served prefix dropped (1,024 served), the
        ready heap rebuilt once stale entries dominate, a worker's deadline heap pruned."""
        def body() -> None:
            pair = Pair()
            pair.send(0, b"put 5 0 60 1\r\nx\r\n")  # the line is cached from here on
            for _ in range(1099):
                pair.send(0, b"put 5 0 60 1\r\nx\r\n")
            for _ in range(1050):  # the run's prefix is dropped at 1,024 served
                pair.send(1, b"reserve\r\n")
                pair.delete_oldest_held(1)
            pair.check_state()
            # 50 ready left (1051-1100) plus 150 more: delete the newest 132 while ready, so that
            # stale entries sit exactly at the threshold; the next reserve rebuilds the heap
            for _ in range(150):
                pair.send(0, b"put 5 0 60 1\r\nx\r\n")
            for job_id in range(1250, 1118, -1):
                pair.send(2, b"delete %d\r\n" % job_id)
            pair.check_state()
            pair.send(1, b"reserve\r\n")
            pair.check_state()
            for _ in range(100):  # a worker holding 120 jobs, then deleting them: its deadline heap is pruned
                pair.send(0, b"put 5 0 60 1\r\nx\r\n")
            for _ in range(120):
                pair.send(1, b"reserve\r\n")
            for job_id in sorted(job.id for job in pair.sides[0][1][1][0].client.held_jobs()):
                pair.send(1, b"delete %d\r\n" % job_id)
                pair.check_state()

        run(body)

    def test_a_drained_page_is_served_from_overflow_by_the_lane() -> None:
        """Draining in id order empties the oldest page to SPARSE_LIVE jobs, which then move to the
        table's overflow: the lane still serves their reserves itself, as the general path does."""
        def body() -> None:
            pair = Pair()
            for _ in range(2600):
                pair.send(0, b"put 5 0 60 1\r\nx\r\n")
            lane_conn = pair.sides[1][1][1][0]
            for _ in range(2):  # the worker's first reserve, and the packet's first time, take the general path
                pair.send(1, b"reserve\r\n")
                pair.delete_oldest_held(1)
            pair.send(1, b"reserve\r\n")
            general = evicted = 0
            for n in range(2200):
                pair.delete_oldest_held(1)
                general += calls_during_named(lambda: pair.send(1, b"reserve\r\n"), lane_conn, "handle_input")
                evicted = max(evicted, len(pair.sides[1][0].queue.jobs.overflow))
                if n % 500 == 0:
                    pair.check_state()
            assert evicted > 0, "no page was evicted: the test does not reach the overflow"
            assert general == 0, f"{general} reserves took the general path"
            pair.check_state()

        run(body)

    def test_a_job_below_the_first_page_is_not_read_at_a_negative_index() -> None:
        """Jobs of drained pages go to the overflow and the pages go, so the table's first page number rises
        past a job still held there: its index is negative, which a list would read from its end (another
        tube's job in the same slot, same priority: the lane must not serve it to a worker of this tube)."""
        def body() -> None:
            pair = Pair()
            pair.send(0, b"use a\r\nput 5 0 60 1\r\nA\r\nuse default\r\n")  # job 1, in tube a
            for _ in range(3070):
                pair.send(0, b"put 5 0 60 1\r\nx\r\n")  # 2-3071: pages 0-2 of default's jobs
            for _ in range(3):  # a worker of default: its first reserve, and the packet's first time
                pair.send(1, b"reserve\r\n")
                pair.delete_oldest_held(1)
            for _ in range(3067):  # every default job, so pages 0-2 are drained
                pair.send(1, b"reserve\r\n")
                pair.delete_oldest_held(1)
            for _ in range(2100):  # pages 3-5 of default's jobs, ready
                pair.send(0, b"put 5 0 60 1\r\ny\r\n")
            table = pair.sides[1][0].queue.jobs
            assert 1 in table.overflow and (1 >> 10) - table.base < 0 < len(table.pages), "job 1 is not below the pages"
            pair.send(2, b"watch a\r\nignore default\r\nreserve\r\n")  # general: the worker's first reserve
            pair.send(2, b"release 1 5 0\r\n")
            pair.send(2, b"reserve\r\n")
            pair.send(2, b"reserve-with-timeout 0\r\n")
            pair.check_state()

        run(body)

    def test_a_client_that_stops_reading_is_closed_as_on_the_general_path() -> None:
        """Replies the client does not read: the write that pauses the transport must be followed by the
        general path's check (--max-output-bytes closes the client) on the lane too, on that very packet."""
        def body() -> None:
            pair = Pair(limits=Limits(max_output_bytes=300))
            for _, conns in pair.sides:
                conn, transport = conns[0]
                transport.pause_at, transport.protocol = 100, conn
            sent = 0
            while not pair.sides[0][1][0][1].closed:
                pair.send(0, b"put 5 0 60 1\r\nx\r\n")
                sent += 1
                assert sent < 100
            for _, conns in pair.sides:
                assert conns[0][1].aborted and conns[0][0].closing
            assert sent > 10  # it was served a while (by the lane: the line is cached from the second put)
            pair.check_state()

        run(body)

    def test_the_idle_sweep_sees_every_client_the_lane_serves() -> None:
        """The lane notes no input for --idle-timeout: asking for activity closes it until the next packet,
        which the general path serves and notes. A client that keeps sending is never idle; a silent one is."""
        def body() -> None:
            server = BrokerServer(ServerConfig(busy_poll_us=0))
            conn, transport = connect(server, LaneConnection)
            put = b"put 5 0 60 1\r\nx\r\n"
            for _ in range(3):  # the first puts take the general path (a first put; the line kept)
                conn.data_received(put)
            assert transport.take().count(b"INSERTED") == 3 and calls_during(conn, put) == []
            for _ in range(3):
                assert conn.take_activity() and not conn.take_activity()  # the put above; then nothing since
                conn.data_received(put)  # after the sweep: the general path, which notes it
                assert transport.take().startswith(b"INSERTED")
                assert calls_during(conn, put) == []  # and the lane serves the next one again
                assert transport.take().startswith(b"INSERTED")

        run(body)

    def test_a_connection_closed_between_packets_is_not_served() -> None:
        """Closed outside a packet (a failing disk drops its unacknowledged replies, a slow reader's stall
        timer, a stepping-down leader): the lane answers nothing more, as the general path."""
        def body() -> None:
            server = BrokerServer(ServerConfig(busy_poll_us=0))
            conn, transport = connect(server, LaneConnection)
            put = b"put 5 0 60 1\r\nx\r\n"
            for _ in range(2):
                conn.data_received(put)
            assert transport.take().count(b"INSERTED") == 2
            conn.drop_unacknowledged()
            conn.data_received(put)
            assert transport.take() == b"" and server.queue.next_id == 3 and transport.aborted

        run(body)

    def test_a_body_that_reads_as_a_command_is_a_body() -> None:
        """A put line alone in its packet leaves the decoder waiting for the body with nothing buffered:
        the next packet is that body even when it reads like a put, reserve or delete the lane knows."""
        def body() -> None:
            pair = Pair()
            put = b"put 5 0 60 1\r\nx\r\n"
            for _ in range(3):  # the lane knows these packets now
                pair.send(0, put)
                pair.send(0, b"reserve\r\n")
                pair.delete_oldest_held(0)
            for packet in (put, b"reserve\r\n", b"delete 1\r\n"):
                pair.send(0, b"put 5 0 60 %d\r\n" % (len(packet) - 2))
                pair.send(0, packet)
            pair.send(0, b"put 5 0 60 1\r\n")
            pair.send(0, b"x\r\n")
            pair.check_state()
            assert pair.state(1)["counters"]["next_id"] == 8  # four bodies, whatever they looked like

        run(body)

    def test_a_reserve_waits_its_turn_behind_a_waiter_owed_a_job() -> None:
        """A tube whose pause has run out (its timer not fired yet) holds a ready job and a waiting
        client: the next reserve anywhere takes the general path, which serves that waiter first."""
        def body() -> None:
            pair = Pair()
            pair.send(0, b"use a\r\nput 9 0 60 1\r\nx\r\nuse b\r\nput 9 0 60 1\r\ny\r\nuse b\r\n")
            pair.send(1, b"watch a\r\nignore default\r\nreserve\r\n")  # worker of a
            pair.send(1, b"delete 1\r\n")
            pair.send(2, b"watch b\r\nignore default\r\nreserve\r\n")  # worker of b
            pair.send(2, b"delete 2\r\n")
            pair.send(0, b"pause-tube a 1\r\n")
            pair.send(1, b"reserve\r\n")  # waits on a
            pair.send(0, b"use a\r\nput 9 0 60 1\r\nx\r\nuse b\r\nput 9 0 60 1\r\ny\r\n")
            pair.clock.now += 2_000_000_000  # the pause is over; its timer has not fired
            pair.send(2, b"reserve\r\n")
            for _, conns in pair.sides:
                assert conns[1][1].take().startswith(b"RESERVED 3 "), "the waiter on a was not served first"
            pair.check_state()

        run(body)

    def test_a_clients_first_put_and_a_capped_reserve_take_the_general_path() -> None:
        """What the lane leaves to the general path even for a line it knows: a client's first put (it
        becomes a producer: stats' current-producers) and a reserve past --max-reserved-per-connection."""
        def body() -> None:
            pair = Pair(limits=Limits(max_reserved_per_connection=2))
            for _ in range(4):
                pair.send(0, b"put 3 0 60 2\r\nhi\r\n")  # the line is known to the lane from the second put
            pair.send(1, b"put 3 0 60 2\r\nhi\r\n")
            pair.check_state()
            assert pair.state(1)["counters"]["producers"] == 2
            for _ in range(3):  # the third answers OUT_OF_MEMORY
                pair.send(2, b"reserve-with-timeout 0\r\n")
            pair.check_state()
            assert len(pair.state(1)["clients"][2][0]) == 2

        run(body)

    def test_a_broker_with_a_binlog_or_auth_keeps_the_general_path() -> None:
        """The lane knows nothing of group commit, the sync point or auth: such brokers never use it."""
        assert connection_class(BrokerServer(ServerConfig()).state) is LaneConnection
        assert connection_class(BrokerServer(ServerConfig(auth_token=b"secret")).state) is BrokerConnection
        assert connection_class(BrokerServer(ServerConfig(), QueueListener()).state) is BrokerConnection
        gated = BrokerServer(ServerConfig())
        gated.state.write_gate = object()  # type: ignore[assignment]  # a replicated member's (which has a binlog too)
        assert connection_class(gated.state) is BrokerConnection

