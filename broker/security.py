"""TLS and token authentication: what beanstalkd leaves to stunnel and firewalls.

Token auth is an extension, off unless ``--auth-token-file`` is given. When on, a
connection must first send ``auth <token>\\r\\n`` and get ``OK\\r\\n``; until then every
other command is answered ``UNAUTHORIZED\\r\\n`` (a put's body is still read, so the
stream stays in step), and three wrong tokens close the connection. When off, ``auth``
is an unknown command exactly as in beanstalkd, so stock clients see no difference.
"""
from __future__ import annotations

import hmac
import ssl
from dataclasses import dataclass

from beanstalk_rules.tokens import read_token as load_token

AUTH_OK = b"OK\r\n"
UNAUTHORIZED = b"UNAUTHORIZED\r\n"
MAX_AUTH_FAILURES = 3

__all__ = ["AUTH_OK", "MAX_AUTH_FAILURES", "UNAUTHORIZED", "TlsConfig", "load_token", "token_matches"]


@dataclass
class TlsConfig:
    cert: str
    key: str
    client_ca: str | None = None
    port: int | None = None  # a second listener; None: the main listener speaks TLS

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            ctx.load_verify_locations(self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def token_matches(expected: bytes, offered: bytes) -> bool:
    return hmac.compare_digest(expected, offered)
