"""The operator verbs of `spark-beanstalk` against real server processes.

Every test that takes `server` runs twice: against our broker and against beanstalkd
1.12 (`-k beanstalkd` / `-k ours` to pick one). The CLI runs in-process through click's
CliRunner (fast), and once as a real subprocess for the unreachable-server error.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from spark_beanstalk.cli import main
from spark_beanstalk.client import Connection
from spark_beanstalk.embedded import free_port
from spark_beanstalk.ops import TopSampler
from tests.helpers import TopProcess, wait_until

VERBS_READ_ONLY = [
    ["stats"],
    ["stats", "default"],
    ["tubes"],
    ["peek", "1"],
    ["peek", "--buried", "default"],
    ["top", "-n", "1"],
]
VERBS_WRITING = [
    ["put", "hello"],
    ["kick", "5"],
    ["kick", "--job", "1"],
    ["delete", "1"],
    ["pause", "default", "5"],
]


def cli(server, *args: str, input: str | bytes | None = None, env: dict | None = None):
    """Run `spark-beanstalk ARGS -H server` in-process and return click's Result."""
    runner = CliRunner()
    argv = list(args)
    if server is not None:
        argv += ["-H", server.address]
    return runner.invoke(main, argv, input=input, env=env, catch_exceptions=False)


def cli_json(server, *args: str, input: str | bytes | None = None):
    result = cli(server, *args, "--json", input=input)
    assert result.exit_code == 0, (result.output, result.stderr)
    return json.loads(result.stdout)


@pytest.fixture
def conn(server, conn_factory):
    return conn_factory(server)


# --- put / peek -----------------------------------------------------------------------------


def test_put_from_argument_then_peek_by_id(server, conn):
    out = cli_json(server, "put", "hello world", "--tube", "emails", "--priority", "7", "--ttr", "30")
    assert out["tube"] == "emails" and out["status"] == "inserted"
    job_id = out["id"]

    peeked = cli_json(server, "peek", str(job_id))
    assert peeked["id"] == job_id
    assert peeked["body"] == "hello world" and peeked["body_encoding"] == "utf-8"
    assert peeked["tube"] == "emails" and peeked["state"] == "ready"
    assert peeked["stats"]["pri"] == 7 and peeked["stats"]["ttr"] == 30

    stats = conn.stats_job(job_id)
    assert stats["tube"] == "emails" and stats["pri"] == 7

    human = cli(server, "peek", str(job_id))
    assert human.exit_code == 0
    assert "hello world" in human.stdout and f"job {job_id}" in human.stdout and "emails" in human.stdout


def test_put_from_stdin_strips_one_newline(server, conn):
    out = cli_json(server, "put", "--tube", "in", input='{"a": 1}\n')
    assert conn.peek(out["id"]).body == b'{"a": 1}'
    kept = cli_json(server, "put", "-", "--tube", "in", "--keep-newline", input="x\n")
    assert conn.peek(kept["id"]).body == b"x\n"


def test_put_each_line(server, conn):
    out = cli_json(server, "put", "--each-line", "--tube", "lines", input="one\ntwo\r\n\nthree\n")
    assert out["count"] == 3 and out["tube"] == "lines" and out["buried"] == []
    assert [conn.peek(i).body for i in out["ids"]] == [b"one", b"two", b"three"]
    assert conn.stats_tube("lines")["current-jobs-ready"] == 3

    human = cli(server, "put", "--each-line", "-t", "lines", input="four\nfive\n")
    assert human.exit_code == 0 and "put 2 job(s) into tube 'lines'" in human.stdout


