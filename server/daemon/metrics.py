"""Prometheus metrics: the daemon's counters and gauges at /metrics over HTTP.

prometheus_client serves them from a thread of its own (one per scrape), while
the depot's state lives on the event loop's thread and is changed there
without locks (depot.py). Reading it from a scrape thread could meet a dict
in the middle of a change ("changed size during iteration") or counters of
one namespace from before a job and of the pool from after it. So a scrape
asks the loop for a snapshot (`call_soon_threadsafe`, then waits on a future
for at most SNAPSHOT_TIMEOUT_S): the loop copies plain numbers in one go,
O(namespaces + transports), and the scrape thread turns them into metric
families. The hot path pays nothing for it: a job's end adds to a few ints of
`JobMetrics`, on the loop, like every other counter.

Label sets stay bounded: per namespace (at most --max-namespaces live), per
job kind, failure reason, GPU and NUMA node (at most 64, numa.MAX_NODES);
never per key, session or client pid. A
namespace's series end when the namespace is freed; the daemon-wide totals
keep counting.

The per-namespace series name a tenant's model and count its hits and misses
as they happen: that is what GetStats shows a tenant of its own namespaces
only. So they go only to a scrape that sends the metrics token
(--metrics-token-file; metrics_http.py checks it); every other scrape gets the
node-wide series, and the snapshot behind it copies no namespace at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import sys
import threading

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from kvdepot.server.core.counters import DURATION_BUCKETS, FAILURE_REASONS, Counters
from kvdepot.server.core.report import Report
from kvdepot.server.core.requests import JobKind
from kvdepot.server.core.tenants import Identity
from kvdepot.server.daemon.metrics_http import BoundedMetricsServer, MetricsLimits, Views

log = logging.getLogger("kvdepot.metrics")

# How long a scrape waits for the event loop: longer means the loop is stuck,
# and the scrape answers without the depot's metrics rather than hang.
SNAPSHOT_TIMEOUT_S = 5.0

# Who a scrape sees the daemon as: everything (the port is the operator's to guard).
METRICS_VIEWER = Identity(tenant="metrics", scope="", admin=True)


class MetricsListenError(RuntimeError):
    """The metrics address cannot be served; the message says why and what to do."""


def parse_listen(text: str) -> tuple[str, int] | None:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port); 'none' -> None. ValueError otherwise."""
    if text.strip().lower() == "none":
        return None
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9400) or none")
    return host, int(port)


def take_snapshot(depot, tenant_series: bool = True) -> Report:
    """Runs on the event loop's thread: the daemon as an admin sees it, with
    every namespace or (for a scrape without the token) none."""
    return depot.report(METRICS_VIEWER, most=sys.maxsize if tenant_series else 0)


# Counters kept per namespace and for the whole daemon (core/counters.py):
# field -> (metric name without kvdepot_ / kvdepot_namespace_, help).
COUNTERS = {
    "lookups": ("lookups_total", "Lookups answered or reported by engines."),
    "stored_blocks": ("stored_blocks_total", "Blocks (one TP rank's shard each) stored by jobs that succeeded."),
    "stored_bytes": ("stored_bytes_total", "Bytes stored by jobs that succeeded."),
    "loaded_blocks": ("loaded_blocks_total", "Blocks (one TP rank's shard each) loaded by jobs that succeeded."),
    "loaded_bytes": ("loaded_bytes_total", "Bytes loaded by jobs that succeeded."),
    "evicted_blocks": ("evicted_blocks_total", "Blocks evicted to make room."),
}
LOOKUP_BLOCKS_HELP = (
    "Blocks looked up, by result: hit (ready in DRAM), disk_hit (promoted from a lower tier, disk or remote, "
    "for a lookup, then loaded) or miss; their sum is the blocks queried."
)
# TierStats field -> (metric name after kvdepot_tier_, help, a counter?).
TIER_FIELDS = {
    "shards": ("shards", "Shards (one TP rank of a block) the tier holds.", False),
    "bytes": ("bytes", "Bytes the tier holds (disk: its segment files' physical bytes).", False),
    "capacity_bytes": ("capacity_bytes", "The most bytes the tier may hold.", False),
    "written_shards": ("written_shards", "Shards written into the tier (dram: records sealed; disk: demotions).", True),
    "written_bytes": ("written_bytes", "Bytes written into the tier from the one above.", True),
    "read_shards": ("read_shards", "Shards read from the tier into the one above (promotions).", True),
    "read_bytes": ("read_bytes", "Bytes read from the tier into the one above.", True),
    "promotions": ("promotions", "Blocks promoted from the tier into DRAM.", True),
    "failed_promotions": ("failed_promotions", "Promotions that failed and became misses.", True),
    "evicted_shards": ("evicted_shards", "Shards evicted from the tier.", True),
    "recovered_shards": ("recovered_shards", "Shards found valid and kept at start (adopted, or scanned).", False),
    "misses": ("misses", "remote: blocks a lookup asked the store for that it did not hold whole.", True),
    "dropped_writes": ("dropped_writes", "remote: shards not published (queue full, store failing).", True),
    "write_errors": ("errors", "Write errors (disk); calls to the store that failed or timed out (remote).", True),
}
CIRCUIT_STATES = ("closed", "open", "half_open")


