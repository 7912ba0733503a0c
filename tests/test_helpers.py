"""The shared test helpers themselves: wait_until's contract, the port retry of ServerProcess."""
from __future__ import annotations

import socket
import time

import pytest

from tests.helpers import broker_process, wait_until


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


def test_server_on_a_taken_port_moves_to_a_free_one() -> None:
    """A port from free_port() that someone takes before the broker binds it: start() retries elsewhere."""
    proc = broker_process()
    taken = proc.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))  # bound, not listening: like an outgoing connection's port
        proc.start()
        try:
            assert proc.port != taken and proc.argv[proc.argv.index("-p") + 1] == str(proc.port)
            with socket.create_connection((proc.host, proc.port), timeout=5) as conn:
                conn.sendall(b"list-tube-used\r\n")
                assert conn.recv(100) == b"USING default\r\n"
        finally:
            proc.stop()
