"""The connection protocol in-process, over a fake transport (as uvicorn tests its protocols).

No sockets: bytes go into ``BrokerConnection.data_received`` and come out of a transport
stand-in that records writes, pauses and closes. Beside the real-process tests, these
reach what a socket cannot time exactly: a packet split at every byte, pause_writing /
resume_writing at a chosen moment, a connection lost while it holds jobs.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from broker.connection import MAX_BUFFER_WHILE_WAITING, TURN_COMMANDS
from broker.limits import Limits
from broker.queue import QueueListener
from broker.server import BrokerServer, ServerConfig
from tests.helpers import connect, make_server, wait_until_async


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 10))


async def settle() -> None:
    """Let call_soon callbacks (resumed processing) run."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_put_reserve_delete_bytes_in_bytes_out() -> None:
    async def body() -> None:
        server = make_server()
        conn, t = connect(server)
        conn.data_received(b"put 5 0 60 5\r\nhello\r\n")
        assert t.take() == b"INSERTED 1\r\n"
        conn.data_received(b"reserve\r\n")
        assert t.take() == b"RESERVED 1 5\r\nhello\r\n"
        conn.data_received(b"delete 1\r\ndelete 1\r\n")
        assert t.take() == b"DELETED\r\nNOT_FOUND\r\n"
        conn.data_received(b"stats\r\n")
        stats = t.take()
        assert b"cmd-put: 1\n" in stats and b"cmd-reserve: 1\n" in stats and b"cmd-delete: 2\n" in stats
    run(body)


def test_a_64_deep_packet_is_answered_with_one_write() -> None:
    """A client pipelining 64 commands gets their replies in one transport.write (one system call)."""
    async def body() -> None:
        conn, t = connect(make_server())
        conn.data_received(b"put 0 0 60 1\r\nx\r\n" * 40 + b"reserve-with-timeout 0\r\n" * 20 + b"delete 1\r\n" * 4)
        assert t.writes == 1
        replies = t.take()
        assert replies.count(b"INSERTED") == 40 and replies.count(b"RESERVED") == 20
        assert replies.endswith(b"RESERVED 20 1\r\nx\r\nDELETED\r\n" + b"NOT_FOUND\r\n" * 3)
        conn.data_received(b"stats\r\n")
        stats = t.take()
        assert b"cmd-put: 40\n" in stats and b"cmd-reserve-with-timeout: 20\n" in stats and b"cmd-delete: 4\n" in stats
    run(body)


def test_one_client_pipelining_put_reserve_delete_keeps_its_jobs_in_pages() -> None:
    """The load generator's cycle at one connection, depth 64: each packet deletes every job the
    previous one reserved, then puts and reserves more, so the job table empties once a packet.
    Its ids must stay in the table's pages: in its overflow every look-up missed the pages
    through a caught exception, and this row cost twice the instructions of 50 connections."""
    async def body() -> None:
        server = make_server()
        conn, t = connect(server)
        reserved: list[bytes] = []
        for _ in range(6):
            packet = b"".join(b"delete %s\r\n" % job_id for job_id in reserved)
            packet += b"put 0 0 60 1\r\nx\r\nreserve\r\n" * 20
            conn.data_received(packet)
            assert t.writes == 1
            replies = t.take().split(b"\r\n")
            assert replies.count(b"DELETED") == len(reserved)
            reserved = [line.split()[1] for line in replies if line.startswith(b"RESERVED")]
            assert len(reserved) == 20 and len(server.queue.jobs) == 20
            assert server.queue.jobs.footprint() == (1, 0), "ids spilled into the overflow dict"
            t.writes = 0
    run(body)


SCRIPT = (b"use jobs\r\nwatch jobs\r\nput 1 0 60 3\r\nabc\r\nput 0 0 60 0\r\n\r\nreserve\r\n"
          b"release 2 9 0\r\nreserve-with-timeout 0\r\nbury 2 3\r\nput 0 0 60 2\r\nxyz\r\n"
          b"stats-job 1\r\nkick 5\r\npeek-ready\r\ndelete 1\r\nlist-tube-used\r\nbogus\r\nquit\r\n")


def _transcript(chunks: list[bytes]) -> tuple[bytes, bool]:
    out: list[bytes] = []

    async def body() -> None:
        conn, t = connect(make_server())
        for chunk in chunks:
            conn.data_received(chunk)
            await settle()
        out.append(t.take())
        out.append(b"closed" if t.closed else b"open")

    run(body)
    return out[0], out[1] == b"closed"


def test_pipelined_packets_split_at_every_byte_answer_the_same() -> None:
    whole, closed = _transcript([SCRIPT])
    assert whole.startswith(b"USING jobs\r\nWATCHING 2\r\nINSERTED 1\r\nINSERTED 2\r\nRESERVED 2 0\r\n\r\n")
    assert b"EXPECTED_CRLF\r\n" in whole and b"UNKNOWN_COMMAND\r\n" in whole and closed
    for cut in range(1, len(SCRIPT)):
        assert _transcript([SCRIPT[:cut], SCRIPT[cut:]]) == (whole, True), cut
    assert _transcript([SCRIPT[i:i + 1] for i in range(len(SCRIPT))]) == (whole, True)


