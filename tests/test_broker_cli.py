"""The broker as an operator starts it: flags, config file, signals, Unix socket."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spark_beanstalk.client import Connection
from tests.helpers import ServerProcess, broker_process, free_port, wait_until

pytestmark = pytest.mark.timeout(60)


def test_help_lists_beanstalkd_flags():
    out = subprocess.run([sys.executable, "-m", "broker", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("-l, --listen", "-p, --port", "-z, --max-job-size", "-V, --verbose", "-b, --binlog-dir",
                 "--config", "--max-connections", "--tls-cert", "--auth-token-file", "--metrics"):
        assert flag in out


def test_console_script_runs_the_broker():
    out = subprocess.run(["spark-beanstalk", "broker", "--help"], capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    assert "[default: 127.0.0.1]" in flat and "beanstalkd's default is 0.0.0.0" in flat


def test_sigterm_stops_cleanly_and_sigint_too():
    for signum in (signal.SIGTERM, signal.SIGINT):
        server = broker_process().start()
        server.signal(signum)
        assert server.proc is not None and server.proc.wait(15) == 0


def test_sigusr1_enters_drain_mode():
    server = broker_process().start()
    try:
        with Connection(server.host, server.port) as conn:
            assert conn.put(b"before") == 1
            server.signal(signal.SIGUSR1)
            wait_until(lambda: conn.stats()["draining"] == "true", 10, "drain mode in stats")
            reply = conn.call("put 0 0 10 1", b"x")
            assert reply.status == b"DRAINING"
            assert conn.reserve(0).body == b"before"  # reads still work
    finally:
        server.stop()


def test_default_listen_is_loopback_only():
    port = free_port()
    server = ServerProcess(argv=[sys.executable, "-m", "broker", "-p", str(port)], host="127.0.0.1", port=port).start()
    try:
        # /proc/net/tcp: local address column, hex; state 0A = LISTEN; 0100007F = 127.0.0.1
        rows = [r.split() for r in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        listening = [r[1] for r in rows if r[3] == "0A" and r[1].endswith(f":{port:04X}")]
        assert listening == [f"0100007F:{port:04X}"]
    finally:
        server.stop()


def test_unix_socket_listener(tmp_path):
    path = tmp_path / "broker.sock"
    proc = subprocess.Popen([sys.executable, "-m", "broker", "-l", f"unix:{path}"])
    try:
        wait_until(lambda: proc.poll() is not None or path.exists(), 15, "the unix socket file")
        assert proc.poll() is None, "the broker exited before creating its socket"
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(5)
        wait_until(lambda: sock.connect(str(path)) is None, 5, "a connection on the unix socket",
                   retry_on=(ConnectionRefusedError, FileNotFoundError))
        sock.sendall(b"put 0 0 10 2\r\nhi\r\nreserve\r\n")
        data = b""
        while data.count(b"\r\n") < 3:
            data += sock.recv(4096)
        assert data == b"INSERTED 1\r\nRESERVED 1 2\r\nhi\r\n"
        sock.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_unix_listener_never_removes_a_file_that_is_not_a_socket(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("important")
    result = subprocess.run([sys.executable, "-m", "broker", "-l", f"unix:{data}"], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode != 0
    assert "exists and is not a socket" in result.stderr and "Traceback" not in result.stderr
    assert data.read_text() == "important"
    result = subprocess.run([sys.executable, "-m", "broker", "-l", "unix:"], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode != 0
    assert "unix: needs a path" in result.stderr and "Traceback" not in result.stderr


def test_unix_listener_replaces_a_stale_socket(tmp_path):
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays: a socket left by a broker that died
    proc = subprocess.Popen([sys.executable, "-m", "broker", "-l", f"unix:{path}"])
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(5)
        wait_until(lambda: proc.poll() is not None or sock.connect(str(path)) is None, 15,
                   "a connection on the unix socket", retry_on=(ConnectionRefusedError, FileNotFoundError))
        assert proc.poll() is None
        sock.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_config_file_and_flags_override_it(tmp_path):
    port = free_port()
    conf = tmp_path / "broker.toml"
    conf.write_text(f'[broker]\nlisten = "127.0.0.1"\nport = {port}\nmax_job_size = 10\n')
    server = ServerProcess(argv=[sys.executable, "-m", "broker", "--config", str(conf)], host="127.0.0.1",
                           port=port).start()
    try:
        with Connection(server.host, server.port) as conn:
            assert conn.stats()["max-job-size"] == 10
            assert conn.call("put 0 0 10 11", b"x" * 11).status == b"JOB_TOO_BIG"
    finally:
        server.stop()
    port2 = free_port()
    conf.write_text(f'[broker]\nport = {port2}\nmax_job_size = 10\n')
    server = ServerProcess(argv=[sys.executable, "-m", "broker", "--config", str(conf), "-z", "20"],
                           host="127.0.0.1", port=port2).start()
    try:
        with Connection(server.host, server.port) as conn:
            assert conn.stats()["max-job-size"] == 20
    finally:
        server.stop()


def test_config_file_unknown_key_is_a_clear_error(tmp_path):
    conf = tmp_path / "broker.toml"
    conf.write_text("[broker]\nlistne = '127.0.0.1'\n")
    result = subprocess.run([sys.executable, "-m", "broker", "--config", str(conf)], capture_output=True, text=True)
    assert result.returncode == 2
    assert "unknown key 'listne'" in result.stderr


def test_port_in_use_is_a_clear_error():
    server = broker_process().start()
    try:
        result = subprocess.run([sys.executable, "-m", "broker", "-p", str(server.port)], capture_output=True,
                                text=True, timeout=30)
        assert result.returncode != 0
        assert f"cannot listen on 127.0.0.1:{server.port}" in result.stderr
    finally:
        server.stop()


def test_bad_flag_values_are_rejected():
    result = subprocess.run([sys.executable, "-m", "broker", "-p", "99999"], capture_output=True, text=True)
    assert result.returncode == 2 and "99999" in result.stderr
    result = subprocess.run([sys.executable, "-m", "broker", "--metrics", "nope"], capture_output=True, text=True)
    assert result.returncode == 2 and "ADDR:PORT" in result.stderr


@pytest.mark.parametrize("args", [["--idle-timeout", "nan"], ["--slow-reader-timeout", "nan"],
                                  ["--idle-timeout", "inf"]])
def test_non_finite_float_flags_are_rejected(args):
    result = subprocess.run([sys.executable, "-m", "broker", "-p", str(free_port()), *args], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and args[0] in result.stderr and "not a finite number" in result.stderr


def test_non_finite_float_in_the_config_file_is_rejected(tmp_path):
    conf = tmp_path / "broker.toml"
    conf.write_text(f"[broker]\nport = {free_port()}\nidle_timeout = nan\n")
    result = subprocess.run([sys.executable, "-m", "broker", "--config", str(conf)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2 and "not a finite number" in result.stderr


@pytest.mark.parametrize(("text", "why"), [
    (b"broker = 5\n", "broker must be a table"),
    (b"port = [1, 2]\n", "port in .* must be a whole number, not \\[1, 2\\]"),
    (b"port = 21399.7\n", "port in .* must be a whole number, not 21399.7"),
    (b"binlog_dir = 5\n", "binlog_dir in .* must be a string, not 5"),
    (b"no_fsync = \"yes\"\n", "no_fsync in .* must be true or false"),
    (b"\xff\xfe\n", "not UTF-8 text"),
])
def test_config_file_with_wrong_types_is_a_clear_error(tmp_path, text, why):
    conf = tmp_path / "broker.toml"
    conf.write_bytes(text)
    result = subprocess.run([sys.executable, "-m", "broker", "--config", str(conf)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert re.search(why, result.stderr), result.stderr


def test_unusable_tls_files_are_a_clear_error(tmp_path, certs):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    cases = [(["--tls-cert", str(bad), "--tls-key", str(bad)], "--tls-cert"),
             (["--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "client.key")], "--tls-key"),
             (["--tls-cert", str(certs / "server.crt"), "--tls-key", str(certs / "server.key"),
               "--tls-client-ca", str(bad)], "--tls-client-ca")]
    for args, named in cases:
        result = subprocess.run([sys.executable, "-m", "broker", "-p", str(free_port()), *args], capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 2 and named in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_verbose_logs_connections():
    port = free_port()
    log_path = f"/tmp/broker-verbose-{os.getpid()}.log"
    server = ServerProcess(argv=[sys.executable, "-m", "broker", "-p", str(port), "-V"], host="127.0.0.1",
                           port=port, stderr_path=log_path).start()
    try:
        with Connection(server.host, server.port) as conn:
            conn.stats()
    finally:
        server.stop()
    text = Path(log_path).read_text()
    os.unlink(log_path)
    lines = [dict(field.split("=", 1) for field in line.split(" ") if "=" in field) for line in text.splitlines()]
    events = {line.get("event"): line for line in lines}
    assert events["listening"]["addresses"] == f"127.0.0.1:{port}"
    assert events["accept"]["peer"].startswith("127.0.0.1:") and events["accept"]["level"] == "info"


@pytest.mark.parametrize("kind", ["ours", "beanstalkd"])
def test_server_moves_to_a_new_port_when_its_free_port_was_taken(kind):
    """free_port() races with everyone else on the machine: if the chosen port is taken before
    the server binds it, start() starts the server again on another free port."""
    from spark_beanstalk.embedded import beanstalkd_process

    proc = (broker_process if kind == "ours" else beanstalkd_process)()
    taken = proc.port
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", taken))  # bound, not listening: connects are refused, binds fail
        proc.start()
        try:
            assert proc.port != taken and str(proc.port) in proc.argv and str(taken) not in proc.argv
            with Connection(proc.host, proc.port) as conn:
                assert conn.call("list-tube-used").status == b"USING"
        finally:
            proc.stop()


def test_server_with_a_given_port_does_not_move():
    """A port the caller chose is kept: the start fails instead of silently moving."""
    from spark_beanstalk.embedded import ServerExitedEarly

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        port = blocker.getsockname()[1]
        with pytest.raises(ServerExitedEarly):
            broker_process(port=port).start()
