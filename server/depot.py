"""The daemon's state machine: sessions, namespaces, workers and jobs.

It knows nothing of gRPC: the service turns requests into calls here and the
typed errors raised here into status codes. Every method runs on the event
loop's thread, so the state needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

from kvdepot.defaults import KEY_BYTES, PROTOCOL_VERSION
from kvdepot.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvdepot.layout import (
    DTYPE_BYTES,
    MAX_PAGES_PER_WORKER,
    MAX_TENSORS_PER_WORKER,
    WorkerLayout,
    describe,
)
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.server.eviction import make_policy
from kvdepot.server.index import Block, BlockIndex, Namespace
from kvdepot.server.pool import HostPool
from kvdepot.server.stats import BusyClock, Counters
from kvdepot.server.transport import SharedMemoryTransport, Transport

log = logging.getLogger("kvdepot.depot")

# Job ids a session finished recently, still refused as duplicates: a client
# that reuses one that fast has lost track of its jobs.
RECENT_JOB_IDS = 4096
# Keys per BlocksChanged message of a registration snapshot (1 MiB of keys).
SNAPSHOT_CHUNK_KEYS = 32768

# Slots of a store abandoned by a client that went away are reused only once
# its process is gone (a live one could still be writing them), or after this.
QUARANTINE_MAX_SECONDS = 60.0


def process_gone(pid: int) -> bool:
    """True when `pid` has exited (a zombie has no memory left to write with)."""
    if pid <= 0:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    # The state letter follows the parenthesised command name.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


@dataclass
class Quarantine:
    pid: int
    slots: list[int]
    since: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class Worker:
    id: int
    session: "Session"
    ns: Namespace
    rank: int
    device: str
    layout: WorkerLayout
    transport: Transport


@dataclass(eq=False)
class Job:
    id: int
    kind: str  # "store" or "load"
    session: "Session"
    worker: Worker
    # The blocks the job writes (store) or reads (load), and their block ids.
    blocks: list[Block]
    block_ids: list[int]
    slots: list[int]
    started: float = field(default_factory=time.monotonic)
    # CUDA stores: the worker's compute event to wait for.
    cuda_event_handle: bytes = b""
    cuda_fence_seq: int = 0
    # The client went away while the job's copies ran.
    abandoned: bool = False
    # Whatever the transport keeps for the job while it runs.
    transport_state: object = None


@dataclass(eq=False)
class Session:
    id: str
    client_name: str
    pid: int
    notifications: asyncio.Queue = field(default_factory=asyncio.Queue)
    engines: dict[int, Namespace] = field(default_factory=dict)
    workers: dict[int, Worker] = field(default_factory=dict)
    jobs: dict[int, Job] = field(default_factory=dict)
    recent_job_ids: deque = field(default_factory=lambda: deque(maxlen=RECENT_JOB_IDS))
    recent_job_id_set: set = field(default_factory=set)
    counters: Counters = field(default_factory=Counters)
    ended: bool = False
    # The session's job socket connection (server/job_socket.py), once it has
    # one: its JobDone go there instead of to the Attach stream.
    job_channel: object = None


def _block_bytes_of(spec: pb.TensorSpec) -> int:
    """Bytes of one block of a tensor, from its shape (0 if the spec is malformed)."""
    shape = list(spec.shape)
    if spec.dtype not in DTYPE_BYTES or not 0 <= spec.block_dim < len(shape) or min(shape, default=0) < 1:
        return 0
    return DTYPE_BYTES[spec.dtype] * math.prod(shape) // shape[spec.block_dim]


def namespace_identity(spec: pb.NamespaceSpec) -> tuple:
    return (
        spec.model,
        spec.revision,
        spec.kv_dtype,
        spec.block_size,
        spec.layout,
        spec.tp_size,
        spec.kv_group,
        spec.extra,
        spec.key_version,
    )


def namespace_name(spec: pb.NamespaceSpec) -> str:
    name = spec.model + (f"@{spec.revision}" if spec.revision else "")
    name += f":{spec.kv_dtype or '-'}:bs{spec.block_size}:{spec.layout or '-'}"
    name += f":tp{spec.tp_size}:g{spec.kv_group}:k{spec.key_version}"
    return name + (f":{spec.extra}" if spec.extra else "")


class Depot:
    def __init__(self, pool: HostPool, eviction: str, instance: str, version: str):
        self.pool = pool
        self.instance = instance
        self.version = version
        self.started = time.monotonic()
        self.totals = Counters()
        self.store_clock = BusyClock()
        self.load_clock = BusyClock()
        self.policy = make_policy(eviction, pool.num_slots)
        self.index = BlockIndex(pool, self.policy, self._count_eviction, self._note_change)
        self.transports: dict[str, Transport] = {"shared_memory": SharedMemoryTransport(self)}
        if pool.pinned:
            # Only a pinned pool can be copied to by the GPU; torch is loaded already.
            from kvdepot.server.cuda_transport import CudaTransport

            self.transports["cuda_ipc"] = CudaTransport(self, pool)
        self.sessions: dict[str, Session] = {}
        self.sessions_ended = 0
        self.namespaces: dict[tuple, Namespace] = {}
        self.draining = False
        self.quarantine: list[Quarantine] = []
        self._jobs_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._next_id = 1
        # Namespace id -> {key: latest state} of blocks changed in the current call.
        self._changes: dict[int, dict[bytes, str]] = {}

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # ------------------------------------------------------------ sessions

    def pool_info(self) -> pb.PoolInfo:
        return pb.PoolInfo(
            shm_path=self.pool.path,
            slot_bytes=self.pool.slot_bytes,
            num_slots=self.pool.num_slots,
            pinned=self.pool.pinned,
        )

    def attach(self, client_name: str, pid: int, protocol_version: int) -> Session:
        if protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"this daemon speaks protocol version {PROTOCOL_VERSION}, the client "
                f"{protocol_version}: upgrade the older of the two"
            )
        if self.draining:
            raise Unavailable("the daemon is shutting down")
        session = Session(secrets.token_hex(8), client_name, pid)
        self.sessions[session.id] = session
        log.info("session %s attached: %s (pid %d)", session.id, client_name, pid)
        return session

    def end_session(self, session: Session) -> None:
        """The client is gone: its jobs end, its pins and mappings are released."""
        if session.ended:
            return
        session.ended = True
        if session.job_channel is not None:
            session.job_channel.close()
        jobs = list(session.jobs.values())
        for job in jobs:
            job.worker.transport.abandon(job)
        for worker in session.workers.values():
            try:
                worker.transport.close_worker(worker)
            except Exception:  # the other workers' mappings must still be closed
                log.exception("closing worker %d failed", worker.id)
        del self.sessions[session.id]
        self.sessions_ended += 1
        log.info(
            "session %s ended: %s (pid %d), %d job(s) were in flight",
            session.id,
            session.client_name,
            session.pid,
            len(jobs),
        )

    def session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(
                f"unknown session {session_id!r}: attach first (after a daemon restart, "
                "attach and register again)"
            )
        return session

    # ------------------------------------------------------------ registration

    def _namespace(self, spec: pb.NamespaceSpec) -> Namespace:
        if not spec.model:
            raise InvalidArgument("namespace.model is required")
        if spec.block_size < 1:
            raise InvalidArgument("namespace.block_size must be at least 1")
        if spec.tp_size < 1:
            raise InvalidArgument("namespace.tp_size must be at least 1")
        if spec.key_version < 1:
            raise InvalidArgument(
                "namespace.key_version is required: the version of the block-key definition "
                "the client's keys follow (docs/keys.md)"
            )
        identity = namespace_identity(spec)
        ns = self.namespaces.get(identity)
        if ns is None:
            ns = Namespace(id=self._new_id(), name=namespace_name(spec), tp_size=spec.tp_size)
            self.namespaces[identity] = ns
            log.info("namespace %s created", ns.name)
        return ns

    def register_engine(self, session_id: str, spec: pb.NamespaceSpec) -> tuple[int, Namespace]:
        session = self.session(session_id)
        ns = self._namespace(spec)
        engine_id = self._new_id()
        session.engines[engine_id] = ns
        self._send_snapshot(session, engine_id, ns)
        return engine_id, ns

    def register_worker(self, request: pb.RegisterWorkerRequest) -> Worker:
        session = self.session(request.session_id)
        ns = self._namespace(request.namespace)
        if request.rank >= ns.tp_size:
            raise InvalidArgument(f"rank {request.rank} is outside tp_size {ns.tp_size}")
        if len(request.handles) != len(request.tensors):
            raise InvalidArgument(
                f"{len(request.tensors)} tensors but {len(request.handles)} handles: "
                "give one handle for each tensor"
            )
        if len(request.tensors) > MAX_TENSORS_PER_WORKER:
            raise InvalidArgument(
                f"{len(request.tensors)} tensors; a worker registers at most {MAX_TENSORS_PER_WORKER}"
            )
        pages = sum(math.prod(t.shape[: t.block_dim]) for t in request.tensors if t.block_dim < len(t.shape))
        if pages > MAX_PAGES_PER_WORKER:
            raise InvalidArgument(
                f"{pages} pages per block over all tensors; a worker has at most {MAX_PAGES_PER_WORKER}"
            )
        # The size of a block follows from the shapes alone: refuse an oversized
        # worker before computing any page.
        block_bytes = sum(_block_bytes_of(t) for t in request.tensors)
        if block_bytes > self.pool.slot_bytes:
            raise InvalidArgument(
                f"one block of this worker is {block_bytes} bytes, more than a pool "
                f"slot ({self.pool.slot_bytes} bytes): start kvdepotd with --slot-size "
                f"{block_bytes} or more"
            )
        layout = WorkerLayout.of(
            [
                describe(
                    name=t.name or f"tensor{i}",
                    dtype=t.dtype,
                    shape=t.shape,
                    strides=t.strides,
                    byte_offset=t.byte_offset,
                    storage_bytes=t.storage_bytes,
                    block_dim=t.block_dim,
                    page_bytes=t.page_bytes,
                )
                for i, t in enumerate(request.tensors)
            ]
        )
        known = ns.rank_signatures.get(request.rank)
        if known is not None and known != layout.signature():
            raise InvalidArgument(
                f"rank {request.rank} of namespace {ns.name} was registered with another "
                "layout (dtype, page sizes or pages per block differ): engines that share a "
                "namespace must share the KV layout"
            )
        kind = request.handles[0].WhichOneof("transport")
        transport = self.transports.get(kind)
        if transport is None:
            raise FailedPrecondition(
                f"this daemon has no {kind} transport (available: "
                f"{', '.join(self.transports)})"
            )
        worker = Worker(self._new_id(), session, ns, request.rank, request.device, layout, transport)
        transport.open_worker(worker, layout, request)
        ns.rank_signatures[request.rank] = layout.signature()
        ns.rank_block_bytes[request.rank] = layout.block_bytes
        session.workers[worker.id] = worker
        log.info(
            "worker %d registered: %s rank %d on %s, %d tensors, %d blocks of %d bytes, %s",
            worker.id,
            ns.name,
            worker.rank,
            worker.device,
            len(layout.tensors),
            layout.num_blocks,
            layout.block_bytes,
            transport.name,
        )
        return worker

    # ------------------------------------------------------------ lookup

    @staticmethod
    def _check_keys(keys) -> list[bytes]:
        for position, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise InvalidArgument(
                    f"key {position} has {len(key)} bytes; keys are {KEY_BYTES}-byte hashes"
                )
        return list(keys)

    def lookup(self, session_id: str, engine_id: int, keys) -> pb.LookupResponse:
        session = self.session(session_id)
        ns = session.engines.get(engine_id)
        if ns is None:
            raise NotFound(f"unknown engine {engine_id} in this session: register it first")
        keys = self._check_keys(keys)
        result = self.index.lookup(ns, keys)
        if result.status == pb.LookupResponse.READY:
            self._count(
                session,
                ns,
                lookups=1,
                hit_blocks=result.ready,
                miss_blocks=len(keys) - result.ready,
            )
        return pb.LookupResponse(
            status=result.status,
            ready_blocks=result.ready,
            loading_blocks=result.loading,
            storing_blocks=result.storing,
        )

    # ------------------------------------------------------------ jobs

    def _job_request(self, request) -> tuple[Session, Worker, list[bytes], list[int]]:
        if self.draining:
            raise Unavailable("the daemon is shutting down and takes no new jobs")
        session = self.session(request.session_id)
        worker = session.workers.get(request.worker_id)
        if worker is None:
            raise NotFound(f"unknown worker {request.worker_id} in this session: register it first")
        if request.job_id in session.jobs or request.job_id in session.recent_job_id_set:
            raise AlreadyExists(f"job id {request.job_id} is already used by this session")
        if len(request.keys) != len(request.block_ids):
            raise InvalidArgument(
                f"{len(request.keys)} keys but {len(request.block_ids)} block ids: "
                "give one block id for each key"
            )
        if not request.keys:
            raise InvalidArgument("a job needs at least one block")
        if len(request.keys) > self.pool.num_slots:
            raise ResourceExhausted(
                f"the job has {len(request.keys)} blocks but the whole pool holds "
                f"{self.pool.num_slots}: split it or start kvdepotd with a larger --pool-size"
            )
        keys = self._check_keys(request.keys)
        worker.transport.validate_job(worker, request, "store" if isinstance(request, pb.SubmitStoreRequest) else "load")
        num_blocks = worker.layout.num_blocks
        for position, block_id in enumerate(request.block_ids):
            if block_id >= num_blocks:
                raise InvalidArgument(
                    f"block id {block_id} at position {position} is outside the worker's "
                    f"registered tensors ({num_blocks} blocks)"
                )
        return session, worker, keys, list(request.block_ids)

    def _begin(self, job: Job) -> None:
        job.session.jobs[job.id] = job
        (self.store_clock if job.kind == "store" else self.load_clock).start()
        self._jobs_in_flight += 1
        self._idle.clear()
        try:
            job.worker.transport.start(job)
        except Exception as e:  # a job that cannot start must not stay in flight forever
            log.exception("%s job %d could not start", job.kind, job.id)
            self.finish_job(job, ok=False, error=f"the daemon could not start the job: {e}")

    def submit_store(self, request: pb.SubmitStoreRequest) -> pb.SubmitStoreResponse:
        session, worker, keys, block_ids = self._job_request(request)
        reservation = self.index.reserve_store(worker.ns, worker.rank, keys, request.job_id)
        writes = reservation.writes
        job = Job(
            id=request.job_id,
            kind="store",
            session=session,
            worker=worker,
            blocks=[block for _, block in writes],
            block_ids=[block_ids[position] for position, _ in writes],
            slots=[block.slots[worker.rank] for _, block in writes],
            cuda_event_handle=request.cuda_event_handle,
            cuda_fence_seq=request.cuda_fence_seq,
        )
        self._begin(job)
        self._tell_changes()
        if reservation.not_stored:
            log.warning(
                "store job %d of session %s: %d block(s) not stored, every slot is pinned",
                job.id,
                session.id,
                reservation.not_stored,
            )
        return pb.SubmitStoreResponse(
            copy_indices=[position for position, _ in writes],
            slots=job.slots,
            already_stored=reservation.already_stored,
            not_stored=reservation.not_stored,
        )

    def submit_load(self, request: pb.SubmitLoadRequest) -> pb.SubmitLoadResponse:
        session, worker, keys, block_ids = self._job_request(request)
        if len(set(block_ids)) != len(block_ids):
            raise InvalidArgument("a load writes each block id once; the request repeats some")
        blocks = self.index.reserve_load(worker.ns, keys)
        slots = [block.slots[worker.rank] for block in blocks]
        job = Job(request.job_id, "load", session, worker, blocks, block_ids, slots)
        self._begin(job)
        return pb.SubmitLoadResponse(slots=slots)

    def complete_job(self, request: pb.CompleteJobRequest) -> None:
        session = self.session(request.session_id)
        job = session.jobs.get(request.job_id)
        if job is None:
            raise NotFound(f"no job {request.job_id} in flight in this session")
        if not job.worker.transport.worker_copies:
            raise FailedPrecondition(
                f"job {job.id} is copied by the daemon ({job.worker.transport.name}); "
                "only shared-memory jobs are completed by the client"
            )
        # The client learns the outcome from this call's answer: no JobDone.
        self.finish_job(job, ok=request.ok, error=request.error, notify=False)

    def finish_job(
        self, job: Job, ok: bool, error: str = "", writer_may_live: bool = False, notify: bool = True
    ) -> None:
        """Commits or rolls back a job whose copies have ended, and notifies its client.

        writer_may_live: the client went away without finishing a store; its
        process may still write the job's slots, so they are quarantined.
        """
        session, worker = job.session, job.worker
        if session.jobs.pop(job.id, None) is None:
            return
        if len(session.recent_job_ids) == RECENT_JOB_IDS:
            session.recent_job_id_set.discard(session.recent_job_ids[0])
        session.recent_job_ids.append(job.id)
        session.recent_job_id_set.add(job.id)
        nbytes = worker.layout.block_bytes
        if job.kind == "store":
            held = []
            for block in job.blocks:
                slot = self.index.finish_store(block, worker.rank, ok, release_slot=not writer_may_live)
                if slot is not None:
                    held.append(slot)
            if held:
                self.quarantine.append(Quarantine(session.pid, held))
            if ok:
                n = len(job.blocks)
                self._count(session, worker.ns, stored_blocks=n, stored_bytes=n * nbytes)
            self.store_clock.stop()
        else:
            for block in job.blocks:
                self.index.finish_load(block)
            if ok:
                n = len(job.blocks)
                self._count(session, worker.ns, loaded_blocks=n, loaded_bytes=n * nbytes)
            self.load_clock.stop()
        if not ok:
            self._count(session, worker.ns, failed_jobs=1)
            log.warning("%s job %d of session %s failed: %s", job.kind, job.id, session.id, error)
        self._jobs_in_flight -= 1
        if self._jobs_in_flight == 0:
            self._idle.set()
        if notify and not session.ended:
            done = pb.JobDone(job_id=job.id, ok=ok, error=error)
            channel = session.job_channel
            if channel is not None and channel.open:
                channel.send_done(done)
            else:
                session.notifications.put_nowait(pb.Notification(job_done=done))
        self._tell_changes()

    def release_quarantine(self, now: float | None = None) -> int:
        """Returns quarantined slots whose writer is gone (or waited out) to the pool."""
        now = time.monotonic() if now is None else now
        released = 0
        keep = []
        for entry in self.quarantine:
            if process_gone(entry.pid) or now - entry.since > QUARANTINE_MAX_SECONDS:
                for slot in entry.slots:
                    self.pool.release(slot)
                released += len(entry.slots)
            else:
                keep.append(entry)
        self.quarantine = keep
        return released

    async def housekeeping(self, interval: float = 0.25) -> None:
        while True:
            await asyncio.sleep(interval)
            if self.quarantine:
                released = self.release_quarantine()
                if released:
                    log.info("released %d quarantined slot(s): their writer is gone", released)

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

    # ------------------------------------------------------------ accounting

    def _count(self, session: Session | None, ns: Namespace, **deltas: int) -> None:
        targets = [self.totals, ns.counters] + ([session.counters] if session else [])
        for counters in targets:
            for name, delta in deltas.items():
                setattr(counters, name, getattr(counters, name) + delta)

    def _count_eviction(self, block: Block) -> None:
        # Once per block evicted, which in a full pool is once per block stored.
        self.totals.evicted_blocks += 1
        block.ns.counters.evicted_blocks += 1

    def _note_change(self, block: Block, state: str) -> None:
        self._changes.setdefault(block.ns.id, {})[block.key] = state

    def _tell_changes(self) -> None:
        """Sends this call's block changes to the engines of their namespaces."""
        if not self._changes:
            return
        changes, self._changes = self._changes, {}
        messages = {}
        for ns_id, states in changes.items():
            lists: dict[str, list[bytes]] = {"ready": [], "storing": [], "dropped": []}
            for key, state in states.items():
                lists[state].append(key)
            messages[ns_id] = lists
        for session in self.sessions.values():
            if session.ended:
                continue
            for engine_id, ns in session.engines.items():
                lists = messages.get(ns.id)
                if lists:
                    session.notifications.put_nowait(
                        pb.Notification(blocks_changed=pb.BlocksChanged(engine_id=engine_id, **lists))
                    )

    def _send_snapshot(self, session: Session, engine_id: int, ns: Namespace) -> None:
        """Every ready and storing key of the namespace, for an engine's local lookups."""
        ready = [b.key for b in self.index.blocks_of(ns) if b.ready]
        storing = [b.key for b in self.index.blocks_of(ns) if not b.ready and b.writers]
        for start in range(0, max(len(ready), len(storing)), SNAPSHOT_CHUNK_KEYS):
            session.notifications.put_nowait(
                pb.Notification(
                    blocks_changed=pb.BlocksChanged(
                        engine_id=engine_id,
                        ready=ready[start : start + SNAPSHOT_CHUNK_KEYS],
                        storing=storing[start : start + SNAPSHOT_CHUNK_KEYS],
                    )
                )
            )

    def report_lookups(self, request: pb.ReportLookupsRequest) -> None:
        session = self.session(request.session_id)
        ns = session.engines.get(request.engine_id)
        if ns is None:
            raise NotFound(f"unknown engine {request.engine_id} in this session: register it first")
        self._count(
            session, ns, lookups=request.lookups, hit_blocks=request.hit_blocks, miss_blocks=request.miss_blocks
        )

    def stats(self) -> pb.GetStatsResponse:
        used = self.pool.used_slots
        response = pb.GetStatsResponse(
            daemon_version=self.version,
            daemon_instance=self.instance,
            uptime_seconds=time.monotonic() - self.started,
            pool=self.pool_info(),
            used_slots=used,
            pinned_slots=self.index.pinned_slots,
            quarantined_slots=sum(len(q.slots) for q in self.quarantine),
            open_ipc_mappings=sum(t.open_mappings for t in self.transports.values()),
            gpus=[gpu for t in self.transports.values() for gpu in t.gpu_stats()],
            occupancy=used / self.pool.num_slots,
            eviction_policy=self.policy.name,
            totals=self.totals.to_proto(self.store_clock.seconds, self.load_clock.seconds),
            sessions_ended=self.sessions_ended,
        )
        for ns in self.namespaces.values():
            response.namespaces.add(
                name=ns.name,
                counters=ns.counters.to_proto(),
                ready_blocks=ns.ready_blocks,
                used_slots=ns.used_slots,
            )
        for session in self.sessions.values():
            response.clients.add(
                session_id=session.id,
                client_name=session.client_name,
                pid=session.pid,
                counters=session.counters.to_proto(),
                jobs_in_flight=len(session.jobs),
                workers=len(session.workers),
            )
        return response

    def clear(self, namespace_name: str) -> pb.ClearResponse:
        target = None
        if namespace_name:
            matches = [ns for ns in self.namespaces.values() if ns.name == namespace_name]
            if not matches:
                known = ", ".join(sorted(ns.name for ns in self.namespaces.values())) or "none"
                raise NotFound(f"no namespace {namespace_name!r}; known: {known}")
            target = matches[0]
        cleared, pinned = self.index.clear(target)
        self._tell_changes()
        log.info("cleared %d block(s) of %s; %d pinned kept", cleared, namespace_name or "every namespace", pinned)
        return pb.ClearResponse(cleared_blocks=cleared, pinned_blocks=pinned)
