"""Start and stop beanstalk-protocol servers as child processes.

Used by the flagship demo (an embedded broker it starts itself), the tests (a real
broker process on a free port, and real beanstalkd 1.12 for differential runs) and
the benchmarks. One place, so every caller waits for readiness the same way.
"""
from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")


PORT_POOL_LOW = 20000  # free_port() picks from here up to the kernel's ephemeral range
_port_picker = random.Random()  # its own generator: a test that seeds `random` must not make workers agree
# The ports free_port() handed out last in this process, not handed out again while here: two servers started at
# once (a differential pair, one thread each) both pick before either binds, and a port picked twice went to both.
# The one that lost the bind was restarted on a new port, but meanwhile its readiness probes connected to the
# winner and showed up in the winner's total-connections (a differential case failed in CI that way).
_recent_ports: deque[int] = deque(maxlen=256)
_port_lock = threading.Lock()


def ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections and bind(0) (ip_local_port_range)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, chosen below the kernel's ephemeral range.

    Why below it: a port from that range can become the local port of any outgoing
    connection before the server binds it, and a client polling it for a listener can
    connect to itself (TCP simultaneous open) and take that for the server. Below the
    range only another explicit bind can take it, which ServerProcess.start survives by
    moving. Where the range leaves no room below it, the OS picks (bind to port 0). No port
    is handed out twice within 256 calls of one process (``_recent_ports``).
    """
    top = ephemeral_ports().start - 1
    with _port_lock:
        if top - PORT_POOL_LOW >= 1000:
            for _ in range(200):
                port = _port_picker.randint(PORT_POOL_LOW, top)
                if port not in _recent_ports and _bindable(host, port):
                    _recent_ports.append(port)
                    return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            chosen: int = sock.getsockname()[1]
            _recent_ports.append(chosen)
            return chosen


def wait_until(predicate: Callable[[], T | None], timeout: float, what: str = "condition", interval: float = 0.05, *,
               retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """Poll `predicate` until it returns something truthy and return that; TimeoutError after `timeout` s.

    The one polling helper of tests, jobs and benchmarks: a condition is polled, never slept for.
    Exceptions of the `retry_on` types count as "not yet" (a server still coming up refuses
    connections); the last one is named in the TimeoutError.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
        except retry_on as exc:
            last = exc
        else:
            if value:
                return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}"
                               + (f" (last error: {last!r})" if last is not None else ""))
        time.sleep(interval)


class ServerExitedEarly(RuntimeError):
    """The server process ended before it accepted a connection (a port taken, a bad flag)."""


def _listening_inodes(port: int) -> set[str] | None:
    """Inodes of the sockets listening on TCP `port` (any address); None without Linux's /proc."""
    found: set[str] = set()
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():
        return None
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(cols[9])
    return found


