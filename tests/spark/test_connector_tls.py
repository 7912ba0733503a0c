"""The connector over TLS with token auth (our broker's extensions), end to end."""
from __future__ import annotations

import subprocess

import pytest

from spark_beanstalk.client import Connection
from spark_beanstalk.embedded import broker_process
from spark_beanstalk.options import OptionError, SourceOptions, WriterOptions

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """Our broker speaking only TLS and requiring a token; yields (server, ca, token_file)."""
    d = tmp_path_factory.mktemp("tls")
    cert, key, token = d / "cert.pem", d / "key.pem", d / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    token.write_text("t0ken\n")
    server = broker_process(extra_args=["--tls-cert", str(cert), "--tls-key", str(key),
                                        "--auth-token-file", str(token)]).start()
    yield server, str(cert), str(token)
    server.stop()


def test_security_options_are_validated(tmp_path):
    with pytest.raises(OptionError, match="caFile needs tls=true"):
        SourceOptions.parse({"caFile": "/etc/hosts"})
    with pytest.raises(OptionError, match="no such file"):
        WriterOptions.parse({"tls": "true", "caFile": str(tmp_path / "missing.pem")})
    opts = SourceOptions.parse({"hosts": "tls://127.0.0.1:1234"})
    assert opts.security.tls and opts.hosts == (("127.0.0.1", 1234),)


def test_write_and_read_over_tls_with_token(spark, secured):
    server, ca, token = secured
    common = {"hosts": f"tls://{server.address}", "caFile": ca, "authTokenFile": token}
    rows = spark.range(50).selectExpr("CAST(id AS STRING) AS body")
    rows.write.format("beanstalk").options(tube="secure", **common).mode("append").save()
    with Connection(server.host, server.port, tls=True, ca_file=ca, auth_token="t0ken") as conn:
        assert conn.stats_tube("secure")["current-jobs-ready"] == 50
    query = (spark.readStream.format("beanstalk").options(tubes="secure", **common).load()
             .selectExpr("CAST(body AS STRING) AS body")
             .writeStream.format("memory").queryName("tls_read").trigger(availableNow=True).start())
    query.awaitTermination(150)
    got = sorted(int(r.body) for r in spark.table("tls_read").collect())
    assert got == list(range(50))
    with Connection(server.host, server.port, tls=True, ca_file=ca, auth_token="t0ken") as conn:
        assert conn.stats_tube("secure") is None  # every job deleted after commit: the tube is gone
