"""One rule for the logs of both HTTP servers (the broker's ``--http``, ``spark-beanstalk dashboard``).

aiohttp logs every malformed request (a bad header, a NUL in the path, a header over 8 KiB) with
its traceback at error level, ~700 bytes each, as many as a client cares to send: anyone who
can reach the port could fill the log. The request is already answered 400; here it becomes one
warning line, at most ``PER_SECOND`` a second.
"""
from __future__ import annotations

import logging
import time

from aiohttp.http_exceptions import HttpProcessingError

PER_SECOND = 5


class BadRequestLog(logging.Filter):
    """For the ``aiohttp.server`` logger: malformed requests as rate-limited one-liners."""

    def __init__(self) -> None:
        super().__init__()
        self.window_start = 0.0
        self.in_window = 0
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = time.monotonic()
        if now - self.window_start >= 1.0:
            self.window_start, self.in_window = now, 0
        self.in_window += 1
        if self.in_window > PER_SECOND:
            self.dropped += 1
            return False
        first_line = (exc.message or "").strip().splitlines()[0] if exc.message else type(exc).__name__
        record.msg = "bad HTTP request answered %s: %s (%s more not logged so far)"
        record.args = (exc.code, first_line, self.dropped)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True


_FILTER = BadRequestLog()


def quiet_bad_requests() -> None:
    """Install the filter (once per process; both servers call it)."""
    logger = logging.getLogger("aiohttp.server")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
