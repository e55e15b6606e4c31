"""kvdepotd's configuration: flags over environment over a TOML file over defaults."""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field, fields

from kvdepot import defaults
from kvdepot.defaults import default_socket_path
from kvdepot.server.daemon.metrics import parse_listen
from kvdepot.server.core.tenants import TenantConfigError, parse_admin_uids, parse_tenants

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message says which and why."""


# The copy kernel keeps a chunk in registers (4 bytes a lane, 128 threads):
# 32 KiB is 64 a thread, where 16 KiB, the default, is 32. Beyond that it would
# spill to local memory, which the daemon does not reserve (the CUDA transport
# sets the per-thread stack to 0).
MAX_COPY_CHUNK_BYTES = 32 << 10

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """'64GiB', '512MiB', '1.5G', '4096' -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"{text!r} is not a size; write e.g. 64GiB, 512MiB or 4096")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


@dataclass
class Option:
    name: str
    default: object
    help: str
    kind: type = str
    choices: tuple[str, ...] | None = None
    # A byte count, written like 64GiB or 4096.
    size: bool = False

    @property
    def env(self) -> str:
        return "KVDEPOT_" + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPTIONS = [
    Option(
        "listen",
        None,
        "Where to serve: a unix socket path (default: $XDG_RUNTIME_DIR/kvdepot/kvdepot.sock, "
        "/run/kvdepot/kvdepot.sock for root, else /tmp/kvdepot-$UID/kvdepot.sock), "
        "unix:PATH, or HOST:PORT for TCP, which needs --auth-token-file.",
    ),
    Option(
        "pool_size",
        "1GiB",
        "Host memory for cached blocks, e.g. 64GiB. Allocated and (with CUDA) pinned at start.",
        size=True,
    ),
    Option(
        "slot_size",
        "2MiB",
        "Bytes of one pool slot. A slot holds one block of one TP rank (all its layers): "
        "2MiB fits Llama-3.1-8B at 16 tokens per block. A worker whose block is larger is refused.",
        size=True,
    ),
    Option(
        "pool_dir",
        "auto",
        "Folder for the pool's shared-memory file. 'auto' takes /dev/shm if it has room, else "
        "the socket's folder. Containers often mount a small /dev/shm: raise it (--shm-size) "
        "or point this at a tmpfs or hugetlbfs mount with room.",
    ),
    Option(
        "disk_dir",
        None,
        "Folder for the disk tier (off when unset): blocks evicted from the pool are kept "
        "there, and lookups that hit them are promoted back. Needs --disk-size.",
    ),
    Option(
        "disk_size",
        "0",
        "Bytes the disk tier may take in --disk-dir (what is already there counts), e.g. 500GiB.",
        size=True,
    ),
    Option(
        "eviction",
        "lru",
        "What to drop when the pool is full: lru (least recently used) or arc (adaptive "
        "replacement: blocks used twice outlive scans of blocks used once).",
        choices=("lru", "arc"),
    ),
    Option(
        "pin",
        "auto",
        "Register the pool with CUDA as pinned memory: auto (when CUDA is available), on "
        "(fail without CUDA) or off.",
        choices=("auto", "on", "off"),
    ),
    Option(
        "pin_threads",
        0,
        "Threads that fault in and pin the pool at start; 0 means one per core, at most 16.",
        kind=int,
    ),
    Option(
        "auth_token_file",
        None,
        "File holding the token that TCP clients must send (authorization: Bearer TOKEN). "
        "Required for TCP; ignored on unix sockets, whose file permissions decide who connects.",
    ),
    Option(
        "tls_cert_file",
        None,
        "PEM certificate chain the daemon presents on TCP. TCP other than loopback needs TLS, "
        "so that tokens never travel in clear.",
    ),
    Option("tls_key_file", None, "PEM private key of --tls-cert-file."),
    Option(
        "tls_client_ca_file",
        None,
        "PEM CA certificates: TCP clients must present a certificate they signed. A tenant's "
        "cert_names then name its clients without a token.",
    ),
    Option(
        "admin_uids",
        "",
        "Uids whose unix-socket clients may see every tenant's stats and clear every namespace, "
        "separated by commas; empty: root and the daemon's own user. Tenants are set in the "
        "configuration file ([[tenant]] tables, see the README's security section).",
    ),
    Option(
        "metrics_listen",
        "127.0.0.1:9400",
        "HOST:PORT where the daemon serves Prometheus metrics (/metrics over HTTP), or none. "
        "They name every tenant's namespaces: expose them off localhost only behind protection.",
    ),
    Option(
        "drain_timeout",
        30.0,
        "Seconds SIGTERM waits for jobs in flight before the daemon exits anyway.",
        kind=float,
    ),
    Option(
        "log_level",
        "info",
        "debug, info, warning or error.",
        choices=("debug", "info", "warning", "error"),
    ),
    Option(
        "log_format",
        "text",
        "text (for people) or json (one object a line, for log collectors).",
        choices=("text", "json"),
    ),
    # Tuning of the CUDA transport (docs/benchmarks.md has the measurements
    # behind each default).
    Option(
        "copy_mode",
        "dma",
        "How CUDA copies cross PCIe: dma (a kernel gathers a job's pages into GPU staging "
        "buffers, or scatters them from there, and the copy engines move whole runs of slots) "
        "or kernel (a kernel reads and writes the pinned pool itself; it slows the engine's own "
        "kernels far more).",
        choices=("dma", "kernel"),
    ),
    Option(
        "staging_bytes",
        "128MiB",
        "Size of each of the four GPU staging buffers of the dma mode (two per direction). "
        "Smaller buffers leave the engine more GPU memory and lower the rate of stores and "
        "loads running together.",
        size=True,
    ),
    Option(
        "spin_bytes",
        "64MiB",
        "A CUDA job of up to this many bytes that finds its stream idle is waited for by "
        "spinning a core rather than sleeping, which shortens small jobs; 0: never spin.",
        size=True,
    ),
    Option(
        "copy_chunk_bytes",
        "16KiB",
        "Bytes one program of the copy kernel moves at a time (a power of two from 64 to 32KiB; "
        "more would spill the kernel's registers to memory the daemon does not reserve).",
        size=True,
    ),
    Option(
        "copy_programs",
        0,
        "Programs the copy kernel launches; 0: one per SM for copies over PCIe, two per SM "
        "for gathers into staging buffers.",
        kind=int,
    ),
    Option(
        "pin_chunk_bytes",
        "1GiB",
        "The pool is registered with CUDA in pieces of this size (rounded down to whole "
        "slots, at least one); one DMA copy never crosses two of them.",
        size=True,
    ),
    # Limits on registrations, jobs and namespaces: what one client can make
    # the daemon hold. Each default is far above what a real node's engines
    # need (dozens of engines, TP up to 8, hundreds of layers, thousands of
    # jobs in flight); a client past one gets an error naming the option.
    Option(
        "max_engines_per_session",
        64,
        "Engines (RegisterEngine) one session may register; each gets every block change of its "
        "namespace. More: RESOURCE_EXHAUSTED.",
        kind=int,
    ),
    Option(
        "max_workers_per_session",
        64,
        "Workers (RegisterWorker) one session may register. More: RESOURCE_EXHAUSTED.",
        kind=int,
    ),
    Option(
        "max_jobs_per_session",
        4096,
        "Stores and loads one session may have in flight. More: RESOURCE_EXHAUSTED until some finish.",
        kind=int,
    ),
    Option(
        "max_tp_size",
        64,
        "Largest tensor-parallel size a namespace may declare. More: INVALID_ARGUMENT.",
        kind=int,
    ),
    Option(
        "max_tensors_per_worker",
        1024,
        "KV-cache tensors one worker may register (two per layer is the most real layouts use). "
        "More: INVALID_ARGUMENT.",
        kind=int,
    ),
    Option(
        "max_name_length",
        512,
        "Characters of a client's names: namespace fields, device, tensor names. Longer: INVALID_ARGUMENT.",
        kind=int,
    ),
    Option(
        "max_namespaces",
        1024,
        "Namespaces the daemon holds at once (one is freed when no engine or worker is registered "
        "in it and it holds no block). More: RESOURCE_EXHAUSTED.",
        kind=int,
    ),
    Option(
        "max_shm_worker_bytes",
        "256GiB",
        "The largest memory a shared-memory worker (a CPU engine) may hand the daemon to copy "
        "through: its KV cache's size. The daemon maps it. Larger: INVALID_ARGUMENT.",
        size=True,
    ),
    Option(
        "max_namespaces_per_tenant",
        128,
        "Namespaces one tenant (or sharing group) may hold at once, so that no tenant can take "
        "the daemon's --max-namespaces from the others. More: RESOURCE_EXHAUSTED.",
        kind=int,
    ),
    Option(
        "max_sessions_per_uid",
        256,
        "Sessions one user id (on TCP: one tenant) may have at once; an engine has one to three. "
        "More: the hello (or Attach) is refused with RESOURCE_EXHAUSTED.",
        kind=int,
    ),
    Option(
        "max_unproven_sessions",
        256,
        "Sessions that have attached but not yet said hello, at once (each ends at "
        "--job-hello-timeout anyway). More: Attach is refused with RESOURCE_EXHAUSTED.",
        kind=int,
    ),
    Option(
        "stats_max_entries",
        256,
        "Namespaces, and clients, that one stats answer lists at most (the busiest); the rest are "
        "counted (namespaces_omitted, clients_omitted).",
        kind=int,
    ),
    # Limits on what one client can make the daemon hold (connections, notifications)
    Option(
        "max_queued_notification_keys",
        0,
        "Block keys of notifications (a job's end counts one) that may wait for one session's "
        "Attach stream to read them; a session further behind (a stopped or hung client) is "
        "ended. 0: twice the pool's slots (a snapshot of a full pool fits), at least 524288 "
        "(a queue that full holds about 55 MiB).",
        kind=int,
    ),
    Option(
        "max_job_connections",
        1024,
        "Job socket connections open at once; more are refused (a refused client cannot use its "
        "session, and tries again).",
        kind=int,
    ),
    Option(
        "max_job_connections_per_uid",
        512,
        "Job socket connections open at once from processes of one user id (from the kernel).",
        kind=int,
    ),
    Option(
        "job_hello_timeout",
        10.0,
        "Seconds a new job socket connection has to say hello before it is closed.",
        kind=float,
    ),
    Option(
        "max_unread_job_replies",
        "16MiB",
        "Replies a job socket connection may leave unread before it is closed. Past 256 KiB "
        "the daemon already stops reading that connection's requests until it reads.",
        size=True,
    ),
]


