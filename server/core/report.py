"""What the daemon tells operators: the report behind GetStats and /metrics,
and who may see (and clear) which namespaces.

A report is a snapshot of plain values taken on the event loop's thread, so
that whoever formats it (the API's GetStats answer, the metrics scrape thread)
reads nothing that changes under it. The pool and the tiers are for anyone;
namespaces, clients and counters only for those who may see them (another
tenant's counts would tell what it asks).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvdepot.errors import PermissionDenied
from kvdepot.server.core.counters import Counters, JobTimes
from kvdepot.server.core.tenants import Identity
from kvdepot.server.core.tiers import TierStats
from kvdepot.server.core.transport import GpuStats
from kvdepot.server.host.carving import NodeSlots

# Characters of a client's name that a report shows (the client chose it).
CLIENT_NAME_CHARS = 256


@dataclass(frozen=True)
class PoolInfo:
    slot_bytes: int
    num_slots: int
    pinned: bool
    online_slots: int
    bring_up_error: str = ""


@dataclass(frozen=True)
class NamespaceReport:
    name: str
    scope: str
    counters: Counters
    ready_blocks: int
    used_slots: int
    block_bytes: int = 0
    used_bytes: int = 0


@dataclass(frozen=True)
class BlockSizeReport:
    block_bytes: int
    namespaces: int
    used_slots: int
    used_bytes: int


@dataclass(frozen=True)
class ClientReport:
    session_number: int
    client_name: str
    pid: int
    tenant: str
    uid: int
    counters: Counters
    jobs_in_flight: int
    workers: int


@dataclass(frozen=True)
class Report:
    version: str
    instance: str
    uptime_seconds: float
    pool: PoolInfo
    used_slots: int
    eviction: str
    tiers: list[TierStats]
    # The pool's NUMA nodes (host/carving.py): for anyone, like the pool.
    numa_nodes: list[NodeSlots] = field(default_factory=list)
    numa_carved: bool = False
    numa_gpus_elsewhere: tuple[str, ...] = ()
    # Every GPU sysfs shows, by its node there (-1: none known), carved or not.
    numa_gpus: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # What the DRAM holds (pool-wide, for anyone): KV bytes in used slots,
    # free bytes of slots that are up, the used slots' share holding no KV.
    kv_bytes: int = 0
    free_bytes: int = 0
    free_any_size_bytes: int = 0
    fragmentation: float = 0.0
    # The viewer's namespaces by block size.
    block_sizes: list[BlockSizeReport] = field(default_factory=list)
    # What the viewer may see: its scopes' (an admin: everything).
    totals: Counters = field(default_factory=Counters)
    namespaces: list[NamespaceReport] = field(default_factory=list)
    namespaces_omitted: int = 0
    clients: list[ClientReport] = field(default_factory=list)
    clients_omitted: int = 0
    # An admin's alone: the daemon's busy seconds per direction, pins, mappings, GPUs, sessions, jobs.
    admin: bool = False
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    pinned_slots: int = 0
    open_ipc_mappings: int = 0
    gpus: list[GpuStats] = field(default_factory=list)
    sessions: int = 0
    sessions_ended: int = 0
    jobs_in_flight: int = 0
    job_times: JobTimes = field(default_factory=JobTimes)


@dataclass(frozen=True)
class Cleared:
    cleared_blocks: int
    pinned_blocks: int


def visible_to(identity: Identity | None) -> Callable[[str], bool]:
    """Which scopes `identity` may see: its own, every one for an admin, none without an identity."""
    if identity is None:
        return lambda scope: False
    if identity.admin:
        return lambda scope: True
    return lambda scope: scope == identity.scope


def kv_bytes(ns, used_slots: int, slot_bytes: int) -> int:
    """KV bytes `used_slots` of `ns` hold: a shard takes ceil(block / slot)
    slots of them; a slot of a block size not known counts as full."""
    if not ns.block_bytes:
        return used_slots * slot_bytes
    return used_slots // -(-ns.block_bytes // slot_bytes) * ns.block_bytes


def by_block_size(counts: dict, slot_bytes: int) -> list[BlockSizeReport]:
    sizes: dict[int, list[int]] = {}
    for ns, (used, _, _) in counts.items():
        entry = sizes.setdefault(ns.block_bytes, [0, 0, 0])
        entry[0] += 1
        entry[1] += used
        entry[2] += kv_bytes(ns, used, slot_bytes)
    return sorted((BlockSizeReport(size, *entry) for size, entry in sizes.items()),
                  key=lambda b: b.used_slots, reverse=True)


def _shards(pool, counts: dict) -> int:
    """Shards the pool holds, from every namespace's counts: each of a
    namespace's takes the slots of its block size (one a slot where no worker
    told it yet)."""
    return sum(c[0] // pool.span(ns.block_bytes) if ns.block_bytes else c[0] for ns, c in counts.items())


def build(depot, viewer: Identity | None, asking_session_id: str, most: int | None) -> Report:
    pool = depot.pool
    # What jobs hold first, then everything that finished jobs change (counters,
    # namespaces' and the pool's slots): where jobs finish on a thread of their
    # own meanwhile (the native lane), a job seen gone is then seen counted and
    # its slots seen freed, never the other way round.
    pinned_slots, jobs_in_flight = depot.index.pinned_slots, depot.jobs_in_flight
    visible = visible_to(viewer)
    # The caller's namespaces alone: with the pool's used slots, anyone's KV
    # bytes would tell another tenant's block size (its model's shape).
    every = {ns: depot.namespace_counts(ns) for ns in depot.namespaces}
    counts = {ns: c for ns, c in every.items() if visible(ns.scope)}
    held = sum(kv_bytes(ns, c[0], pool.slot_bytes) for ns, c in counts.items())
    used_bytes = sum(c[0] for c in counts.values()) * pool.slot_bytes
    base = dict(
        version=depot.version,
        instance=depot.instance,
        uptime_seconds=time.monotonic() - depot.started,
        pool=depot.pool_info(),
        used_slots=pool.used_slots,
        eviction=depot.evictions.name,
        tiers=depot.index.tiers.stats(
            TierStats("dram", shards=_shards(pool, every), bytes=pool.used_slots * pool.slot_bytes,
                      capacity_bytes=pool.size)
        ),
        numa_nodes=pool.numa_nodes(),
        numa_carved=pool.slots.carved,
        numa_gpus_elsewhere=pool.numa_gpus_elsewhere(),
        numa_gpus=dict(pool.placement.gpus),
        kv_bytes=held,
        free_bytes=(pool.online_slots - pool.used_slots) * pool.slot_bytes,
        free_any_size_bytes=pool.slots.free_extent_slots * pool.slot_bytes,
        fragmentation=1.0 - min(held, used_bytes) / used_bytes if used_bytes else 0.0,
    )
    if viewer is None:
        return Report(**base)
    most = most if most is not None else depot.limits.stats_max_entries
    namespaces = sorted(counts, key=lambda ns: counts[ns][0], reverse=True)
    clients = {
        s: depot.session_counts(s) for s in depot.sessions.values()
        if s.identity is not None and visible(s.identity.scope) and s.id != asking_session_id
    }
    sessions = sorted(clients, key=lambda s: clients[s][2].stored_bytes + clients[s][2].loaded_bytes, reverse=True)
    base.update(
        namespaces=[
            NamespaceReport(ns.name, ns.scope, counts[ns][2].copy(), counts[ns][1], counts[ns][0], ns.block_bytes,
                            ns.block_bytes and kv_bytes(ns, counts[ns][0], pool.slot_bytes))
            for ns in namespaces[:most]
        ],
        block_sizes=by_block_size(counts, pool.slot_bytes),
        namespaces_omitted=max(0, len(namespaces) - most),
        clients=[_client(s, *clients[s]) for s in sessions[:most]],
        clients_omitted=max(0, len(sessions) - most),
    )
    if not viewer.admin:
        return Report(**base, totals=_sum(counts[ns][2] for ns in namespaces))
    transports = depot.transports.values()
    totals, job_times = depot.finished_counts()
    store_seconds, load_seconds = depot.busy_seconds()
    return Report(
        **base,
        totals=totals.copy(),
        admin=True,
        store_seconds=store_seconds,
        load_seconds=load_seconds,
        pinned_slots=pinned_slots,
        open_ipc_mappings=sum(t.open_mappings for t in transports),
        # NVML is asked here, on the loop: about a millisecond per GPU.
        gpus=[gpu for t in transports for gpu in t.gpu_stats()],
        sessions=len(depot.sessions),
        sessions_ended=depot.sessions_ended,
        jobs_in_flight=jobs_in_flight,
        job_times=job_times.copy(),
    )


def _client(session, jobs: int, workers: int, counters: Counters) -> ClientReport:
    who = session.identity
    return ClientReport(
        session_number=session.number,
        client_name=session.client_name[:CLIENT_NAME_CHARS],
        pid=who.pid,
        tenant=who.tenant,
        uid=who.uid if who.uid is not None else 0,
        counters=counters.copy(),
        jobs_in_flight=jobs,
        workers=workers,
    )


def _sum(counters: Iterable[Counters]) -> Counters:
    total = Counters()
    for c in counters:
        total.add(c)
    return total


def clear_scope(namespaces, identity: Identity | None, namespace_name: str) -> list:
    """The namespaces a Clear of `namespace_name` (empty: all) by `identity` empties."""
    if identity is None:
        raise PermissionDenied("clearing needs a session: name the caller's session_id")
    visible = visible_to(identity)
    if namespace_name:
        return [namespaces.named(namespace_name, lambda ns: visible(ns.scope))]
    if not identity.admin:
        raise PermissionDenied(
            f"clearing every namespace is for admins ({identity.describe()} is not): clear yours by name"
        )
    return [None]  # every namespace