def test_put_delay_and_binary_body(server, conn):
    body = bytes(range(256))
    out = cli_json(server, "put", "--tube", "bin", "--delay", "100", input=body + b"\x00")
    assert conn.stats_job(out["id"])["state"] == "delayed"

    peeked = cli_json(server, "peek", "--delayed", "bin")
    assert peeked["id"] == out["id"] and peeked["body_encoding"] == "base64"
    import base64

    assert base64.b64decode(peeked["body"]) == body + b"\x00"

    raw = CliRunner().invoke(main, ["peek", str(out["id"]), "--raw", "-H", server.address])
    assert raw.exit_code == 0 and raw.stdout_bytes == body + b"\x00"

    human = cli(server, "peek", "--delayed", "bin")  # binary shown as a repr, not garbage
    assert human.exit_code == 0 and "256" not in human.stderr


def test_put_argument_that_is_not_utf8_keeps_its_bytes(server, conn):
    result = subprocess.run([os.fsencode(sys.executable), b"-m", b"spark_beanstalk.cli", b"put", b"\xff\xfe",
                             b"--json", b"-H", server.address.encode()], capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert conn.peek(json.loads(result.stdout)["id"]).body == b"\xff\xfe"


def test_put_job_too_big_is_one_clear_line(server_factory, server):
    small = server_factory(server.kind, extra_args=["-z", "10"])
    result = cli(small, "put", "x" * 11)
    assert result.exit_code == 1
    assert "JOB_TOO_BIG" in result.stderr and "max job size" in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
    assert cli(small, "put", "x" * 10).exit_code == 0


def test_put_rejects_bad_priority_and_tube(server):
    result = cli(server, "put", "x", "--priority", str(2**32))
    assert result.exit_code == 2 and "priority" in result.stderr.lower()
    result = cli(server, "put", "x", "--tube", "-bad")
    assert result.exit_code == 1 and "bad tube name" in result.stderr


def test_peek_states_and_not_found(server, conn):
    conn.use("work")
    ready_id = conn.put(b"r1", priority=5)
    conn.put(b"r2", priority=9)
    delayed_id = conn.put(b"d", delay=300)
    conn.watch("work")
    buried = conn.reserve(0)
    assert buried.id == ready_id and conn.bury(buried.id)

    assert cli_json(server, "peek", "--ready", "work")["body"] == "r2"
    assert cli_json(server, "peek", "--delayed", "work")["id"] == delayed_id
    got = cli_json(server, "peek", "--buried", "work")
    assert got["id"] == ready_id and got["state"] == "buried" and got["stats"]["buries"] == 1

    missing = cli(server, "peek", "999999")
    assert missing.exit_code == 1 and "job 999999 not found" in missing.stderr
    empty = cli(server, "peek", "--buried", "nothing-here")
    assert empty.exit_code == 1 and "no buried job in tube 'nothing-here'" in empty.stderr

    usage = cli(server, "peek", "1", "--ready", "work")
    assert usage.exit_code == 2 and "exactly one of" in usage.stderr
    usage = cli(server, "peek")
    assert usage.exit_code == 2


# --- stats / tubes -----------------------------------------------------------------------------


def test_stats_server_and_tube(server, conn):
    conn.use("alpha")
    conn.put(b"1")
    conn.put(b"2", delay=60)

    stats = cli_json(server, "stats")
    assert stats["current-jobs-ready"] == 1 and stats["current-jobs-delayed"] == 1
    assert stats["total-jobs"] == 2 and "uptime" in stats and "version" in stats

    tube = cli_json(server, "stats", "alpha")
    assert tube["name"] == "alpha"
    assert tube["current-jobs-ready"] == 1 and tube["current-jobs-delayed"] == 1 and tube["total-jobs"] == 2

    human = cli(server, "stats", "alpha")
    assert human.exit_code == 0 and "current-jobs-delayed" in human.stdout and "alpha" in human.stdout
    human = cli(server, "stats")
    assert human.exit_code == 0 and "current-connections" in human.stdout

    missing = cli(server, "stats", "no-such-tube")
    assert missing.exit_code == 1 and "tube 'no-such-tube' not found" in missing.stderr


def test_tubes_lists_counts_by_state(server, conn):
    conn.use("a")
    for i in range(3):
        conn.put(b"a%d" % i)
    conn.use("b")
    conn.put(b"b-delayed", delay=120)
    conn.put(b"b-ready", priority=10)
    conn.watch("b")
    conn.ignore("default")
    held = conn.reserve(0)
    assert held is not None

    tubes = {t["name"]: t for t in cli_json(server, "tubes")}
    assert set(tubes) == {"a", "b", "default"}
    assert tubes["a"]["current-jobs-ready"] == 3
    assert tubes["b"]["current-jobs-reserved"] == 1 and tubes["b"]["current-jobs-delayed"] == 1
    assert tubes["b"]["current-watching"] == 1

    human = cli(server, "tubes")
    assert human.exit_code == 0
    lines = {line.split()[1]: line for line in human.stdout.splitlines() if line.startswith("│")}
    assert lines["a"].split()[3] == "3"  # │ a │ 3 │ ...: the ready column


def test_tube_named_like_a_number(server, conn):
    conn.use("123")
    conn.put(b"x")
    assert [t["name"] for t in cli_json(server, "tubes") if t["name"] != "default"] == ["123"]
    assert cli_json(server, "stats", "123")["name"] == "123"


# --- kick / delete / pause -------------------------------------------------------------------


def _bury(conn: Connection, tube: str, n: int) -> list[int]:
    conn.use(tube)
    ids = [conn.put(b"job-%d" % i) for i in range(n)]
    conn.watch(tube)
    for _ in ids:
        job = conn.reserve(0)
        assert conn.bury(job.id)
    return ids


def test_kick_bound_all_and_job(server, conn):
    ids = _bury(conn, "k", 5)
    assert cli_json(server, "kick", "--tube", "k") == {"tube": "k", "kicked": 1}
    assert cli_json(server, "kick", "2", "--tube", "k") == {"tube": "k", "kicked": 2}
    assert conn.stats_tube("k")["current-jobs-buried"] == 2

    last = ids[-1]
    assert cli_json(server, "kick", "--job", str(last)) == {"id": last, "kicked": 1}
    assert conn.stats_job(last)["state"] == "ready"
    again = cli(server, "kick", "--job", str(last))
    assert again.exit_code == 1 and "not kicked" in again.stderr

    human = cli(server, "kick", "--all", "-t", "k")
    assert human.exit_code == 0 and "kicked 1 job(s) in tube 'k'" in human.stdout
    assert conn.stats_tube("k")["current-jobs-buried"] == 0

    conn.put(b"later", delay=300)
    assert cli_json(server, "kick", "--all", "-t", "k")["kicked"] == 1  # no buried: delayed ones move
    assert conn.stats_tube("k")["current-jobs-delayed"] == 0

    assert cli(server, "kick", "--job", "1", "3").exit_code == 2


def test_delete_by_id_and_by_state(server, conn):
    conn.use("d")
    a, b = conn.put(b"a"), conn.put(b"b")
    out = cli(server, "delete", str(a), "999999", "--json")
    assert out.exit_code == 1
    assert json.loads(out.stdout) == {"deleted": [a], "not_found": [999999]}
    assert "999999" in out.stderr and "not found" in out.stderr
    assert conn.peek(a) is None and conn.peek(b) is not None

    human = cli(server, "delete", str(b))
    assert human.exit_code == 0 and f"deleted job {b}" in human.stdout

    buried = _bury(conn, "d", 4)
    assert cli_json(server, "delete", "--buried", "d")["deleted"] == [buried[0]]
    assert cli_json(server, "delete", "--buried", "d", "--count", "2")["deleted"] == buried[1:3]
    assert cli_json(server, "delete", "--buried", "d", "--all")["deleted"] == [buried[3]]
    assert cli_json(server, "delete", "--buried", "d", "--all")["deleted"] == []

    conn.use("d")
    ready = [conn.put(b"r") for _ in range(3)]
    human = cli(server, "delete", "--ready", "d", "--all")
    assert human.exit_code == 0 and "deleted 3 ready job(s) from tube 'd'" in human.stdout
    assert all(conn.peek(i) is None for i in ready)

    assert cli(server, "delete").exit_code == 2


def test_delete_reserved_job_is_refused(server, conn, conn_factory):
    conn.use("held")
    job_id = conn.put(b"x")
    conn.watch("held")
    assert conn.reserve(0).id == job_id
    result = cli(server, "delete", str(job_id))
    assert result.exit_code == 1 and "reserved by another connection" in result.stderr
    assert conn.stats_job(job_id)["state"] == "reserved"


def test_pause_and_unpause(server, conn):
    conn.use("p")
    conn.put(b"x")
    assert cli_json(server, "pause", "p", "60") == {"tube": "p", "paused": 60}
    stats = conn.stats_tube("p")
    assert stats["pause"] == 60 and stats["pause-time-left"] > 0
    conn.watch("p")
    conn.ignore("default")
    assert conn.reserve(0) is None  # paused: nothing handed out

    human = cli(server, "pause", "p", "0")
    assert human.exit_code == 0 and "unpaused" in human.stdout
    assert conn.reserve(0) is not None

    missing = cli(server, "pause", "nope", "3")
    assert missing.exit_code == 1 and "tube 'nope' not found" in missing.stderr


# --- top ---------------------------------------------------------------------------------------


def test_top_json_iterations(server, conn):
    conn.use("t1")
    conn.put(b"x")
    conn.put(b"y", delay=100)
    result = cli(server, "top", "--iterations", "2", "--interval", "0.1", "--json")
    assert result.exit_code == 0, result.stderr
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(frames) == 2
    tubes = {t["name"]: t for t in frames[1]["tubes"]}
    assert tubes["t1"]["ready"] == 1 and tubes["t1"]["delayed"] == 1 and tubes["t1"]["total"] == 2
    assert frames[0]["tubes"][0]["put_rate"] is None  # no rate before a second sample
    assert tubes["t1"]["put_rate"] == 0.0
    assert frames[1]["server"]["current-jobs-ready"] == 1
    assert tubes["t1"]["backlog"] == 2 and tubes["t1"]["oldest_ready_age"] >= 0   # ready + delayed
    assert conn.list_tubes().count("t1") == 1


def test_top_rates_follow_puts_and_deletes(server, conn):
    sampler = TopSampler(conn, ("rate",))
    first = sampler.sample()
    assert first["rates"] == {}

    other = Connection(server.host, server.port)
    try:
        other.use("rate")
        ids = [other.put(b"j") for _ in range(50)]
        for job_id in ids[:20]:
            assert other.delete(job_id)
    finally:
        other.close()
    second = sampler.sample()
    put_rate, delete_rate = second["rates"]["rate"]
    elapsed = 50 / put_rate
    assert delete_rate == pytest.approx(20 / elapsed)
    assert second["server_rates"]["cmd-put"] == pytest.approx(put_rate)
    assert set(second["tubes"]) == {"rate"}


def test_top_human_view(server, conn):
    conn.use("shown")
    conn.put(b"x")
    result = cli(server, "top", "-n", "2", "-i", "0.05", "--tube", "shown")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("put/s") >= 2  # each refresh printed (stdout is not a terminal)
    assert "shown" in result.stdout and "default" not in result.stdout.split("(every")[1]
    assert "backlog (ready+delayed, a query's lag) 1" in result.stdout


# --- host selection and an unreachable server ---------------------------------------------------


def test_host_from_environment(server):
    result = CliRunner().invoke(main, ["stats", "--json"], env={"SPARK_BEANSTALK_HOST": server.address})
    assert result.exit_code == 0 and "uptime" in json.loads(result.stdout)


@pytest.mark.parametrize("verb", VERBS_READ_ONLY + VERBS_WRITING, ids=lambda v: "-".join(v))
def test_unreachable_server_exits_2_with_one_line(verb):
    dead = f"127.0.0.1:{free_port()}"
    result = CliRunner().invoke(main, [*verb, "-H", dead], catch_exceptions=False)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert f"cannot connect to a beanstalkd server at {dead}" in lines[0]


def test_unreachable_server_as_a_real_process():
    dead = f"127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "spark_beanstalk.cli", "tubes", "--json"], capture_output=True,
                          check=False, text=True, timeout=60, env={**os.environ, "SPARK_BEANSTALK_HOST": dead})
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        (f"Error: cannot connect to a beanstalkd server at {dead}: Connection refused "
         f"(is it running? set --host or $SPARK_BEANSTALK_HOST)")
    ]


