"""The daemon's state machine: sessions, workers, registrations, lookups,
reports; its jobs are the Python lane's (jobs.py), or the native lane's
(server/native/depot.py, which takes this depot for its control plane).

It speaks no protocol and knows no transport by name: the API wing
(server/api) reads requests into the plain values of requests.py, calls
here, and turns the answers (and the typed errors raised here) into messages;
each transport moves bytes behind the interface of transport.py, and the tiers
below DRAM sit behind tiers.py. Every method runs on the event loop's thread,
so the state needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from kvdepot.errors import (
    ComingUp,
    FailedPrecondition,
    InvalidArgument,
    KVDepotError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvdepot.logsafe import RateLimitedLog
from kvdepot.server.core import report, staging
from kvdepot.server.core.blocks import Block
from kvdepot.server.core.counters import COUNTER_MAX, BusyClock, Counters, JobTimes
from kvdepot.server.core.index import BlockIndex, LookupResult
from kvdepot.server.core.jobs import JobPath
from kvdepot.server.core.limits import Limits, StagingBudget, shown
from kvdepot.server.core.namespaces import Namespace, Namespaces
from kvdepot.server.core.outbox import ChangeFeed
from kvdepot.server.core.registration import worker_layout
from kvdepot.server.core.requests import LookupStatus, NamespaceSpec, WorkerSpec, check_keys
from kvdepot.server.core.sessions import Session, Worker
from kvdepot.server.core.shares import ScopedEviction
from kvdepot.server.core.tenants import Identity
from kvdepot.server.core.tiers import TierStack
from kvdepot.server.core.transport import Transport

log = logging.getLogger("kvdepot.depot")


class Depot(JobPath):
    def __init__(
        self,
        pool,
        eviction: str,
        instance: str,
        version: str,
        limits: Limits | None = None,
        quotas: dict[str, int] | None = None,
        tiers: TierStack | None = None,
    ):
        self.pool = pool
        self.limits = limits = limits or Limits()
        self.instance = instance
        self.version = version
        self.started = time.monotonic()
        self.totals = Counters()
        self.store_clock = BusyClock()
        self.load_clock = BusyClock()
        self.job_times = JobTimes()
        self.sessions: dict[str, Session] = {}
        self.sessions_ended = 0
        self.changes = ChangeFeed(self.sessions)
        self.namespaces = Namespaces(self.new_id, self._namespace_created, limits, self._holds_blocks,
                                     self._namespace_freed)
        self.evictions = ScopedEviction(eviction, pool.num_slots, quotas)
        self.index = self._open_index(pool, tiers)
        # By the kind of handles their workers register with.
        self.transports: dict[str, Transport] = {}
        # Kinds still coming up (CUDA's, after the daemon serves: daemon/main.py), and why one never did.
        self._coming: dict[str, asyncio.Future] = {}
        # Registrations waiting for one, by (uid, tenant).
        self._waiting: dict[tuple, int] = {}
        self._not_up: dict[str, str] = {}
        self.staging_budget = StagingBudget(limits)
        self.draining = False
        self._jobs_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._next_id = 1
        # Sessions that never said hello are any local process's to make at will: their
        # comings and goings are DEBUG lines, and ending them for room a line now and then.
        self._unproven_log = RateLimitedLog(log)

    def _open_index(self, pool, tiers: TierStack | None):
        return BlockIndex(
            pool, self.evictions, self.namespaces, self._count_eviction, self.changes.note, self.changes.send, tiers
        )

    def _namespace_created(self, ns: Namespace) -> None:
        log.info("namespace %r created", ns.name)

    def _holds_blocks(self, ns: Namespace) -> bool:
        return ns.used_slots > 0 or ns.ready_blocks > 0

    def _namespace_freed(self, ns: Namespace) -> None:
        pass

    def pool_info(self) -> report.PoolInfo:
        return report.PoolInfo(self.pool.slot_bytes, self.pool.num_slots, self.pool.pinned, self.pool.online_slots,
                               self.pool.bring_up_error)

    def add_transport(self, transport: Transport) -> None:
        self.transports[transport.handle_kind] = transport
        self._arrived(transport.handle_kind)

    def transport_coming(self, kind: str) -> None:
        """A transport of `kind` is on its way up: its workers' registrations wait for it."""
        self._coming[kind] = asyncio.get_running_loop().create_future()

    def transport_failed(self, kind: str, why: str) -> None:
        """The transport of `kind` never came up: its workers are refused, and told why."""
        self._not_up[kind] = why
        self._arrived(kind)

    def _arrived(self, kind: str) -> None:
        coming = self._coming.pop(kind, None)
        if coming is not None and not coming.done():
            coming.set_result(None)

    async def transport_up(self, kind: str | None, identity: Identity, within: float | None = None) -> None:
        """Returns once the transport of `kind` is up (or never will be);
        ComingUp if it is not within `within` seconds (a caller's deadline:
        it is told to ask again rather than left to time out). A user may
        have only so many calls waiting (Limits.room_to_wait): each holds
        its request until then."""
        coming = self._coming.get(kind)
        if coming is None:
            return
        who = (identity.uid, identity.tenant)
        self.limits.room_to_wait(self._waiting.get(who, 0), identity, kind)
        self._waiting[who] = self._waiting.get(who, 0) + 1
        try:
            await asyncio.wait_for(asyncio.shield(coming), within)
        except TimeoutError:
            raise ComingUp(f"the daemon's {kind} transport is still starting; ask again") from None
        finally:
            self._waiting[who] -= 1
            if not self._waiting[who]:
                del self._waiting[who]

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # ------------------------------------------------------------ sessions

    def attach(self, client_name: str, identity: Identity | None) -> Session:
        """A new session; `identity` is None where the client must still prove
        who it is (prove())."""
        if self.draining:
            raise Unavailable("the daemon is shutting down")
        # Kept and shown: bounded, and escaped wherever it is logged.
        self.limits.check_text("client_name", client_name, printable=False)
        if identity is None:
            for oldest in self.limits.unproven_over(self.sessions.values()):
                self.expel(oldest, f"it had not said hello on the job socket when a newer session needed its place "
                                   f"(--max-unproven-sessions {self.limits.max_unproven_sessions})")
        else:
            self.limits.room_for_session(self.sessions.values(), identity)
        session = Session(secrets.token_hex(16), self.new_id(), client_name, identity)
        self.sessions[session.id] = session
        # A session still to say hello is logged as attached when it does (prove()).
        log.log(logging.INFO if identity else logging.DEBUG, "session %d attached: %s%s", session.number,
                shown(client_name), _who(session))
        return session

    def prove(self, session_id: str, identity: Identity) -> Session:
        """The session's identity, as the kernel told it for its job socket."""
        session = self._session(session_id)
        known = session.identity
        if known is not None and (known.uid, known.pid) != (identity.uid, identity.pid):
            raise PermissionDenied(f"session {session.number} belongs to another process")
        if known is None:
            self.limits.room_for_session(self.sessions.values(), identity)
            session.identity = identity
            log.info("session %d attached: %s%s", session.number, shown(session.client_name), _who(session))
        return session

    def end_session(self, session: Session) -> None:
        """The client is gone: its jobs end, its pins and mappings are released."""
        if session.ended:
            return
        session.ended = True
        session.outbox.close()
        for memory in session.staging.values():
            memory.close()
        session.staging.clear()
        jobs = self._end_jobs(session)
        for ns in session.engines.values():
            self._engine_gone(ns)
        for ns in [*session.engines.values(), *(w.ns for w in session.workers.values())]:
            self.namespaces.release(ns)
        self.namespaces.sweep()
        del self.sessions[session.id]
        self.sessions_ended += 1
        log.log(logging.INFO if session.identity else logging.DEBUG, "session %d ended: %s%s, %d job(s) were in flight",
                session.number, shown(session.client_name), _who(session), jobs)

    def _end_jobs(self, session: Session) -> int:
        """The session's jobs end (abandoned to their transports) and its workers
        close once their copies have; returns how many jobs were in flight."""
        jobs = list(session.jobs.values())
        for job in jobs:
            job.worker.transport.abandon(job)
        for worker in session.workers.values():
            try:
                worker.transport.close_worker(worker)
            except Exception:  # the other workers' mappings must still be closed
                log.exception("closing worker %d failed", worker.id)
        return len(jobs)

    def _engine_registered(self, ns: Namespace) -> None:
        """An engine keeps a copy of `ns`'s keys from now on."""

    def _engine_gone(self, ns: Namespace) -> None:
        """One of `ns`'s engines is gone."""

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            # The id is not repeated: a guess must learn nothing, and logs keep no secrets.
            raise NotFound("unknown session: attach first (after a daemon restart, attach and register again)")
        return session

    def session(self, session_id: str) -> Session:
        """A session that has proven who it is."""
        session = self._session(session_id)
        if session.identity is None:
            raise FailedPrecondition(
                f"session {session.number} has not said hello on the job socket yet: the daemon "
                "takes a unix-socket client's identity from that connection"
            )
        return session

    # ------------------------------------------------------------ registration

    def register_engine(self, session_id: str, spec: NamespaceSpec) -> tuple[int, Namespace]:
        session = self.session(session_id)
        self.limits.room_for_engine(session)
        ns = self.namespaces.of(spec, session.identity.scope)
        engine_id = self.new_id()
        session.engines[engine_id] = ns
        self.namespaces.acquire(ns)
        self._engine_registered(ns)
        ready, storing, held = self.index.snapshot(ns)
        lower = self.index.tiers.lower_keys(ns, held)
        session.outbox.snapshot(engine_id, ready, storing, lower)
        return engine_id, ns

    def register_worker(self, session_id: str, spec: WorkerSpec) -> Worker:
        session = self.session(session_id)
        self.limits.room_for_worker(session)
        ns = self.namespaces.of(spec.namespace, session.identity.scope)
        layout = worker_layout(spec, ns, self.pool.largest_shard, self.limits)
        if spec.transport is None:
            raise InvalidArgument("all handles of a worker must be of one transport")
        transport = self.transports.get(spec.transport)
        if transport is None:
            why = self._not_up.get(spec.transport)
            raise FailedPrecondition(
                f"this daemon's {spec.transport} transport did not start: {why}" if why else
                f"this daemon has no {spec.transport} transport (available: {', '.join(self.transports)})"
            )
        worker = Worker(self.new_id(), session, ns, spec.rank, spec.device, layout, transport)
        transport.open_worker(worker, spec)
        try:
            ns.fix_rank_layout(spec.rank, layout)
        except BaseException:
            transport.close_worker(worker)
            raise
        session.workers[worker.id] = worker
        self.namespaces.acquire(ns)
        log.info("worker %d registered: %r rank %d on %r, %d tensors, %d blocks of %d bytes, %s", worker.id,
                 ns.name, worker.rank, worker.device, len(layout.tensors), layout.num_blocks, layout.block_bytes,
                 transport.name)
        return worker

    # The job socket's connections stay with the API wing (api/job_socket.py);
    # the native lane takes them after their hello (server/native/depot.py).
    takes_job_connections = False

    def adopt_job_connection(self, session: Session, fd: int, peer: str, uid: int, first: bytes, leftover: bytes,
                             quiet: bool, release) -> bool:
        raise NotImplementedError("this depot leaves job socket connections to the API wing")

    def take_staging(self, session_id: str, identity: Identity, fd: int) -> int:
        """Keeps a worker's staging memory (a descriptor from the job socket,
        closed here whatever happens) for the session's next RegisterWorker."""
        return staging.take(self, session_id, identity, fd)

    # ------------------------------------------------------------ lookup

    def _engine(self, session: Session, engine_id: int) -> Namespace:
        ns = session.engines.get(engine_id)
        if ns is None:
            raise NotFound(f"unknown engine {engine_id} in this session: register it first")
        return ns

    async def lookup_asking(self, session_id: str, engine_id: int, keys) -> LookupResult:
        """`lookup`, but where DRAM and the tiers that know their blocks miss,
        a tier that must ask (the remote store) is asked first (the event loop
        serves others meanwhile): the blocks it has then start their promotion."""
        ns = self._engine(self.session(session_id), engine_id)
        tiers = self.index.tiers
        if tiers.may_find(ns):
            checked = check_keys(keys)
            # Not yet "gone" to engines: the remote store has not been asked.
            result = self.index.lookup(ns, checked, note_gone=False)
            if result.status is LookupStatus.READY and result.ready < len(checked):
                await tiers.find(ns, checked[result.ready :])
        # The session or its engine may have ended while the store answered.
        return self.lookup(session_id, engine_id, keys)

    def lookup(self, session_id: str, engine_id: int, keys) -> LookupResult:
        session = self.session(session_id)
        ns = self._engine(session, engine_id)
        keys = check_keys(keys)
        result = self.index.lookup(ns, keys)
        self.changes.send()
        if result.status is LookupStatus.READY:
            self._count(session, ns, lookups=1, hit_blocks=result.ready, miss_blocks=len(keys) - result.ready)
        return result

    def report_lookups(self, session_id: str, engine_id: int, lookups: int, hit_blocks: int, miss_blocks: int) -> None:
        """Lookups an engine answered from its own copy of the keys."""
        session = self.session(session_id)
        ns = self._engine(session, engine_id)
        self.limits.check_lookup_report(lookups, hit_blocks, miss_blocks)
        self._count(session, ns, lookups=lookups, hit_blocks=hit_blocks, miss_blocks=miss_blocks)

    # ------------------------------------------------------------ life cycle

    async def housekeeping(self, interval: float = 0.25) -> None:
        while True:
            await asyncio.sleep(interval)
            self._end_unproven(time.monotonic())
            self.namespaces.sweep()

    def _end_unproven(self, now: float) -> None:
        """Sessions that never proved who they are hold nothing useful: they go."""
        deadline = self.limits.job_hello_timeout
        late = [s for s in self.sessions.values() if s.identity is None and now - s.attached_at > deadline]
        for session in late:
            reason = f"it did not say hello on the job socket within {deadline:g} s (--job-hello-timeout)"
            self.expel(session, reason, FailedPrecondition)

    def expel(self, session: Session, reason: str, error: type[KVDepotError] = ResourceExhausted) -> None:
        """Ends a session the daemon gives up on, now rather than when its client
        reads its stream (which may be never); the stream then ends with `error`
        and `reason`."""
        if session.identity:
            log.warning("ending session %d (%s, %s): %s", session.number, shown(session.client_name),
                        session.identity.describe(), reason)
        else:
            self._unproven_log.warning("expel-unproven", "ending session %d (%s, not proven): %s", session.number,
                                       shown(session.client_name), reason)
        session.outbox.end(reason, error)
        self.end_session(session)

    async def drain(self, timeout: float) -> bool:
        """Refuses new jobs and waits for those in flight; False if time ran out."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def shutdown(self) -> None:
        for transport in self.transports.values():
            transport.shutdown()

    @property
    def jobs_in_flight(self) -> int:
        return self._jobs_in_flight

    # What reports read (core/report.py); the native lane keeps its own.

    def namespace_counts(self, ns: Namespace) -> tuple[int, int, Counters]:
        """(slots used, ready blocks, counters) of `ns`."""
        return ns.used_slots, ns.ready_blocks, ns.counters

    def session_counts(self, session: Session) -> tuple[int, int, Counters]:
        """(jobs in flight, workers, counters) of `session`."""
        return len(session.jobs), len(session.workers), session.counters

    def busy_seconds(self) -> tuple[float, float]:
        return self.store_clock.seconds, self.load_clock.seconds

    def finished_counts(self) -> tuple[Counters, JobTimes]:
        """What finished jobs counted in all, and their durations."""
        return self.totals, self.job_times

    # ------------------------------------------------------------ accounting

    def _count(self, session: Session | None, ns: Namespace, **deltas: int) -> None:
        targets = (self.totals, ns.counters, session.counters) if session else (self.totals, ns.counters)
        for counters in targets:
            for name, delta in deltas.items():
                value = getattr(counters, name) + delta
                setattr(counters, name, value if value <= COUNTER_MAX else COUNTER_MAX)

    def _count_eviction(self, block: Block) -> None:
        # Once per block evicted, which in a full pool is once per block stored.
        self.totals.evicted_blocks += 1
        block.ns.counters.evicted_blocks += 1

    # ------------------------------------------------------------ operators

    def report(self, viewer: Identity | None, asking_session_id: str = "", most: int | None = None) -> report.Report:
        """What `viewer` may see of the daemon (GetStats, /metrics); at most
        `most` namespaces and clients, the busiest."""
        return report.build(self, viewer, asking_session_id, most)

    def clear(self, identity: Identity | None, namespace_name: str) -> report.Cleared:
        """Empties the namespace `namespace_name` (every one: empty name, admins
        only) of what `identity` may see."""
        cleared = pinned = 0
        for target in report.clear_scope(self.namespaces, identity, namespace_name):
            counts = self.index.clear(target)
            cleared, pinned = cleared + counts[0], pinned + counts[1]
        self.changes.send()
        log.info("%s cleared %d block(s) of %s; %d pinned kept", identity.describe(), cleared,
                 shown(namespace_name) if namespace_name else "every namespace", pinned)
        return report.Cleared(cleared, pinned)


def _who(session: Session) -> str:
    return f", {session.identity.describe()}" if session.identity else ""
