"""The shared test helpers themselves: wait_until's contract, free_port's pool, the port retry of ServerProcess, the
retried start (spawn)."""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from spark_beanstalk.embedded import PORT_POOL_LOW, SPAWN_ATTEMPTS, ephemeral_ports, listens_on, spawn
from tests.helpers import FaultyDisk, broker_process, free_port, member_process, wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    calls = iter([0, None, "", {"n": 3}])
    assert wait_until(lambda: next(calls), 5, "a value", interval=0.001) == {"n": 3}


def test_wait_until_times_out_naming_what_it_waited_for() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out after 0.2s waiting for the moon"):
        wait_until(lambda: False, 0.2, "the moon", interval=0.01)
    assert 0.2 <= time.monotonic() - start < 2


def test_wait_until_retries_only_the_named_errors() -> None:
    attempts: list[int] = []

    def flaky() -> bool:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionRefusedError("not yet")
        return True

    assert wait_until(flaky, 5, "a connection", interval=0.001, retry_on=(OSError,)) is True
    assert len(attempts) == 3
    with pytest.raises(ValueError):  # not in retry_on: raised at once
        wait_until(lambda: int("x"), 5, "never", retry_on=(OSError,))
    with pytest.raises(TimeoutError, match=r"last error: ConnectionRefusedError\('still not'\)"):
        wait_until(lambda: (_ for _ in ()).throw(ConnectionRefusedError("still not")), 0.1, "x",
                   interval=0.01, retry_on=(OSError,))


