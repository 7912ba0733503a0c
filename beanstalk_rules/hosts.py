"""Host specs: ``host:port``, ``tls://host:port``, comma lists, the default port, and
replica sets ``cluster:a:11300,b:11300,c:11300``.

The connector's ``hosts`` option, the writers and the operator CLI's ``--host`` all read
the same spec; this is the one parser, so a spec means the same thing everywhere.

A ``cluster:`` group is ONE logical broker whose members replicate each other (see
docs/replication.md): clients follow whichever member leads. Groups are separated by
``;`` (``cluster:a,b,c;cluster:d,e,f`` is two logical brokers); a group without the
prefix is a comma list of independent brokers, as before.
"""
from __future__ import annotations

from typing import NamedTuple

DEFAULT_PORT = 11300
TLS_SCHEME = "tls://"
CLUSTER_SCHEME = "cluster:"


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


class BrokerAddress(NamedTuple):
    """One logical broker: a single server, or a replica set followed to its leader.

    ``name`` is stable across failovers (batches, offsets and progress key on it);
    ``members`` are the servers to try.
    """

    name: str
    members: tuple[HostSpec, ...]

    @property
    def is_cluster(self) -> bool:
        return self.name.startswith(CLUSTER_SCHEME)


def _groups(spec: str) -> list[tuple[bool, str]]:
    """';'-separated groups of a spec, each as (is a cluster, its comma list)."""
    out: list[tuple[bool, str]] = []
    for raw in spec.split(";"):
        group = raw.strip()
        if group.lower().startswith(CLUSTER_SCHEME):
            out.append((True, group[len(CLUSTER_SCHEME):]))
        elif group:
            out.append((False, group))
    return out


def parse_brokers(spec: str, default_port: int = DEFAULT_PORT) -> list[BrokerAddress]:
    """'cluster:a:1,b:2;c:3' -> [BrokerAddress('cluster:a:1,b:2', (a, b)), BrokerAddress('c:3', (c,))].

    Raises ValueError for a bad entry, an empty cluster or a member named twice.
    """
    brokers: list[BrokerAddress] = []
    for is_cluster, group in _groups(spec):
        members = _parse_entries(group, default_port)
        if not is_cluster:
            brokers.extend(BrokerAddress(m.address, (m,)) for m in members)
            continue
        if not members:
            raise ValueError(f"cluster group {group!r} names no member")
        names = [m.address for m in members]
        if len(set(names)) != len(names):
            raise ValueError(f"cluster group {group!r} names a member twice")
        brokers.append(BrokerAddress(CLUSTER_SCHEME + ",".join(names), tuple(members)))
    if not brokers:
        raise ValueError(f"no hosts in {spec!r}")
    return brokers


def parse_host_specs(spec: str, default_port: int = DEFAULT_PORT) -> list[HostSpec]:
    """'h1:p1,tls://h2' -> [HostSpec('h1', p1, False), HostSpec('h2', 11300, True)].

    Every server the spec names (a cluster's members included). Raises ValueError naming
    the bad entry: an empty host, a port that is not a number or is out of 1-65535, or a
    spec with no host at all.
    """
    hosts = [h for _, group in _groups(spec) for h in _parse_entries(group, default_port)]
    if not hosts:
        raise ValueError(f"no hosts in {spec!r}")
    return hosts


def _parse_entries(spec: str, default_port: int) -> list[HostSpec]:
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
    return any(_strip_scheme(raw.strip())[1] for _, group in _groups(spec) for raw in group.split(","))


def parse_listen(address: str, default_host: str | None = "127.0.0.1") -> tuple[str, int]:
    """'ADDR:PORT' of a listener (HTTP, dashboard) -> (host, port); '[::1]:80' gives '::1'.

    An empty ADDR means `default_host`, or is an error when that is None. Raises ValueError
    with the words an operator sees.
    """
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not (host or default_host):
        raise ValueError(f"takes ADDR:PORT, not {address!r}")
    if int(port) > 65535:
        raise ValueError(f"port {port} out of range 0-65535 in {address!r}")
    return host or str(default_host), int(port)
