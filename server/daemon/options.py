"""Every option of kvdepotd, declared once: its flag, environment variable,
TOML key, type, default, help and group. Argument parsing, the environment,
the TOML file (config.py) and the option tables of the docs are all made from
OPTIONS.

    python -m kvdepot.server.daemon.options_doc --write   # rewrites the docs' marked tables
    python -m kvdepot.server.daemon.options_doc --markdown  # prints the table
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from kvdepot.server.core.limits import Limits
from kvdepot.settings import format_size

# A default that the daemon works out when it starts (listen: from the user).
COMPUTED = object()

_LIMIT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Limits)}


@dataclass(frozen=True)
class Option:
    # The TOML key; the flag and the environment variable are made from it.
    key: str
    group: str
    default: object
    help: str
    kind: type = str
    choices: tuple[str, ...] | None = None
    # A byte count, written like 64GiB or 4096.
    size: bool = False
    # Seconds, written like 6h, 30m or 45.
    duration: bool = False
    # The attribute in its group (config.pool.size); the key when None.
    field: str | None = None
    # Read from the TOML file; flags that only make sense on one command line are not.
    in_file: bool = True
    # Read from the environment (KVDEPOT_<KEY>) unless False.
    in_environment: bool = True
    # The docs' default column where the default is not a value.
    shown_default: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str | None:
        return "KVDEPOT_" + self.key.upper() if self.in_environment else None

    @property
    def attribute(self) -> str:
        return self.field or self.key

    @property
    def is_switch(self) -> bool:
        return self.kind is bool

    def default_text(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None:
            return "none"
        if self.size and isinstance(self.default, int):
            return format_size(self.default)
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)


def limit(key: str, help: str, **kw) -> Option:
    """An option of the limits group; its default is core's Limits'."""
    return Option(key, "limits", _LIMIT_DEFAULTS[key], help, **kw)


# The groups of the configuration object (config.<group>.<attribute>), in the docs' order.
GROUPS = {
    "network": "Where and to whom the daemon answers",
    "pool": "The host memory pool",
    "tiers": "Tiers below the pool",
    "copy": "CUDA copies (docs/benchmarks.md has the measurements behind each default)",
    "metrics": "Metrics",
    "logging": "Logging",
    "lifecycle": "Start and stop",
    "limits": "Limits: what one client can make the daemon hold",
}

OPTIONS = [
    Option(
        "listen", "network", COMPUTED,
        "Where to serve: a unix socket path (default: $XDG_RUNTIME_DIR/kvdepot/kvdepot.sock where that "
        "folder exists, root included; else /run/kvdepot/kvdepot.sock for root, /tmp/kvdepot-$UID/kvdepot.sock "
        "for others), unix:PATH, or HOST:PORT "
        "for TCP, which needs --auth-token-file (or tenants' token_file, or client certificates). Beside a "
        "unix socket the daemon also serves its job socket, PATH.jobs, with the same permissions (0660). "
        "The socket's folder must be the daemon user's and writable by it alone (docs/security.md).",
        shown_default="per user: see what it does",
    ),
    Option(
        "auth_token_file", "network", None,
        "File holding the token that TCP clients must send (authorization: Bearer TOKEN). Required for TCP "
        "without tenants' tokens or client certificates; ignored on unix sockets, whose file permissions "
        "decide who connects; health checks need none. A file that is missing, unreadable or empty stops "
        "the daemon at start.",
    ),
    Option(
        "tls_cert_file", "network", None,
        "PEM certificate chain the daemon presents on TCP. TCP other than loopback needs TLS, so that "
        "tokens never travel in clear.",
    ),
    Option("tls_key_file", "network", None, "PEM private key of --tls-cert-file."),
    Option(
        "tls_client_ca_file", "network", None,
        "PEM CA certificates: TCP clients must present a certificate they signed. A tenant's cert_names "
        "then name its clients without a token.",
    ),
    Option(
        "admin_uids", "network", "",
        "Uids whose unix-socket clients may see every tenant's stats and clear every namespace, separated "
        "by commas; empty: root and the daemon's own user. Tenants are set in the configuration file "
        "([[tenant]] tables, see docs/security.md).",
        shown_default="root and the daemon's user",
    ),
    Option(
        "pool_size", "pool", "1GiB",
        "Host memory for cached blocks, e.g. 64GiB. Allocated and (with --pin) pinned at start, the daemon "
        "serving once the first --pin-chunk-bytes of it is up.",
        size=True, field="size",
    ),
    Option(
        "slot_size", "pool", "64KiB",
        "The pool's unit: a block of one TP rank (all its layers) takes as many consecutive slots as its "
        "bytes need, so a block wastes less than a slot. Smaller wastes less and costs more records "
        "(128 bytes a slot). A hint for a new pool: a kept pool is adopted with the slot size it has.",
        size=True,
    ),
    Option(
        "pool_dir", "pool", "auto",
        "Folder for the pool's shared-memory file. 'auto' takes /dev/shm if it has room, else the socket's "
        "folder, else /tmp. Pinning needs tmpfs or hugetlbfs: the kernel does not pin pages of disk files. Containers "
        "often mount a small /dev/shm: raise it (--shm-size) or point this at a tmpfs or hugetlbfs mount "
        "with room (on huge pages the pool faults in and pins about 3x faster).",
        field="dir",
    ),
    Option(
        "eviction", "pool", "lru",
        "What to drop when the pool is full: lru (least recently used) or arc (adaptive replacement: "
        "blocks used twice outlive scans of blocks used once). Blocks that a job in flight holds are "
        "never dropped.",
        choices=("lru", "arc"),
    ),
    Option(
        "pin", "pool", "auto",
        "Register the pool with CUDA as pinned memory: auto (when CUDA is available), on (fail without "
        "CUDA) or off.",
        choices=("auto", "on", "off"),
    ),
    Option(
        "pin_threads", "pool", 0,
        "Threads that fault in and pin the pool at start; 0 means one per core, at most 16.",
        kind=int,
    ),
    Option(
        "pool_files", "pool", 0,
        "Files the pool is kept in, striped (page faults into one tmpfs file queue on its locks, so a pool "
        "of several comes up several times faster); 0 means 16 for a pool of 4 GiB or more, else one. "
        "A pool on huge pages is one file. A kept pool is adopted with the files it has. At most 64.",
        kind=int, field="files",
    ),
    Option(
        "pin_chunk_bytes", "pool", "1GiB",
        "The pool is registered with CUDA in pieces of this size (rounded down to whole slots, at least "
        "one); one DMA copy never crosses two of them.",
        size=True,
    ),
    Option(
        "numa", "pool", "auto",
        "The pool on the machine's NUMA nodes (sysfs): auto carves it into equal ranges of slots, one per node "
        "with memory, each placed on its node, when there are two or more; a GPU's stores take slots of its "
        "node first (loads read wherever a block is). off: one undivided pool; a list (0,1 or 0-3): carved over "
        "those nodes. A hint: a placement the kernel refuses is logged, never fatal. See `kvdepot stats`.",
    ),
    Option(
        "disk_dir", "tiers", None,
        "Folder for the disk tier (off when unset): blocks evicted from the pool are kept there, and "
        "lookups that hit them are promoted back. Needs --disk-size.",
    ),
    Option(
        "disk_size", "tiers", "0",
        "Bytes the disk tier may take in --disk-dir (what is already there counts), e.g. 500GiB.",
        size=True,
    ),
    Option(
        "remote", "tiers", None,
        "A Valkey or Redis store the fleet's daemons share blocks through (off when unset): valkey://host:port "
        "(redis:// too), valkeys:// or rediss:// over TLS, valkey://host1:port1,host2:port2 (or ?cluster=1) for a "
        "cluster. Only tenants with a remote_secret_file publish and fetch. See docs/remote.md.",
    ),
    Option("remote_user", "tiers", None, "The ACL user of --remote (with --remote-password-file)."),
    Option(
        "remote_password_file", "tiers", None,
        "A file holding the password of --remote (never on the command line, where ps shows it).",
    ),
    Option("remote_ca_file", "tiers", None, "PEM CA certificates that sign a TLS --remote store's certificate."),
    Option(
        "remote_prefix", "tiers", "kvdepot",
        "What every key the daemon writes to --remote starts with (then ':' and the tenant's scope): what an "
        "operator's ACL grants (~kvdepot:*).",
    ),
    Option(
        "remote_timeout", "tiers", "0.5",
        "Seconds each call to --remote may take; one that takes longer is a miss (and counts against the store).",
        kind=float,
    ),
    Option(
        "copy_mode", "copy", "dma",
        "How CUDA copies cross PCIe: dma (a kernel gathers a job's pages into GPU staging buffers, or "
        "scatters them from there, and the copy engines move whole runs of slots) or kernel (a kernel "
        "reads and writes the pinned pool itself; it slows the engine's own kernels far more).",
        choices=("dma", "kernel"), field="mode",
    ),
    Option(
        "staging_bytes", "copy", "128MiB",
        "Size of each of the four GPU staging buffers of the dma mode (two per direction, so that the copy "
        "engine moves one chunk while a kernel fills the other). Smaller buffers leave the engine more GPU "
        "memory and lower the rate of stores and loads running together.",
        size=True,
    ),
    Option(
        "spin_bytes", "copy", "64MiB",
        "A CUDA job of up to this many bytes that finds its stream idle is waited for by spinning a core "
        "(the native lane: for 50 us once it should have ended) rather than sleeping, which shortens small "
        "jobs; 0: never spin.",
        size=True,
    ),
    Option(
        "copy_chunk_bytes", "copy", "16KiB",
        "Bytes one program of the copy kernel moves at a time (a power of two from 64 to 32KiB; more "
        "would spill the kernel's registers to memory the daemon does not reserve).",
        size=True, field="chunk_bytes",
    ),
    Option(
        "copy_programs", "copy", 0,
        "Programs the copy kernel launches; 0: one per SM for copies over PCIe, two per SM for gathers "
        "into staging buffers.",
        kind=int, field="programs",
    ),
    Option("lane", "copy", "auto", "What runs the per-job path: native (compiled: server/native, which `make native` "
           "builds), python, or auto: native where it is built and serves this configuration, else python (the "
           "log says why).", choices=("auto", "native", "python")),
    Option(
        "metrics_listen", "metrics", "127.0.0.1:9400",
        "HOST:PORT where the daemon serves Prometheus metrics (/metrics over HTTP), or none. Every scrape "
        "gets the node-wide series; each tenant's namespaces only a scrape with --metrics-token-file's token "
        "or a --metrics-tls-client-ca-file certificate.",
        field="listen",
    ),
    Option(
        "metrics_token_file", "metrics", None,
        "File holding the token a scrape sends (authorization: Bearer TOKEN) to see the per-namespace series, "
        "which name each tenant's namespaces and count their hits, misses, stores and loads. Unset (and no "
        "--metrics-tls-client-ca-file): no scrape sees them. A wrong token is answered 401. See "
        "docs/security.md.",
        field="token_file",
    ),
    Option(
        "metrics_tls_cert_file", "metrics", None,
        "PEM certificate chain: the metrics port then speaks HTTPS only, so that a token never travels in "
        "clear.",
        field="tls_cert_file",
    ),
    Option("metrics_tls_key_file", "metrics", None, "PEM private key of --metrics-tls-cert-file.",
           field="tls_key_file"),
    Option(
        "metrics_tls_client_ca_file", "metrics", None,
        "PEM CA certificates: a scrape presenting a client certificate they signed sees the per-namespace "
        "series, as one with the token does (Prometheus: tls_config cert_file and key_file). Scrapes "
        "without a certificate still get the node-wide series.",
        field="tls_client_ca_file",
    ),
    Option(
        "metrics_max_connections", "metrics", 16,
        "Connections to the metrics port open at once (one thread each). At the cap the oldest that has "
        "sent no request is closed to make room; with none such the new one is.",
        kind=int, field="max_connections",
    ),
    Option(
        "metrics_timeout", "metrics", 10.0,
        "Seconds a metrics connection may wait for each read or write before it is closed.",
        kind=float, field="timeout",
    ),
    Option("log_level", "logging", "info", "debug, info, warning or error.",
           choices=("debug", "info", "warning", "error"), field="level"),
    Option("log_format", "logging", "text", "text (for people) or json (one object a line, for log collectors).",
           choices=("text", "json"), field="format"),
    Option(
        "config", "lifecycle", None,
        "TOML file with options by their keys (the flags' names with _), e.g. pool_size = \"64GiB\", and "
        "the [[tenant]] tables.",
        field="config_file", in_file=False,
    ),
    Option(
        "fresh", "lifecycle", False,
        "Start with an empty cache: discard the pool a previous daemon on this address left (which it "
        "adopts otherwise) and the disk tier's segments.",
        kind=bool, in_file=False, in_environment=False, shown_default="off",
    ),
    Option(
        "kept_pool_max_age", "lifecycle", 6 * 3600.0,
        "How long (6h, 30m, or seconds) a pool that a stopped daemon on another address kept (for its next "
        "start to adopt) may stay "
        "in RAM: at start, the daemon discards its user's kept pools that no live daemon serves and that "
        "were kept longer, and logs each. `kvdepot pools` lists them.",
        kind=float, duration=True, shown_default="6h",
    ),
    Option(
        "kept_pools_max_bytes", "lifecycle", 0,
        "RAM that pools kept by stopped daemons on other addresses may hold together: past it, the daemon "
        "discards the oldest at start (never a pool a live daemon serves). 0: a quarter of the node's memory.",
        size=True, shown_default="a quarter of the node's memory",
    ),
    Option(
        "drain_timeout", "lifecycle", 30.0,
        "Seconds SIGTERM waits for jobs in flight before the daemon exits anyway.",
        kind=float,
    ),
    limit("max_engines_per_session",
          "Engines (RegisterEngine) one session may register; each gets every block change of its namespace. "
          "More: RESOURCE_EXHAUSTED.", kind=int),
    limit("max_workers_per_session",
          "Workers (RegisterWorker) one session may register. More: RESOURCE_EXHAUSTED.", kind=int),
    limit("max_jobs_per_session",
          "Stores and loads one session may have in flight. More: RESOURCE_EXHAUSTED until some finish.",
          kind=int),
    limit("max_tp_size", "Largest tensor-parallel size a namespace may declare. More: INVALID_ARGUMENT.", kind=int),
    limit("max_tensors_per_worker",
          "KV-cache tensors one worker may register (two per layer is the most real layouts use). "
          "More: INVALID_ARGUMENT.", kind=int),
    limit("max_name_length",
          "Characters of a client's names: namespace fields, device, tensor names. Longer: INVALID_ARGUMENT.",
          kind=int),
    limit("max_namespaces",
          "Namespaces the daemon holds at once (one is freed when no engine or worker is registered in it "
          "and it holds no block). More: RESOURCE_EXHAUSTED.", kind=int),
    limit("max_shm_worker_bytes",
          "The largest memory a shared-memory worker (a CPU engine) may hand the daemon to copy through: "
          "its KV cache's size. The daemon maps it. Larger: INVALID_ARGUMENT.", size=True),
    limit("max_staging_bytes_per_uid",
          "Staging memory (the memfds of shared-memory workers) the daemon maps at once for the processes of "
          "one user id: a memfd is charged whole when it is handed over and cut to its worker's rows when the "
          "worker registers, released when the worker or session ends. More: RESOURCE_EXHAUSTED. See "
          "docs/security.md.", size=True),
    limit("max_staging_bytes",
          "Staging memory the daemon maps at once for all users, which keeps its address space bounded "
          "whatever sparse memfds clients hand over. More: RESOURCE_EXHAUSTED.", size=True),
    limit("max_namespaces_per_tenant",
          "Namespaces one tenant (or sharing group) may hold at once, so that no tenant can take the "
          "daemon's --max-namespaces from the others. More: RESOURCE_EXHAUSTED.", kind=int),
    limit("max_sessions_per_uid",
          "Sessions one user id (on TCP: one tenant) may have at once; an engine has one to three. More: "
          "the hello (or Attach) is refused with RESOURCE_EXHAUSTED.", kind=int),
    limit("max_unproven_sessions",
          "Sessions that have attached but not yet said hello, at once (each ends at --job-hello-timeout "
          "anyway). More: the oldest of them is ended (its Attach stream ends RESOURCE_EXHAUSTED), since "
          "no identity is known before the hello and one user must not lock the others out.", kind=int),
    limit("max_waiting_registrations_per_uid",
          "Worker registrations one user id (on TCP: one tenant) may have waiting at once for a transport "
          "still coming up (the CUDA transport, for seconds after the daemon starts serving); each holds its "
          "request meanwhile. More are answered at once UNAVAILABLE 'coming up' (the client asks again).",
          kind=int),
    limit("stats_max_entries",
          "Namespaces, and clients, that one stats answer lists at most (the busiest); the rest are counted "
          "(namespaces_omitted, clients_omitted).", kind=int),
    limit("max_queued_notification_keys",
          "Block keys of notifications (a job's end counts one) that may wait for one session's Attach "
          "stream to read them; a session further behind (a stopped or hung client) is ended. 0: twice the "
          "pool's slots (a snapshot of a full pool fits), at least 524288 (a queue that full holds about "
          "55 MiB).", kind=int),
    limit("max_job_connections",
          "Job socket connections open at once; more are refused (a refused client cannot use its session, "
          "and tries again).", kind=int),
    limit("max_job_connections_per_uid",
          "Job socket connections open at once from processes of one user id (from the kernel).", kind=int),
    limit("job_hello_timeout",
          "Seconds a new job socket connection has to say hello before it is closed.", kind=float),
    limit("grpc_handshake_timeout",
          "Seconds a new gRPC connection has to finish its handshake (the HTTP/2 preface and settings; TLS "
          "on TCP) before the daemon closes it.", kind=float),
    limit("grpc_idle_timeout",
          "Seconds a gRPC connection with no call in flight stays open; then the daemon closes it (GOAWAY) "
          "and a client's channel reconnects on its next call. An engine's Attach stream keeps its "
          "connection busy.", kind=float),
    limit("max_grpc_connections_per_uid",
          "gRPC connections on the unix socket that processes of one user id (from the kernel) may hold at "
          "once; the daemon closes the newest past it within a fraction of a second, and logs it. See "
          "docs/security.md.", kind=int),
    limit("max_unread_job_replies",
          "Replies a job socket connection may leave unread before it is closed. Past 256 KiB the daemon "
          "already stops reading that connection's requests until it reads.", size=True),
    limit("max_job_frame_bytes_per_uid",
          "Bytes of job socket frames not yet whole that the connections of one user id (from the kernel) "
          "may hold at once, counted by the length each frame announces; a connection whose frame would "
          "pass it is answered RESOURCE_EXHAUSTED and closed. Frames of up to 256 KiB (a read) are not "
          "counted: an engine's are a few KiB. 64MiB (the longest frame) to 1TiB.", size=True),
]

BY_KEY = {opt.key: opt for opt in OPTIONS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvdepotd",
        description=(
            "kvdepot daemon: keeps LLM KV-cache blocks in host memory for the inference engines of this "
            "node. Every option but --fresh can also be set in the environment (KVDEPOT_<OPTION>, e.g. "
            "KVDEPOT_POOL_SIZE) or in a TOML file (--config); flags win over the environment, which wins over the "
            "file."
        ),
    )
    for opt in OPTIONS:
        where = f"env {opt.env}; " if opt.env else ""
        if opt.is_switch:
            parser.add_argument(opt.flag, dest=opt.key, action="store_true", help=opt.help)
            continue
        parser.add_argument(
            opt.flag,
            dest=opt.key,
            default=None,
            choices=opt.choices,
            type=opt.kind if opt.kind is not str and not opt.duration else None,
            help=f"{opt.help} [{where}default {opt.default_text()}]",
        )
    return parser
