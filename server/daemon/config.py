"""kvdepotd's configuration: flags over environment over a TOML file over
defaults, read by the table of server/daemon/options.py into frozen groups
(config.pool.size, config.copy.mode, config.limits.max_tp_size...)."""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field, replace

from kvdepot import defaults
from kvdepot.defaults import default_socket_path
from kvdepot.pool_parts import MAX_PARTS
from kvdepot.server.core.limits import Limits
from kvdepot.server.core.tenants import (
    TenantConfigError,
    TenantSpec,
    parse_admin_uids,
    parse_tenants,
    scope_remote_secrets,
)
from kvdepot.server.daemon.metrics import parse_listen
from kvdepot.server.daemon.options import BY_KEY, COMPUTED, OPTIONS, Option, build_parser
from kvdepot.server.host.numa import parse_node_list
from kvdepot.server.tiers.remote_store import RemoteConfigError, remote_spec
from kvdepot.settings import ConfigError, parse_duration, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["ConfigError", "DaemonConfig", "describe", "load_config", "parse_size"]

# The copy kernel keeps a chunk in registers (4 bytes a lane, 128 threads):
# 32 KiB is 64 a thread, where 16 KiB, the default, is 32. Beyond that it would
# spill to local memory, which the daemon does not reserve (the CUDA transport
# sets the per-thread stack to 0).
MAX_COPY_CHUNK_BYTES = 32 << 10


@dataclass(frozen=True)
class Network:
    listen: str
    auth_token_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_client_ca_file: str | None
    admin_uids: str


@dataclass(frozen=True)
class Pool:
    size: int
    slot_size: int
    dir: str
    eviction: str
    pin: str
    pin_threads: int
    pin_chunk_bytes: int
    numa: str
    files: int


@dataclass(frozen=True)
class Tiers:
    disk_dir: str | None
    disk_size: int
    remote: str | None
    remote_user: str | None
    remote_password_file: str | None
    remote_ca_file: str | None
    remote_prefix: str
    remote_timeout: float


@dataclass(frozen=True)
class Copy:
    mode: str
    staging_bytes: int
    spin_bytes: int
    chunk_bytes: int
    programs: int
    lane: str


@dataclass(frozen=True)
class Metrics:
    listen: str
    token_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_client_ca_file: str | None
    max_connections: int
    timeout: float


@dataclass(frozen=True)
class Logging:
    level: str
    format: str


@dataclass(frozen=True)
class Lifecycle:
    config_file: str | None
    fresh: bool
    kept_pool_max_age: float
    kept_pools_max_bytes: int
    drain_timeout: float


GROUP_TYPES = {
    "network": Network, "pool": Pool, "tiers": Tiers, "copy": Copy, "metrics": Metrics,
    "logging": Logging, "lifecycle": Lifecycle, "limits": Limits,
}  # fmt: skip


@dataclass(frozen=True)
class DaemonConfig:
    network: Network
    pool: Pool
    tiers: Tiers
    copy: Copy
    metrics: Metrics
    logging: Logging
    lifecycle: Lifecycle
    limits: Limits
    # Read from network.auth_token_file when the configuration is loaded; never logged.
    auth_token: str | None = field(default=None, repr=False)
    # The configuration file's [[tenant]] tables (server/core/tenants.py); their tokens are never logged.
    tenants: tuple[TenantSpec, ...] = field(default=(), repr=False)
    admin_uids: frozenset[int] = frozenset()
    # Read from metrics.token_file when the configuration is loaded; never logged.
    metrics_token: str | None = field(default=None, repr=False)

    def value(self, key: str):
        """An option's value by its key (pool_size), as the table names it."""
        opt = BY_KEY[key]
        return getattr(getattr(self, opt.group), opt.attribute)


