"""The one home of test helpers: waiting, free ports, server processes, a TCP proxy for network faults.

Tests import from here (`from tests.helpers import wait_until`); the implementations live
in `spark_beanstalk.embedded` so that jobs/ and bench/ share them too.
"""
from __future__ import annotations

import socket
import threading

from spark_beanstalk.embedded import (
    ServerExitedEarly,
    ServerProcess,
    beanstalkd_process,
    broker_process,
    free_port,
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
    "free_port",
    "start_server",
    "wait_for_port",
    "wait_until",
]


class TcpProxy:
    """A TCP proxy on 127.0.0.1:<free port> to `target`, for network-fault tests.

    Accepts connections, pipes bytes both ways, and `cut_all()` drops every connection it
    carries at once (both sides see the close), as a network fault would; new connections
    are accepted again right after.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = "127.0.0.1", self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False
        self.cuts = 0
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)      # idle connections stay up until cut
            with self._lock:
                self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut_all(self) -> int:
        """Drop every connection now; returns how many there were."""
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.cuts += 1
        return len(socks) // 2

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut_all()