class Snapshots:
    """Takes snapshots of the depot from scrape threads, on its event loop."""

    def __init__(self) -> None:
        self._depot = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failed = 0

    def attach(self, depot, loop: asyncio.AbstractEventLoop) -> None:
        """From now on scrapes show `depot`, whose state lives on `loop`."""
        self._depot, self._loop = depot, loop

    def take(self, tenant_series: bool) -> Report | None:
        depot, loop = self._depot, self._loop
        if depot is None:
            return None  # still starting (pinning the pool): process metrics only
        future: concurrent.futures.Future = concurrent.futures.Future()

        def take() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(take_snapshot(depot, tenant_series))
                except BaseException as e:  # the scrape thread logs it
                    future.set_exception(e)

        try:
            loop.call_soon_threadsafe(take)
            return future.result(SNAPSHOT_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            log.warning("a metrics scrape got no answer from the event loop within %.0f s", SNAPSHOT_TIMEOUT_S)
        except RuntimeError:
            return None  # the loop has closed: the daemon is exiting
        except Exception:
            log.exception("taking the metrics snapshot failed")
        self.failed += 1
        return None


class DepotCollector(Collector):
    """Builds the metric families from a snapshot of the depot, at each scrape:
    with each namespace's series or without any."""

    def __init__(self, snapshots: Snapshots, tenant_series: bool) -> None:
        self._snapshots = snapshots
        self._tenant_series = tenant_series

    def collect(self):
        snap = self._snapshots.take(self._tenant_series)
        failed = CounterMetricFamily(
            "kvdepot_metrics_snapshot_failures_total",
            "Scrapes that got no snapshot of the daemon's state (the event loop did not answer in time).",
        )
        failed.add_metric([], self._snapshots.failed)
        yield failed
        if snap is not None:
            yield from _families(snap, self._tenant_series)


def _gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help, value=value)


def _families(s: Report, tenant_series: bool):
    info = InfoMetricFamily("kvdepot", "The daemon: version, instance (changes at each start), eviction policy.")
    info.add_metric([], {"version": s.version, "instance": s.instance, "eviction_policy": s.eviction})
    yield info

    yield from _counters("kvdepot_", "", [([], s.totals)])
    if tenant_series:
        scoped = [([ns.name, ns.scope], ns.counters) for ns in s.namespaces]
        yield from _counters("kvdepot_namespace_", " Per namespace, while it lives.", scoped, ["namespace", "scope"])

    failed = CounterMetricFamily(
        "kvdepot_failed_jobs_total", "Jobs that failed, by kind and reason.", labels=["kind", "reason"]
    )
    for kind in JobKind:
        for reason in FAILURE_REASONS:
            failed.add_metric([kind.value, reason], s.job_times.failures.get((kind, reason), 0))
    yield failed

    durations = HistogramMetricFamily(
        "kvdepot_job_duration_seconds",
        "Seconds from a job's submission to its completion, of jobs that succeeded, by kind.",
        labels=["kind"],
    )
    for kind in JobKind:
        counts, total = s.job_times.buckets[kind], 0
        cumulative = []
        for bound, count in zip([*map(str, DURATION_BUCKETS), "+Inf"], counts):
            total += count
            cumulative.append((bound, total))
        durations.add_metric([kind.value], cumulative, s.job_times.seconds[kind])
    yield durations

    slot_bytes, num_slots = s.pool.slot_bytes, s.pool.num_slots
    yield _gauge("kvdepot_pool_capacity_bytes", "Bytes of the pool (whole slots).", num_slots * slot_bytes)
    yield _gauge("kvdepot_pool_used_bytes", "Bytes of the pool's slots in use.", s.used_slots * slot_bytes)
    yield _gauge("kvdepot_pool_slots", "Slots of the pool.", num_slots)
    yield _gauge("kvdepot_pool_free_bytes", "Bytes of the pool's slots that are up and in no block's run (a "
                 "free run in an extent of one block size serves that size alone).", s.free_bytes)
    yield _gauge("kvdepot_pool_free_any_size_bytes", "Of the free bytes, those in extents no block holds: room "
                 "for a block of any size.", s.free_any_size_bytes)
    if tenant_series:  # with the pool's used bytes they would tell a tenant's block size
        yield _gauge("kvdepot_pool_kv_bytes", "Bytes of KV the pool's used slots hold (each namespace's blocks "
                     "times its block bytes; a block takes a run of ceil(block / slot) slots).", s.kv_bytes)
        yield _gauge("kvdepot_pool_fragmentation_ratio", "Share of the used slots' bytes that holds no KV (the "
                     "unused end of each block's last slot).", s.fragmentation)
    yield _gauge("kvdepot_pool_online_bytes", "Bytes of the pool that are up (faulted in and pinned); below "
                 "the capacity while the pool comes up after a start.", s.pool.online_slots * slot_bytes)
    yield _gauge("kvdepot_pinned_slots", "Slots held by jobs in flight (never evicted).", s.pinned_slots)
    yield _gauge("kvdepot_sessions", "Client sessions attached now.", s.sessions)
    ended = CounterMetricFamily("kvdepot_sessions_ended_total", "Client sessions that ended.")
    ended.add_metric([], s.sessions_ended)
    yield ended
    yield _gauge("kvdepot_jobs_in_flight", "Stores and loads in flight.", s.jobs_in_flight)
    yield _gauge("kvdepot_namespaces", "Namespaces the daemon holds now.", len(s.namespaces) + s.namespaces_omitted)
    yield _gauge(
        "kvdepot_open_ipc_mappings", "Workers' GPU allocations the daemon has opened (CUDA IPC).", s.open_ipc_mappings
    )
    gpu = GaugeMetricFamily(
        "kvdepot_gpu_daemon_memory_bytes",
        "GPU memory this daemon process holds, per GPU (NVML); absent where NVML cannot tell.",
        labels=["gpu", "uuid"],
    )
    for g in s.gpus:
        if g.daemon_memory_bytes:
            gpu.add_metric([str(g.index), g.uuid], g.daemon_memory_bytes)
    yield gpu

    if tenant_series:
        yield from _namespace_families(s)
    yield from _tier_families(s.tiers)
    yield from _numa_families(s)