def load_config(argv: list[str] | None = None, environ: dict | None = None) -> DaemonConfig:
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    config_file = _resolve(BY_KEY["config"], args, environ, {}, None)
    from_file = _read_file(config_file) if config_file else {}
    groups: dict[str, dict] = {group: {} for group in GROUP_TYPES}
    for opt in OPTIONS:
        groups[opt.group][opt.attribute] = _resolve(opt, args, environ, from_file, config_file)
    if groups["network"]["listen"] is None:
        groups["network"]["listen"] = default_socket_path()
    config = DaemonConfig(**{group: GROUP_TYPES[group](**values) for group, values in groups.items()})
    _check(config)
    token = read_token(config.network.auth_token_file) if config.network.auth_token_file else None
    metrics_token = read_token(config.metrics.token_file) if config.metrics.token_file else None
    try:
        admins = parse_admin_uids(config.network.admin_uids)
        tenants = parse_tenants(from_file.get("tenant", []), config_file or "the configuration")
        scope_remote_secrets(tenants)
    except TenantConfigError as e:
        raise ConfigError(str(e)) from None
    return replace(
        config, auth_token=token, tenants=tuple(tenants), admin_uids=admins, metrics_token=metrics_token
    )


def _read_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            from_file = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
    known = {opt.key for opt in OPTIONS if opt.in_file} | {"tenant"}
    unknown = sorted(set(from_file) - known)
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return from_file


def _resolve(opt: Option, args, environ, from_file: dict, config_file: str | None):
    value, source = getattr(args, opt.key), opt.flag
    if opt.is_switch:
        return bool(value)
    # An empty variable is unset, as in shells' ${VAR:-default}.
    if value is None and opt.env and environ.get(opt.env, "") != "":
        value, source = environ[opt.env], opt.env
    if value is None and opt.in_file and opt.key in from_file:
        value, source = from_file[opt.key], f"{config_file}: {opt.key}"
    if value is None:
        value, source = opt.default, "default"
    if value is None or value is COMPUTED:
        return None
    try:
        if opt.size:
            return parse_size(value)
        value = parse_duration(value) if opt.duration else opt.kind(value)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (TypeError, ValueError):
        wanted = {int: "a whole number", float: "a number"}.get(opt.kind, f"a {opt.kind.__name__}")
        raise ConfigError(f"{source}: {value!r} is not a valid {opt.key}: it must be {wanted}") from None
    if isinstance(value, float) and not math.isfinite(value):
        # nan passes every comparison a range check makes; inf overflows the timers it reaches.
        raise ConfigError(f"{source}: {value!r} is not a valid {opt.key}: it must be a finite number")
    if opt.choices and value not in opt.choices:
        raise ConfigError(f"{source}: {opt.key} must be one of {', '.join(opt.choices)}")
    return value