def test_a_put_split_across_packets_is_counted_once() -> None:
    async def body() -> None:
        conn, t = connect(make_server())
        conn.data_received(b"put 0 0 60 5\r\nhel")
        conn.data_received(b"lo\r\nstats\r\n")
        out = t.take()
        assert out.startswith(b"INSERTED 1\r\n") and b"cmd-put: 1\n" in out
    run(body)


def test_pause_writing_stops_processing_and_resume_writing_catches_up() -> None:
    async def body() -> None:
        conn, t = connect(make_server())
        conn.pause_writing()
        assert not t.reading
        conn.data_received(b"list-tube-used\r\n" * 600)
        before = t.take().count(b"USING default\r\n")
        assert 0 < before < 600  # stopped at the first periodic flush while the client is not reading
        conn.resume_writing()
        assert t.reading
        await settle()
        assert before + t.take().count(b"USING default\r\n") == 600
    run(body)


def test_a_paused_reader_past_the_output_limit_is_closed_and_counted() -> None:
    async def body() -> None:
        server = make_server(Limits(max_output_bytes=1 << 16))
        conn, t = connect(server)
        conn.data_received(b"put 0 0 60 1\r\nx\r\n")
        conn.pause_writing()
        t.buffered = 1 << 17
        conn.data_received(b"peek 1\r\n")
        assert t.aborted and server.queue.refusals.counts["slow_reader"] == 1
        conn.connection_lost(None)
        assert server.queue.cur_conns == 0
    run(body)


def test_connection_loss_releases_reserved_jobs() -> None:
    async def body() -> None:
        server = make_server()
        worker, wt = connect(server)
        other, ot = connect(server)
        other.data_received(b"put 0 0 60 3\r\none\r\n")
        worker.data_received(b"reserve\r\n")
        assert wt.take() == b"RESERVED 1 3\r\none\r\n"
        other.data_received(b"reserve-with-timeout 0\r\n")
        assert ot.take().endswith(b"TIMED_OUT\r\n")
        worker.connection_lost(ConnectionResetError())
        other.data_received(b"reserve-with-timeout 0\r\nstats-job 1\r\n")
        out = ot.take()
        assert out.startswith(b"RESERVED 1 3\r\none\r\n") and b"reserves: 2\n" in out
        assert server.queue.cur_conns == 1
    run(body)