def _process_tree(root: int) -> set[int]:
    """`root` and every process descended from it (a launcher script's server, for one)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` (or a descendant) holds a socket listening on TCP `port`.

    Why: two servers handed the same free port start together; the one that loses the bind
    exits a moment later, and until then a bare connect reaches the winner, so a caller
    would take the other's server for its own. True where /proc cannot tell.
    """
    inodes = _listening_inodes(port)
    if inodes is None:
        return True
    for tree_pid in _process_tree(pid):
        try:
            fds = list(Path(f"/proc/{tree_pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
    return False


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll until a TCP connect succeeds (and, given the process, until it is the one listening);
    ServerExitedEarly at once if the process died."""

    def listening() -> bool:
        if proc is not None and proc.poll() is not None:
            raise ServerExitedEarly(
                f"server process exited with code {proc.returncode} before listening on {host}:{port}")
        with socket.create_connection((host, port), timeout=0.5):
            return proc is None or listens_on(proc.pid, port)

    wait_until(listening, timeout, f"a listener on {host}:{port}", interval=0.02, retry_on=(OSError,))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (/proc/PID/stat), for per-command costs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SPAWN_ATTEMPTS = 3


def spawn(argv: Sequence[str], out: IO[bytes] | int, env: dict[str, str] | None,
          preexec: Callable[[], None] | None,
          popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen) -> subprocess.Popen[bytes]:
    """Start ``argv`` (stdin closed, stdout and stderr to ``out``), again if its exec failed with EFAULT.

    Why: a test run starts servers from several threads at once, and once (a full run of the
    suite on the CI machine's kind) a child's exec of this very interpreter failed with "[Errno 14]
    Bad address" (CPython 3.11 forks with vfork); nothing in the command was wrong. Every other
    error is raised at once.
    """
    for attempt in range(SPAWN_ATTEMPTS):
        try:
            return popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, preexec_fn=preexec)
        except OSError as exc:
            if exc.errno != errno.EFAULT or attempt == SPAWN_ATTEMPTS - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


@dataclass
class ServerProcess:
    """A running server child process listening on host:port."""

    argv: list[str]
    host: str
    port: int
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None
    stderr_path: str | None = None
    _stderr_file: IO[bytes] | None = field(default=None, repr=False)
    port_chosen: bool = False  # the port came from free_port(): start() may move to another
    repl_address: str = ""  # a replicated member's --replication-listen (member_process)
    preexec: Callable[[], None] | None = None  # run in the child before exec (e.g. lower RLIMIT_NOFILE)
    kind: str = ""  # "ours" / "beanstalkd" for the parametrized fixtures

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 15.0) -> ServerProcess:
        """Start and wait until it accepts connections.

        A port from free_port() can be taken by someone else before the server binds it
        (another test's explicit bind): when we chose the port
        and the server exits before listening, it is started again on a new free port.
        A replicated member also waits for its replication listener, which it may open after
        the client port: a caller may connect to ``repl_address`` at once.
        """
        for attempt in range(3):
            try:
                return self._start_once(timeout)
            except ServerExitedEarly:
                if not self.port_chosen or attempt == 2:
                    raise
                new = free_port(self.host)
                self.argv[self.argv.index("-p") + 1] = str(new)
                self.port = new
                if self.repl_address:  # it may have been the replication port that was taken
                    at = self.argv.index(self.repl_address)
                    self.repl_address = self.argv[at] = f"127.0.0.1:{free_port()}"
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> ServerProcess:
        out: IO[bytes] | int = subprocess.DEVNULL
        if self.stderr_path:
            self._stderr_file = out = open(self.stderr_path, "ab")  # noqa: SIM115 (open while the child runs)
        self.proc = spawn(self.argv, out, self.env, self.preexec)
        try:
            wait_for_port(self.host, self.port, timeout, self.proc)
            if self.repl_address:
                repl_host, repl_port = self.repl_address.rsplit(":", 1)
                wait_for_port(repl_host, int(repl_port), timeout, self.proc)
        except BaseException:
            self.kill()
            raise
        return self

    def log(self) -> str:
        """What the server wrote to stderr_path so far ("" without one)."""
        if self._stderr_file is not None:
            self._stderr_file.flush()
        return Path(self.stderr_path).read_text(errors="replace") if self.stderr_path else ""

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._close_log()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the server can tell."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_log()

    def restart(self, timeout: float = 15.0) -> ServerProcess:
        """SIGKILL it if it still runs, then start it again on the same port and arguments: clients
        configured with its address must reach it again (so never moved to another free port)."""
        self.kill()
        self.port_chosen = False
        return self.start(timeout)

    def _close_log(self) -> None:
        if self._stderr_file is not None:
            self._stderr_file.close()
            self._stderr_file = None

    def __enter__(self) -> ServerProcess:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def broker_process(port: int | None = None, host: str = "127.0.0.1", extra_args: Sequence[str] = (),
                   **kw: Any) -> ServerProcess:
    """Our broker (`python -m broker`) as a child process; call .start()."""
    chosen = port is None
    port = port or free_port(host)
    argv = [sys.executable, "-m", "broker", "-l", host, "-p", str(port), *extra_args]
    return ServerProcess(argv=argv, host=host, port=port, port_chosen=chosen, **kw)


def beanstalkd_binary() -> str | None:
    """Path of the real beanstalkd, if installed."""
    found = shutil.which("beanstalkd")
    if found is None and os.path.exists("/usr/bin/beanstalkd"):
        found = "/usr/bin/beanstalkd"
    return found


def beanstalkd_process(port: int | None = None, host: str = "127.0.0.1", extra_args: Sequence[str] = (),
                       **kw: Any) -> ServerProcess:
    """Real beanstalkd 1.12 as a child process; call .start()."""
    binary = beanstalkd_binary()
    if binary is None:
        raise RuntimeError("beanstalkd is not installed (apt-get install -y beanstalkd)")
    chosen = port is None
    port = port or free_port(host)
    argv = [binary, "-l", host, "-p", str(port), *extra_args]
    return ServerProcess(argv=argv, host=host, port=port, port_chosen=chosen, **kw)


def start_server(kind: str, **kw: Any) -> ServerProcess:
    """kind is 'ours' or 'beanstalkd'."""
    factory = {"ours": broker_process, "beanstalkd": beanstalkd_process}[kind]
    server = factory(**kw).start()
    server.kind = kind
    return server


def etcd_binary() -> str | None:
    """Path of etcd (Debian's etcd-server package), if installed."""
    return shutil.which("etcd") or (os.path.exists("/usr/bin/etcd") and "/usr/bin/etcd") or None


def etcd_process(data_dir: str, host: str = "127.0.0.1", **kw: Any) -> ServerProcess:
    """A one-node etcd on free ports with a short raft heartbeat (lease TTLs of 1 s are allowed); call .start().

    ``.address`` is the client endpoint (``host:port``); pass ``http://`` + it to ``--etcd``.
    """
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError("etcd is not installed (apt-get install -y etcd-server)")
    client, peer = free_port(host), free_port(host)
    argv = [binary, "--name", "sb", "--data-dir", data_dir,
            "--listen-client-urls", f"http://{host}:{client}", "--advertise-client-urls", f"http://{host}:{client}",
            "--listen-peer-urls", f"http://{host}:{peer}", "--initial-advertise-peer-urls", f"http://{host}:{peer}",
            "--initial-cluster", f"sb=http://{host}:{peer}", "--heartbeat-interval", "50", "--election-timeout", "300"]
    return ServerProcess(argv=argv, host=host, port=client, **kw)


def member_process(binlog_dir: str, etcd: str | None = None, name: str | None = None, replica_of: str | None = None,
                   sync_replicas: int = 0, lease_ttl: int = 1, extra_args: Sequence[str] = (),
                   **kw: Any) -> ServerProcess:
    """One member of a replicated broker (``-b`` plus replication flags); call .start().

    ``.repl_address`` is its replication listener (what ``--replica-of`` and promote/demote take).
    """
    repl = free_port()
    args = ["-b", binlog_dir, "--replication-listen", f"127.0.0.1:{repl}", *extra_args]
    if etcd is not None:
        args += ["--etcd", etcd, "--lease-ttl", str(lease_ttl), "--member-name", name or f"m{repl}"]
    if replica_of is not None:
        args += ["--replica-of", replica_of]
    if sync_replicas:
        args += ["--sync-replicas", str(sync_replicas)]
    proc = broker_process(extra_args=args, **kw)
    proc.repl_address = f"127.0.0.1:{repl}"
    return proc
