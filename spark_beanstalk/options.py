"""Every connector option, parsed and validated in one place.

Spark hands a data source its options as a case-insensitive map of strings. Each
option set below names its keys, their defaults and their checks; an unknown key or a
bad value raises ``OptionError`` naming the key, the value and what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from spark_beanstalk.client import parse_hosts


class OptionError(ValueError):
    """A connector option is unknown or has a bad value."""


def _lower_keys(options: Mapping[str, str]) -> dict[str, str]:
    return {str(k).lower(): v for k, v in options.items()}


def check_known(options: Mapping[str, str], known: set[str], what: str) -> None:
    """Reject keys nobody reads: a typo must not silently fall back to a default."""
    unknown = sorted(set(_lower_keys(options)) - {k.lower() for k in known})
    if unknown:
        allowed = ", ".join(sorted(known))
        raise OptionError(f"unknown {what} option(s) {', '.join(unknown)}; known options: {allowed}")


def get_int(options: Mapping[str, str], key: str, default: int, minimum: int | None = None,
            maximum: int | None = None) -> int:
    raw = _lower_keys(options).get(key.lower())
    if raw is None or raw == "":
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise OptionError(f"option {key}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise OptionError(f"option {key}={value} is below the minimum {minimum}")
    if maximum is not None and value > maximum:
        raise OptionError(f"option {key}={value} is above the maximum {maximum}")
    return value


def get_float(options: Mapping[str, str], key: str, default: float, minimum: float | None = None) -> float:
    raw = _lower_keys(options).get(key.lower())
    if raw is None or raw == "":
        return default
    try:
        value = float(str(raw).strip())
    except ValueError:
        raise OptionError(f"option {key}={raw!r} is not a number") from None
    if minimum is not None and value < minimum:
        raise OptionError(f"option {key}={value} is below the minimum {minimum}")
    return value


def get_bool(options: Mapping[str, str], key: str, default: bool) -> bool:
    raw = _lower_keys(options).get(key.lower())
    if raw is None or raw == "":
        return default
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise OptionError(f"option {key}={raw!r} is not a boolean (true/false)")


def get_str(options: Mapping[str, str], key: str, default: str,
            check: Callable[[str], None] | None = None) -> str:
    raw = _lower_keys(options).get(key.lower())
    value = default if raw is None or raw == "" else str(raw)
    if check is not None:
        check(value)
    return value


def get_hosts(options: Mapping[str, str], key: str = "hosts",
              default: str = "127.0.0.1:11300") -> list[tuple[str, int]]:
    spec = get_str(options, key, default)
    try:
        return parse_hosts(spec)
    except ValueError as exc:
        raise OptionError(f"option {key}: {exc}") from None


TUBE_NAME_CHARS = frozenset(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-+/;.$_()"
)


def check_tube_name(name: str) -> None:
    """beanstalkd's rule: 1-200 bytes of letters, digits and -+/;.$_(), not starting with '-'."""
    if not 1 <= len(name.encode()) <= 200:
        raise OptionError(f"tube name {name!r} must be 1-200 bytes long")
    if name.startswith("-"):
        raise OptionError(f"tube name {name!r} must not start with '-'")
    bad = sorted(set(name) - TUBE_NAME_CHARS)
    if bad:
        raise OptionError(f"tube name {name!r} has characters beanstalkd does not allow: {''.join(bad)!r}")


def get_tubes(options: Mapping[str, str], key: str = "tubes", default: str = "default") -> list[str]:
    tubes = [t.strip() for t in get_str(options, key, default).split(",") if t.strip()]
    if not tubes:
        raise OptionError(f"option {key} names no tube")
    for tube in tubes:
        check_tube_name(tube)
    return tubes


# --- Source options (spark.readStream.format("beanstalk")) -------------------------------
# Owned by the source; see spark_beanstalk/source.py.


# --- Writer options (beanstalk_put, df.write.format("beanstalk")) -------------------------
# Owned by the writers; see spark_beanstalk/writer.py.
