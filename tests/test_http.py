"""The broker's HTTP listener (--http, formerly --metrics): /healthz, /readyz, /metrics,
and the Grafana dashboard in conf/ against the metrics the broker really exports.

Real broker processes; /readyz must turn 503 while draining (SIGUSR1) and while the
binlog directory does not take writes. Tests run as root, for whom chmod changes
nothing, so the directory is made unwritable by the immutable flag (FS_IOC_SETFLAGS,
which binds root too) and, on every filesystem, by moving it away and leaving a plain
file at its path.
"""
from __future__ import annotations

import array
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spark_beanstalk.client import Connection
from tests.helpers import broker_process, free_port, wait_for_port, wait_until
from tests.helpers import http_get as get

ROOT = Path(__file__).resolve().parent.parent
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10



@pytest.fixture
def http_broker(tmp_path):
    """Our broker with a binlog and the HTTP listener; yields (process, http base URL, binlog dir)."""
    port = free_port()
    binlog = tmp_path / "binlog"
    proc = broker_process(extra_args=["-b", str(binlog), "--http", f"127.0.0.1:{port}"]).start()
    wait_for_port("127.0.0.1", port, 10, proc.proc)
    yield proc, f"http://127.0.0.1:{port}", binlog
    proc.stop()


def test_healthz_and_readyz_then_draining(http_broker):
    proc, base, _ = http_broker
    assert get(base + "/healthz") == (200, "ok\n")
    assert get(base + "/readyz") == (200, "ready\n")
    proc.signal(signal.SIGUSR1)
    _, text = wait_until(lambda: (r := get(base + "/readyz"))[0] == 503 and r, 10, what="readyz 503")
    assert "draining" in text
    assert get(base + "/healthz")[0] == 200  # alive, just not taking new work
    with Connection(proc.host, proc.port) as conn:
        assert conn.call("put 0 0 1 1", b"x").status == b"DRAINING"


def _set_immutable(path: Path, on: bool) -> bool:
    """chattr +i / -i; False where the filesystem has no such flag."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        flags[0] = flags[0] | FS_IMMUTABLE_FL if on else flags[0] & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_readyz_when_binlog_directory_is_not_writable(http_broker):
    _, base, binlog = http_broker
    assert get(base + "/readyz")[0] == 200
    if _set_immutable(binlog, True):
        try:
            status, text = get(base + "/readyz")
            assert status == 503 and "not writable" in text and str(binlog) in text, text
        finally:
            _set_immutable(binlog, False)
        assert get(base + "/readyz")[0] == 200
    moved = binlog.with_name("binlog.moved")
    binlog.rename(moved)
    binlog.write_text("not a directory")
    try:
        status, text = get(base + "/readyz")
        assert status == 503 and "not writable" in text, text
        assert get(base + "/healthz")[0] == 200
    finally:
        binlog.unlink()
        moved.rename(binlog)
    assert get(base + "/readyz") == (200, "ready\n")
    assert not list(binlog.glob(".readyz*")), "the probe file must not be left behind"


def test_http_port_taken_is_a_clear_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "broker", "-p", str(free_port()), "--http", f"127.0.0.1:{port}"],
                                check=False, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def _exported(base: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(base + "/metrics")
    assert status == 200
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_grafana_panels_name_exported_metrics(http_broker):
    """Every metric a panel queries is one the broker really exports (scraped, not assumed)."""
    proc, base, _ = http_broker
    with Connection(proc.host, proc.port) as conn:
        conn.put(b"job")  # the binlog then has written and fsynced something
        wait_until(lambda: "beanstalk_binlog_fsync_seconds_count" in _exported(base), 10, what="fsync metrics")
    exported = _exported(base)
    dashboard = json.loads((ROOT / "conf" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    used = {name for expr in exprs for name in re.findall(r"\b(beanstalk_[a-z_]+)", expr)}
    assert used - exported == set(), f"panels query metrics the broker does not export: {used - exported}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("jobs", "command", "connections", "refusals", "binlog size", "fsync latency"):
        assert topic in titles


def test_no_dashboard_serves_only_the_probes_and_metrics():
    port = free_port()
    with broker_process(extra_args=["--metrics", f"127.0.0.1:{port}", "--no-dashboard"]) as proc:
        wait_for_port("127.0.0.1", port, 10, proc.proc)
        base = f"http://127.0.0.1:{port}"
        assert get(base + "/")[0] == 404
        assert get(base + "/readyz") == (200, "ready\n")  # no binlog: nothing to probe
        assert "beanstalk_connections" in get(base + "/metrics")[1]


@pytest.mark.parametrize("pure", [False, True])
def test_the_core_a_broker_runs_is_logged_and_exported(tmp_path, pure):
    """An install without a C compiler runs the interpreted core at about half the speed: an
    operator sees which core runs in the start-up log line and in ``beanstalk_build_info``."""
    from broker import _build

    env = {k: v for k, v in os.environ.items() if k != "SPARK_BEANSTALK_PURE"}
    if pure:
        env["SPARK_BEANSTALK_PURE"] = "1"
    expected = "compiled" if _build.inspect_build().compiled and not pure else "interpreted"
    http_port = free_port()
    log_path = tmp_path / "broker.log"
    proc = broker_process(extra_args=["-V", "--http", f"127.0.0.1:{http_port}"], env=env,
                          stderr_path=str(log_path)).start()
    try:
        wait_for_port("127.0.0.1", http_port, 10, proc.proc)
        status, text = get(f"http://127.0.0.1:{http_port}/metrics")
    finally:
        proc.stop()
    assert status == 200
    transport = "c" if expected == "compiled" else "uvloop"  # the C transport comes with the compiled core
    assert f'beanstalk_build_info{{core="{expected}",transport="{transport}"}} 1.0' in text
    listening = [line for line in log_path.read_text().splitlines() if "event=listening" in line]
    assert len(listening) == 1 and f"core={expected}" in listening[0].split(" ")
    assert ("C transport" in listening[0]) == (expected == "compiled")


def test_a_flood_of_malformed_requests_does_not_flood_the_log(tmp_path):
    """aiohttp logged each malformed request with a ~700-byte traceback at error level: anyone who
    could reach the port could fill the broker's log. Each still gets its 400."""
    port = free_port()
    proc = broker_process(extra_args=["--http", f"127.0.0.1:{port}"], stderr_path=str(tmp_path / "err.log")).start()
    try:
        wait_for_port("127.0.0.1", port, 10, proc.proc)
        for n in range(40):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"GET /\x00%d HTTP/1.1\r\nHost: x\r\n\r\n" % n)
                assert sock.recv(100).startswith(b"HTTP/1.0 400 Bad Request")
        assert get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
    finally:
        proc.stop()
    log = proc.log()
    assert "Traceback" not in log
    lines = [line for line in log.splitlines() if "bad HTTP request answered 400" in line]
    assert 1 <= len(lines) <= 5 * 10  # at most 5 a second
    assert "level=warning" in lines[0]