def test_bad_host_option():
    result = CliRunner().invoke(main, ["tubes", "-H", "localhost:notaport"])
    assert result.exit_code == 2 and "bad --host" in result.stderr


def test_lost_connection_is_a_clear_error(server):
    """The server goes away mid-`top` for longer than --retry: one line, exit 2."""
    import threading

    def kill_soon():
        server.kill()

    timer = threading.Timer(0.3, kill_soon)
    timer.start()
    try:
        result = cli(server, "top", "-n", "0", "-i", "0.05", "--json", "--retry", "0.5")
    finally:
        timer.cancel()
    assert result.exit_code == 2
    last = result.stderr.strip().splitlines()
    assert len(last) == 1 and "Traceback" not in result.stderr
    assert "cannot connect" in last[0] and "still after --retry 0.5s" in last[0], last
    errors = [json.loads(line) for line in result.stdout.splitlines() if '"error"' in line]
    assert errors and all(e["lost_for"] <= 0.5 for e in errors)   # the outage was shown while it was retried


def test_top_rides_through_a_broker_restart(server):
    """`top` left running outlasts a restart of its broker: it shows the outage, then the new process."""
    with TopProcess(server.address) as top:
        first = top.wait_for(lambda f: "server" in f, "top's first refresh")
        server.kill()
        outage = top.wait_for(lambda f: "error" in f, "top showing the outage")
        server.restart()
        back = top.wait_for(lambda f: "server" in f, "top showing the restarted broker")
        assert top.running()
    assert "cannot connect" in outage["error"] or "lost the connection" in outage["error"], outage
    assert back["server"]["pid"] != first["server"]["pid"] and back["address"] == server.address
    assert all(r is None for r in back["rates"].values())  # no rate across the restart: the counters started again


