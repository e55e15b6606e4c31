"""kvdepotd: start-up, signals and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import secrets
import signal
import sys
import time

import kvdepot
from kvdepot.logsafe import EscapingFormatter
from kvdepot.server.core.depot import Depot
from kvdepot.server.core.tenants import Tenants, scope_quotas, scope_remote_secrets
from kvdepot.server.core.tiers import Tier, TierStack
from kvdepot.server.daemon import lanes, preload, startup
from kvdepot.server.daemon.config import ConfigError, Copy, DaemonConfig, describe, load_config
from kvdepot.server.daemon.metrics import MetricsServer
from kvdepot.server.daemon.startup import StartupError, notify_systemd, startup_progress
from kvdepot.server.host.malloc_tuning import keep_freed_memory
from kvdepot.server.host.pool import HostPool
from kvdepot.server.host.pool_folder import choose_pool_dir, pool_folders
from kvdepot.server.native.depot import NativeDepot
from kvdepot.server.tiers.disk import DiskMover
from kvdepot.server.tiers.disk_store import SEGMENT_BYTES, DiskTier
from kvdepot.server.tiers.remote import RemoteTier
from kvdepot.server.tiers.remote_format import Secrets
from kvdepot.server.tiers.remote_store import RemoteStore, remote_spec
from kvdepot.server.tiers.warm import WarmPool, pick_pool_file
from kvdepot.server.transports.shared_memory import SharedMemoryTransport

log = logging.getLogger("kvdepot")


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
    if config.logging.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        # Messages may hold what clients sent: one record, one line.
        handler.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.logging.level.upper())


async def serve(config: DaemonConfig, stop: asyncio.Event | None = None) -> int:
    """Runs the daemon until SIGTERM or SIGINT (or `stop` is set)."""
    stop = stop or asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        with startup.reported_as_startup_errors():
            depot, health = await start(config, stack, stop)
        await stop.wait()
        log.info("shutting down: draining %d job(s) in flight", depot.jobs_in_flight)
        notify_systemd(f"STOPPING=1\nSTATUS=stopping: draining {depot.jobs_in_flight} job(s)")
        await startup.set_not_serving(health)
        if not await depot.drain(config.lifecycle.drain_timeout):
            log.warning(
                "%d job(s) still in flight after %.0f s; exiting anyway",
                depot.jobs_in_flight, config.lifecycle.drain_timeout,
            )
        # Leaving the stack stops the rest, last taken first: the gRPC server,
        # the job socket, the depot's copies (before the pool is unpinned), the
        # tiers, the warm pool's sealing (so the next daemon adopts every
        # committed shard), the pool, metrics, and the address.
    log.info("kvdepotd stopped")
    return 1 if depot.pool.bring_up_error and config.pool.pin == "on" else 0


async def start(config: DaemonConfig, stack: contextlib.AsyncExitStack, stop: asyncio.Event):
    """Takes, in order, what the daemon serves with, each entered into `stack`;
    returns the depot and the health servicer once calls are answered."""
    loop = asyncio.get_running_loop()
    # Removed last on the way out: a second SIGTERM or SIGINT while the tiers
    # close or the warm pool seals must not cut that short.
    # Each with the handler it had (SIG_IGN under nohup), which asyncio's removal would not restore.
    handled: list[tuple[int, object]] = []
    stack.callback(lambda: [(loop.remove_signal_handler(sig), signal.signal(sig, was)) for sig, was in handled])
    address = startup.Address.of(config.network.listen)
    unix_path = address.unix_path
    tenants = Tenants(list(config.tenants), config.admin_uids, config.auth_token)
    credentials = None if unix_path else startup.tcp_credentials(config.network, address.target, tenants)
    if unix_path:
        lock_path = unix_path + ".lock"
        startup.take_address(stack, address, lock_path)
    pool_dirs = pool_folders(config.pool.dir, os.path.dirname(unix_path) if unix_path else None)
    startup.discard_kept_pools(pool_dirs, address.pool_prefix, config.lifecycle)
    pool_dir = choose_pool_dir(
        config.pool.dir, os.path.dirname(unix_path) if unix_path else None, config.pool.size, address.pool_prefix
    )
    if not unix_path:
        lock_path = os.path.join(pool_dir, address.pool_prefix + "tcp.lock")
        startup.take_address(stack, address, lock_path)
    # The pool an earlier daemon on this address left, if it fits this
    # configuration; any other it left is removed.
    kept = pick_pool_file(pool_dir, address.pool_prefix, config.pool.slot_size, config.pool.size,
                          config.lifecycle.fresh)
    if kept is not None:  # a kept pool keeps its slot size
        config = dataclasses.replace(config, pool=dataclasses.replace(config.pool, slot_size=kept[1]))
        kept = kept[0]
    # Before the pool, which may take tens of seconds to pin: a taken port fails at once.
    metrics = startup.open_metrics(stack, config)
    instance = secrets.token_hex(6)
    serving = asyncio.Event()
    pool = startup.open_pool(
        stack, config, pool_dir, kept or address.pool_prefix + instance, kept is not None, serving,
        (address.target, lock_path),
    )
    quotas = scope_quotas(list(config.tenants), pool.size, pool.slot_bytes)
    depot = wire_depot(stack, config, pool, metrics, instance, quotas)
    bring_up_rest(pool, depot, loop, stop if config.pool.pin == "on" else None)
    # Before the tiers close (the stack runs last taken first): no chunk comes up while they do.
    stack.callback(pool.stop_bringing_up)
    job_path = ""
    if unix_path:
        job_path = await startup.open_job_socket(stack, depot, tenants, unix_path, config.limits)
    # Enough for a registration's snapshot of a namespace that fills the pool, twice.
    max_queued_keys = config.limits.max_queued_notification_keys or max(1 << 19, 2 * pool.num_slots)
    health = await startup.open_grpc_server(stack, depot, tenants, address, credentials, job_path, max_queued_keys)
    startup.start_housekeeping(stack, depot)
    if pool.pinned:
        startup.start_task(stack, add_cuda_transport(depot, pool, config.copy))
    for sig in (signal.SIGTERM, signal.SIGINT):
        was = signal.getsignal(sig)
        loop.add_signal_handler(sig, stop.set)
        handled.append((sig, signal.SIG_DFL if was is None else was))
    log.info("kvdepotd %s ready on %s (instance %s)", kvdepot.__version__, address.target, instance)
    # Only now: systemd starts units ordered after this one on READY=1, and
    # they expect calls to be answered.
    notify_systemd(f"READY=1\nSTATUS=serving on {address.target}")
    serving.set()
    return depot, health


def bring_up_rest(pool: HostPool, depot: Depot, loop: asyncio.AbstractEventLoop, stop: asyncio.Event | None) -> None:
    """The rest of the pool comes up behind the daemon's start (host/bring_up.py),
    each chunk's slots handed to the depot on the loop's thread. With `stop`
    (--pin on), a part that cannot come up stops the daemon (exit 1), as a
    pool that cannot be pinned fails the start."""

    def up(first: int, count: int) -> None:
        pool.add_online(first, count)
        depot.index.tiers.pool_grew(first, count)  # the kept blocks it completes

    def online(first: int, count: int) -> None:
        try:
            loop.call_soon_threadsafe(up, first, count)
        except RuntimeError:  # the loop has closed: the daemon is stopping
            pass

    def failed(error: str) -> None:
        if stop is not None:
            log.error("--pin on and part of the pool could not come up: stopping")
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass

    pool.bring_up_rest(online, failed)


def wire_depot(
    stack: contextlib.AsyncExitStack, config: DaemonConfig, pool: HostPool, metrics: MetricsServer, instance: str,
    quotas: dict[str, int],
) -> Depot:
    """The depot and its tiers and transports over `pool`; each closed by `stack`
    in the order shutdown needs (copies end, then the tiers, bottom first,
    then the native lane, which seals the kept pool's last records)."""
    lane = lanes.open_lane(stack, config, pool)
    tiers = TierStack(open_tiers(stack, config, pool))
    args = (pool, config.pool.eviction, instance, kvdepot.__version__, config.limits, quotas, tiers)
    depot = Depot(*args) if lane is None else NativeDepot(lane, *args)
    stack.callback(depot.shutdown)
    tiers.recover()
    add_transports(depot, pool)
    metrics.attach(depot, asyncio.get_running_loop())
    # Scrapes end before the copies and the tiers do: they would read
    # transports being shut down, from a loop blocked on the tiers' threads.
    stack.callback(metrics.close)
    return depot


def open_tiers(stack: contextlib.AsyncExitStack, config: DaemonConfig, pool: HostPool) -> list[Tier]:
    """The tiers under DRAM, top first: the pool kept across restarts, then the
    disk if configured. Each is closed by `stack`, the lowest first."""
    loop = asyncio.get_running_loop()
    tiers: list[Tier] = [WarmPool(pool, loop, threads=config.pool.pin_threads, progress=startup_progress)]
    stack.push_async_callback(tiers[-1].close)
    if config.tiers.disk_dir:
        tiers.append(open_disk_tier(config, pool, loop))
        stack.push_async_callback(tiers[-1].close)
    if config.tiers.remote:
        tiers.append(open_remote_tier(config, pool, loop))
        stack.push_async_callback(tiers[-1].close)
    return tiers


def open_remote_tier(config: DaemonConfig, pool: HostPool, loop: asyncio.AbstractEventLoop) -> RemoteTier:
    spec = remote_spec(config.tiers)  # load_config checked it
    keep_freed_memory()  # the store's 2 MiB values, sent and received again and again
    secrets = {
        scope: Secrets(current, old) for scope, (current, old) in scope_remote_secrets(list(config.tenants)).items()
    }
    if not secrets:
        log.warning("--remote is set but no tenant has a remote_secret_file: nothing is shared through it")
    log.info("remote tier: %s, for %s", spec.describe(), ", ".join(sorted(secrets)) or "no tenant")
    return RemoteTier(RemoteStore(spec), pool, loop, secrets.get, config.tiers.remote_prefix)


def open_disk_tier(config: DaemonConfig, pool: HostPool, loop: asyncio.AbstractEventLoop) -> DiskMover:
    tiers = config.tiers
    startup_progress(f"scanning the disk tier in {tiers.disk_dir}")
    # Space comes back a segment at a time: an eighth of the tier at most.
    segment = max(64 << 10, min(SEGMENT_BYTES, tiers.disk_size // 8))
    disk = DiskTier(tiers.disk_dir, tiers.disk_size, segment_bytes=segment, fresh=config.lifecycle.fresh)
    counters = disk.counters
    log.info(
        "disk tier in %s: %d shard(s), %.2f of %.2f GiB, %s",
        tiers.disk_dir, counters.records, counters.bytes_used / 2**30, tiers.disk_size / 2**30,
        "O_DIRECT" if disk.direct else "buffered I/O (the filesystem refuses O_DIRECT)",
    )
    try:
        # At most a quarter of the pool on its way up from disk at once.
        return DiskMover(disk, pool, loop, max_promotions=max(1, pool.num_slots // 4))
    except BaseException:
        disk.close()
        raise


# The proto's name for CUDA IPC handles (WorkerHandle.cuda_ipc): CudaTransport.handle_kind.
CUDA_IPC = "cuda_ipc"


def add_transports(depot: Depot, pool: HostPool) -> None:
    """Shared memory now; CUDA's, if the pool is pinned, once the daemon serves (add_cuda_transport)."""
    native = isinstance(depot, NativeDepot)  # its lane copies: the transports set up and map
    depot.add_transport(SharedMemoryTransport(depot.finish_job, pool, depot.finish_jobs, threads=not native))
    if pool.pinned:
        depot.transport_coming(CUDA_IPC)


def _import_cuda_transport(took: dict[str, float]):
    """The CUDA transport's module, torch's CUDA state initialised (which
    cudaHostRegister through torch used to do): off the loop, both take seconds."""
    started = time.monotonic()
    preload.load_all()  # the loop answers calls meanwhile (preload.py)
    cuda = importlib.import_module("kvdepot.server.transports.cuda")
    imported = time.monotonic()
    cuda.torch.cuda.init()
    took.update(imported=imported - started, initialised=time.monotonic() - imported)
    return cuda


async def add_cuda_transport(depot: Depot, pool: HostPool, copy: Copy) -> None:
    """The CUDA transport, after the daemon serves: it needs torch, whose import
    takes seconds (the pool was pinned without it: host/cuda_driver.py).
    Imported on a thread, so that calls are answered meanwhile; GPU workers'
    registrations wait for it (Depot.transport_up)."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    try:
        took: dict[str, float] = {}
        cuda = await loop.run_in_executor(None, _import_cuda_transport, took)
        made = time.monotonic()
        transport = cuda.CudaTransport(
            depot.finish_job,
            pool,
            mode=copy.mode,
            staging_bytes=copy.staging_bytes,
            spin_bytes=copy.spin_bytes,
            chunk_bytes=copy.chunk_bytes,
            programs=copy.programs,
            finish_many=depot.finish_jobs,
            native=isinstance(depot, NativeDepot),
        )
    except asyncio.CancelledError:
        depot.transport_failed(CUDA_IPC, "the daemon is stopping")
        raise
    except Exception as e:
        log.exception("the CUDA transport did not start: GPU workers are refused")
        depot.transport_failed(CUDA_IPC, f"{type(e).__name__}: {e} (see the daemon's log)")
        return
    depot.add_transport(transport)
    # Its parts, so that a late transport says what made it late (GPU workers wait for it).
    log.info("CUDA transport up %.2f s after the daemon began serving (its modules, torch and Triton, imported in "
             "%.2f s, torch's CUDA initialised in %.2f s, streams, buffers and kernels set up in %.2f s)",
             time.monotonic() - started, took["imported"], took["initialised"], time.monotonic() - made)


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
    except StartupError as e:
        log.error("%s", e)
        return e.exit_code
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
