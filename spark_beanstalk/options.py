"""Every connector option, parsed and validated in one place.

Spark hands a data source its options as a case-insensitive map of strings. Each
option set below names its keys, their defaults and their checks; an unknown key or a
bad value raises ``OptionError`` naming the key, the value and what is allowed.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from beanstalk_rules.hosts import BrokerAddress, HostSpec, parse_brokers, uses_tls
from beanstalk_rules.numbers import finite_float
from beanstalk_rules.tokens import read_token_text
from beanstalk_rules.tubes import tube_name_problem


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
        value = finite_float(str(raw), f"option {key}")
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    if minimum is not None and value < minimum:
        raise OptionError(f"option {key}={value} is below the minimum {minimum}")
    return value


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def get_duration(options: Mapping[str, str], key: str, default: str) -> float:
    """A duration such as "500ms", "3s", "1m" or "2h", in seconds; the unit is required."""
    raw = _lower_keys(options).get(key.lower())
    text = default if raw is None or str(raw).strip() == "" else str(raw)
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise OptionError(f"option {key}={text!r} is not a duration; write a number and a unit: "
                          "500ms, 3s, 1m or 2h")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


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


def get_brokers(options: Mapping[str, str], key: str = "hosts",
                default: str = "127.0.0.1:11300") -> tuple[BrokerAddress, ...]:
    """The logical brokers of a hosts option (a ``cluster:`` replica set is one), no server twice:
    the source keys what it holds by broker, and the writer keys its batch markers and its hash
    slots by broker (the same server twice got two slots and raced on one marker tube)."""
    spec = get_str(options, key, default)
    try:
        brokers = parse_brokers(spec)
    except ValueError as exc:
        raise OptionError(f"option {key}: {exc}") from None
    servers = [m.address for b in brokers for m in b.members]
    if len(set(servers)) != len(servers):
        raise OptionError(f"option {key} names a broker twice: {spec!r}")
    return tuple(brokers)


def first_members(brokers: tuple[BrokerAddress, ...]) -> tuple[tuple[str, int], ...]:
    """(host, port) of each logical broker's first member: the ``hosts`` field kept for callers
    that only know plain brokers."""
    return tuple((b.members[0].host, b.members[0].port) for b in brokers)


def brokers_of(brokers: tuple[BrokerAddress, ...], hosts: tuple[tuple[str, int], ...]) -> tuple[BrokerAddress, ...]:
    """The parsed brokers, or plain ones made from `hosts` (options built without ``parse``)."""
    if brokers:
        return brokers
    return tuple(BrokerAddress(f"{h}:{p}", (HostSpec(h, p, False),)) for h, p in hosts)


def check_tube_name(name: str) -> None:
    """beanstalkd's tube-name rule (beanstalk_rules.tubes), failing as an OptionError."""
    problem = tube_name_problem(name)
    if problem is not None:
        raise OptionError(problem)


def get_tubes(options: Mapping[str, str], key: str = "tubes", default: str = "default") -> list[str]:
    tubes = [t.strip() for t in get_str(options, key, default).split(",") if t.strip()]
    if not tubes:
        raise OptionError(f"option {key} names no tube")
    for tube in tubes:
        check_tube_name(tube)
    return tubes


