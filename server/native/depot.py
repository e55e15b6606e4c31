"""The depot when the native lane runs the per-job path.

The control plane is core/depot.py's (sessions, proofs, registration,
namespaces, lookups' counts, reports, drains): this class hands the lane what
it needs of each (a session, a worker, a namespace), hands it the job
socket's connections after their hello and the gRPC submits, and reads what
it says (its events) after every call and whenever it says it has some. The
lane serves the connections and the copies' ends on its own thread: no job
costs the event loop anything.
"""

from __future__ import annotations

import asyncio
import logging
import os

from kvdepot import jobtrace
from kvdepot.logsafe import RateLimitedLog
from kvdepot.server.core.blocks import BlockState
from kvdepot.server.core.depot import Depot
from kvdepot.server.core.jobs import Submitted
from kvdepot.server.core.namespaces import Namespace
from kvdepot.server.core.requests import JobRequest, WorkerSpec
from kvdepot.server.core.sessions import Session, Worker
from kvdepot.server.core.tenants import Identity
from kvdepot.server.native import binding
from kvdepot.server.native.binding import EventType
from kvdepot.server.native.index import NativeBlock, NativeIndex
from kvdepot.server.native.lane import Lane

log = logging.getLogger("kvdepot.depot")
jobs_log = logging.getLogger("kvdepot.jobs")

_CHANGES = {1: BlockState.STORING, 2: BlockState.READY, 3: BlockState.DROPPED}
_EVICTED = 4
_LEVELS = {20: logging.INFO, 30: logging.WARNING, 40: logging.ERROR}


class NativeSlots:
    """The pool's runs of slots, which the lane keeps (host/free_runs.py's
    face). What depends on the extents' geometry alone (fits, max_span) is
    asked of the FreeRuns the pool opened with: the lane cuts the same
    extents from the same numbers."""

    def __init__(self, lane: Lane, slots):
        self._lane = lane
        self._geometry = slots
        self.ranges = slots.ranges
        self.carved = slots.carved
        self.online = slots.online
        self.max_span = slots.max_span
        if slots.online < sum(r.count for r in slots.ranges):
            lane.set_online(slots.online_runs())

    @property
    def free(self) -> int:
        return self._lane.counts()["free_slots"]

    @property
    def free_extent_slots(self) -> int:
        return self._lane.counts()["free_extent_slots"]

    def free_in(self, index: int) -> int:
        return self._lane.free_in(index)

    def online_in(self, index: int) -> int:
        return self._lane.online_in(index)

    def span_at(self, slot: int) -> int:
        return self._lane.span_at(slot)

    def fits(self, runs) -> dict[int, str]:
        return self._geometry.fits(runs)

    def add_online(self, first: int, count: int, held=None) -> list[int]:
        """`held`: the chunk's runs ({first slot: span}) that kept blocks wait in (the lane counts them)."""
        self.online += self._lane.add_online(first, count, dict(held or {}))  # the lane clears the free ones' records
        return []

    def keep_only(self, used, kept_waiting: int = 0) -> list[int]:
        """`used`: runs, {first slot: span}."""
        self._lane.keep_only(dict(used), kept_waiting)
        return []  # the lane has cleared the free slots' records

    def allocate(self, node=None, span: int = 1):
        raise RuntimeError("the native lane allocates the pool's slots")

    def release(self, slot: int, span: int = 1) -> None:
        raise RuntimeError("the native lane releases the pool's slots")


class _Channel:
    """A session's job socket connection while the lane holds it (outbox.py JobChannel)."""

    def __init__(self, depot: NativeDepot, conn: int):
        self._depot, self.conn = depot, conn

    @property
    def open(self) -> bool:
        return self.conn in self._depot._conns

    def send_done(self, done) -> None:  # the lane writes JobDone itself while the connection is open
        raise RuntimeError("JobDone of a lane's connection goes through the lane")

    def hold_writes(self) -> None:
        pass

    def write_held(self) -> None:
        pass

    def close(self) -> None:
        pass  # the lane closes it when the session ends