def _numa_families(s: Report):
    """The pool's NUMA nodes (one series of node="any" for a pool not carved on several)."""
    labels = ["node"]
    slots = GaugeMetricFamily("kvdepot_numa_node_slots", "Slots of the pool's range on each NUMA node.", labels=labels)
    used = GaugeMetricFamily(
        "kvdepot_numa_node_used_slots", "Slots in use of each NUMA node's range (blocks, and stores in flight).",
        labels=labels,
    )
    bound = GaugeMetricFamily(
        "kvdepot_numa_node_bound", "1 when the kernel placed the node's range on the node (mbind), else 0.",
        labels=labels,
    )
    gpus = GaugeMetricFamily(
        "kvdepot_numa_node_gpu", "1 for each GPU (PCI address) that sysfs places on the node (unknown: on none).",
        labels=["node", "pci"],
    )
    for n in s.numa_nodes:
        node = str(n.node) if n.node >= 0 else "any"
        slots.add_metric([node], n.slots)
        used.add_metric([node], n.used_slots)
        bound.add_metric([node], int(n.bound))
    # By sysfs's node, whether or not the pool is carved over it.
    for node, pcis in sorted(s.numa_gpus.items()):
        for pci in pcis:
            gpus.add_metric([str(node) if node >= 0 else "unknown", pci], 1)
    yield from (slots, used, bound, gpus)


def _namespace_families(s: Report):
    """Each namespace's name, scope and counts: for a scrape with the token only."""
    failed = CounterMetricFamily(
        "kvdepot_namespace_failed_jobs_total", "Jobs that failed, per namespace.", labels=["namespace", "scope"]
    )
    ready = GaugeMetricFamily(
        "kvdepot_namespace_ready_blocks", "Blocks of the namespace that lookups and loads see.",
        labels=["namespace", "scope"],
    )
    used = GaugeMetricFamily(
        "kvdepot_namespace_used_bytes", "Bytes of the pool's slots the namespace holds.", labels=["namespace", "scope"]
    )
    kv = GaugeMetricFamily(
        "kvdepot_namespace_kv_bytes", "Bytes of KV in the slots the namespace holds (0 while its block size is not "
        "known).", labels=["namespace", "scope"]
    )
    block = GaugeMetricFamily(
        "kvdepot_namespace_block_bytes", "Bytes of one block of one rank of the namespace (0: not known yet).",
        labels=["namespace", "scope"]
    )
    for ns in s.namespaces:
        failed.add_metric([ns.name, ns.scope], ns.counters.failed_jobs)
        ready.add_metric([ns.name, ns.scope], ns.ready_blocks)
        used.add_metric([ns.name, ns.scope], ns.used_slots * s.pool.slot_bytes)
        kv.add_metric([ns.name, ns.scope], ns.used_bytes)
        block.add_metric([ns.name, ns.scope], ns.block_bytes)
    yield failed
    yield ready
    yield used
    yield kv
    yield block


