"""The steps of kvdepotd's start that take something (an address, a port, the
pool, sockets, threads), and the one error a failed start is reported as.

Each step enters what it takes into the caller's AsyncExitStack as soon as it
has it, so that whichever later step fails, and at shutdown, everything is
released once, in the reverse order of its taking (main.py runs the steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import socket
import ssl
import stat
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvdepot import kept_pools
from kvdepot.defaults import grpc_target
from kvdepot.server.api import job_socket
from kvdepot.server.api.service import KVDepotService, add_to_server
from kvdepot.server.core.limits import Limits
from kvdepot.server.core.tenants import TenantConfigError, Tenants
from kvdepot.server.daemon import grpc_cap
from kvdepot.server.daemon.config import DaemonConfig, Metrics, Network
from kvdepot.server.daemon.health_service import HealthService
from kvdepot.server.daemon.metrics import MetricsListenError, MetricsServer
from kvdepot.server.daemon.metrics_http import MetricsLimits
from kvdepot.server.host import numa, pidlock
from kvdepot.server.host.own_files import ForeignFile, check_own_folder
from kvdepot.server.host.pool import HostPool, PoolError, amount
from kvdepot.server.tiers.disk_store import DiskTierError

log = logging.getLogger("kvdepot")

SERVICE_NAME = "kvdepot.v1.KVDepot"


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to change.

    exit_code 2 where an option's value turned out unusable only when tried
    (the exit code of a configuration error), 1 otherwise."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def reported_as_startup_errors():
    """The boundary where the errors of the wings' own start-up code (their
    messages say what is wrong) become StartupError; anything else is a bug
    and keeps its traceback."""
    try:
        yield
    except StartupError:
        raise
    except MetricsListenError as e:
        raise StartupError(str(e), exit_code=2) from e
    except (PoolError, DiskTierError, TenantConfigError) as e:
        raise StartupError(str(e)) from e
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) not in str(e) else ""
        raise StartupError(f"{e}{where}") from e


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


@dataclass(frozen=True)
class Address:
    target: str
    # The socket's path on a unix socket; None on TCP.
    unix_path: str | None
    # Pool files are named after the address, so that the next daemon on it
    # can tell the ones a crashed predecessor left.
    pool_prefix: str

    @classmethod
    def of(cls, listen: str) -> Address:
        target = grpc_target(listen)
        unix_path = target[len("unix:"):] if target.startswith("unix:") else None
        return cls(target, unix_path, "kvdepot-" + hashlib.sha256(target.encode()).hexdigest()[:12] + "-")


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
        try:
            if self.socket_path:
                check_own_folder(directory, "the socket's folder")
            fd, holder = pidlock.take(self.lock_path)
        except ForeignFile as e:
            raise StartupError(f"refusing to serve {self.target}: {e}") from None
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
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def take_address(stack: contextlib.AsyncExitStack, address: Address, lock_path: str) -> None:
    guard = AddressGuard(address.target, lock_path, address.unix_path)
    guard.acquire()
    stack.callback(guard.release)


def open_metrics(stack: contextlib.AsyncExitStack, config: DaemonConfig) -> MetricsServer:
    settings = config.metrics
    limits = MetricsLimits(max_connections=settings.max_connections, timeout=settings.timeout)
    metrics = MetricsServer(settings.listen, limits, config.metrics_token, metrics_tls(settings))
    stack.callback(metrics.close)
    return metrics


def discard_kept_pools(directories: list[str], own_prefix: str, lifecycle) -> None:
    """Pools that daemons on other addresses kept and that no live daemon
    serves go once kept longer than the bound, and the oldest while all of
    them hold more RAM than the cap: each holds its size in RAM until then.
    This address's own kept pool is pick_pool_file's to adopt or remove.
    Later files and catalogs of a pool whose first file is gone go too."""
    for path in kept_pools.orphaned_parts(directories):
        try:
            size = os.lstat(path).st_blocks * 512
            os.unlink(path)
        except OSError as e:
            log.warning("cannot remove %s, a file of a pool whose first file is gone: %s", path, e.strerror)
            continue
        log.warning("removed %s (%.2f GiB), a file of a pool whose first file is gone", path, size / 2**30)
    pools = [p for p in kept_pools.kept_pools(directories) if not os.path.basename(p.path).startswith(own_prefix)]
    cap = lifecycle.kept_pools_max_bytes or kept_pools_default_cap()
    for pool, why in kept_pools.stale(pools, lifecycle.kept_pool_max_age, cap):
        try:
            kept_pools.discard(pool.path)
        except OSError as e:
            log.warning("cannot discard the pool %s kept for %s: %s", pool.path, pool.address, e.strerror)
            continue
        log.warning("discarded the pool %s (%.2f GiB) kept for %s since %s: %s", pool.path, pool.bytes / 2**30,
                    pool.address, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pool.since)), why)


def kept_pools_default_cap() -> int:
    """A quarter of the node's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def open_pool(
    stack: contextlib.AsyncExitStack, config: DaemonConfig, directory: str, name: str, adopt: bool,
    serving: asyncio.Event, owner: tuple[str, str],
) -> HostPool:
    started = time.monotonic()
    address, lock_path = owner
    pool = HostPool(
        size=config.pool.size,
        slot_bytes=config.pool.slot_size,
        directory=directory,
        name=name,
        pin=config.pool.pin,
        threads=config.pool.pin_threads,
        pin_chunk_bytes=config.pool.pin_chunk_bytes,
        progress=startup_progress,
        adopt=adopt,
        address=address,
        lock_path=lock_path,
        placement=numa.placement(config.pool.numa),
        files=config.pool.files,
    )
    # A pool this start made holds nothing until the daemon serves: if the
    # start fails it only takes memory (a tmpfs file), so it goes. A kept
    # pool's blocks stay for the next daemon whatever happens.
    stack.callback(lambda: pool.close(discard=not pool.adopted and not serving.is_set()))
    up = pool.online_slots * pool.slot_bytes
    log.info(
        "pool ready in %.2f s: %d slots of %d bytes (%.2f GiB) at %s%s, %s; %s",
        time.monotonic() - started, pool.num_slots, pool.slot_bytes, pool.size / 2**30, pool.path,
        f" and {pool.layout.parts - 1} more files beside it" if pool.layout.parts > 1 else "",
        "pinned" if pool.pinned else "not pinned",
        "all of it up" if up == pool.size else f"serving with {amount(up)} up, the rest coming up behind",
    )
    for node in pool.numa_nodes() if pool.slots.carved else ():
        log.info("NUMA node %d: slots %d-%d%s; GPUs: %s", node.node, node.first_slot, node.first_slot + node.slots - 1,
                 "" if node.bound else " (not placed)", ", ".join(node.gpus) or "none")
    elsewhere = pool.numa_gpus_elsewhere()
    if elsewhere:
        log.info("NUMA: GPUs on no node of the pool (their stores take the range with the most free slots): %s",
                 ", ".join(elsewhere))
    if not pool.slots.carved:
        (whole,) = pool.numa_nodes()
        log.info("NUMA: pool not carved (%s); GPUs: %s",
                 f"one memory node, {whole.node}" if whole.node >= 0 else "several memory nodes, or none known",
                 ", ".join(whole.gpus) or "none")
    return pool


