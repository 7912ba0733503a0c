"""Structured (logfmt) logs for the broker: one `key=value` line per event.

beanstalkd's -V prints free text; ours prints lines a log pipeline can parse without
regexes, e.g. ``ts=2026-11-22T03:08:01.123Z level=warning logger=broker.limits
event=refused reason=jobs peer=127.0.0.1:40786 detail="2 jobs held"``.
"""
from __future__ import annotations

import logging
import sys
import time


def _quote(value: object) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' ="\\\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class LogfmtFormatter(logging.Formatter):
    """Formats records as logfmt; fields passed as ``extra={"fields": {...}}`` are appended."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [f"ts={ts}", f"level={record.levelname.lower()}", f"logger={record.name}"]
        fields = getattr(record, "fields", None)
        if fields:
            parts += [f"{key}={_quote(value)}" for key, value in fields.items()]
            message = record.getMessage()
            if message:
                parts.append(f"msg={_quote(message)}")
        else:
            parts.append(f"msg={_quote(record.getMessage())}")
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


def event(logger: logging.Logger, level: int, name: str, message: str = "", **fields: object) -> None:
    """Log one structured event: ``event=<name>`` plus the given fields."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={"fields": {"event": name, **fields}})


def setup(verbose: int) -> None:
    """-V: info level (connections, lifecycle, refusals); without it only warnings."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
