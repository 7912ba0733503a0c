"""The one home of test helpers: waiting, free ports, server processes.

Tests import from here (`from tests.helpers import wait_until`); the implementations live
in `spark_beanstalk.embedded` so that jobs/ and bench/ share them too.
"""
from __future__ import annotations

import contextlib
import socket
import threading

from spark_beanstalk.embedded import (
    ServerExitedEarly,
    ServerProcess,
    beanstalkd_process,
    broker_process,
    etcd_process,
    free_port,
    member_process,
    start_server,
    wait_for_port,
    wait_until,
)

__all__ = [
    "ServerExitedEarly",
    "ServerProcess",
    "TcpProxy",
    "beanstalkd_process",
    "broker_process",
    "etcd_process",
    "free_port",
    "member_process",
    "start_server",
    "wait_for_port",
    "wait_until",
]


class TcpProxy:
    """A TCP forwarder on a free loopback port that a test can cut (a network partition).

    ``cut()`` closes every forwarded connection and refuses new ones until ``restore()``.
    Threads, not asyncio: it runs beside processes the test drives synchronously.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.open = True
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data or not self.open:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def cut(self) -> None:
        self.open = False
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        self.open = True

    def close(self) -> None:
        self._stopped = True
        self.cut()
        self.listener.close()
