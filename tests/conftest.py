"""Shared fixtures: real server processes on free ports, one SparkSession per session."""
from __future__ import annotations

import datetime as _dt
import itertools
import os
from pathlib import Path

import pytest

from spark_beanstalk.client import Connection
from spark_beanstalk.embedded import ServerProcess, beanstalkd_process, broker_process

SERVER_KINDS = ("ours", "beanstalkd")


def pytest_report_header(config) -> str:
    """Which broker core the tests run: compiled (mypyc) or interpreted (SPARK_BEANSTALK_PURE=1)."""
    from broker import _build

    return f"broker core: {_build.describe()}"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks (it renames the node ids)
def pytest_collection_modifyitems(config, items) -> None:
    """Under `pytest -n 2 --dist loadgroup` (scripts/test.sh): every test that uses the `spark`
    fixture runs on one worker, so one SparkSession (one JVM) serves the whole session; every
    other module stays whole on one worker, so its module-scoped servers start once and the
    differential suite's fresh-pair prefetch starts only pairs it will use."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = "spark" if "spark" in item.fixturenames else item.nodeid.split("::", 1)[0]
            item.add_marker(pytest.mark.xdist_group(group))
    # The spark group is the longest unit of work (~540 of ~1,230 s on the AMD VM): it goes first, so one
    # worker starts on it while the other takes the modules; then the longest modules, so that no long one
    # is left for the end while the other worker idles (with --no-loadscope-reorder, scripts/test.sh; xdist
    # would otherwise order the units by their number of tests).
    items.sort(key=lambda item: ("spark" not in item.fixturenames, _rank(item.nodeid.split("::", 1)[0])))


# Modules of more than ~20 s, longest first (pytest --durations=0, AMD EPYC VM, 2026-11-29): scheduled first.
LONGEST_FIRST = ("tests/spark/test_cluster.py", "tests/spark/test_connect.py", "tests/test_failover.py",
                 "tests/differential/test_differential.py", "tests/test_steady_heap.py", "tests/test_binlog_crash.py",
                 "tests/test_hardening.py", "tests/spark/test_writer_unit.py", "tests/test_binlog_faults.py",
                 "tests/test_dashboard_browser.py", "tests/test_bench_smoke.py")


def _rank(module: str) -> int:
    return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)


_LOG_NUMBERS = itertools.count()  # stderr file names of the servers one test starts


def _start(kind: str, extra_args=(), log_dir: Path | None = None) -> ServerProcess:
    factory = broker_process if kind == "ours" else beanstalkd_process
    stderr = str(log_dir / f"{kind}-{next(_LOG_NUMBERS)}.stderr.log") if log_dir is not None else None
    proc = factory(extra_args=list(extra_args), stderr_path=stderr).start()
    proc.kind = kind
    return proc


def _stop(proc: ServerProcess) -> None:
    """Stop the server and print how it ended and the end of its stderr: pytest shows this only
    for a failed test, where a server that died or refused connections must say why."""
    code = proc.stop()
    lines: list[str] = []
    if proc.stderr_path and os.path.exists(proc.stderr_path):
        lines = Path(proc.stderr_path).read_text(errors="replace").splitlines()[-20:]
    print(f"{proc.kind} on {proc.address}, pid {proc.pid}: exit code {code}; stderr:", *lines, sep="\n  ")


@pytest.fixture
def broker(tmp_path):
    """A fresh process of our broker on 127.0.0.1:<free port>."""
    proc = _start("ours", log_dir=tmp_path)
    yield proc
    _stop(proc)


@pytest.fixture
def beanstalkd(tmp_path):
    """A fresh real beanstalkd 1.12 on 127.0.0.1:<free port>."""
    proc = _start("beanstalkd", log_dir=tmp_path)
    yield proc
    _stop(proc)


@pytest.fixture(params=SERVER_KINDS)
def server(request, tmp_path):
    """Each test using this runs twice: against our broker and against beanstalkd 1.12."""
    proc = _start(request.param, log_dir=tmp_path)
    yield proc
    _stop(proc)


@pytest.fixture
def server_factory(tmp_path):
    """Start extra servers inside a test: server_factory('ours', extra_args=[...])."""
    started: list[ServerProcess] = []

    def make(kind: str, extra_args=()) -> ServerProcess:
        proc = _start(kind, extra_args, log_dir=tmp_path)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        _stop(proc)


@pytest.fixture
def conn_factory():
    """Open client connections to a ServerProcess; all are closed after the test."""
    opened: list[Connection] = []

    def make(proc: ServerProcess, timeout: float = 10.0) -> Connection:
        conn = Connection(proc.host, proc.port, timeout=timeout)
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.close()


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for the whole test session (starting Spark costs seconds)."""
    from spark_beanstalk.session import get_spark

    session = get_spark("spark-beanstalk-tests")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """A CA, a server certificate (localhost, 127.0.0.1), a client certificate from the CA, and a
    client certificate from an unrelated CA; all PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = tmp_path_factory.mktemp("tls")
    now = _dt.datetime.now(_dt.UTC)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(path, cert, k):
        (d / f"{path}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{path}.key").write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                                        serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))

    def ca(cn):
        k = key()
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn)).public_key(k.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - _dt.timedelta(hours=1))
                .not_valid_after(now + _dt.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(k, hashes.SHA256()))
        return cert, k

    def leaf(cn, ca_cert, ca_key, usage, san=None):
        k = key()
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
             .public_key(k.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - _dt.timedelta(hours=1)).not_valid_after(now + _dt.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(ca_key, hashes.SHA256()), k

    ca_cert, ca_key = ca("spark-beanstalk test CA")
    write("ca", ca_cert, ca_key)
    write("server", *leaf("localhost", ca_cert, ca_key, ExtendedKeyUsageOID.SERVER_AUTH,
                          [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]))
    write("client", *leaf("worker-1", ca_cert, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH))
    rogue_cert, rogue_key = ca("rogue CA")
    write("rogue", *leaf("intruder", rogue_cert, rogue_key, ExtendedKeyUsageOID.CLIENT_AUTH))
    return d