def _counters(prefix: str, scope_help: str, rows: list[tuple[list[str], Counters]], labels: tuple = ()):
    labels = list(labels)
    for field_name, (name, help) in COUNTERS.items():
        family = CounterMetricFamily(prefix + name, help + scope_help, labels=labels)
        for values, counters in rows:
            family.add_metric(values, getattr(counters, field_name))
        yield family
    blocks = CounterMetricFamily(prefix + "lookup_blocks_total", LOOKUP_BLOCKS_HELP + scope_help,
                                 labels=[*labels, "result"])
    for values, counters in rows:
        disk_hits = min(counters.disk_hit_blocks, counters.hit_blocks)
        blocks.add_metric([*values, "hit"], counters.hit_blocks - disk_hits)
        blocks.add_metric([*values, "disk_hit"], disk_hits)
        blocks.add_metric([*values, "miss"], counters.miss_blocks)
    yield blocks


def _tier_families(tiers: list):
    for field_name, (name, help, counter) in TIER_FIELDS.items():
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        family = kind("kvdepot_tier_" + name + ("_total" if counter else ""), help, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier.name], getattr(tier, field_name))
        yield family
    discarded = CounterMetricFamily(
        "kvdepot_tier_discarded_shards_total",
        "Shards a tier discarded rather than serve, by reason (torn, data_hash, corrupt, format...).",
        labels=["tier", "reason"],
    )
    for tier in tiers:
        for reason, count in sorted(tier.discarded.items()):
            discarded.add_metric([tier.name, reason], count)
    yield discarded
    remote = [tier for tier in tiers if tier.circuit]
    if not remote:
        return
    circuit = GaugeMetricFamily(
        "kvdepot_tier_circuit", "The remote store's circuit breaker: 1 for its state now.", labels=["tier", "state"]
    )
    fetches = HistogramMetricFamily(
        "kvdepot_tier_fetch_seconds",
        "Seconds from asking the remote store for a block to its bytes checked in DRAM, of promotions that succeeded.",
        labels=["tier"],
    )
    for tier in remote:
        for state in CIRCUIT_STATES:
            circuit.add_metric([tier.name, state], 1 if tier.circuit == state else 0)
        total, cumulative = 0, []
        for bound, count in zip([*map(str, tier.fetch_bounds), "+Inf"], tier.fetch_counts):
            total += count
            cumulative.append((bound, total))
        fetches.add_metric([tier.name], cumulative, tier.fetch_seconds)
    yield circuit
    yield fetches


class MetricsServer:
    """The HTTP listener of /metrics (metrics_http.py). It binds at start (so
    that a taken port stops the daemon before it pins its pool) and shows the
    depot once attached."""

    def __init__(
        self, listen: str, limits: MetricsLimits | None = None, token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ):
        address = parse_listen(listen)
        self.snapshots = Snapshots()
        public = self._registry(tenant_series=False)
        client_certificates = tls is not None and tls.verify_mode != ssl.CERT_NONE
        full = self._registry(tenant_series=True) if token or client_certificates else None
        self._server: BoundedMetricsServer | None = None
        self._thread: threading.Thread | None = None
        self.address = ""
        self.tenant_series = full is not None
        if address is None:
            return
        host, port = address
        try:
            self._server = BoundedMetricsServer(
                host, port, Views(public, full, token), limits or MetricsLimits(max_connections=16, timeout=10.0), tls
            )
        except OSError as e:
            raise MetricsListenError(
                f"cannot serve metrics on {listen}: {e.strerror or e}; give --metrics-listen a free "
                "HOST:PORT, or none to serve no metrics"
            ) from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvdepot-metrics", daemon=True)
        self._thread.start()
        bound_port = self._server.server_address[1]
        shown_host = f"[{host}]" if ":" in host else host
        self.address = f"{'https' if tls else 'http'}://{shown_host}:{bound_port}/metrics"

    def _registry(self, tenant_series: bool) -> CollectorRegistry:
        registry = CollectorRegistry()
        registry.register(DepotCollector(self.snapshots, tenant_series))
        ProcessCollector(registry=registry)  # CPU, memory, open files, start time
        return registry

    def attach(self, depot, loop: asyncio.AbstractEventLoop) -> None:
        self.snapshots.attach(depot, loop)
        if self.address:
            log.info(
                "serving Prometheus metrics at %s (per-namespace series: %s)", self.address,
                "to scrapes with the metrics token or a client certificate" if self.tenant_series
                else "off; set --metrics-token-file",
            )

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None