# The integer limits; each must be at least 1.
LIMITS = (
    "max_engines_per_session",
    "max_workers_per_session",
    "max_jobs_per_session",
    "max_tp_size",
    "max_tensors_per_worker",
    "max_name_length",
    "max_namespaces",
    "max_namespaces_per_tenant",
    "max_sessions_per_uid",
    "max_unproven_sessions",
    "stats_max_entries",
)


@dataclass
class DaemonConfig:
    listen: str
    pool_size: int
    slot_size: int
    pool_dir: str
    eviction: str
    pin: str
    pin_threads: int
    auth_token_file: str | None
    metrics_listen: str
    drain_timeout: float
    log_level: str
    log_format: str
    copy_mode: str
    staging_bytes: int
    spin_bytes: int
    copy_chunk_bytes: int
    copy_programs: int
    pin_chunk_bytes: int
    max_engines_per_session: int
    max_workers_per_session: int
    max_jobs_per_session: int
    max_tp_size: int
    max_tensors_per_worker: int
    max_name_length: int
    max_namespaces: int
    max_namespaces_per_tenant: int
    max_sessions_per_uid: int
    max_unproven_sessions: int
    max_shm_worker_bytes: int
    stats_max_entries: int
    max_queued_notification_keys: int
    max_job_connections: int
    max_job_connections_per_uid: int
    job_hello_timeout: float
    max_unread_job_replies: int
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    admin_uids: str = ""
    disk_dir: str | None = None
    disk_size: int = 0
    # --fresh: start empty, discarding the kept pool and the disk tier's segments.
    fresh: bool = False
    # Read from auth_token_file when the configuration is loaded; never logged.
    auth_token: str | None = field(default=None, repr=False)
    # The configuration file's [[tenant]] tables (server/core/tenants.py); their tokens are never logged.
    tenants: list = field(default_factory=list, repr=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvdepotd",
        description=(
            "kvdepot daemon: keeps LLM KV-cache blocks in host memory for the inference "
            "engines of this node. Every option can also be set in the environment "
            "(KVDEPOT_<OPTION>, e.g. KVDEPOT_POOL_SIZE) or in a TOML file (--config); "
            "flags win over the environment, which wins over the file."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--config",
        default=os.environ.get("KVDEPOT_CONFIG"),
        help="TOML file with options by their long names, e.g. pool_size = \"64GiB\" "
        "(also $KVDEPOT_CONFIG).",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="Start with an empty cache: discard the pool a previous daemon on this address "
        "left (which it adopts otherwise) and the disk tier's segments.",
    )
    for opt in OPTIONS:
        parser.add_argument(
            opt.flag,
            dest=opt.name,
            default=None,
            choices=opt.choices,
            type=opt.kind if opt.kind is not str else None,
            help=f"{opt.help} [env {opt.env}; default {opt.default}]",
        )
    return parser


def load_config(argv: list[str] | None = None, environ: dict | None = None) -> DaemonConfig:
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    from_file: dict = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                from_file = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {args.config}: {e.strerror}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {args.config} is not valid TOML: {e}") from e
        known = {opt.name for opt in OPTIONS} | {"tenant"}
        unknown = sorted(set(from_file) - known)
        if unknown:
            raise ConfigError(
                f"config file {args.config}: unknown option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
    values: dict = {}
    for opt in OPTIONS:
        value = getattr(args, opt.name)
        source = opt.flag
        # An empty variable is unset, as in shells' ${VAR:-default}.
        if value is None and environ.get(opt.env, "") != "":
            value, source = environ[opt.env], opt.env
        if value is None and opt.name in from_file:
            value, source = from_file[opt.name], f"{args.config}: {opt.name}"
        if value is None:
            value, source = opt.default, "default"
        values[opt.name] = _convert(opt, value, source)
    if values["listen"] is None:
        values["listen"] = default_socket_path()
    config = DaemonConfig(**values, fresh=args.fresh)
    _check(config)
    if config.auth_token_file:
        config.auth_token = read_token(config.auth_token_file)
    try:
        parse_admin_uids(config.admin_uids)
        config.tenants = parse_tenants(from_file.get("tenant", []), args.config or "the configuration")
    except TenantConfigError as e:
        raise ConfigError(str(e)) from None
    return config


def read_token(path: str) -> str:
    try:
        return defaults.read_token(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _convert(opt: Option, value, source: str):
    if value is None:
        return None
    try:
        if opt.size:
            return parse_size(value)
        value = opt.kind(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {value!r} is not a valid {opt.name}: {e}") from e
    if opt.choices and value not in opt.choices:
        raise ConfigError(f"{source}: {opt.name} must be one of {', '.join(opt.choices)}")
    return value


def _check(config: DaemonConfig) -> None:
    if config.slot_size < 64:
        raise ConfigError(f"slot_size {config.slot_size} is too small (at least 64 bytes)")
    if config.pool_size < config.slot_size:
        raise ConfigError(
            f"pool_size {config.pool_size} is smaller than one slot ({config.slot_size} bytes)"
        )
    if config.pin_threads < 0:
        raise ConfigError("pin_threads must be 0 (automatic) or more")
    if (config.tls_cert_file is None) != (config.tls_key_file is None):
        raise ConfigError("tls_cert_file and tls_key_file go together: give both or neither")
    if config.tls_client_ca_file and not config.tls_cert_file:
        raise ConfigError("tls_client_ca_file needs TLS: give tls_cert_file and tls_key_file too")
    try:
        parse_listen(config.metrics_listen)
    except ValueError as e:
        raise ConfigError(f"metrics_listen: {e}") from None
    if config.drain_timeout < 0:
        raise ConfigError("drain_timeout must not be negative")
    chunk = config.copy_chunk_bytes
    if chunk < 64 or chunk > MAX_COPY_CHUNK_BYTES or chunk & (chunk - 1):
        raise ConfigError(f"copy_chunk_bytes must be a power of two from 64 to {MAX_COPY_CHUNK_BYTES}, not {chunk}")
    if config.copy_programs < 0:
        raise ConfigError("copy_programs must be 0 (automatic) or more")
    for name in LIMITS:
        if getattr(config, name) < 1:
            raise ConfigError(f"{name} must be at least 1, not {getattr(config, name)}")
    if bool(config.disk_dir) != (config.disk_size > 0):
        raise ConfigError("disk_dir and disk_size go together: give both (a folder and its size) or neither")
    if config.max_shm_worker_bytes < 1:
        raise ConfigError("max_shm_worker_bytes must be at least 1 byte")
    _check_limits(config)
    if config.copy_mode == "dma" and config.pin != "off" and config.staging_bytes < config.slot_size:
        raise ConfigError(
            f"staging_bytes ({config.staging_bytes}) must hold at least one pool slot ({config.slot_size} bytes)"
        )


def _check_limits(config: DaemonConfig) -> None:
    if config.max_queued_notification_keys < 0:
        raise ConfigError("max_queued_notification_keys must be 0 (automatic) or more")
    if config.max_job_connections < 1 or config.max_job_connections_per_uid < 1:
        raise ConfigError("max_job_connections and max_job_connections_per_uid must be at least 1")
    if config.job_hello_timeout <= 0:
        raise ConfigError("job_hello_timeout must be more than 0 seconds")
    if config.max_unread_job_replies < 1 << 20:
        raise ConfigError(f"max_unread_job_replies must be at least 1MiB, not {config.max_unread_job_replies}")


def describe(config: DaemonConfig) -> dict:
    """The configuration for the log: everything but the token."""
    described = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in ("auth_token", "tenants")}
    described["tenants"] = [t.name for t in config.tenants]
    return described