# --- TLS and token auth (our broker's extensions; beanstalkd has neither) ------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    import datetime as dt
    import ipaddress

    pytest.importorskip("cryptography")  # a test dependency (pyproject's [test] extra)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = tmp_path_factory.mktemp("ops-tls")
    now = dt.datetime.now(dt.UTC)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(cn, key, issuer, issuer_key, ca=False, usage=None, san=None):
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
             .not_valid_after(now + dt.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(stem, crt, key):
        (d / f"{stem}.crt").write_bytes(crt.public_bytes(serialization.Encoding.PEM))
        (d / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("ops test CA", ca_key, name("ops test CA"), ca_key, ca=True)
    write("ca", ca, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    write("server", cert("localhost", server_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                         san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), server_key)
    client_key = ec.generate_private_key(ec.SECP256R1())
    write("client", cert("operator", client_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH),
          client_key)
    return d


def test_tls_with_client_certificate(server_factory, tls_files):
    d = tls_files
    srv = server_factory("ours", extra_args=["--tls-cert", str(d / "server.crt"), "--tls-key", str(d / "server.key"),
                                             "--tls-client-ca", str(d / "ca.crt")])
    creds = ["--ca-file", str(d / "ca.crt"), "--cert-file", str(d / "client.crt"), "--key-file", str(d / "client.key")]
    runner = CliRunner()

    def run(*args):
        return runner.invoke(main, list(args), catch_exceptions=False)

    put = run("put", "over tls", "-t", "secure", "-H", f"tls://{srv.address}", *creds, "--json")
    assert put.exit_code == 0, put.stderr
    job_id = json.loads(put.stdout)["id"]
    peek = run("peek", str(job_id), "-H", srv.address, "--tls", *creds, "--json")
    assert peek.exit_code == 0 and json.loads(peek.stdout)["body"] == "over tls"
    tubes = run("tubes", "-H", f"tls://{srv.address}", *creds, "--json")
    assert tubes.exit_code == 0 and "secure" in {t["name"] for t in json.loads(tubes.stdout)}

    untrusted = run("tubes", "-H", f"tls://{srv.address}", "--cert-file", str(d / "client.crt"),
                    "--key-file", str(d / "client.key"))  # the system CAs do not know our CA
    assert untrusted.exit_code == 2 and "TLS handshake" in untrusted.stderr
    assert len(untrusted.stderr.strip().splitlines()) == 1


def test_token_auth(server_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    srv = server_factory("ours", extra_args=["--auth-token-file", str(token)])

    refused = cli(srv, "stats")
    assert refused.exit_code == 2
    assert "requires authentication" in refused.stderr and "--token-file" in refused.stderr

    ok = cli(srv, "put", "with token", "--token-file", str(token), "--json")
    assert ok.exit_code == 0, ok.stderr
    from_env = CliRunner().invoke(main, ["tubes", "-H", srv.address, "--json"],
                                  env={"SPARK_BEANSTALK_TOKEN_FILE": str(token)})
    assert from_env.exit_code == 0 and any(t["current-jobs-ready"] == 1 for t in json.loads(from_env.stdout))

    bad = cli(srv, "tubes", "--token-file", str(wrong))
    assert bad.exit_code == 2 and "refused the token" in bad.stderr and "Traceback" not in bad.output


# --- clear / move (spark_beanstalk.tubeops) ----------------------------------------------------


def _fill(conn: Connection, tube: str, ready: int = 0, delayed: int = 0, buried: int = 0) -> None:
    conn.use(tube)
    if buried:
        conn.watch_only([tube])
        for i in range(buried):
            conn.put(b"b%d" % i, priority=9)
        for _ in range(buried):
            job = conn.reserve(0)
            assert job is not None and conn.bury(job.id, 7)
        conn.watch_only(["default"])
    for i in range(ready):
        conn.put(b"r%d" % i, priority=5, ttr=33)
    for i in range(delayed):
        conn.put(b"d%d" % i, delay=100)


def _counts(conn: Connection, tube: str) -> dict[str, int]:
    st = conn.stats_tube(tube) or {}
    return {s: int(st.get(f"current-jobs-{s}", 0)) for s in ("ready", "reserved", "delayed", "buried")}


def test_clear_by_state_then_all_leaves_reserved_jobs(server, conn, conn_factory):
    _fill(conn, "clr", ready=3, delayed=2, buried=2)
    worker = conn_factory(server)
    worker.use("clr")
    worker.put(b"held")
    worker.watch_only(["clr"])
    assert worker.reserve(0) is not None  # the highest-priority ready job: "r0" (pri 5) stays reserved
    assert cli(server, "clear", "clr").exit_code == 2  # no terminal and no --yes: refuses
    out = cli_json(server, "clear", "clr", "--state", "buried", "--yes")
    assert out["deleted"] == 2 and out["by_state"]["buried"] == 2
    assert _counts(conn, "clr") == {"ready": 3, "reserved": 1, "delayed": 2, "buried": 0}
    result = cli(server, "clear", "clr", "--yes")
    assert result.exit_code == 0
    assert "deleted 5 job(s) from tube 'clr' (ready 3, delayed 2)" in result.stdout
    assert _counts(conn, "clr") == {"ready": 0, "reserved": 1, "delayed": 0, "buried": 0}


def test_move_keeps_priority_delay_ttr_and_burial(server, conn):
    _fill(conn, "src", ready=2, delayed=1, buried=1)
    out = cli_json(server, "move", "src", "dst", "-n", "1", "--state", "ready")
    assert out["moved"] == 1
    assert _counts(conn, "src")["ready"] == 1 and _counts(conn, "dst")["ready"] == 1
    out = cli_json(server, "move", "src", "dst")
    assert out["moved"] == 3 and out["by_state"] == {"ready": 1, "delayed": 1, "buried": 1}
    assert _counts(conn, "src") == {"ready": 0, "reserved": 0, "delayed": 0, "buried": 0}
    assert _counts(conn, "dst") == {"ready": 2, "reserved": 0, "delayed": 1, "buried": 1}
    conn.use("dst")
    ready = conn.peek_ready()
    assert ready is not None and ready.body in (b"r0", b"r1")
    st = conn.stats_job(ready.id)
    assert st is not None and (st["pri"], st["ttr"]) == (5, 33)
    delayed = conn.peek_delayed()
    assert delayed is not None and delayed.body == b"d0"
    assert 95 <= int(conn.stats_job(delayed.id)["time-left"]) <= 100
    buried = conn.peek_buried()
    assert buried is not None and buried.body == b"b0" and conn.stats_job(buried.id)["pri"] == 7
    assert cli(server, "move", "dst", "dst").exit_code == 2


def test_interrupted_move_loses_and_duplicates_nothing(server, conn, conn_factory):
    """SIGINT in the middle of a real `spark-beanstalk move`: every job is in exactly one tube."""
    total = 4000
    conn.use("big")
    bodies = {b"job-%05d" % i for i in range(total)}
    for _ in conn.pipeline([b"put 100 0 60 9\r\n" + body + b"\r\n" for body in sorted(bodies)]):
        pass
    proc = subprocess.Popen([sys.executable, "-m", "spark_beanstalk.cli", "move", "big", "moved", "-H", server.address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        wait_until(lambda: _counts(conn, "moved")["ready"] >= 300, 30, what="the move to be under way")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert "stopped early: moved" in stdout, stdout
    left, moved = _counts(conn, "big")["ready"], _counts(conn, "moved")["ready"]
    assert left > 0 and moved > 0 and left + moved == total
    seen: list[bytes] = []
    reader = conn_factory(server)
    reader.watch_only(["big", "moved"])
    while (job := reader.reserve(0)) is not None:
        seen.append(job.body)
    assert len(seen) == total and set(seen) == bodies


def test_clear_shows_a_progress_bar_on_a_terminal(broker, conn_factory):
    """On a terminal (a pty here) a large clear draws rich's bar on stderr; the summary stays on stdout."""
    conn = conn_factory(broker)
    conn.use("lots")
    for _ in conn.pipeline([b"put 1 0 60 1\r\nx\r\n"] * 500):
        pass
    primary, secondary = os.openpty()
    try:
        try:
            proc = subprocess.run([sys.executable, "-m", "spark_beanstalk.cli", "clear", "lots", "--yes",
                                   "-H", broker.address], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=secondary, text=True, check=False, timeout=60,
                                  env={**os.environ, "PYTHONPATH": os.getcwd(), "COLUMNS": "100"})
        finally:
            os.close(secondary)
        drawn = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(primary)
    assert proc.returncode == 0
    assert "deleted 500 job(s) from tube 'lots' (ready 500)" in proc.stdout
    assert b"clearing lots" in drawn and b"500" in drawn


@pytest.mark.parametrize(("value", "why"), [("nan", "not a finite number"), ("inf", "not a finite number"),
                                           ("1e300", "beyond 1e+09")])
def test_top_interval_must_be_finite(value, why):
    result = CliRunner().invoke(main, ["top", "-n", "1", "--interval", value, "-H", "127.0.0.1:1"])
    assert result.exit_code == 2 and "'--interval'" in result.output and why in result.output


@pytest.mark.parametrize("args", [["pause", "default", "99999999999"], ["pause", "bad!", "5"],
                                  ["delete", str(2**70)], ["kick", "--job", str(2**70)]])
def test_bad_format_is_reported_as_such_not_as_not_found(server, args):
    result = cli(server, *args)
    assert result.exit_code != 0
    assert "BAD_FORMAT" in result.stderr and "not found" not in result.stderr, result.stderr
