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

__all__ = ["AUTH_OK", "MAX_AUTH_FAILURES", "UNAUTHORIZED", "TlsConfig", "TlsFileError", "load_token", "token_matches"]


@dataclass
class TlsConfig:
    cert: str
    key: str
    client_ca: str | None = None
    port: int | None = None  # a second listener; None: the main listener speaks TLS

    def server_context(self) -> ssl.SSLContext:
        """The server's context; TlsFileError naming the files when they cannot be used (the CLI
        builds it before starting, so a bad PEM is one line there, not a traceback)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise TlsFileError(f"--tls-cert {self.cert} / --tls-key {self.key}: not a usable certificate and "
                               f"matching key ({_ssl_reason(exc)})") from None
        if self.client_ca:
            try:
                ctx.load_verify_locations(self.client_ca)
            except (ssl.SSLError, OSError, ValueError) as exc:
                raise TlsFileError(f"--tls-client-ca {self.client_ca}: not a usable CA file "
                                   f"({_ssl_reason(exc)})") from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


class TlsFileError(ValueError):
    """A TLS certificate, key or CA file cannot be loaded; the message names it."""


def _ssl_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def token_matches(expected: bytes, offered: bytes) -> bool:
    return hmac.compare_digest(expected, offered)