async def open_job_socket(
    stack: contextlib.AsyncExitStack, depot, tenants: Tenants, unix_path: str, limits: Limits
) -> str:
    """On a unix socket the job socket is where clients prove who they are
    (gRPC does not tell a server its peer's credentials), and the fast way in
    for jobs (proto: "job socket"). On TCP the token names the client and
    jobs go through the calls."""
    path = job_socket.job_socket_path(unix_path)
    limits = job_socket.JobSocketLimits(
        connections=limits.max_job_connections,
        connections_per_uid=limits.max_job_connections_per_uid,
        hello_timeout=limits.job_hello_timeout,
        max_unread_replies=limits.max_unread_job_replies,
        frame_bytes_per_uid=limits.max_job_frame_bytes_per_uid,
    )
    try:
        server = await job_socket.listen(depot, tenants, path, limits)
    except OSError as e:
        raise StartupError(f"cannot serve the job socket {path}: {e}") from e
    stack.callback(_close_job_socket, server, path)
    return path


def _close_job_socket(server: asyncio.AbstractServer, path: str) -> None:
    server.close()
    with contextlib.suppress(FileNotFoundError):  # some event loops remove it on close
        os.unlink(path)


async def open_grpc_server(
    stack: contextlib.AsyncExitStack, depot, tenants: Tenants, address: Address,
    credentials: grpc.ServerCredentials | None, job_path: str, max_queued_keys: int,
):
    """The gRPC server, started; returns its health servicer."""
    server = grpc.aio.server(options=grpc_cap.server_options(depot.limits))
    stack.push_async_callback(server.stop, 1.0)
    add_to_server(KVDepotService(depot, tenants, job_path, max_queued_keys), server)
    servicer = HealthService(("", SERVICE_NAME))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    # So that grpcurl and similar tools list and call the service without the
    # .proto. It tells only the schema, which is public; every call made with
    # it is checked as any other.
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    target = address.target
    try:
        bound = server.add_secure_port(target, credentials) if credentials else server.add_insecure_port(target)
    except RuntimeError as e:
        bound, reason = 0, str(e)
    else:
        reason = "the address is in use or not allowed"
    if not bound:
        raise StartupError(f"cannot listen on {target}: {reason}")
    await server.start()
    if address.unix_path:
        os.chmod(address.unix_path, 0o660)
        cap = asyncio.create_task(grpc_cap.keep_cap(address.unix_path, depot.limits.max_grpc_connections_per_uid))
        stack.push_async_callback(_cancel, cap)
    await set_health(servicer, health_pb2.HealthCheckResponse.SERVING)
    return servicer


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def set_health(servicer, status) -> None:
    for name in servicer.names:
        await servicer.set(name, status)