@dataclass(frozen=True)
class Security:
    """TLS and token auth for every connection the connector opens (our broker's extensions;
    stock beanstalkd needs neither). One mixed list of plain and TLS hosts is not supported."""

    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    auth_token: str | None = None

    KEYS = ("tls", "caFile", "certFile", "keyFile", "authTokenFile")

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> Security:
        hosts_spec = str(_lower_keys(options).get("hosts") or "")
        tls = get_bool(options, "tls", uses_tls(hosts_spec))
        ca_file = get_str(options, "caFile", "") or None
        cert_file = get_str(options, "certFile", "") or None
        key_file = get_str(options, "keyFile", "") or None
        for key, path in (("caFile", ca_file), ("certFile", cert_file), ("keyFile", key_file)):
            if path and not tls:
                raise OptionError(f"option {key} needs tls=true (or tls:// hosts)")
            if path and not os.path.isfile(path):
                raise OptionError(f"option {key}={path!r}: no such file")
        token = None
        token_file = get_str(options, "authTokenFile", "") or None
        if token_file:
            try:
                token = read_token_text(token_file)
            except ValueError as exc:
                raise OptionError(f"option authTokenFile: {exc}") from None
        return cls(tls=tls, ca_file=ca_file, cert_file=cert_file, key_file=key_file, auth_token=token)

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for spark_beanstalk.client.Connection."""
        return {"tls": self.tls, "ca_file": self.ca_file, "certfile": self.cert_file, "keyfile": self.key_file,
                "auth_token": self.auth_token}


# --- Source options (spark.readStream.format("beanstalk")) -------------------------------
# Read by the source; see spark_beanstalk/source.py and docs/source.md (options table).


@dataclass(frozen=True)
class SourceOptions:
    """Options of ``spark.readStream.format("beanstalk")``; ``parse`` is the only constructor users need."""

    hosts: tuple[tuple[str, int], ...] = (("127.0.0.1", 11300),)
    tubes: tuple[str, ...] = ("default",)
    max_jobs_per_trigger: int = 20000        # 0: no limit (ReadAllAvailable)
    min_jobs_per_trigger: int = 0            # a batch waits for this many ready jobs ...
    max_trigger_delay: float = 900.0         # ... or this many seconds since the last batch
    num_partitions: int = 2                  # Spark partitions (and minimum reservation connections) per broker
    reserve_timeout: int = 0                 # seconds latestOffset may block waiting for a first job
    jobs_per_connection: int = 1000          # reserved jobs held on one connection at most
    touch_fraction: float = 0.5              # touch a held job once this fraction of its TTR has passed
    max_reserves: int = 0                    # bury a job reserved more than this many times; 0: never
    replay_wait_seconds: float = 10.0        # on restart, how long to wait for a batch's jobs still held elsewhere
    socket_timeout: float = 30.0             # seconds without a reply before a connection counts as lost
    broker_retry_seconds: float = 300.0      # how long a broker may stay unreachable before the query fails
    prefetch: bool = True                    # reserve the next batch's jobs while the current batch runs
    prefetch_poll_ms: int = 20               # how often the read-ahead polls empty tubes
    security: Security = Security()          # tls, caFile, certFile, keyFile, authTokenFile
    brokers: tuple[BrokerAddress, ...] = ()  # from `hosts`: logical brokers (a cluster: is one); see links()

    KEYS = (
        "hosts", "tubes", "maxJobsPerTrigger", "minJobsPerTrigger", "maxTriggerDelay",
        "numPartitions", "reserveTimeout", "jobsPerConnection",
        "touchFraction", "maxReserves", "replayWaitSeconds", "socketTimeout", "brokerRetrySeconds", "prefetch",
        "prefetchPollMs",
    ) + Security.KEYS

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        known = {k.lower() for k in cls.KEYS}
        unknown = sorted(str(k) for k in options if str(k).lower() not in known)
        if unknown:   # named as the user spelled them
            raise OptionError(f"unknown beanstalk source option(s) {', '.join(unknown)}; "
                              f"known options: {', '.join(cls.KEYS)}")
        brokers = get_brokers(options, "hosts")
        tubes = get_tubes(options, "tubes")
        if len(set(tubes)) != len(tubes):
            raise OptionError(f"option tubes names a tube twice: {','.join(tubes)!r}")
        touch_fraction = get_float(options, "touchFraction", 0.5, minimum=0.05)
        if touch_fraction > 0.9:
            raise OptionError(f"option touchFraction={touch_fraction} is above the maximum 0.9 "
                              "(a job must be touched before its TTR runs out)")
        socket_timeout = get_float(options, "socketTimeout", 30.0, minimum=1.0)
        reserve_timeout = get_int(options, "reserveTimeout", 0, minimum=0, maximum=20)
        if reserve_timeout >= socket_timeout:
            raise OptionError(f"option reserveTimeout={reserve_timeout} must be below socketTimeout={socket_timeout}")
        max_jobs, min_jobs, max_delay = _trigger_limits(options)
        return cls(
            hosts=first_members(brokers),
            brokers=brokers,
            tubes=tuple(tubes),
            max_jobs_per_trigger=max_jobs,
            min_jobs_per_trigger=min_jobs,
            max_trigger_delay=max_delay,
            num_partitions=get_int(options, "numPartitions", 2, minimum=1, maximum=256),
            reserve_timeout=reserve_timeout,
            jobs_per_connection=get_int(options, "jobsPerConnection", 1000, minimum=1, maximum=1_000_000),
            touch_fraction=touch_fraction,
            max_reserves=get_int(options, "maxReserves", 0, minimum=0),
            replay_wait_seconds=get_float(options, "replayWaitSeconds", 10.0, minimum=0.0),
            socket_timeout=socket_timeout,
            broker_retry_seconds=get_float(options, "brokerRetrySeconds", 300.0, minimum=0.0),
            prefetch=get_bool(options, "prefetch", True),
            prefetch_poll_ms=get_int(options, "prefetchPollMs", 20, minimum=1, maximum=10_000),
            security=Security.parse(options),
        )

    def links(self) -> tuple[BrokerAddress, ...]:
        return brokers_of(self.brokers, self.hosts)

    @property
    def addresses(self) -> list[str]:
        return [b.name for b in self.links()]


def _trigger_limits(options: Mapping[str, str]) -> tuple[int, int, float]:
    """maxJobsPerTrigger, minJobsPerTrigger, maxTriggerDelay (seconds): the admission rules, checked together."""
    max_jobs = get_int(options, "maxJobsPerTrigger", 20000, minimum=0)
    min_jobs = get_int(options, "minJobsPerTrigger", 0, minimum=0)
    max_delay = get_duration(options, "maxTriggerDelay", "15m")
    if max_delay <= 0:
        raise OptionError(f"option maxTriggerDelay={max_delay:g}s must be above 0")
    if min_jobs and max_jobs and min_jobs > max_jobs:
        raise OptionError(f"option minJobsPerTrigger={min_jobs} is above maxJobsPerTrigger={max_jobs}: "
                          "no batch could ever satisfy both")
    if not min_jobs and _lower_keys(options).get("maxtriggerdelay") not in (None, ""):
        raise OptionError("option maxTriggerDelay only applies with minJobsPerTrigger > 0")
    return max_jobs, min_jobs, max_delay


def _check_dead_letter_path(path: str) -> None:
    """A local deadLetterPath is a directory (created when a row is refused): refuse, at parse
    time, one that cannot become one, instead of failing a task when its first bad row arrives.

    Only a file where the directory or one of its parents must be is refused: whether the
    executors may write there is theirs to find out (they may run elsewhere, as another user).
    URIs (``scheme://``) are left to their file system.
    """
    if not path or "://" in path:
        return
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent
    if not os.path.isdir(current):
        raise OptionError(f"option deadLetterPath={path!r}: {current} exists and is not a directory")


# --- Writer options (beanstalk_put, df.write.format("beanstalk")) -------------------------
# Read by the writers; see spark_beanstalk/writer.py.

#: Spark conf prefix: ``spark.beanstalk.<option>`` sets a writer option's default.
WRITER_CONF_PREFIX = "spark.beanstalk."

MAX_U32 = 2**32 - 1
RECONNECT_FIRST = 0.1   # seconds: the first pause before a lost broker is tried again (source and writer)
RECONNECT_MAX = 5.0     # seconds: the longest, after doubling from the first

# Keys Spark itself may put into a sink's option map; accepted and ignored.
_SPARK_PASSED_KEYS = {"path", "checkpointLocation", "queryName"}


@dataclass(frozen=True)
class WriterOptions:
    """Options of the beanstalk writers (foreachBatch ``beanstalk_put`` and the data source sinks).

    Precedence: explicit options > ``spark.beanstalk.<key>`` Spark conf > defaults below.
    """

    hosts: tuple[tuple[str, int], ...] = (("127.0.0.1", 11300),)
    tube: str = "default"
    priority: int = 2**31
    delay: int = 0
    ttr: int = 120
    key_column: str | None = None
    distribution: str = "roundrobin"          # "hash" (by keyColumn) or "roundrobin"
    dead_letter_path: str | None = None       # bad rows go here (JSON lines) instead of failing
    validate: str = "partition"               # "partition" or "batch" (foreachBatch: pre-pass)
    max_job_size: int = 0                     # 0: ask the servers (stats max-job-size)
    window: int = 1024                        # unanswered puts per connection
    timeout: float = 30.0                     # socket read timeout, seconds
    connect_timeout: float = 5.0
    retries: int = 2                          # extra rounds when every host is unavailable
    retry_interval: float = RECONNECT_FIRST   # seconds between those rounds (first backoff step)
    broker_retry_seconds: float = 180.0       # keep reconnecting this long when every host is down; 0: fail fast
    dedup: bool = True                        # skip a batch id whose completion marker exists
    writer_id: str | None = None              # marker namespace; default: the streaming query id
    marker_retain: int = 1000                 # accepted, no longer used: only the last completed batch is skipped
    arrow: bool = True                        # data source: Arrow writer variants
    security: Security = Security()           # tls, caFile, certFile, keyFile, authTokenFile
    brokers: tuple[BrokerAddress, ...] = ()   # from `hosts`: logical brokers (a cluster: is one); see links()

    KEYS = ("hosts", "tube", "priority", "delay", "ttr", "keyColumn", "distribution",
            "deadLetterPath", "validate", "maxJobSize", "window", "timeout", "connectTimeout",
            "retries", "retryInterval", "brokerRetrySeconds", "dedup", "writerId", "markerRetain",
            "arrow") + Security.KEYS

    @classmethod
    def conf_defaults(cls, conf: Mapping[str, str] | None) -> dict[str, str]:
        """``spark.beanstalk.<key>`` entries of a Spark conf mapping, as writer option keys."""
        known = {k.lower(): k for k in cls.KEYS}
        out: dict[str, str] = {}
        for key, value in (conf or {}).items():
            k = str(key)
            if k.lower().startswith(WRITER_CONF_PREFIX):
                name = k[len(WRITER_CONF_PREFIX):]
                if name.lower() in known:
                    out[known[name.lower()]] = value
        return out

    @classmethod
    def parse(cls, options: Mapping[str, str] | None, conf: Mapping[str, str] | None = None) -> WriterOptions:
        """Validate writer options; ``conf`` (a Spark conf mapping) supplies defaults."""
        explicit = {str(k): ("" if v is None else str(v)) for k, v in (options or {}).items()}
        check_known({k: v for k, v in explicit.items() if k.lower() not in {p.lower() for p in _SPARK_PASSED_KEYS}},
                    set(cls.KEYS), "beanstalk writer")
        merged = _lower_keys(cls.conf_defaults(conf))
        merged.update(_lower_keys(explicit))
        o = merged
        key_column = get_str(o, "keyColumn", "") or None
        distribution = get_str(o, "distribution", "hash" if key_column else "roundrobin").lower().replace("-", "")
        if distribution not in ("hash", "roundrobin"):
            raise OptionError(f"option distribution={distribution!r}: allowed values are hash, roundrobin")
        if distribution == "hash" and not key_column:
            raise OptionError("option distribution=hash needs keyColumn (the column whose value picks the broker)")
        validate = get_str(o, "validate", "partition").lower()
        if validate not in ("partition", "batch"):
            raise OptionError(f"option validate={validate!r}: allowed values are partition, batch")
        tube = get_str(o, "tube", "default")
        try:
            check_tube_name(tube)
        except OptionError as exc:
            raise OptionError(f"option tube: {exc}") from None
        brokers = get_brokers(o, "hosts", "127.0.0.1:11300")
        return cls(
            hosts=first_members(brokers),
            brokers=brokers,
            tube=tube,
            priority=get_int(o, "priority", 2**31, 0, MAX_U32),
            delay=get_int(o, "delay", 0, 0, MAX_U32),
            ttr=get_int(o, "ttr", 120, 0, MAX_U32),
            key_column=key_column,
            distribution=distribution,
            dead_letter_path=get_str(o, "deadLetterPath", "", check=_check_dead_letter_path) or None,
            validate=validate,
            max_job_size=get_int(o, "maxJobSize", 0, 0),
            window=get_int(o, "window", 1024, 1, 1_000_000),
            timeout=get_float(o, "timeout", 30.0, 0.001),
            connect_timeout=get_float(o, "connectTimeout", 5.0, 0.001),
            retries=get_int(o, "retries", 2, 0, 1000),
            retry_interval=get_float(o, "retryInterval", RECONNECT_FIRST, 0.0),
            broker_retry_seconds=get_float(o, "brokerRetrySeconds", 180.0, 0.0),
            dedup=get_bool(o, "dedup", True),
            writer_id=get_str(o, "writerId", "") or None,
            marker_retain=get_int(o, "markerRetain", 1000, 1),
            arrow=get_bool(o, "arrow", True),
            security=Security.parse(o),
        )

    def links(self) -> tuple[BrokerAddress, ...]:
        return brokers_of(self.brokers, self.hosts)

    def host_names(self) -> list[str]:
        return [b.name for b in self.links()]