def test_free_port_hands_no_port_out_twice_within_256_calls() -> None:
    """Two servers started at once (a differential pair, from two threads) both pick before either binds: a
    port picked twice went to both, and the loser's readiness probes were counted by the winner (CI, a
    differential stats case: total-connections 7 against 2). From 12,000-odd ports, 600 random picks repeat
    one within 256 of each other almost surely (about six times on average); here none may."""
    picks: list[int] = []
    lock = threading.Lock()

    def pick(n: int) -> None:
        for _ in range(n):
            port = free_port()
            with lock:
                picks.append(port)

    threads = [threading.Thread(target=pick, args=(300,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(picks) == 600
    repeats = [(i, port) for i, port in enumerate(picks) if port in picks[max(0, i - 255):i]]
    assert not repeats, repeats[:5]


def test_free_ports_come_from_below_the_ephemeral_range() -> None:
    """No outgoing connection can take such a port, and no client polling it can connect to itself.

    The sixteenth session moved free_port() there after two tests failed once on a broker that
    seemed to listen and did not (a port from bind(0) is in the ephemeral range).
    """
    ephemeral = ephemeral_ports()
    assert ephemeral.start - 1 - PORT_POOL_LOW >= 1000  # this machine leaves room below the range
    ports = [free_port() for _ in range(50)]
    assert all(PORT_POOL_LOW <= port < ephemeral.start for port in ports), ports
    assert len(set(ports)) > 40  # spread over the pool, not one port for every caller
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when handed out


def test_a_port_polled_for_a_listener_is_never_the_poller_own() -> None:
    """A connect() picks its local port from the ephemeral range, so it cannot meet a pool port.

    Why it matters: with no listener, a socket whose local port equals the port it connects to
    is connected to itself (TCP simultaneous open), and wait_for_port would take that for a
    server. Shown here by binding such a socket on purpose.
    """
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.connect(("127.0.0.1", port))  # nothing listens, yet it connects: to itself
        assert sock.getsockname() == sock.getpeername()
    for _ in range(200):
        with socket.socket() as probe:
            probe.settimeout(1)
            assert probe.connect_ex(("127.0.0.1", port)) != 0  # refused: nobody listens, no self-connect
            assert probe.getsockname()[1] in ephemeral_ports()


def test_server_on_a_taken_port_moves_to_a_free_one() -> None:
    """A port from free_port() that someone takes before the broker binds it: start() retries elsewhere."""
    proc = broker_process()
    taken = proc.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))  # bound, not listening: another process's bind
        proc.start()
        try:
            assert proc.port != taken and proc.argv[proc.argv.index("-p") + 1] == str(proc.port)
            with socket.create_connection((proc.host, proc.port), timeout=5) as conn:
                conn.sendall(b"list-tube-used\r\n")
                assert conn.recv(100) == b"USING default\r\n"
        finally:
            proc.stop()


def test_a_server_that_loses_its_port_to_another_listener_moves_on() -> None:
    """Two servers handed the same port: the one that loses the bind exits a moment later, and
    until then a connect reaches the winner. start() must not take the winner for its own server.

    The mechanism behind the two one-off failures of the fifteenth session (a broker that seemed
    to listen, then EOF or "connection refused"): here the winner is this test's own listener.
    """
    proc = broker_process()
    with socket.socket() as winner:
        winner.bind(("127.0.0.1", 0))
        winner.listen(8)
        taken = winner.getsockname()[1]
        proc.port = taken
        proc.argv[proc.argv.index("-p") + 1] = str(taken)
        proc.start()
        try:
            assert proc.port != taken                         # moved on once its bind had failed
            assert listens_on(proc.pid, proc.port) and not listens_on(proc.pid, taken)
            with socket.create_connection((proc.host, proc.port), timeout=5) as conn:
                conn.sendall(b"list-tube-used\r\n")
                assert conn.recv(100) == b"USING default\r\n"
        finally:
            proc.stop()


def test_a_member_whose_replication_port_was_taken_moves_on(tmp_path: Path) -> None:
    """The broker exits when it cannot bind --replication-listen: start() picks a new port for it.

    start() also waits for the replication listener, which the broker may open after the client
    port: a test that connected to repl_address at once was refused (CI of stop 39).
    """
    member = member_process(str(tmp_path / "a"))
    taken = member.repl_address
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", int(taken.rsplit(":", 1)[1])))  # bound, not listening: another process's bind
        member.start()
        try:
            assert member.repl_address != taken and member.repl_address in member.argv
            assert listens_on(member.pid, int(member.repl_address.rsplit(":", 1)[1]))
        finally:
            member.kill()


class _FailingPopen:
    """A stand-in for subprocess.Popen that fails with the given errnos, then starts ``true``."""

    def __init__(self, *errnos: int) -> None:
        self.errnos = list(errnos)
        self.calls = 0

    def __call__(self, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
        self.calls += 1
        if self.errnos:
            code = self.errnos.pop(0)
            raise OSError(code, os.strerror(code), argv[0])
        return subprocess.Popen(["true"])


def test_a_start_whose_exec_hit_efault_is_tried_again() -> None:
    popen = _FailingPopen(errno.EFAULT)
    proc = spawn(["true"], subprocess.DEVNULL, None, None, popen=popen)
    assert proc.wait(10) == 0 and popen.calls == 2


def test_a_start_fails_at_once_on_other_errors_and_after_the_last_efault() -> None:
    popen = _FailingPopen(errno.ENOENT)
    with pytest.raises(FileNotFoundError):
        spawn(["true"], subprocess.DEVNULL, None, None, popen=popen)
    assert popen.calls == 1
    popen = _FailingPopen(*[errno.EFAULT] * SPAWN_ATTEMPTS)
    with pytest.raises(OSError) as info:
        spawn(["true"], subprocess.DEVNULL, None, None, popen=popen)
    assert info.value.errno == errno.EFAULT and popen.calls == SPAWN_ATTEMPTS


def test_the_faulty_disk_sets_file_times_given_now_or_left(tmp_path: Path) -> None:
    """tests/faultfs.py passed mfusepy's float seconds (and None) to os.utime as ns=: every utime on the mount
    failed with EINVAL (mypy --strict found the None case once the file joined the lint gate); "now" and "leave
    as it is" come as utimensat's markers, which the float seconds had lost."""
    disk = FaultyDisk(tmp_path)
    try:
        kept = disk.mount / "f"
        kept.write_bytes(b"x")
        os.utime(kept, (1_000_000_000, 2_000_000_000))
        assert os.stat(disk.backing / "f").st_mtime == 2_000_000_000
        before = time.time()
        os.utime(kept)
        assert os.stat(disk.backing / "f").st_mtime >= before - 1
        atime = os.stat(disk.backing / "f").st_atime
        subprocess.run(["touch", "-m", "-d", "@5", str(kept)], check=True, timeout=10)  # atime: UTIME_OMIT
        assert os.stat(disk.backing / "f").st_mtime == 5 and os.stat(disk.backing / "f").st_atime == atime
    finally:
        disk.close()
