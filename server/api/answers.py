"""The wire's answers built from the core's values: GetStats from a report,
notices as Notification messages, lookups, clears and job results; and the
job socket's framing of a reply."""

from __future__ import annotations

from dataclasses import asdict, fields

import grpc

from kvdepot.defaults import JOB_FRAME_HEADER
from kvdepot.errors import KVDepotError
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.server.core.counters import Counters
from kvdepot.server.core.index import LookupResult
from kvdepot.server.core.jobs import Submitted
from kvdepot.server.core.outbox import BlocksChanged, JobDone, Notice
from kvdepot.server.core.report import Cleared, PoolInfo, Report
from kvdepot.server.core.requests import LookupStatus
from kvdepot.server.core.tiers import TierStats

_LOOKUP_STATUS = {LookupStatus.READY: pb.LookupResponse.READY, LookupStatus.NOT_YET: pb.LookupResponse.NOT_YET}


def pool_info(pool: PoolInfo) -> pb.PoolInfo:
    return pb.PoolInfo(slot_bytes=pool.slot_bytes, num_slots=pool.num_slots, pinned=pool.pinned,
                       online_slots=pool.online_slots, bring_up_error=pool.bring_up_error)


def lookup(result: LookupResult) -> pb.LookupResponse:
    return pb.LookupResponse(
        status=_LOOKUP_STATUS[result.status],
        ready_blocks=result.ready,
        loading_blocks=result.loading,
        storing_blocks=result.storing,
    )


def store_submitted(answer: Submitted) -> pb.SubmitStoreResponse:
    return pb.SubmitStoreResponse(already_stored=answer.already_stored, not_stored=answer.not_stored)


def cleared(answer: Cleared) -> pb.ClearResponse:
    return pb.ClearResponse(cleared_blocks=answer.cleared_blocks, pinned_blocks=answer.pinned_blocks)


def job_done(done: JobDone) -> pb.JobDone:
    return pb.JobDone(job_id=done.job_id, ok=done.ok, error=done.error, already_stored=done.already_stored,
                      not_stored=done.not_stored)


def notification(notice: Notice) -> pb.Notification:
    if isinstance(notice, BlocksChanged):
        return pb.Notification(blocks_changed=pb.BlocksChanged(
            engine_id=notice.engine_id, ready=notice.ready, storing=notice.storing, dropped=notice.dropped,
            lower=notice.lower, were_ready=notice.were_ready,
        ))
    return pb.Notification(job_done=job_done(notice))


def _counters(counters: Counters, store_seconds: float = 0.0, load_seconds: float = 0.0) -> pb.Counters:
    message = pb.Counters(**{f.name: getattr(counters, f.name) for f in fields(counters)})
    if store_seconds > 0:
        message.store_gbps = counters.stored_bytes / store_seconds / 1e9
    if load_seconds > 0:
        message.load_gbps = counters.loaded_bytes / load_seconds / 1e9
    return message


def _tier(stats: TierStats) -> pb.TierStats:
    values = asdict(stats)
    discarded = values.pop("discarded")
    message = pb.TierStats(**values)
    message.discarded.update(discarded)
    return message


def stats(report: Report, identified: bool) -> pb.GetStatsResponse:
    """GetStats' answer; a caller not `identified` gets the pool and the tiers alone."""
    response = pb.GetStatsResponse(
        daemon_version=report.version,
        daemon_instance=report.instance,
        uptime_seconds=report.uptime_seconds,
        pool=pool_info(report.pool),
        used_slots=report.used_slots,
        occupancy=report.used_slots / report.pool.num_slots,
        eviction_policy=report.eviction,
        tiers=[_tier(t) for t in report.tiers],
        numa_carved=report.numa_carved,
        numa_gpus_elsewhere=report.numa_gpus_elsewhere[:64],
        kv_bytes=report.kv_bytes,
        free_bytes=report.free_bytes,
        free_any_size_bytes=report.free_any_size_bytes,
        fragmentation=report.fragmentation,
    )
    for n in report.numa_nodes:
        response.numa_nodes.add(node=n.node, first_slot=n.first_slot, slots=n.slots, used_slots=n.used_slots,
                                bound=n.bound, gpus=n.gpus)
    if not identified:
        return response
    if report.admin:
        response.pinned_slots = report.pinned_slots
        response.open_ipc_mappings = report.open_ipc_mappings
        response.gpus.extend(pb.GpuStats(index=g.index, uuid=g.uuid, daemon_memory_bytes=g.daemon_memory_bytes)
                             for g in report.gpus)
        response.sessions_ended = report.sessions_ended
    response.totals.CopyFrom(_counters(report.totals, report.store_seconds, report.load_seconds))
    response.namespaces_omitted = report.namespaces_omitted
    for ns in report.namespaces:
        response.namespaces.add(
            name=ns.name, counters=_counters(ns.counters), ready_blocks=ns.ready_blocks, used_slots=ns.used_slots,
            block_bytes=ns.block_bytes, used_bytes=ns.used_bytes,
        )
    for size in report.block_sizes:
        response.block_sizes.add(block_bytes=size.block_bytes, namespaces=size.namespaces,
                                 used_slots=size.used_slots, used_bytes=size.used_bytes)
    response.clients_omitted = report.clients_omitted
    for client in report.clients:
        response.clients.add(
            session_number=client.session_number,
            client_name=client.client_name,
            pid=client.pid,
            tenant=client.tenant,
            uid=client.uid,
            counters=_counters(client.counters),
            jobs_in_flight=client.jobs_in_flight,
            workers=client.workers,
        )
    return response


def job_frame(message) -> bytes:
    """A message as the job socket sends it: its length, then its bytes."""
    data = message.SerializeToString()
    return JOB_FRAME_HEADER.pack(len(data)) + data


def job_refused(request_id: int, error: Exception) -> bytes:
    """A request's refusal on the job socket. An error that is not a
    KVDepotError is a bug in the daemon: INTERNAL."""
    status = error.code if isinstance(error, KVDepotError) else grpc.StatusCode.INTERNAL
    refused = pb.JobRefused(code=status.value[0], message=str(error))
    return job_frame(pb.JobReply(request_id=request_id, refused=refused))