async def set_not_serving(servicer) -> None:
    await set_health(servicer, health_pb2.HealthCheckResponse.NOT_SERVING)


def start_housekeeping(stack: contextlib.AsyncExitStack, depot) -> None:
    start_task(stack, depot.housekeeping())


def start_task(stack: contextlib.AsyncExitStack, coroutine) -> None:
    """Runs `coroutine` beside the daemon; cancelled, if still running, on the way out."""
    stack.push_async_callback(_cancel, asyncio.create_task(coroutine))


def tcp_credentials(network: Network, target: str, tenants: Tenants) -> grpc.ServerCredentials | None:
    """TLS for a TCP listener, and the checks that TCP clients can be named at all."""
    if not tenants.has_tokens and not network.tls_client_ca_file:
        raise StartupError(
            f"refusing to serve TCP ({target}) without authentication: set --auth-token-file "
            "(clients send it as 'authorization: Bearer TOKEN'), tenants' token_file, or "
            "--tls-client-ca-file with tenants' cert_names; or listen on a unix socket"
        )
    if network.tls_cert_file is None:
        host = target.rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise StartupError(
                f"refusing to serve TCP on {target} without TLS: tokens would travel in clear. "
                "Set --tls-cert-file and --tls-key-file (plain TCP is allowed on loopback only)"
            )
        log.warning("serving TCP on %s without TLS (loopback only)", target)
        return None
    chain, key, client_ca = read_tls_files(
        network.tls_cert_file, network.tls_key_file, network.tls_client_ca_file, "--tls-"
    )
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca, require_client_auth=bool(client_ca))


def metrics_tls(settings: Metrics) -> ssl.SSLContext | None:
    """HTTPS for the metrics port; with a client CA, a scrape with a
    certificate it signed sees the per-namespace series (metrics_http.py)."""
    if settings.tls_cert_file is None:
        return None
    read_tls_files(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file, "--metrics-tls-")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_client_ca_file:
        context.load_verify_locations(cafile=settings.tls_client_ca_file)
        # Optional: a scrape without a certificate still gets the node-wide series.
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


# TLS libraries report an unusable certificate or key vaguely (gRPC: as a
# failure to bind the address); these checks name the file and what is wrong.
_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----")
_PRIVATE_KEY = re.compile(rb"-----BEGIN (?:RSA |EC |ENCRYPTED )?PRIVATE KEY-----")


def read_tls_files(cert_file: str, key_file: str, client_ca_file: str | None, flags: str):
    """(certificate chain, key, client CAs or None) as PEM bytes, each file
    checked; `flags` is the options' prefix ("--tls-"), for the messages."""
    chain = _read_pem(cert_file, flags + "cert-file", _CERTIFICATE, "certificate")
    key = _read_pem(key_file, flags + "key-file", _PRIVATE_KEY, "private key")
    client_ca = None
    if client_ca_file:
        client_ca = _read_pem(client_ca_file, flags + "client-ca-file", _CERTIFICATE, "CA certificate")
    _check_key_pair(cert_file, key_file, client_ca_file, flags)
    return chain, key, client_ca


def _read_pem(path: str, flag: str, block: re.Pattern, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise StartupError(f"cannot read the TLS file {path} ({flag}): {e.strerror}", exit_code=2) from e
    if not block.search(data):
        raise StartupError(f"the TLS file {path} ({flag}) holds no PEM {what} (no -----BEGIN line of one)",
                           exit_code=2)
    return data


def _check_key_pair(cert_file: str, key_file: str, client_ca_file: str | None, flags: str) -> None:
    """Parses the certificates and the key as the TLS library will, and checks
    that the key is the certificate's."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for path, flag in ((cert_file, flags + "cert-file"), (client_ca_file, flags + "client-ca-file")):
        if path is None:
            continue
        try:
            context.load_verify_locations(cafile=path)
        except ssl.SSLError as e:
            raise StartupError(
                f"the TLS file {path} ({flag}) holds a certificate that does not parse: {e.reason or e}", exit_code=2
            ) from None
    key_flag = flags + "key-file"

    def no_password() -> bytes:
        raise StartupError(
            f"the private key in {key_file} ({key_flag}) is encrypted: give a key without a passphrase "
            "(the file's permissions protect it)", exit_code=2,
        )

    try:
        context.load_cert_chain(cert_file, key_file, password=no_password)
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            why = f"it is not the key of the certificate in {cert_file} ({flags}cert-file)"
        else:
            why = f"it does not parse ({e.reason or e})"
        raise StartupError(f"the private key in {key_file} ({key_flag}) cannot be used: {why}",
                           exit_code=2) from None