class NativeDepot(Depot):
    takes_job_connections = True

    def __init__(self, lane: Lane, pool, eviction: str, instance: str, version: str, limits=None, quotas=None,
                 tiers=None):
        self.lane = lane
        self._by_id: dict[int, Namespace] = {}
        self._engines: dict[int, int] = {}  # namespace id -> engines registered in it
        self._workers: dict[int, Worker] = {}
        self._conns: dict[int, tuple[Session, object]] = {}
        self._events = RateLimitedLog(jobs_log)
        super().__init__(pool, eviction, instance, version, limits, quotas, tiers)
        pool.slots = NativeSlots(lane, pool.slots)
        self.index.tiers.hand_sealing_over(self)
        lane.demote(self.index.tiers.on)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(lane.events_fd(), self._after_call)

    # ------------------------------------------------------------ the lane's parts of the depot

    def _open_index(self, pool, tiers):
        return NativeIndex(self.lane, self.namespaces, self.evictions, self.changes.note, self.changes.send,
                           self._after_call, tiers)

    def _namespace_created(self, ns: Namespace) -> None:
        super()._namespace_created(ns)
        scope = self.lane.scope(ns.scope, self.evictions.quotas.get(ns.scope))
        self.lane.add_namespace(ns.id, scope, ns.tp_size, ns.name, ns.digest)
        self._by_id[ns.id] = ns
        self.index.tiers.note(ns, None)

    def _holds_blocks(self, ns: Namespace) -> bool:
        used, ready, _ = self.lane.namespace_counts(ns.id)
        return used > 0 or ready > 0

    def _namespace_freed(self, ns: Namespace) -> None:
        self.lane.remove_namespace(ns.id)
        self._by_id.pop(ns.id, None)

    def _count(self, session: Session | None, ns: Namespace, **deltas: int) -> None:
        self.lane.count(ns.id, session.number if session else 0, **deltas)

    # ------------------------------------------------------------ sessions

    def attach(self, client_name: str, identity: Identity | None) -> Session:
        session = super().attach(client_name, identity)
        self.lane.add_session(session.number, session.number, session.id, self.limits.max_jobs_per_session)
        return session

    def _end_jobs(self, session: Session) -> int:
        jobs = self.lane.session_counts(session.number)[0]
        self.lane.end_session(session.number)  # its workers are released once their copies end
        self._after_call()
        return jobs

    def adopt_job_connection(self, session: Session, fd: int, peer: str, uid: int, first: bytes, leftover: bytes,
                             quiet: bool, release) -> bool:
        conn = self.lane.add_connection(session.number, fd, peer, uid, first, leftover, quiet)
        if conn < 0:
            os.close(fd)
            release()
            return True
        self._conns[conn] = (session, release)
        session.outbox.job_channel = _Channel(self, conn)
        self._after_call()
        return True

    # ------------------------------------------------------------ registration

    def _engine_registered(self, ns: Namespace) -> None:
        self._engines[ns.id] = self._engines.get(ns.id, 0) + 1
        self.lane.follow(ns.id, True)

    def _engine_gone(self, ns: Namespace) -> None:
        left = self._engines.get(ns.id, 0) - 1
        if left > 0:
            self._engines[ns.id] = left
        else:
            self._engines.pop(ns.id, None)
            self.lane.follow(ns.id, False)

    def register_worker(self, session_id: str, spec: WorkerSpec) -> Worker:
        worker = super().register_worker(session_id, spec)
        layout = worker.layout
        try:
            lw = worker.transport.lane_worker(worker)
            if lw.device is not None:
                self.lane.cuda_device(lw.device)
            self.lane.add_worker(worker.session.number, worker.id, worker.ns.id, worker.rank, layout.num_blocks,
                                 layout.block_bytes, worker.node, lw.kind, lw.memory, lw.memory_bytes)
            if lw.device is not None:
                self.lane.cuda_worker(worker.session.number, worker.id, lw)
        except BaseException:
            del worker.session.workers[worker.id]
            self.namespaces.release(worker.ns)
            worker.transport.close_worker(worker)
            raise
        self._workers[worker.id] = worker
        self.index.tiers.note(worker.ns, worker.rank)
        return worker

    # ------------------------------------------------------------ jobs

    def submit(self, session_id: str, request: JobRequest, received_ns: int = 0) -> Submitted:
        session = self.session(session_id)
        try:
            already, not_stored = self.lane.submit(session.number, request)
        finally:
            self._after_call()
        return Submitted(already, not_stored)

    def finish_job(self, job, ok: bool, error: str = "") -> None:
        raise RuntimeError("the native lane ends its own jobs")

    def finish_jobs(self, ended) -> None:
        raise RuntimeError("the native lane ends its own jobs")

    async def drain(self, timeout: float) -> bool:
        self.draining = True
        self.lane.set_draining(True)
        deadline = self._loop.time() + timeout
        while self.lane.jobs_in_flight():
            if self._loop.time() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    @property
    def jobs_in_flight(self) -> int:
        return self.lane.jobs_in_flight()

    def shutdown(self) -> None:
        self._loop.remove_reader(self.lane.events_fd())
        super().shutdown()

    # ------------------------------------------------------------ what reports read

    def namespace_counts(self, ns: Namespace):
        return self.lane.namespace_counts(ns.id)

    def session_counts(self, session: Session):
        return self.lane.session_counts(session.number)

    def busy_seconds(self) -> tuple[float, float]:
        counts = self.lane.counts()
        return counts["store_busy_ns"] / 1e9, counts["load_busy_ns"] / 1e9

    def finished_counts(self):
        return self.lane.totals(), self.lane.job_times()

    # ------------------------------------------------------------ the kept pool's sealing (tiers/warm.py)

    @property
    def unsealed(self) -> int:
        return self.lane.counts()["unsealed"]

    @property
    def sealed(self) -> int:
        return self.lane.counts()["sealed"]

    @property
    def not_sealed(self) -> int:
        return self.lane.counts()["not_sealed"]

    def set_generation(self, generation: int) -> None:
        self.lane.set_generation(generation)

    # ------------------------------------------------------------ what the lane says

    def _after_call(self) -> None:
        if self.lane.check:
            problem = self.lane.verify()
            if problem:
                from kvdepot.server.core.index_check import IndexInconsistent

                raise IndexInconsistent(f"the native lane's index: {problem}")
        changed = False
        for event in self.lane.take_events():
            changed |= self._handle(event)
        if changed:
            self.changes.send()

    def _handle(self, event: binding.Event) -> bool:
        kind, data = event.type, event.payload
        if kind is EventType.CHANGE:
            ns_id, state, key = binding.CHANGE.unpack(data)
            ns = self._by_id.get(ns_id)
            if ns is None:
                return False
            if state == _EVICTED:
                held = self.index.tiers.holds(ns, key)
                self.changes.note(ns, key, BlockState.LOWER if held else BlockState.DROPPED)
            else:
                self.changes.note(ns, key, _CHANGES[state])
            return True
        if kind is EventType.JOB_DONE:
            number, job_id, ok, already, not_stored = binding.JOB_DONE.unpack_from(data)
            session = self._session_numbered(number)
            if session is not None:
                error = data[binding.JOB_DONE.size :].decode(errors="replace")
                session.outbox.job_done(job_id, bool(ok), error, already, not_stored)
        elif kind is EventType.LOG:
            level, key_length = data[0], data[1]
            key, text = data[2 : 2 + key_length].decode(), data[2 + key_length :].decode(errors="replace")
            if key:
                self._events.warning(key, "%s", text)
            else:
                (jobs_log if "job socket" in text else log).log(_LEVELS.get(level, logging.WARNING), "%s", text)
        elif kind is EventType.RELEASED:
            (worker_id,) = binding.struct.unpack("<I", data)
            worker = self._workers.pop(worker_id, None)
            if worker is not None:
                try:
                    worker.transport.close_worker(worker)
                except Exception:
                    log.exception("closing worker %d failed", worker_id)
        elif kind is EventType.CONN_CLOSED:
            conn, _, _ = binding.CONN_CLOSED.unpack(data)
            session, release = self._conns.pop(conn, (None, None))
            if release is not None:
                release()
            if session is not None and getattr(session.outbox.job_channel, "conn", None) == conn:
                session.outbox.job_channel = None
        elif kind is EventType.COMMITTED:
            ns_id, rank, length = binding.COMMITTED.unpack_from(data)
            ns = self._by_id.get(ns_id)
            if ns is not None:
                blocks = [NativeBlock(self.lane, *binding.COMMITTED_BLOCK.unpack_from(data, at)[:2], ns)
                          for at in range(binding.COMMITTED.size, len(data), binding.COMMITTED_BLOCK.size)]
                self.index.tiers.committed(ns, rank, blocks, length)
        elif kind is EventType.TRACE:
            self._trace(data)
        return False

    def _session_numbered(self, number: int) -> Session | None:
        return next((s for s in self.sessions.values() if s.number == number), None)

    def _trace(self, data: bytes) -> None:
        number, job_id, kind, blocks = binding.TRACE.unpack_from(data)
        session = self._session_numbered(number)
        stamps = {}
        for at in range(binding.TRACE.size, len(data), binding.STAMP.size):
            stage, ns = binding.STAMP.unpack_from(data, at)
            stamps[binding.STAGES[stage]] = ns
        if session is not None and jobtrace.ON:
            jobtrace.write_job(session.id, job_id, "load" if kind else "store", blocks, stamps)
