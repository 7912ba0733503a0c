"""One client connection: bytes in through the codec, commands into the queue, replies out.

``data_received`` feeds the decoder, runs every complete command in order, gathers the
replies and writes them once. A reserve that has to wait stops the loop for that
connection only; its later commands stay buffered until the reply has gone out, as in
beanstalkd. Back-pressure lives in :class:`FlowControl`; what is shared with the server
(queue, config, loop timer, reply gate) comes in a :class:`broker.state.ServerState`.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final

from broker import logs, queue_timers, queue_verbs, security, stats
from broker import protocol as p
from broker.limits import OUTPUT_HIGH_WATER, Limits
from broker.queue import Client, Queue
from broker.state import ServerState

log = logging.getLogger("broker")

# Commands that map straight onto a Queue method, by argument shape.
_BY_ID: Final[dict[str, Callable[[Queue, Client, int], bytes]]] = {
    "reserve-job": queue_verbs.reserve_job,
    "delete": Queue.delete,
    "touch": queue_verbs.touch,
    "kick-job": queue_verbs.kick_job,
    "peek": queue_verbs.peek,
    "stats-job": stats.stats_job,
}
_BY_TUBE: Final[dict[str, Callable[[Queue, Client, str], bytes]]] = {
    "use": queue_verbs.use,
    "watch": queue_verbs.watch,
    "ignore": queue_verbs.ignore,
    "stats-tube": stats.stats_tube,
}
_BARE: Final[dict[str, Callable[[Queue, Client], bytes]]] = {
    "peek-ready": queue_verbs.peek_ready,
    "peek-delayed": queue_verbs.peek_delayed,
    "peek-buried": queue_verbs.peek_buried,
    "stats": stats.stats,
    "list-tubes": queue_verbs.list_tubes,
    "list-tube-used": queue_verbs.list_tube_used,
    "list-tubes-watched": queue_verbs.list_tubes_watched,
}
# The stats counter (cmd-*) each command bumps; an Error names its own, a put whose header
# was already counted ("put-header") is not counted again. Counted in _execute only.
_COUNTED_AS: Final[dict[str, str]] = {name: name for name in (*_BY_ID, *_BY_TUBE, *_BARE)}
_COUNTED_AS.update({"put-header": "put", "too-big": "put", "reserve": "reserve",
                    "reserve-with-timeout": "reserve-with-timeout", "release": "release", "bury": "bury",
                    "kick": "kick", "pause-tube": "pause-tube"})

# While a client is blocked in reserve we keep reading (to notice a hang-up), but stop
# reading once this much unprocessed input has piled up behind the reserve.
MAX_BUFFER_WHILE_WAITING: Final = 1048576  # 1 MiB
_FLUSH_BYTES: Final = 65536
# Commands one call of _process serves before it lets the loop serve everyone else. A client pipelining
# cheap commands faster than they run would otherwise hold the loop: uvloop (libuv) reads a ready socket
# up to 32 times in one pass, each read handed to data_received, so 8 MiB of `use a` (over a million
# commands) came in one turn, seconds of interpreted work. A multiple of 256 (the write-out interval).
TURN_COMMANDS: Final = 4096


class FlowControl:
    """Back-pressure of one connection, both ways.

    Reading stops for four independent reasons: input piling up behind a blocked reserve
    (``backlog_paused``), the client not reading its replies (``write_paused``, from
    the transport's pause_writing), a client that sent more commands than one turn serves
    (``turn_paused``, until the loop's next pass), and the server shutting down (``stopped``, for good).
    Reading resumes only when none holds. A client that
    stays paused past --slow-reader-timeout, or leaves more than --max-output-bytes unread,
    is to be closed (the connection decides how).
    """

    __slots__ = ("backlog_paused", "limits", "stall_timer", "stopped", "transport", "turn_paused", "write_paused")

    def __init__(self, transport: asyncio.BaseTransport, limits: Limits) -> None:
        self.transport: Any = transport  # a Transport, or a test's stand-in with the same methods
        self.limits = limits
        self.backlog_paused = False
        self.write_paused = False
        self.stopped = False
        self.turn_paused = False
        self.stall_timer: asyncio.TimerHandle | None = None

    def _reasons(self) -> int:
        """How many of the four reasons to stop reading hold now."""
        return int(self.backlog_paused) + int(self.write_paused) + int(self.stopped) + int(self.turn_paused)

    def stop(self) -> None:
        """Read nothing more from this client (the server is shutting down)."""
        if not self.stopped:
            self.stopped = True
            if self._reasons() == 1:
                self.transport.pause_reading()

    def pause_for_backlog(self) -> None:
        if not self.backlog_paused:
            self.backlog_paused = True
            if self._reasons() == 1:
                self.transport.pause_reading()

    def end_backlog(self) -> None:
        if self.backlog_paused:
            self.backlog_paused = False
            if not self._reasons():
                self.transport.resume_reading()

    def pause_for_turn(self) -> None:
        """This client's commands took their turn: read no more until the loop has served the others."""
        if not self.turn_paused:
            self.turn_paused = True
            if self._reasons() == 1:
                self.transport.pause_reading()

    def end_turn(self) -> None:
        if self.turn_paused:
            self.turn_paused = False
            if not self._reasons():
                self.transport.resume_reading()

    def pause_writing(self, on_stall: Callable[[], None]) -> None:
        """The client stopped reading: stop reading its commands until it catches up.

        ``on_stall`` runs if it has not caught up after --slow-reader-timeout (a rare
        event, so one timer handle per stalled connection).
        """
        self.write_paused = True
        if self._reasons() == 1:
            self.transport.pause_reading()
        timeout = self.limits.slow_reader_timeout
        if timeout > 0 and self.stall_timer is None:
            self.stall_timer = asyncio.get_running_loop().call_later(timeout, on_stall)

    def resume_writing(self, closing: bool) -> bool:
        """The client caught up; True when the commands it already sent may run (and reading resumed,
        unless the server is shutting down)."""
        self.cancel_stall()
        self.write_paused = False
        if self.backlog_paused or closing:
            return False
        if not self._reasons():
            self.transport.resume_reading()
        return True

    def cancel_stall(self) -> None:
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None

    def output_over_limit(self) -> bool:
        """After a write: has a paused client left more than --max-output-bytes unread?"""
        return self.write_paused and self.transport.get_write_buffer_size() > self.limits.max_output_bytes


class BrokerConnection(asyncio.Protocol):
    """One client connection."""

    __slots__ = (
        "activity",
        "auth_failures",
        "authed",
        "busy",
        "client",
        "closing",
        "decoder",
        "eof",
        "flow",
        "idle_sweeps",
        "internal",
        "out",
        "peer",
        "poll",
        "queue",
        "refused",
        "state",
        "timer",
        "transport",
    )

    def __init__(self, state: ServerState, internal: bool = False) -> None:
        # Compiled (mypyc), the fields lie in the order of their first assignment here: the flags side by side
        # (one word), then what every command reads, the rest last, so that with hundreds of connections a
        # command misses on fewer of the object's 64-byte lines (bench/instructions.py --cache-sim).
        self.closing = False
        # Set on input, cleared by the idle sweep. A flag, not a count: interpreted, `+= 1` costs
        # ~300 instructions a command (load, add, store) where a constant store costs ~80.
        self.activity = False
        self.authed = state.config.auth_token is None
        self.busy = False
        self.eof = False
        self.refused = False
        self.internal = internal  # the broker's own (the dashboard's): a client's close is not the last
        self.client: Client
        self.decoder = state.new_decoder(auth_enabled=not self.authed)
        self.poll = state.busy_poll
        self.transport: Any = None  # asyncio.Transport once connected (or a test's stand-in)
        self.queue = state.queue
        self.state = state
        self.out: list[bytes] = []
        self.flow: FlowControl
        self.timer = state.timer
        self.auth_failures = 0
        self.idle_sweeps = 0
        self.peer = "?"

    # -- asyncio callbacks ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        state = self.state
        self.flow = FlowControl(transport, state.config.limits)
        self.peer = _format_peer(transport.get_extra_info("peername"))
        limits = state.config.limits
        open_now = self.queue.cur_conns
        if limits.max_connections and open_now >= limits.max_connections:
            self._refuse("connections", f"{open_now} open")
            return
        if open_now >= state.descriptor_cap:
            # libuv copes with EMFILE silently (accepts and drops); refusing just before it
            # keeps descriptors for the binlog and listeners, and lets us count it.
            self._refuse("accept_errors", f"{open_now} open, near the file descriptor limit")
            return
        self.transport.set_write_buffer_limits(high=OUTPUT_HIGH_WATER)
        self.client = queue_verbs.connect(self.queue, self._deliver, self.peer)
        state.connections.add(self)
        if self.internal:
            state.internal_conns += 1
        if state.config.verbose:
            logs.event(log, logging.INFO, "accept", peer=self.peer)

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused = True
        self.mark_closing()
        self.queue.refusals.refuse(reason, self.peer, detail)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.activity = True
        poll = self.poll
        # BusyPoll.note_input, inlined for the common case: a command already noted in this turn of the poll
        # (fresh is only ever set while it spins) leaves nothing to do.
        if poll is not None and not poll.fresh:
            if poll.spinning:
                poll.fresh = True
            else:
                poll.note_input()
        self.handle_input(data)

    def handle_input(self, data: bytes) -> None:
        """A packet whose arrival was noted (idle sweep, busy poll): decode it, run its commands."""
        if self.authed and not self.client.waiting:
            # The fast path: one command decoded straight from its packet.
            cmd = self.decoder.parse_packet(data)
            if cmd is not None:
                self.busy = True
                try:
                    reply = self._execute(cmd)
                finally:
                    self.busy = False
                state = self.state
                if reply is None:
                    self._flush()  # what a reserve got through deliver(), if anything
                elif self.out:
                    self.out.append(reply)
                    self._flush()
                elif state.group_commit or state.sync_point is not None or self.closing:
                    self._write(reply)
                else:  # _write and send, inlined: every depth-1 command comes here
                    self.transport.write(reply)
                    if self.flow.write_paused:
                        self._check_output()
                timer = self.timer
                if timer.heap.earliest_pushed < timer.when:  # LoopTimer.check, inlined: every command
                    timer.reschedule()
                return
        self.decoder.feed(data)
        if self.client.waiting:
            if self.decoder.buffered() > MAX_BUFFER_WHILE_WAITING:
                self.flow.pause_for_backlog()
            return
        self._process()

    def eof_received(self) -> bool:
        self.eof = True
        if not self.closing:
            self._process()
            if not self.client.waiting or self.closing:
                self.close()
        # True keeps a half-closed TCP connection open for the replies still due. A TLS transport closes
        # anyway, and asyncio's (without uvloop) logs a warning for every such True.
        return self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        self.mark_closing()
        if self.refused:
            return
        self.flow.cancel_stall()
        self.state.connections.discard(self)
        queue_verbs.disconnect(self.queue, self.client)
        self.client.deliver = _discard  # break the client <-> connection cycle
        self.timer.reschedule()
        state = self.state
        if self.internal:
            state.internal_conns -= 1
        elif self.poll is not None and self.queue.cur_conns == state.internal_conns:
            self.poll.no_clients()  # the last client left: nothing can send the next command
        if state.config.verbose:
            logs.event(log, logging.INFO, "close", peer=self.peer)

    def pause_writing(self) -> None:
        self.flow.pause_writing(self._stalled)

    def _stalled(self) -> None:
        flow = self.flow
        flow.stall_timer = None
        if flow.write_paused and not self.closing:
            self.queue.refusals.refuse("slow_reader", self.peer, f"{self.transport.get_write_buffer_size()} "
                                       f"reply bytes unread for {flow.limits.slow_reader_timeout:g}s")
            self.mark_closing()
            self.transport.abort()

    def resume_writing(self) -> None:
        if self.flow.resume_writing(self.closing):
            asyncio.get_running_loop().call_soon(self._resume)

    # -- command loop ---------------------------------------------------------------
    def mark_closing(self) -> None:
        """Nothing more is read or answered (set with the transport's close or abort, which stop its input).
        Never undone. A method, so that a subclass that keeps its own gate closes it too (broker.lane)."""
        self.closing = True

    def take_activity(self) -> bool:
        """The idle sweep: whether input came since it last asked, and watch afresh from now."""
        active = self.activity
        self.activity = False
        return active

    def is_closing(self) -> bool:
        """close() was called (quit, a failed auth, a refusal): nothing more is answered."""
        return self.closing

    def _process(self) -> None:
        if self.closing:
            return
        if not self.authed and not self._process_unauthenticated():
            return
        queue = self.queue
        client = self.client
        decoder = self.decoder
        out = self.out
        flow = self.flow
        self.busy = True
        handled = 0
        pending = 0  # bytes of the large replies (jobs, stats) gathered since the last write
        flush_bytes = _FLUSH_BYTES
        try:
            while True:
                handled += 1
                # Write out every 256 commands or 64 KiB of replies: output stays bounded (a
                # client pipelining `peek` of big jobs), back-pressure is noticed promptly.
                if not handled & 255 or pending > flush_bytes:  # 256: a client's 64-deep packet gets one write
                    pending = 0
                    self._flush()
                    if flow.write_paused or self.closing:
                        break
                    if handled >= TURN_COMMANDS and not self.eof and decoder.buffered():
                        # (after EOF nothing more is read: the rest is served now, then the connection closes)
                        flow.pause_for_turn()
                        asyncio.get_running_loop().call_soon(self._next_turn)
                        break
                if client.waiting:
                    if not self.eof:
                        break
                    queue_timers.hangup(queue, client)  # half-closed while blocked: TIMED_OUT, as beanstalkd
                cmd = decoder.next_command()
                if cmd is None:
                    break
                reply = self._execute(cmd)
                if reply is not None:
                    out.append(reply)
                    pending += len(reply)
                elif self.is_closing():  # a call: mypy keeps `self.closing` narrowed to False here
                    return  # quit (or a failed auth): nothing more to answer
        finally:
            self.busy = False
        self._flush()
        if not client.waiting:
            flow.end_backlog()
        self.timer.check()

    def _execute(self, cmd: p.Command) -> bytes | None:
        """Run one decoded command: its reply, or None when there is none yet (a reserve now
        waiting, a put header) or the connection is closing (quit).

        The one place where commands are counted (stats cmd-*, metrics): put, reserve, delete and
        reserve-with-timeout in the queue's native counters (Queue.counted_ops), the id commands in
        their own branch, the rest through _COUNTED_AS.
        """
        queue = self.queue
        name = cmd[0]
        gate = self.state.write_gate  # replication: None unless this broker is a replicated member
        if gate is not None and name in gate.commands and type(cmd) is not p.PutLine:
            refusal = gate.refuse(name)
            if refusal is not None:
                return refusal
        # The hot commands first, told apart by name (a compare with a literal; compiled, a type
        # test is a module attribute look-up) and called directly, not through a table.
        if name == "put":  # a Put: the decoder names a put line still waiting for its body "put-header"
            put: p.Put = cmd  # type: ignore[assignment]  # not cast(): interpreted, that is a call
            _, pri, delay, ttr, body, header_seen = put
            if not header_seen:  # else its put-header was counted
                queue.cmd_put += 1
            return queue.put(self.client, pri, delay, ttr, body, header_seen)
        if name == "reserve":
            queue.cmd_reserve += 1
            return queue.reserve(self.client, -1)
        if name == "delete":
            queue.cmd_delete += 1
            by_id: p.IdArg = cmd  # type: ignore[assignment]
            return queue.delete(self.client, by_id[1])
        if name == "reserve-with-timeout":
            queue.cmd_reserve_timeout += 1
            seconds: p.IntArg = cmd  # type: ignore[assignment]
            return queue.reserve(self.client, seconds[1])
        if type(cmd) is p.IdArg:  # touch, peek, stats-job...: unpacked, as cheap as a plain tuple
            job_id = cmd[1]
            queue.op_counts[name] += 1
            return _BY_ID[name](queue, self.client, job_id)
        counted = _COUNTED_AS.get(name)
        if counted is not None:
            queue.op_counts[counted] += 1
        elif type(cmd) is p.Error:
            if cmd.counted:
                queue.op_counts[cmd.counted] += 1
            return cmd.reply
        if type(cmd) is p.Bare:
            fn = _BARE.get(name)
            if fn is not None:
                return fn(queue, self.client)
            if name == "quit":
                self._flush()
                self.close()
            return None  # quit, too-big (its JOB_TOO_BIG follows once the body is skipped)
        if isinstance(cmd, p.TubeArg):
            return _BY_TUBE[name](queue, self.client, cmd.tube)
        if isinstance(cmd, p.IntArg):  # kick (reserve-with-timeout is above)
            return queue_verbs.kick(queue, self.client, cmd.value)
        if isinstance(cmd, p.Release):
            return queue_verbs.release(queue, self.client, cmd.job_id, cmd.pri, cmd.delay)
        if isinstance(cmd, p.Bury):
            return queue_verbs.bury(queue, self.client, cmd.job_id, cmd.pri)
        if isinstance(cmd, p.PauseTube):
            return queue_verbs.pause_tube(queue, self.client, cmd.tube, cmd.delay)
        if isinstance(cmd, p.PutLine):  # put-header: beanstalkd assigns the id now
            queue.put_header(self.client)
            return None
        if isinstance(cmd, p.Auth):
            return self._check_token(cmd.token)
        return None

    # -- output -----------------------------------------------------------------------
    def _flush(self) -> None:
        out = self.out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self.closing:
            return
        state = self.state
        if state.group_commit:
            state.hold_for_commit(self, data)
            return
        sync = state.sync_point
        if sync is not None and not sync():
            self.drop_unacknowledged()
            return
        self.send(data)

    def send(self, data: bytes) -> None:
        """Write replies whose changes are already durable as the binlog's -f asks."""
        if self.closing:
            return
        self.transport.write(data)
        if self.flow.write_paused:
            self._check_output()

    def drop_unacknowledged(self) -> None:
        """Its replies acknowledge changes that could not be made durable (a failing disk):
        close without them, so that the client treats them as unknown, as after a crash."""
        if not self.closing:
            self.mark_closing()
            self.transport.abort()  # connection_lost releases its reservations

    def _check_output(self) -> None:
        """After a write to a paused client: close it once it leaves too much unread."""
        if self.flow.output_over_limit():
            self.queue.refusals.refuse("slow_reader", self.peer,
                                       f"{self.transport.get_write_buffer_size()} reply bytes unread")
            self.mark_closing()
            self.transport.abort()  # connection_lost releases its reservations

    def stop_reading(self) -> None:
        """The server is shutting down: read no more commands. Those already read are still answered."""
        if not self.closing and not self.refused:
            self.flow.stop()

    def close(self) -> None:
        """Close after the replies already produced (held ones included) have been written."""
        if not self.closing:
            self.state.commit_group()  # this connection's last replies may be held
            self.mark_closing()
            self.transport.close()

    # -- authentication ---------------------------------------------------------------
    def _check_token(self, offered: bytes) -> bytes:
        token = self.state.config.auth_token
        if token is not None and security.token_matches(token, offered):
            self.authed = True
            return security.AUTH_OK
        self.auth_failures += 1
        self.queue.refusals.refuse("auth", self.peer, f"wrong token ({self.auth_failures})")
        if self.auth_failures >= security.MAX_AUTH_FAILURES:
            self.out.append(security.UNAUTHORIZED)
            self._flush()
            self.close()
        return security.UNAUTHORIZED

    def _process_unauthenticated(self) -> bool:
        """Before `auth`: answer UNAUTHORIZED to everything. True once authenticated."""
        decoder = self.decoder
        out = self.out
        while not self.authed and not self.closing:
            cmd = decoder.next_command()
            if cmd is None:
                break
            name = cmd[0]  # a put or delete record is a plain tuple (see protocol.Put)
            if isinstance(cmd, p.Auth):
                reply = self._check_token(cmd.token)
                if not self.closing:
                    out.append(reply)
            elif name == "quit":
                self._flush()
                self.close()
            elif name not in ("put-header", "too-big"):
                out.append(security.UNAUTHORIZED)
        self._flush()
        return self.authed and not self.closing

    # -- replies from elsewhere ---------------------------------------------------------
    def _deliver(self, reply: bytes) -> None:
        """A reply produced outside this connection's command loop (woken reserve, timeout)."""
        self.out.append(reply)
        if not self.busy:
            self._flush()
            if self.decoder.buffered() or self.eof:
                asyncio.get_running_loop().call_soon(self._resume)

    def _next_turn(self) -> None:
        """The loop served the others: read again and go on with what this client sent."""
        self.flow.end_turn()
        self._resume()

    def _resume(self) -> None:
        if not self.closing and not self.client.waiting and not self.flow.write_paused:
            self._process()
            if self.eof and not self.client.waiting:
                self.close()


def _discard(_reply: bytes) -> None:
    """deliver() of a closed connection."""


def _format_peer(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) if peer else "unix"
