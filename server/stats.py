"""Counters kept for the whole daemon, each namespace and each client, and the
GetStats answer built from them."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from kvdepot.proto import kvdepot_pb2 as pb

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


def stats_response(depot) -> pb.GetStatsResponse:
    """GetStats' answer: the depot's state and counters, for operators."""
    pool = depot.pool
    used = pool.used_slots
    transports = depot.transports.values()
    response = pb.GetStatsResponse(
        daemon_version=depot.version,
        daemon_instance=depot.instance,
        uptime_seconds=time.monotonic() - depot.started,
        pool=depot.pool_info(),
        used_slots=used,
        pinned_slots=depot.index.pinned_slots,
        quarantined_slots=depot.quarantine.slots,
        open_ipc_mappings=sum(t.open_mappings for t in transports),
        gpus=[gpu for t in transports for gpu in t.gpu_stats()],
        occupancy=used / pool.num_slots,
        eviction_policy=depot.policy.name,
        totals=depot.totals.to_proto(depot.store_clock.seconds, depot.load_clock.seconds),
        sessions_ended=depot.sessions_ended,
    )
    # A reply that grows with the clients and namespaces a node has seen would
    # one day pass gRPC's 4 MiB: the busiest come first, the rest are counted.
    most = depot.limits.stats_max_entries
    namespaces = sorted(depot.namespaces, key=lambda ns: ns.used_slots, reverse=True)
    response.namespaces_omitted = max(0, len(namespaces) - most)
    for ns in namespaces[:most]:
        response.namespaces.add(
            name=ns.name, counters=ns.counters.to_proto(), ready_blocks=ns.ready_blocks, used_slots=ns.used_slots
        )
    sessions = sorted(depot.sessions.values(), key=lambda s: s.counters.stored_bytes + s.counters.loaded_bytes,
                      reverse=True)
    response.clients_omitted = max(0, len(sessions) - most)
    for session in sessions[:most]:
        response.clients.add(
            session_id=session.id,
            client_name=session.client_name[:CLIENT_NAME_CHARS],
            pid=session.pid,
            counters=session.counters.to_proto(),
            jobs_in_flight=len(session.jobs),
            workers=len(session.workers),
        )
    return response
