"""kvdepotd: start-up, the listening socket, signals and shutdown."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import signal
import socket
import stat
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import kvdepot
from kvdepot.defaults import grpc_target
from kvdepot.server.api import job_socket
from kvdepot.server.host import pidlock
from kvdepot.server.daemon.config import ConfigError, DaemonConfig, describe, load_config
from kvdepot.server.core.depot import Depot
from kvdepot.server.core.limits import Limits
from kvdepot.logsafe import EscapingFormatter
from kvdepot.server.daemon.metrics import MetricsListenError, MetricsServer
from kvdepot.server.host.pool import HostPool, PoolError, choose_pool_dir
from kvdepot.server.api.service import KVDepotService, add_to_server
from kvdepot.server.tiers.disk_store import SEGMENT_BYTES, DiskTier, DiskTierError
from kvdepot.server.tiers.disk import DiskMover
from kvdepot.server.core.tiers import TierStack
from kvdepot.server.tiers.warm import WarmPool, pick_pool_file
from kvdepot.server.core.tenants import TenantConfigError, Tenants, parse_admin_uids, scope_quotas
from kvdepot.server.transports.shared_memory import SharedMemoryTransport

log = logging.getLogger("kvdepot")

SERVICE_NAME = "kvdepot.v1.KVDepot"


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to do."""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(config: DaemonConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        # Messages may hold what clients sent: one record, one line.
        handler.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.log_level.upper())


