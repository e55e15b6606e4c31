"""Counters kept for the whole daemon, each namespace and each client, and the
GetStats answer built from them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

from kvdepot.errors import PermissionDenied
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.server.core.limits import shown
from kvdepot.server.core.tenants import Identity

log = logging.getLogger("kvdepot.depot")

# Characters of a client's name that stats show (the client chose it).
CLIENT_NAME_CHARS = 256


@dataclass
class Counters:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    evicted_blocks: int = 0
    failed_jobs: int = 0
    disk_hit_blocks: int = 0

    def add(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, min(getattr(self, f.name) + getattr(other, f.name), 2**64 - 1))

    def to_proto(self, store_seconds: float = 0.0, load_seconds: float = 0.0) -> pb.Counters:
        msg = pb.Counters(**{f.name: getattr(self, f.name) for f in fields(self)})
        if store_seconds > 0:
            msg.store_gbps = self.stored_bytes / store_seconds / 1e9
        if load_seconds > 0:
            msg.load_gbps = self.loaded_bytes / load_seconds / 1e9
        return msg


class BusyClock:
    """Time during which at least one job of one direction was in flight.

    Bytes over this time is the rate the transport achieved, not diluted by
    idle periods between requests.
    """

    def __init__(self) -> None:
        self._in_flight = 0
        self._since = 0.0
        self._total = 0.0

    def start(self) -> None:
        if self._in_flight == 0:
            self._since = time.monotonic()
        self._in_flight += 1

    def stop(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._total += time.monotonic() - self._since

    @property
    def seconds(self) -> float:
        if self._in_flight:
            return self._total + time.monotonic() - self._since
        return self._total


def visible_to(identity: Identity | None):
    """Which namespaces (and sessions) `identity` may see: its own scope's,
    every one for an admin, none without an identity."""
    if identity is None:
        return lambda scope: False
    if identity.admin:
        return lambda scope: True
    return lambda scope: scope == identity.scope


def stats_response(depot, identity: Identity | None, asking_session_id: str = "") -> pb.GetStatsResponse:
    """GetStats' answer: the pool for anyone; namespaces, sessions and counters
    for those who may see them (another tenant's counts would tell what it asks)."""
    pool = depot.pool
    used = pool.used_slots
    response = pb.GetStatsResponse(
        daemon_version=depot.version,
        daemon_instance=depot.instance,
        uptime_seconds=time.monotonic() - depot.started,
        pool=pb.PoolInfo(slot_bytes=pool.slot_bytes, num_slots=pool.num_slots, pinned=pool.pinned),
        used_slots=used,
        occupancy=used / pool.num_slots,
        eviction_policy=depot.evictions.name,
    )
    response.tiers.extend(depot.index.tiers.stats(pool))
    if identity is None:
        return response
    visible = visible_to(identity)
    if identity.admin:
        transports = depot.transports.values()
        response.pinned_slots = depot.index.pinned_slots
        response.open_ipc_mappings = sum(t.open_mappings for t in transports)
        response.gpus.extend(gpu for t in transports for gpu in t.gpu_stats())
        response.totals.CopyFrom(depot.totals.to_proto(depot.store_clock.seconds, depot.load_clock.seconds))
        response.sessions_ended = depot.sessions_ended
    else:
        totals = Counters()
        for ns in depot.namespaces:
            if visible(ns.scope):
                totals.add(ns.counters)
        response.totals.CopyFrom(totals.to_proto())
    # A reply that grows with the clients and namespaces a node has seen would
    # one day pass gRPC's 4 MiB: the busiest come first, the rest are counted.
    most = depot.limits.stats_max_entries
    namespaces = sorted((ns for ns in depot.namespaces if visible(ns.scope)), key=lambda ns: ns.used_slots,
                        reverse=True)
    response.namespaces_omitted = max(0, len(namespaces) - most)
    for ns in namespaces[:most]:
        response.namespaces.add(
            name=ns.name, counters=ns.counters.to_proto(), ready_blocks=ns.ready_blocks, used_slots=ns.used_slots
        )
    sessions = [
        s for s in depot.sessions.values()
        if s.identity is not None and visible(s.identity.scope) and s.id != asking_session_id
    ]
    sessions.sort(key=lambda s: s.counters.stored_bytes + s.counters.loaded_bytes, reverse=True)
    response.clients_omitted = max(0, len(sessions) - most)
    for session in sessions[:most]:
        who = session.identity
        response.clients.add(
            session_number=session.number,
            client_name=session.client_name[:CLIENT_NAME_CHARS],
            pid=who.pid,
            tenant=who.tenant,
            uid=who.uid if who.uid is not None else 0,
            counters=session.counters.to_proto(),
            jobs_in_flight=len(session.jobs),
            workers=len(session.workers),
        )
    return response


def _clear_scope(depot, identity: Identity | None, namespace_name: str) -> list:
    """The namespaces a Clear of `namespace_name` (empty: all) by `identity` empties."""
    if identity is None:
        raise PermissionDenied("clearing needs a session: name the caller's session_id")
    visible = visible_to(identity)
    if namespace_name:
        return [depot.namespaces.named(namespace_name, lambda ns: visible(ns.scope))]
    if not identity.admin:
        raise PermissionDenied(
            f"clearing every namespace is for admins ({identity.describe()} is not): clear yours by name"
        )
    return [None]  # every namespace


def clear_response(depot, identity: Identity | None, namespace_name: str) -> pb.ClearResponse:
    """Clear's answer, once the namespaces `identity` may empty are emptied."""
    cleared = pinned = 0
    for target in _clear_scope(depot, identity, namespace_name):
        counts = depot.index.clear(target)
        cleared, pinned = cleared + counts[0], pinned + counts[1]
    depot.changes.send()
    log.info("%s cleared %d block(s) of %s; %d pinned kept", identity.describe(), cleared,
             shown(namespace_name) if namespace_name else "every namespace", pinned)
    return pb.ClearResponse(cleared_blocks=cleared, pinned_blocks=pinned)
