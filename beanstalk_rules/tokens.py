"""Auth token files: one reader for the broker (``--auth-token-file``), the connector
(``authTokenFile``) and the operator CLI (``--token-file``).

They must agree byte for byte, or a token that the broker loads is one the client cannot
send. The token travels as ``auth <token>\\r\\n``, so it must be one word of printable
ASCII that fits a command line. The file holds that word; white space around it (the
newline ``echo token > file`` leaves, a CRLF from an editor) is not part of it. Anything
else is refused with a message naming the file, never silently cut.
"""
from __future__ import annotations

import errno
import os
import stat

MAX_TOKEN_BYTES = 200
_PRINTABLE = frozenset(range(0x21, 0x7F))  # printable ASCII without the space
_AROUND = b" \t\r\n"


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file and the reason."""


def parse_token(data: bytes, source: str = "token") -> bytes:
    """The token held in `data` (a token file's content); TokenFileError naming `source` if none."""
    token = data.strip(_AROUND)
    if not token:
        raise TokenFileError(f"{source} holds no token (it is empty)")
    if any(c in _AROUND for c in token):
        raise TokenFileError(f"{source} must hold one token on one line; it holds several words or lines")
    if len(token) > MAX_TOKEN_BYTES:
        raise TokenFileError(f"{source}: the token is {len(token)} bytes; at most {MAX_TOKEN_BYTES} are allowed")
    bad = sorted({c for c in token if c not in _PRINTABLE})
    if bad:
        shown = ", ".join(f"0x{c:02x}" for c in bad[:5])
        raise TokenFileError(f"{source}: the token may hold only printable ASCII characters, not {shown}")
    return token


def read_token(path: str | os.PathLike[str]) -> bytes:
    """Read and check a token file; TokenFileError (a ValueError) for every way it can be unusable."""
    name = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO waits for a writer, and reading one may never end; a
        # token file must be a regular file, checked on the open descriptor (no race).
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            if not stat.S_ISREG(mode):
                raise TokenFileError(f"{name}: not a regular file (a FIFO, socket or device cannot hold a token)")
            data = fh.read(64 * 1024 + 1)
    except FileNotFoundError:
        raise TokenFileError(f"{name}: no such token file") from None
    except OSError as exc:
        raise TokenFileError(f"{name}: cannot read the token file: {exc.strerror or exc}") from None
    if len(data) > 64 * 1024:
        raise TokenFileError(f"{name} is too large to be a token file")
    return parse_token(data, name)


def read_token_text(path: str | os.PathLike[str]) -> str:
    """read_token for clients that send text: the same checks, the token as str (ASCII)."""
    return read_token(path).decode("ascii")
