"""Host specs: ``host:port``, ``tls://host:port``, comma lists, the default port.

The connector's ``hosts`` option, the writers and the operator CLI's ``--host`` all read
the same spec; this is the one parser, so a spec means the same thing everywhere.
"""
from __future__ import annotations

from typing import NamedTuple

DEFAULT_PORT = 11300
TLS_SCHEME = "tls://"


class HostSpec(NamedTuple):
    """One entry of a host spec."""

    host: str
    port: int
    tls: bool

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _strip_scheme(entry: str) -> tuple[str, bool]:
    if entry.lower().startswith(TLS_SCHEME):
        return entry[len(TLS_SCHEME):], True
    return entry, False


def parse_host_specs(spec: str, default_port: int = DEFAULT_PORT) -> list[HostSpec]:
    """'h1:p1,tls://h2' -> [HostSpec('h1', p1, False), HostSpec('h2', 11300, True)].

    Raises ValueError naming the bad entry: an empty host, a port that is not a number or
    is out of 1-65535, or a spec with no host at all.
    """
    hosts: list[HostSpec] = []
    for raw in spec.split(","):
        entry, tls = _strip_scheme(raw.strip())
        if not entry:
            continue
        host, sep, port_text = entry.rpartition(":")
        if not sep:
            host, port_text = entry, str(default_port)
        host = host.strip("[]")
        if not host:
            raise ValueError(f"bad host entry {entry!r}: empty host name")
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"bad host entry {entry!r}: port {port_text!r} is not a number") from None
        if not 0 < port < 65536:
            raise ValueError(f"bad host entry {entry!r}: port {port} out of range 1-65535")
        hosts.append(HostSpec(host, port, tls))
    if not hosts:
        raise ValueError(f"no hosts in {spec!r}")
    return hosts


def parse_hosts(spec: str, default_port: int = DEFAULT_PORT) -> list[tuple[str, int]]:
    """'h1:p1,tls://h2' -> [('h1', p1), ('h2', 11300)] (the scheme is read by `uses_tls`)."""
    return [(h.host, h.port) for h in parse_host_specs(spec, default_port)]


def parse_one_host(spec: str, default_port: int = DEFAULT_PORT) -> HostSpec:
    """Exactly one host (a CLI's ``--host``); ValueError otherwise."""
    hosts = parse_host_specs(spec, default_port)
    if len(hosts) != 1:
        raise ValueError(f"expected one host:port, got {spec!r}")
    return hosts[0]


def uses_tls(spec: str) -> bool:
    """Whether any entry of the spec asks for TLS with the ``tls://`` scheme."""
    return any(_strip_scheme(raw.strip())[1] for raw in spec.split(","))
