"""Tube names: beanstalkd 1.12's rule, for the broker's wire codec and the connector alike.

beanstalkd accepts a name of 1 to 200 bytes drawn from letters, digits and ``-+/;.$_()``
that does not start with ``-`` (``is_valid_tube`` in its prot.c). The broker must refuse
exactly what beanstalkd refuses (BAD_FORMAT), and the connector must refuse the same names
before it sends them, so both ask this module.
"""
from __future__ import annotations

MAX_TUBE_NAME = 200  # bytes; beanstalkd's MAX_TUBE_NAME_LEN - 1
TUBE_NAME_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-+/;.$_()"
NAME_BYTES = frozenset(TUBE_NAME_ALPHABET.encode("ascii"))  # for the wire (byte values)
NAME_CHARS = frozenset(TUBE_NAME_ALPHABET)  # for names given as text
_HYPHEN = ord("-")


class TubeNameError(ValueError):
    """A tube name beanstalkd would refuse; the message says why."""


def valid_tube_name(name: bytes) -> bool:
    """True if beanstalkd accepts `name` as a tube name (the broker's hot path: no message built)."""
    return 0 < len(name) <= MAX_TUBE_NAME and name[0] != _HYPHEN and NAME_BYTES.issuperset(name)


def tube_name_problem(name: object) -> str | None:
    """Why beanstalkd would refuse `name` as a tube name ("bad tube name 'x': ..."), or None."""
    if isinstance(name, bytes):
        try:
            name = name.decode("ascii")
        except UnicodeDecodeError:
            return f"bad tube name {name!r}: not ASCII"
    if not isinstance(name, str):
        return f"bad tube name {name!r}: not a string"
    size = len(name.encode("utf-8"))
    if not 1 <= size <= MAX_TUBE_NAME:
        return f"bad tube name {name!r}: must be 1-{MAX_TUBE_NAME} bytes, not {size}"
    if name.startswith("-"):
        return f"bad tube name {name!r}: must not start with '-'"
    bad = sorted(set(name) - NAME_CHARS)
    if bad:
        return (f"bad tube name {name!r}: beanstalkd does not allow the characters {''.join(bad)!r} "
                "(only letters, digits and -+/;.$_())")
    return None


def check_tube_name(name: object) -> str:
    """`name` itself if beanstalkd accepts it; TubeNameError (a ValueError) saying why not."""
    problem = tube_name_problem(name)
    if problem is not None:
        raise TubeNameError(problem)
    assert isinstance(name, str | bytes)
    return name if isinstance(name, str) else name.decode("ascii")