def notify_systemd(state: str) -> None:
    """sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError as e:
            log.warning("could not notify systemd: %s", e)


def startup_progress(message: str) -> None:
    """A start-up step (allocating and pinning the pool take long), in the log
    and in `systemctl status` (STATUS=)."""
    logging.getLogger("kvdepot.pool").info("%s", message)
    notify_systemd(f"STATUS={message}")


class AddressGuard:
    """Owns a listening address: refuses a second daemon, clears what a crash left.

    The lock (beside a unix socket; in the pool folder for TCP) is held for the
    daemon's life and released by the kernel when it dies, so a socket file or
    pool file left by a crash is recognisably stale while a live daemon's is not.
    """

    def __init__(self, target: str, lock_path: str, socket_path: str | None):
        self.target = target
        self.lock_path = lock_path
        self.socket_path = socket_path
        self._lock_fd: int | None = None

    def acquire(self) -> None:
        self._refuse_non_socket()
        directory = os.path.dirname(self.lock_path) or "."
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as e:
            raise StartupError(f"cannot create the folder {directory}: {e.strerror}") from e
        fd, holder = pidlock.take(self.lock_path)
        if fd < 0:
            raise StartupError(
                f"another kvdepotd (pid {holder}) is already serving {self.target}; "
                "stop it first, or give this one another --listen address"
            )
        self._lock_fd = fd
        if self.socket_path and os.path.exists(self.socket_path):
            log.info("removing the stale socket %s left by a daemon that is gone", self.socket_path)
            os.unlink(self.socket_path)

    def _refuse_non_socket(self) -> None:
        # A mistyped --listen must not cost someone a file: only a socket is
        # ever removed from where the daemon listens.
        if not self.socket_path:
            return
        try:
            mode = os.lstat(self.socket_path).st_mode
        except FileNotFoundError:
            return
        except OSError as e:
            raise StartupError(f"cannot check {self.socket_path}: {e.strerror}") from e
        if not stat.S_ISSOCK(mode):
            raise StartupError(
                f"{self.socket_path} exists and is not a socket: refusing to replace it; "
                "give --listen a path that is free (or a socket a kvdepotd left)"
            )

    def release(self) -> None:
        if self.socket_path:
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


async def serve(config: DaemonConfig) -> int:
    target = grpc_target(config.listen)
    unix_path = target[len("unix:"):] if target.startswith("unix:") else None
    token = config.auth_token
    tenants = Tenants(config.tenants, parse_admin_uids(config.admin_uids), token)
    credentials = None
    if unix_path is None:
        credentials = _tcp_credentials(config, target, tenants)

    # Pool files are named after the address, so that the next daemon on it
    # can tell the ones a crashed predecessor left.
    pool_prefix = "kvdepot-" + hashlib.sha256(target.encode()).hexdigest()[:12] + "-"
    guard = None
    if unix_path:
        guard = AddressGuard(target, unix_path + ".lock", unix_path)
        guard.acquire()
    instance = secrets.token_hex(6)
    metrics = None
    try:
        pool_dir = choose_pool_dir(
            config.pool_dir, os.path.dirname(unix_path) if unix_path else None, config.pool_size, pool_prefix
        )
        if guard is None:
            guard = AddressGuard(target, os.path.join(pool_dir, pool_prefix + "tcp.lock"), None)
            guard.acquire()
        # The pool an earlier daemon on this address left, if it fits this
        # configuration; any other it left is removed.
        kept = pick_pool_file(
            pool_dir, pool_prefix, config.slot_size, config.pool_size // config.slot_size, config.fresh
        )
        # Before the pool, which may take tens of seconds to pin: a taken port fails at once.
        metrics = MetricsServer(config.metrics_listen)
        started = time.monotonic()
        pool = HostPool(
            size=config.pool_size,
            slot_bytes=config.slot_size,
            directory=pool_dir,
            name=kept or pool_prefix + instance,
            pin=config.pin,
            threads=config.pin_threads,
            pin_chunk_bytes=config.pin_chunk_bytes,
            progress=startup_progress,
            adopt=kept is not None,
        )
    except (PoolError, StartupError, MetricsListenError) as e:
        if guard:
            guard.release()
        if metrics:
            metrics.close()
        if isinstance(e, MetricsListenError):
            raise
        raise StartupError(str(e)) from e
    log.info(
        "pool ready in %.2f s: %d slots of %d bytes (%.2f GiB) at %s, %s",
        time.monotonic() - started,
        pool.num_slots,
        pool.slot_bytes,
        pool.size / 2**30,
        pool.path,
        "pinned" if pool.pinned else "not pinned",
    )

    try:
        quotas = scope_quotas(config.tenants, pool.size, pool.slot_bytes)
    except TenantConfigError as e:
        pool.close()
        guard.release()
        raise StartupError(str(e)) from e
    try:
        tiers = TierStack(open_tiers(config, pool))
    except StartupError:
        pool.close()
        guard.release()
        raise
    depot = Depot(pool, config.eviction, instance, kvdepot.__version__, Limits.of(config), quotas, tiers)
    tiers.recover()
    add_transports(depot, pool, config)
    metrics.attach(depot, asyncio.get_running_loop())
    server = grpc.aio.server(
        options=[
            # Without this a second daemon could bind the same TCP port.
            ("grpc.so_reuseport", 0),
            # Notice dead TCP peers; unix sockets report them at once anyway.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # Small messages that engine steps wait on (see the client's channel).
            ("grpc.optimization_target", "latency"),
        ],
    )
    # On a unix socket the job socket is where clients prove who they are
    # (gRPC does not tell a server its peer's credentials), and the fast way in
    # for jobs (proto: "job socket"). On TCP the token names the client and
    # jobs go through the calls.
    job_server, job_path = None, ""
    if unix_path:
        job_path = job_socket.job_socket_path(unix_path)
        try:
            job_server = await job_socket.listen(depot, tenants, job_path, job_limits(config))
        except OSError as e:
            pool.close()
            guard.release()
            raise StartupError(f"cannot serve the job socket {job_path}: {e}") from e
    # Enough for a registration's snapshot of a namespace that fills the pool, twice.
    max_queued_keys = config.max_queued_notification_keys or max(1 << 19, 2 * pool.num_slots)
    add_to_server(KVDepotService(depot, tenants, job_path, max_queued_keys), server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # So that grpcurl and similar tools list and call the service without the
    # .proto. It tells only the schema, which is public; every call made with
    # it is checked as any other.
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        bound = server.add_secure_port(target, credentials) if credentials else server.add_insecure_port(target)
    except RuntimeError as e:
        bound = 0
        reason = str(e)
    else:
        reason = "the address is in use or not allowed"
    if not bound:
        if job_server is not None:
            _close_job_socket(job_server, job_path)
        pool.close()
        guard.release()
        raise StartupError(f"cannot listen on {target}: {reason}")
    await server.start()
    if unix_path:
        os.chmod(unix_path, 0o660)
    for name in ("", SERVICE_NAME):
        await _set_health(health_servicer, name, health_pb2.HealthCheckResponse.SERVING)
    log.info("kvdepotd %s ready on %s (instance %s)", kvdepot.__version__, target, instance)
    # Only now: systemd starts units ordered after this one on READY=1, and
    # they expect calls to be answered.
    notify_systemd(f"READY=1\nSTATUS=serving on {target}")

    housekeeping = asyncio.create_task(depot.housekeeping())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    log.info("shutting down: draining %d job(s) in flight", depot.jobs_in_flight)
    notify_systemd(f"STOPPING=1\nSTATUS=stopping: draining {depot.jobs_in_flight} job(s)")
    for name in ("", SERVICE_NAME):
        await _set_health(health_servicer, name, health_pb2.HealthCheckResponse.NOT_SERVING)
    drained = await depot.drain(config.drain_timeout)
    if not drained:
        log.warning(
            "%d job(s) still in flight after %.0f s; exiting anyway", depot.jobs_in_flight, config.drain_timeout
        )
    await server.stop(grace=1.0)
    if job_server is not None:
        _close_job_socket(job_server, job_path)
    housekeeping.cancel()
    metrics.close()
    depot.shutdown()  # copies still on the GPU end before the pool is unpinned
    await tiers.close()  # the disk's writes and promotions end, then every committed shard is sealed
    pool.close()
    guard.release()
    log.info("kvdepotd stopped")
    return 0


def open_tiers(config: DaemonConfig, pool: HostPool) -> list:
    """The tiers under DRAM, top first: the pool kept across restarts, then the disk if configured."""
    loop = asyncio.get_running_loop()
    tiers = [WarmPool(pool, loop, threads=config.pin_threads, progress=startup_progress)]
    if config.disk_dir:
        tiers.append(open_disk_tier(config, pool, loop))
    return tiers


def open_disk_tier(config: DaemonConfig, pool: HostPool, loop) -> DiskMover:
    startup_progress(f"scanning the disk tier in {config.disk_dir}")
    try:
        # Space comes back a segment at a time: an eighth of the tier at most.
        segment = max(64 << 10, min(SEGMENT_BYTES, config.disk_size // 8))
        disk = DiskTier(config.disk_dir, config.disk_size, segment_bytes=segment, fresh=config.fresh)
    except DiskTierError as e:
        raise StartupError(str(e)) from e
    counters = disk.counters
    log.info(
        "disk tier in %s: %d shard(s), %.2f of %.2f GiB, %s",
        config.disk_dir, counters.records, counters.bytes_used / 2**30, config.disk_size / 2**30,
        "O_DIRECT" if disk.direct else "buffered I/O (the filesystem refuses O_DIRECT)",
    )
    # At most a quarter of the pool on its way up from disk at once.
    return DiskMover(disk, pool, loop, max_promotions=max(1, pool.num_slots // 4))


def _tcp_credentials(config: DaemonConfig, target: str, tenants: Tenants) -> grpc.ServerCredentials | None:
    """TLS for a TCP listener, and the checks that TCP clients can be named at all."""
    if not tenants.has_tokens and not config.tls_client_ca_file:
        raise StartupError(
            f"refusing to serve TCP ({target}) without authentication: set --auth-token-file "
            "(clients send it as 'authorization: Bearer TOKEN'), tenants' token_file, or "
            "--tls-client-ca-file with tenants' cert_names; or listen on a unix socket"
        )
    if config.tls_cert_file is None:
        host = target.rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise StartupError(
                f"refusing to serve TCP on {target} without TLS: tokens would travel in clear. "
                "Set --tls-cert-file and --tls-key-file (plain TCP is allowed on loopback only)"
            )
        log.warning("serving TCP on %s without TLS (loopback only)", target)
        return None
    try:
        with open(config.tls_cert_file, "rb") as f:
            chain = f.read()
        with open(config.tls_key_file, "rb") as f:
            key = f.read()
        client_ca = None
        if config.tls_client_ca_file:
            with open(config.tls_client_ca_file, "rb") as f:
                client_ca = f.read()
    except OSError as e:
        raise StartupError(f"cannot read a TLS file: {e.filename}: {e.strerror}") from e
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca, require_client_auth=bool(client_ca))


def add_transports(depot: Depot, pool: HostPool, config: DaemonConfig) -> None:
    depot.add_transport(SharedMemoryTransport(depot.finish_job, pool))
    if pool.pinned:
        # Only a pinned pool can be copied to by the GPU; torch is loaded already.
        from kvdepot.server.transports.cuda import CudaTransport

        depot.add_transport(
            CudaTransport(
                depot.finish_job,
                pool,
                mode=config.copy_mode,
                staging_bytes=config.staging_bytes,
                spin_bytes=config.spin_bytes,
                chunk_bytes=config.copy_chunk_bytes,
                programs=config.copy_programs,
            )
        )


def job_limits(config: DaemonConfig) -> job_socket.JobSocketLimits:
    return job_socket.JobSocketLimits(
        connections=config.max_job_connections,
        connections_per_uid=config.max_job_connections_per_uid,
        hello_timeout=config.job_hello_timeout,
        max_unread_replies=config.max_unread_job_replies,
    )


def _close_job_socket(server: asyncio.AbstractServer, path: str) -> None:
    server.close()
    try:
        os.unlink(path)
    except FileNotFoundError:  # some event loops remove it on close
        pass


async def _set_health(servicer, name: str, status) -> None:
    result = servicer.set(name, status)
    if asyncio.iscoroutine(result):
        await result


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as e:
        print(f"kvdepotd: {e}", file=sys.stderr)
        return 2
    setup_logging(config)
    log.debug("configuration: %s", describe(config))
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(serve(config))
    except MetricsListenError as e:
        log.error("%s", e)
        return 2
    except StartupError as e:
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