def test_input_behind_a_blocked_reserve_pauses_reading_until_served() -> None:
    async def body() -> None:
        server = make_server()
        waiter, wt = connect(server)
        producer, pt = connect(server)
        waiter.data_received(b"reserve\r\n")
        assert wt.take() == b""
        waiter.data_received(b"list-tube-used\r\n" * (MAX_BUFFER_WHILE_WAITING // 16 + 2))
        assert not wt.reading  # over a MiB queued behind the reserve
        producer.data_received(b"put 0 0 60 2\r\nhi\r\n")
        assert pt.take() == b"INSERTED 1\r\n"
        # the queued commands are served a turn (connection.TURN_COMMANDS) a loop pass, then reading resumes
        await wait_until_async(lambda: not waiter.decoder.buffered() and wt.reading, 5, "the backlog served")
        out = wt.take()
        assert out.startswith(b"RESERVED 1 2\r\nhi\r\nUSING default\r\n")
        assert out.count(b"USING default\r\n") == MAX_BUFFER_WHILE_WAITING // 16 + 2
    run(body)


def test_a_client_pipelining_many_commands_yields_the_loop_between_turns() -> None:
    """More commands than one turn serves: the connection stops reading and goes on in the loop's next
    pass, so other clients are answered meanwhile; every command is still answered, in order."""
    async def body() -> None:
        server = make_server()
        flood, ft = connect(server)
        other, ot = connect(server)
        flood.data_received(b"use a\r\n" * (3 * TURN_COMMANDS))
        first_turn = ft.take().count(b"USING a\r\n")
        assert TURN_COMMANDS - 256 <= first_turn <= TURN_COMMANDS and not ft.reading
        other.data_received(b"list-tube-used\r\n")
        assert ot.take() == b"USING default\r\n"  # answered while the flood waits for its next turn
        await wait_until_async(lambda: not flood.decoder.buffered() and ft.reading, 5, "the flood served")
        assert first_turn + ft.take().count(b"USING a\r\n") == 3 * TURN_COMMANDS
    run(body)


def test_a_stopped_connection_reads_nothing_more_whatever_resumes() -> None:
    """Shutdown stops reading clients for good (a replicated leader hands its records over meanwhile):
    neither the client catching up on its replies nor a served reserve may start reading again; the
    commands they had sent before are still answered."""
    async def body() -> None:
        server = make_server()
        waiter, wt = connect(server)
        slow, st = connect(server)
        producer, pt = connect(server)
        waiter.data_received(b"reserve\r\n")
        waiter.data_received(b"list-tube-used\r\n" * (MAX_BUFFER_WHILE_WAITING // 16 + 2))
        assert not wt.reading
        slow.pause_writing()
        slow.data_received(b"list-tube-used\r\n" * 600)
        answered = st.take().count(b"USING default\r\n")
        for conn in (waiter, slow):
            conn.stop_reading()
        slow.resume_writing()
        producer.data_received(b"put 0 0 60 2\r\nhi\r\n")  # serves the blocked reserve
        assert pt.take() == b"INSERTED 1\r\n"
        await settle()
        # what they had sent before the stop is answered; nothing more is read
        out = wt.take()
        assert out.startswith(b"RESERVED 1 2\r\nhi\r\nUSING default\r\n") and not wt.reading
        assert answered + st.take().count(b"USING default\r\n") == 600 and not st.reading
    run(body)


def test_close_runs_the_hook_with_clients_unread_then_closes_them() -> None:
    async def body() -> None:
        server = make_server()
        conn, t = connect(server)
        conn.data_received(b"put 0 0 60 1\r\nx\r\n")
        seen: list[tuple[bool, bool]] = []

        async def hook() -> None:
            seen.append((t.reading, t.closed))

        server.before_close = hook
        await server.close()
        assert seen == [(False, False)] and t.closed
        assert t.take() == b"INSERTED 1\r\n"
    run(body)


def test_a_failing_close_hook_still_closes_the_clients_and_the_listener() -> None:
    """The replication hook may fail (a bug, an etcd client error): the binlog must close all the same."""
    async def body() -> None:
        closed: list[bool] = []

        class Listener(QueueListener):
            def close(self) -> None:
                closed.append(True)

        server = BrokerServer(ServerConfig(limits=Limits()), Listener())
        conn, t = connect(server)

        async def hook() -> None:
            raise RuntimeError("hand-off failed")

        server.before_close = hook
        await server.close()
        assert t.closed and closed == [True]
    run(body)


def test_touching_a_job_over_and_over_keeps_the_deadline_heap_small() -> None:
    """Every touch pushed a deadline entry that stayed until the TTR came round: a worker that
    heartbeats a long job grew the broker by ~105 bytes a touch (1M touches: +100 MB)."""
    async def body() -> None:
        conn, t = connect(make_server())
        conn.data_received(b"put 0 0 3600 1\r\nx\r\nreserve\r\n")
        assert t.take() == b"INSERTED 1\r\nRESERVED 1 1\r\nx\r\n"
        for _ in range(50):
            conn.data_received(b"touch 1\r\n" * 200)
        assert t.take() == b"TOUCHED\r\n" * 10_000
        assert len(conn.client.deadlines) <= 2 * 1 + 64 + 1
        conn.data_received(b"stats-job 1\r\n")
        assert b"state: reserved\n" in t.take()
    run(body)


def test_closed_connections_do_not_stay_in_the_timer_heap() -> None:
    """A closed worker's TTR entry (and a hung-up reserve-with-timeout's) held the connection, its
    tube and its deadline heap until it came due, hours later, when a live entry stood before it:
    ~1.5 KB per short-lived worker."""
    async def body() -> None:
        server = make_server()
        queue = server.queue
        keeper, kt = connect(server)
        keeper.data_received(b"put 0 0 1800 1\r\nx\r\nreserve\r\n")  # a live entry at the top of the heap
        assert kt.take() == b"INSERTED 1\r\nRESERVED 1 1\r\nx\r\n"
        for n in range(3000):
            conn, t = connect(server)
            conn.data_received(b"use w%d\r\nwatch w%d\r\nignore default\r\nput 0 0 3600 1\r\nx\r\nreserve\r\n"
                               b"delete %d\r\nreserve-with-timeout 3600\r\n" % (n, n, n + 2))
            assert t.take().endswith(b"DELETED\r\n")
            conn.connection_lost(None)
        assert queue.cur_conns == 1 and len(queue.jobs) == 1 and len(queue.tubes) == 1
        assert len(queue.timers) <= 2 * 3 + 1024 + 2  # not two entries per closed connection (6,000)
    run(body)


def test_a_paused_tube_nobody_uses_any_more_is_freed() -> None:
    """pause-tube pushed an unpause entry that kept the tube (and its name) alive until it came
    due, up to 2**32 s away, long after its last user and job were gone."""
    async def body() -> None:
        server = make_server()
        queue = server.queue
        for n in range(3000):
            conn, t = connect(server)
            conn.data_received(b"use p%d\r\npause-tube p%d 4000000\r\n" % (n, n))
            assert t.take() == b"USING p%d\r\nPAUSED\r\n" % n
            conn.connection_lost(None)
        assert len(queue.tubes) == 1  # default
        assert len(queue.timers) <= 1024 + 3
    run(body)