def read_token(path: str) -> str:
    try:
        return defaults.read_token(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check(config: DaemonConfig) -> None:
    pool, net, copy = config.pool, config.network, config.copy
    if pool.slot_size < 64:
        raise ConfigError(f"slot_size {pool.slot_size} is too small (at least 64 bytes)")
    if pool.size < pool.slot_size:
        raise ConfigError(f"pool_size {pool.size} is smaller than one slot ({pool.slot_size} bytes)")
    if pool.pin_threads < 0:
        raise ConfigError("pin_threads must be 0 (automatic) or more")
    if not 0 <= pool.files <= MAX_PARTS:
        raise ConfigError(f"pool_files must be 0 (automatic) to {MAX_PARTS}")
    if pool.numa not in ("auto", "off"):
        try:
            parse_node_list(pool.numa)
        except ValueError as e:
            raise ConfigError(f"numa must be auto, off or a list of NUMA nodes like 0,1: {e}") from None
    if (net.tls_cert_file is None) != (net.tls_key_file is None):
        raise ConfigError("tls_cert_file and tls_key_file go together: give both or neither")
    if net.tls_client_ca_file and not net.tls_cert_file:
        raise ConfigError("tls_client_ca_file needs TLS: give tls_cert_file and tls_key_file too")
    try:
        parse_listen(config.metrics.listen)
    except ValueError as e:
        raise ConfigError(f"metrics_listen: {e}") from None
    if config.lifecycle.kept_pool_max_age < 0 or config.lifecycle.kept_pools_max_bytes < 0:
        raise ConfigError("kept_pool_max_age and kept_pools_max_bytes must not be negative")
    metrics = config.metrics
    if (metrics.tls_cert_file is None) != (metrics.tls_key_file is None):
        raise ConfigError("metrics_tls_cert_file and metrics_tls_key_file go together: give both or neither")
    if metrics.tls_client_ca_file and not metrics.tls_cert_file:
        raise ConfigError("metrics_tls_client_ca_file needs HTTPS: give metrics_tls_cert_file and metrics_tls_key_file")
    if config.metrics.max_connections < 1:
        raise ConfigError(f"metrics_max_connections must be at least 1, not {config.metrics.max_connections}")
    if not 0 < config.metrics.timeout <= MAX_TIMEOUT:
        raise ConfigError(f"metrics_timeout must be more than 0 seconds and at most {MAX_TIMEOUT:.0f}")
    if not 0 <= config.lifecycle.drain_timeout <= MAX_TIMEOUT:
        raise ConfigError(f"drain_timeout must be 0 to {MAX_TIMEOUT:.0f} seconds")
    chunk = copy.chunk_bytes
    if chunk < 64 or chunk > MAX_COPY_CHUNK_BYTES or chunk & (chunk - 1):
        raise ConfigError(f"copy_chunk_bytes must be a power of two from 64 to {MAX_COPY_CHUNK_BYTES}, not {chunk}")
    if copy.programs < 0:
        raise ConfigError("copy_programs must be 0 (automatic) or more")
    if bool(config.tiers.disk_dir) != (config.tiers.disk_size > 0):
        raise ConfigError("disk_dir and disk_size go together: give both (a folder and its size) or neither")
    _check_remote(config.tiers)
    _check_limits(config.limits)
    if copy.mode == "dma" and pool.pin != "off" and copy.staging_bytes < pool.slot_size:
        raise ConfigError(
            f"staging_bytes ({copy.staging_bytes}) must hold at least one pool slot ({pool.slot_size} bytes)"
        )


def _check_remote(tiers: Tiers) -> None:
    if not tiers.remote:
        for key in ("remote_user", "remote_password_file", "remote_ca_file"):
            if getattr(tiers, key):
                raise ConfigError(f"{key} needs remote (the store's URL)")
        return
    try:
        remote_spec(tiers)  # the URL parsed and the files read, before anything starts
    except RemoteConfigError as e:
        raise ConfigError(str(e)) from None
    if not 0 < tiers.remote_timeout <= 10:
        # A Lookup waits for the store: past 10 s engines' calls time out first.
        raise ConfigError(f"remote_timeout must be more than 0 and at most 10 seconds, not {tiers.remote_timeout}")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", tiers.remote_prefix):
        raise ConfigError("remote_prefix must be 1-64 letters, digits, '.', '_' or '-'")
    if tiers.remote_user and not tiers.remote_password_file:
        raise ConfigError("remote_user needs remote_password_file")


# The longest timeout in seconds: gRPC takes its timeouts in milliseconds as a 32-bit number.
MAX_TIMEOUT = 86400.0

# Limits that mean "automatic" at 0; every other integer limit is at least 1.
_AUTOMATIC_AT_ZERO = {"max_queued_notification_keys"}


def _check_limits(limits: Limits) -> None:
    for opt in OPTIONS:
        if opt.group != "limits" or opt.kind is float:
            continue
        value = getattr(limits, opt.attribute)
        if opt.key in _AUTOMATIC_AT_ZERO:
            if value < 0:
                raise ConfigError(f"{opt.key} must be 0 (automatic) or more")
        elif value < 1:
            raise ConfigError(f"{opt.key} must be at least 1, not {value}")
    for key in ("job_hello_timeout", "grpc_handshake_timeout", "grpc_idle_timeout"):
        if not 0 < getattr(limits, key) <= MAX_TIMEOUT:
            raise ConfigError(f"{key} must be more than 0 seconds and at most {MAX_TIMEOUT:.0f}")
    if not 1 << 20 <= limits.max_unread_job_replies <= 1 << 40:
        raise ConfigError(
            f"max_unread_job_replies must be at least 1MiB and at most 1TiB, not {limits.max_unread_job_replies}"
        )
    if not defaults.MAX_JOB_FRAME_BYTES <= limits.max_job_frame_bytes_per_uid <= 1 << 40:
        raise ConfigError(
            f"max_job_frame_bytes_per_uid must be at least 64MiB (the longest frame) and at most 1TiB, "
            f"not {limits.max_job_frame_bytes_per_uid}"
        )


def describe(config: DaemonConfig) -> dict:
    """The configuration for the log, by option key: everything but tokens."""
    described = {opt.key: config.value(opt.key) for opt in OPTIONS}
    described["tenants"] = [t.name for t in config.tenants]
    return described
