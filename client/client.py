"""KVDepotClient: the library that engines (the vLLM connector) and tools use.

It is synchronous, for callers like vLLM's scheduler and workers, and keeps one
background thread that holds the session's notification stream. When the
daemon goes away, that thread fails the jobs in flight, logs it once, and
reconnects with backoff; once attached again it registers every engine and
worker again by itself. Meanwhile lookups answer "nothing stored" and jobs fail
at once, so the engine recomputes instead of raising. Bad requests raise the
typed errors of kvdepot.errors.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import grpc

from kvdepot.client.job_socket import JobSocket
from kvdepot.client.shm_copy import BlockCopier, MappedPool
from kvdepot.client.tensors import normalize_block_dims, tensor_layout, tensor_spec
from kvdepot.defaults import PROTOCOL_VERSION, default_socket_path, grpc_target
from kvdepot.keys import KEY_VERSION
from kvdepot.errors import InvalidArgument, KVDepotError, Unavailable, from_status, status_code
from kvdepot.layout import WorkerLayout
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc

log = logging.getLogger("kvdepot.client")

# Engines whose BlocksChanged may arrive before their RegisterEngine answer.
MAX_EARLY_ENGINES = 16

# Status codes that mean "the daemon is not there (any more)", not "your request is wrong".
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)

# The gRPC call that does what a job socket request does, where there is no job socket.
_JOB_METHODS = {"submit_store": "SubmitStore", "submit_load": "SubmitLoad", "complete_job": "CompleteJob"}


def _typed_error(code: grpc.StatusCode, details: str | None) -> KVDepotError:
    """Unavailable when the daemon is gone or restarted, else the typed error for the status."""
    if code in _GONE:
        return Unavailable(f"kvdepotd is not available: {details}")
    if code == grpc.StatusCode.NOT_FOUND and "unknown session" in (details or ""):
        return Unavailable("the daemon restarted; reconnecting")
    return from_status(code, details or "")


@dataclass
class LookupResult:
    # Leading keys whose blocks are stored and loadable now.
    ready_blocks: int
    # True when blocks right after the ready ones are being stored: ask again.
    not_yet: bool = False
    # Of the ready blocks, how many some job is loading right now.
    loading_blocks: int = 0
    storing_blocks: int = 0
    # False when the daemon could not be asked; the answer is then "nothing".
    available: bool = True


@dataclass
class JobResult:
    job_id: int
    ok: bool
    error: str = ""
    # Stores: keys left out because they were stored (or being stored) already,
    # and keys not stored because every slot was pinned by jobs in flight.
    already_stored: int = 0
    not_stored: int = 0


@dataclass(eq=False)
class EngineHandle:
    namespace: pb.NamespaceSpec
    engine_id: int | None = None
    namespace_name: str = ""
    # The namespace's ready and storing keys, as the daemon reports them
    # (BlocksChanged): cached_lookup() answers from them without a call.
    ready: set = field(default_factory=set)
    storing: set = field(default_factory=set)
    # Keys that were ready and are gone (evicted, cleared, daemon lost) since
    # the last take_removed(); kept only when asked for (track_removed), so
    # that nobody's list grows without a reader.
    removed: list = field(default_factory=list)
    track_removed: bool = False

    @property
    def registered(self) -> bool:
        return self.engine_id is not None


@dataclass(eq=False)
class WorkerHandle:
    namespace: pb.NamespaceSpec
    rank: int
    device: str
    tensors: list
    layout: WorkerLayout
    # What the daemon needs to reach the tensors: TensorHandle messages.
    handles: list
    # Shared-memory transport: this process copies.
    copier: BlockCopier | None = None
    # CUDA transport: orders stores after the compute that wrote the blocks.
    compute_fence: object = None
    worker_id: int | None = None
    namespace_name: str = ""

    @property
    def registered(self) -> bool:
        return self.worker_id is not None

    @property
    def copies_itself(self) -> bool:
        return self.copier is not None


@dataclass
class _Connection:
    stub: pb_grpc.KVDepotStub
    session_id: str
    instance: str
    pool_info: pb.PoolInfo
    pool: MappedPool | None = None
    # Jobs go here when the daemon offers a job socket, else through calls.
    jobs: JobSocket | None = None


@dataclass(eq=False)
class Transfer:
    """A submitted shared-memory job whose bytes this process still has to copy.

    `run()` copies and reports completion to the daemon; the daemon keeps the
    job's blocks pinned until then.
    """

    client: "KVDepotClient"
    kind: str
    job_id: int
    worker: WorkerHandle | None = None
    connection: _Connection | None = None
    block_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    done: bool = False

    def run(self) -> None:
        if self.done:
            return
        self.done = True
        if not self.client._copy_started():
            # The client is closing: its session ends, and the daemon may hand
            # the job's slots to others.
            self.client._finish(self.job_id, False, "the client was closed before the copy")
            return
        try:
            self._copy()
        finally:
            self.client._copy_ended()

    def _copy(self) -> None:
        try:
            if self.connection.pool is None:
                raise RuntimeError("the daemon's pool is not mapped in this process")
            if self.kind == "store":
                self.worker.copier.to_slots(self.connection.pool, self.block_ids, self.slots)
            else:
                self.worker.copier.from_slots(self.connection.pool, self.slots, self.block_ids)
        except Exception as e:  # a failed copy fails the job, never the caller
            log.exception("%s job %d: copy failed", self.kind, self.job_id)
            self.client._complete(self.connection, self.job_id, ok=False, error=f"copy failed: {e}")
            return
        self.client._complete(self.connection, self.job_id, ok=True)


def namespace_spec(namespace: pb.NamespaceSpec | Mapping) -> pb.NamespaceSpec:
    """The namespace as sent, with this release's key_version unless it names one."""
    spec = pb.NamespaceSpec()
    if isinstance(namespace, pb.NamespaceSpec):
        spec.CopyFrom(namespace)
    else:
        spec = pb.NamespaceSpec(**namespace)
    if not spec.key_version:
        spec.key_version = KEY_VERSION
    return spec


class KVDepotClient:
    def __init__(
        self,
        target: str | None = None,
        *,
        name: str = "kvdepot-client",
        auth_token: str | None = None,
        call_timeout: float = 10.0,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
    ):
        self.target = grpc_target(target or default_socket_path())
        self.name = name
        self.call_timeout = call_timeout
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._backoff = (backoff_initial, backoff_max)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._connection: _Connection | None = None
        # Held while registering, so a handle added during a reconnect is
        # registered exactly once, by whoever comes second.
        self._register_lock = threading.Lock()
        self._engines: list[EngineHandle] = []
        self._workers: list[WorkerHandle] = []
        self._pending: set[int] = set()
        # Finished jobs not yet handed over, in the order they finished.
        self._results: OrderedDict[int, JobResult] = OrderedDict()
        # Job ids a wait() is blocked on: take_finished() leaves them to it.
        self._awaited: dict[int, int] = {}
        # A store's counts from its submit response, until its result exists.
        self._store_counts: dict[int, tuple[int, int]] = {}
        # Job socket requests: ids are never reused, also across sessions.
        # A caller blocked on its answer is in _replies_wanted until the reader
        # files the answer in _replies; a request nobody waits for is in
        # _unanswered as (kind, job_id).
        self._request_ids = itertools.count(1)
        self._replies_wanted: set[int] = set()
        self._replies: dict[int, pb.JobReply] = {}
        self._unanswered: dict[int, tuple[str, int]] = {}
        self._said_no_job_socket = False
        self._closing = threading.Event()
        self._copies_running = 0
        self._stream_call = None
        # BlocksChanged for an engine whose RegisterEngine answer is still on
        # its way, by (session, engine id).
        self._early_changes: dict[tuple[str, int], list] = {}
        self._said_gone = False
        self.reconnects = 0
        self._thread = threading.Thread(target=self._stream_loop, name="kvdepot-client", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ connection

    def connect(self, timeout: float = 10.0) -> "KVDepotClient":
        """Waits until attached to the daemon; raises Unavailable after `timeout`."""
        if not self.wait_connected(timeout):
            raise Unavailable(f"kvdepotd is not answering on {self.target} after {timeout:.1f} s")
        return self

    def wait_connected(self, timeout: float | None = None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._connection is not None, timeout)

    @property
    def connected(self) -> bool:
        return self._connection is not None

    @property
    def daemon_instance(self) -> str | None:
        connection = self._connection
        return connection.instance if connection else None

    def close(self, timeout: float = 30.0) -> None:
        """Ends the session. Copies already running finish first: the daemon
        reuses a session's slots once its stream closes."""
        with self._changed:
            self._closing.set()
            self._changed.wait_for(lambda: self._copies_running == 0, timeout)
        call = self._stream_call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=5)

    def __enter__(self) -> "KVDepotClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _channel(self) -> grpc.Channel:
        return grpc.insecure_channel(
            self.target,
            options=[
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1_000),
                # Every call is small and an engine step waits on some: on an H200
                # host this took about 80 us off a store's submit-to-completion.
                ("grpc.optimization_target", "latency"),
            ],
        )

    def _stream_loop(self) -> None:
        delay = self._backoff[0]
        while not self._closing.is_set():
            channel = self._channel()
            reason = "the stream ended"
            try:
                stub = pb_grpc.KVDepotStub(channel)
                call = stub.Attach(
                    pb.AttachRequest(
                        client_name=self.name, pid=os.getpid(), protocol_version=PROTOCOL_VERSION
                    ),
                    metadata=self._metadata,
                )
                self._stream_call = call
                first = next(call)
                self._on_attached(stub, first.started)
                delay = self._backoff[0]
                for notification in call:
                    kind = notification.WhichOneof("kind")
                    if kind == "job_done":
                        done = notification.job_done
                        self._finish(done.job_id, done.ok, done.error)
                    elif kind == "blocks_changed":
                        self._note_changes(notification.blocks_changed)
            except grpc.RpcError as e:
                reason = f"{e.code().name}: {e.details()}"
                if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED):
                    log.error("kvdepotd refused this client: %s", e.details())
            except StopIteration:
                pass
            except Exception:
                log.exception("kvdepot client stream failed")
                reason = "the client's stream thread failed"
            finally:
                self._stream_call = None
                self._on_detached(reason)
                channel.close()
            if self._closing.wait(delay * random.uniform(0.5, 1.0)):
                break
            delay = min(delay * 2, self._backoff[1])

    def _on_attached(self, stub: pb_grpc.KVDepotStub, started: pb.SessionStarted) -> None:
        connection = _Connection(stub, started.session_id, started.daemon_instance, started.pool)
        if started.job_socket:
            try:
                connection.jobs = JobSocket(
                    started.job_socket,
                    started.session_id,
                    lambda reply: self._on_job_reply(connection, reply),
                    lambda reason: self._on_job_socket_lost(connection, reason),
                    self.call_timeout,
                )
            except OSError as e:
                if not self._said_no_job_socket:
                    log.warning("cannot open kvdepotd's job socket %s (%s): jobs go through gRPC calls",
                                started.job_socket, e)
                    self._said_no_job_socket = True
        with self._register_lock:
            with self._lock:
                handles = [*self._engines, *self._workers]
            for handle in handles:
                try:
                    self._register(connection, handle)
                except KVDepotError as e:
                    log.error("registering %s again failed: %s", handle.namespace_name or "a handle", e)
            with self._changed:
                self._connection = connection
                self._changed.notify_all()
        if self._said_gone:
            self.reconnects += 1
            log.warning("reconnected to kvdepotd on %s (instance %s)", self.target, connection.instance)
            self._said_gone = False
        else:
            log.info("attached to kvdepotd on %s (instance %s)", self.target, connection.instance)

    def _on_detached(self, reason: str) -> None:
        with self._changed:
            was_connected = self._connection is not None
            if self._connection is not None and self._connection.jobs is not None:
                self._connection.jobs.close()
            # Their jobs are in _pending and fail below; waiters see the connection gone.
            self._unanswered.clear()
            self._connection = None
            self._early_changes.clear()
            for engine in self._engines:
                engine.engine_id = None
                # The daemon's blocks are unknown until it sends them again.
                if engine.track_removed:
                    engine.removed.extend(engine.ready)
                engine.ready, engine.storing = set(), set()
            for worker in self._workers:
                worker.worker_id = None
            pending = list(self._pending)
            self._changed.notify_all()
        why = "the client was closed during the job" if self._closing.is_set() else "kvdepotd went away during the job"
        for job_id in pending:
            self._finish(job_id, False, why)
        if (was_connected or not self._said_gone) and not self._closing.is_set():
            log.warning(
                "kvdepotd on %s is not available (%s); offloading is off until it returns",
                self.target,
                reason,
            )
            self._said_gone = True

    def _on_job_socket_lost(self, connection: _Connection, reason: str) -> None:
        """The job socket closed (or failed a write) under a live session: start
        over, so that no job waits for an end that cannot come."""
        call = self._stream_call
        if self._connection is connection and call is not None and not self._closing.is_set():
            log.warning("kvdepotd's job socket closed (%s); reconnecting", reason)
            call.cancel()

    def _on_job_reply(self, connection: _Connection, reply: pb.JobReply) -> None:
        if self._connection is not connection:
            # Buffered on a connection that has ended: its jobs failed with it, and
            # a job id may have been used again since.
            return
        kind = reply.WhichOneof("kind")
        if kind == "job_done":
            done = reply.job_done
            self._finish(done.job_id, done.ok, done.error)
            return
        with self._changed:
            if reply.request_id in self._replies_wanted:
                self._replies[reply.request_id] = reply
                self._changed.notify_all()
                return
            unanswered = self._unanswered.pop(reply.request_id, None)
        if unanswered is None:
            return  # its session is gone, and the job failed with it
        job_kind, job_id = unanswered
        if kind == "refused":
            self._submit_failed(job_kind, job_id, self._refusal(reply.refused))
        elif kind == "store_submitted":
            self._record_store_counts(job_id, reply.store_submitted.already_stored, reply.store_submitted.not_stored)

    @staticmethod
    def _refusal(refused: pb.JobRefused) -> KVDepotError:
        return _typed_error(status_code(refused.code), refused.message)

    def _job_call(self, connection: _Connection, kind: str, request):
        """A job request, answered: on the job socket when there is one, else
        the gRPC call of the same name."""
        if connection.jobs is None:
            return self._call(connection, _JOB_METHODS[kind], request)
        request_id = next(self._request_ids)
        with self._lock:
            self._replies_wanted.add(request_id)
        try:
            try:
                connection.jobs.send(pb.JobFrame(request_id=request_id, **{kind: request}))
            except OSError as e:
                self._on_job_socket_lost(connection, str(e))
                raise Unavailable(f"kvdepotd is not available: {e}") from None
            with self._changed:
                self._changed.wait_for(
                    lambda: request_id in self._replies or self._connection is not connection, self.call_timeout
                )
                reply = self._replies.pop(request_id, None)
        finally:
            with self._lock:
                self._replies_wanted.discard(request_id)
                self._replies.pop(request_id, None)
        if reply is None:
            if self._connection is not connection:
                raise Unavailable("the connection to kvdepotd was lost; reconnecting")
            raise Unavailable(f"kvdepotd did not answer {kind} within {self.call_timeout} s")
        if reply.HasField("refused"):
            raise self._refusal(reply.refused)
        return getattr(reply, reply.WhichOneof("kind"))

    def _copy_started(self) -> bool:
        with self._lock:
            if self._closing.is_set():
                return False
            self._copies_running += 1
            return True

    def _copy_ended(self) -> None:
        with self._changed:
            self._copies_running -= 1
            self._changed.notify_all()

    def _call(self, connection: _Connection, method: str, request):
        """One unary call; typed errors, and Unavailable when the daemon is gone."""
        try:
            return getattr(connection.stub, method)(
                request, timeout=self.call_timeout, metadata=self._metadata
            )
        except ValueError:
            # grpc raises this for a call on a channel closed after the daemon went away.
            raise Unavailable("the connection to kvdepotd is closed; reconnecting") from None
        except grpc.RpcError as e:
            raise _typed_error(e.code(), e.details()) from None

    # ------------------------------------------------------------ registration

    def register_engine(self, namespace: pb.NamespaceSpec | Mapping, track_removed: bool = False) -> EngineHandle:
        """Declares the namespace this process looks up; kept across reconnects.

        track_removed: keep the keys the daemon drops, for take_removed().
        """
        engine = EngineHandle(namespace_spec(namespace), track_removed=track_removed)
        self._add_handle(self._engines, engine)
        return engine

    def _add_handle(self, handles: list, handle) -> None:
        """Keeps the handle for every future session, and registers it now if attached."""
        with self._lock:
            handles.append(handle)
        try:
            with self._register_lock:
                connection = self._connection
                if connection is not None and not handle.registered:
                    self._register(connection, handle)
        except Unavailable:
            pass  # registered when the daemon is back
        except KVDepotError:
            with self._lock:
                handles.remove(handle)
            raise

    def _register(self, connection: _Connection, handle) -> None:
        if isinstance(handle, EngineHandle):
            self._register_engine(connection, handle)
        else:
            self._register_worker(connection, handle)

    def _register_engine(self, connection: _Connection, engine: EngineHandle) -> None:
        response = self._call(
            connection,
            "RegisterEngine",
            pb.RegisterEngineRequest(session_id=connection.session_id, namespace=engine.namespace),
        )
        with self._lock:
            engine.engine_id = response.engine_id
            engine.namespace_name = response.namespace_name
            # The namespace's snapshot may have come in before this response.
            for message in self._early_changes.pop((connection.session_id, response.engine_id), []):
                self._apply_changes(engine, message)

    def register_worker(
        self,
        namespace: pb.NamespaceSpec | Mapping,
        *,
        rank: int,
        tensors: Sequence,
        block_dim: int | Sequence[int],
        device: str | None = None,
        names: Sequence[str] | None = None,
    ) -> WorkerHandle:
        """Declares this worker's KV-cache tensors.

        CPU tensors use the shared-memory transport (this process copies); CUDA
        tensors the CUDA transport (the daemon copies over CUDA IPC, on its own
        streams). `block_dim` says which dimension of each tensor indexes
        blocks, e.g. 1 for vLLM's [2, num_blocks, block_size, heads, head_dim].
        """
        tensors = list(tensors)
        dims = normalize_block_dims(tensors, block_dim)
        names = list(names) if names is not None else [f"kv{i}" for i in range(len(tensors))]
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise InvalidArgument(f"all tensors of a worker must be on one device, not {sorted(map(str, devices))}")
        layout = WorkerLayout.of([tensor_layout(t, d, n) for t, d, n in zip(tensors, dims, names)])
        worker = WorkerHandle(
            namespace=namespace_spec(namespace),
            rank=rank,
            device=device or str(tensors[0].device),
            tensors=tensors,
            layout=layout,
            handles=[],
        )
        if tensors[0].device.type == "cuda":
            from kvdepot.client.cuda_worker import ComputeFence, cuda_handles

            worker.handles = cuda_handles(tensors)
            worker.compute_fence = ComputeFence(tensors[0].device)
        elif tensors[0].device.type == "cpu":
            worker.handles = [pb.TensorHandle(shared_memory=pb.SharedMemoryWorker()) for _ in tensors]
            worker.copier = BlockCopier(tensors, layout)
        else:
            raise InvalidArgument(f"no transport for tensors on {tensors[0].device}")
        self._add_handle(self._workers, worker)
        return worker

    def _register_worker(self, connection: _Connection, worker: WorkerHandle) -> None:
        request = pb.RegisterWorkerRequest(
            session_id=connection.session_id,
            namespace=worker.namespace,
            rank=worker.rank,
            device=worker.device,
            tensors=[tensor_spec(t) for t in worker.layout.tensors],
            handles=worker.handles,
        )
        if worker.compute_fence is not None:
            request.cuda_fence.CopyFrom(worker.compute_fence.handle)
        response = self._call(connection, "RegisterWorker", request)
        if worker.copies_itself and connection.pool is None:
            info = connection.pool_info
            connection.pool = MappedPool(info.shm_path, info.slot_bytes, info.num_slots)
        worker.worker_id = response.worker_id
        worker.namespace_name = response.namespace_name

    # ------------------------------------------------------------ lookup

    def lookup(self, engine: EngineHandle, keys: Sequence[bytes]) -> LookupResult:
        """How many leading keys are ready; "not yet" while the next ones are being stored."""
        connection, engine_id = self._connection, engine.engine_id
        if connection is None or engine_id is None:
            return LookupResult(0, available=False)
        try:
            response = self._call(
                connection,
                "Lookup",
                pb.LookupRequest(session_id=connection.session_id, engine_id=engine_id, keys=keys),
            )
        except Unavailable:
            return LookupResult(0, available=False)
        return LookupResult(
            ready_blocks=response.ready_blocks,
            not_yet=response.status == pb.LookupResponse.NOT_YET,
            loading_blocks=response.loading_blocks,
            storing_blocks=response.storing_blocks,
        )

    def _note_changes(self, message: pb.BlocksChanged) -> None:
        with self._lock:
            engine = next((e for e in self._engines if e.engine_id == message.engine_id), None)
            if engine is None:
                connection = self._connection
                session = connection.session_id if connection else ""
                if len(self._early_changes) >= MAX_EARLY_ENGINES and (session, message.engine_id) not in self._early_changes:
                    # A registration whose answer never came: its notes have no reader.
                    self._early_changes.pop(next(iter(self._early_changes)))
                self._early_changes.setdefault((session, message.engine_id), []).append(message)
                return
            self._apply_changes(engine, message)

    @staticmethod
    def _apply_changes(engine: EngineHandle, message: pb.BlocksChanged) -> None:
        ready, storing = engine.ready, engine.storing
        for key in message.storing:
            storing.add(key)
        for key in message.ready:
            storing.discard(key)
            ready.add(key)
        for key in message.dropped:
            storing.discard(key)
            if key in ready:
                ready.remove(key)
                if engine.track_removed:
                    engine.removed.append(key)

    def cached_lookup(self, engine: EngineHandle, keys: Sequence[bytes], start: int = 0) -> LookupResult:
        """Lookup answered from the engine's copy of the namespace: no call, no wait.

        Leading ready keys from `start`; not_yet when the next one is being
        stored. The copy lags the daemon by a notification: a block it calls
        ready may be gone by the time it is loaded (the load then fails).
        """
        if self._connection is None or engine.engine_id is None:
            return LookupResult(0, available=False)
        ready = engine.ready
        n = start
        end = len(keys)
        while n < end and keys[n] in ready:
            n += 1
        not_yet = n < end and keys[n] in engine.storing
        return LookupResult(ready_blocks=n - start, not_yet=not_yet)

    def report_lookups(self, engine: EngineHandle, lookups: int, hit_blocks: int, miss_blocks: int) -> bool:
        """Adds cached lookups to the daemon's stats; False when it could not be told."""
        connection, engine_id = self._connection, engine.engine_id
        if connection is None or engine_id is None:
            return False
        request = pb.ReportLookupsRequest(
            session_id=connection.session_id,
            engine_id=engine_id,
            lookups=lookups,
            hit_blocks=hit_blocks,
            miss_blocks=miss_blocks,
        )
        try:
            self._call(connection, "ReportLookups", request)
        except KVDepotError:
            return False
        return True

    def take_removed(self, engine: EngineHandle) -> list[bytes]:
        """Keys of the engine's namespace that the daemon evicted or cleared since the last call."""
        with self._lock:
            removed, engine.removed = engine.removed, []
            return removed

    # ------------------------------------------------------------ jobs

    def submit_store(self, worker: WorkerHandle, job_id: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Stores blocks; the result comes through wait() or take_finished().

        CUDA workers: call it after launching the compute that writes the
        blocks, on the current stream; the daemon's copy waits for that compute.
        It returns without waiting for the daemon's answer: a job the daemon
        refuses (a bad request) ends failed, with the daemon's message.
        """
        self.begin_store(worker, job_id, keys, block_ids).run()
        return job_id

    def submit_load(self, worker: WorkerHandle, job_id: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Loads blocks; a failed load is reported so the engine recomputes them."""
        self.begin_load(worker, job_id, keys, block_ids).run()
        return job_id

    def begin_store(self, worker: WorkerHandle, job_id: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> Transfer:
        return self._begin("store", worker, job_id, keys, block_ids)

    def begin_load(self, worker: WorkerHandle, job_id: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> Transfer:
        return self._begin("load", worker, job_id, keys, block_ids)

    def _begin(self, kind: str, worker: WorkerHandle, job_id: int, keys, block_ids) -> Transfer:
        block_ids = [int(b) for b in block_ids]
        with self._lock:
            # A duplicate id is the daemon's to refuse; it must not disturb the
            # bookkeeping of the job that already has it.
            tracked_here = job_id not in self._pending
            if tracked_here:
                self._pending.add(job_id)
                self._results.pop(job_id, None)
            connection, worker_id = self._connection, worker.worker_id
        transfer = Transfer(self, kind, job_id, worker, connection, done=True)
        if connection is None or worker_id is None:
            if tracked_here:
                self._finish(job_id, False, "kvdepotd is not available")
            return transfer
        fields = dict(session_id=connection.session_id, worker_id=worker_id, job_id=job_id, keys=keys, block_ids=block_ids)
        if kind == "store" and worker.compute_fence is not None:
            fields["cuda_event_handle"], fields["cuda_fence_seq"] = worker.compute_fence.mark()
        if not worker.copies_itself and tracked_here:
            # The daemon copies and reports the end on the stream: the caller
            # (an engine step) need not wait for the call's answer either.
            self._submit_in_background(connection, kind, job_id, fields)
            return transfer
        try:
            if kind == "store":
                response = self._job_call(connection, "submit_store", pb.SubmitStoreRequest(**fields))
                transfer.block_ids = [block_ids[i] for i in response.copy_indices]
                transfer.slots = list(response.slots)
                self._record_store_counts(job_id, response.already_stored, response.not_stored)
            else:
                response = self._job_call(connection, "submit_load", pb.SubmitLoadRequest(**fields))
                transfer.block_ids = block_ids
                transfer.slots = list(response.slots)
        except Unavailable as e:
            if tracked_here:
                self._finish(job_id, False, str(e))
            return transfer
        except KVDepotError:
            if tracked_here:
                with self._lock:
                    self._pending.discard(job_id)
            raise
        # The daemon copies for CUDA workers and reports the end on the stream.
        transfer.done = not worker.copies_itself
        return transfer

    def _submit_in_background(self, connection: _Connection, kind: str, job_id: int, fields: dict) -> None:
        request = pb.SubmitStoreRequest(**fields) if kind == "store" else pb.SubmitLoadRequest(**fields)
        if connection.jobs is not None:
            request_id = next(self._request_ids)
            with self._lock:
                self._unanswered[request_id] = (kind, job_id)
            try:
                connection.jobs.send(pb.JobFrame(request_id=request_id, **{f"submit_{kind}": request}))
            except OSError as e:
                with self._lock:
                    self._unanswered.pop(request_id, None)
                self._finish(job_id, False, f"kvdepotd is not available: {e}")
                self._on_job_socket_lost(connection, str(e))
            return
        method = connection.stub.SubmitStore if kind == "store" else connection.stub.SubmitLoad
        try:
            call = method.future(request, timeout=self.call_timeout, metadata=self._metadata)
        except ValueError:  # the channel closed under us: the daemon went away
            self._finish(job_id, False, "the connection to kvdepotd is closed; reconnecting")
            return

        def submitted(call) -> None:
            try:
                response = call.result()
            except grpc.RpcError as e:
                self._submit_failed(kind, job_id, _typed_error(e.code(), e.details()))
                return
            if kind == "store":
                self._record_store_counts(job_id, response.already_stored, response.not_stored)

        call.add_done_callback(submitted)

    def _submit_failed(self, kind: str, job_id: int, error: KVDepotError) -> None:
        """A submit nobody waited for failed: the daemon is gone (quietly), or
        it refused the request (a bug in the caller: logged)."""
        if isinstance(error, Unavailable):
            message = str(error)
        else:
            message = f"kvdepotd refused the {kind} job: {error}"
            log.warning("job %d: %s", job_id, message)
        self._finish(job_id, False, message)

    def _complete(self, connection: _Connection, job_id: int, ok: bool, error: str = "") -> None:
        try:
            self._job_call(
                connection,
                "complete_job",
                pb.CompleteJobRequest(session_id=connection.session_id, job_id=job_id, ok=ok, error=error),
            )
        except KVDepotError as e:
            ok, error = False, f"the daemon did not take the job's completion: {e}"
        self._finish(job_id, ok, error)

    def _record_store_counts(self, job_id: int, already_stored: int, not_stored: int) -> None:
        with self._lock:
            result = self._results.get(job_id)
            if result is not None:  # the daemon's completion came first
                result.already_stored, result.not_stored = already_stored, not_stored
            elif job_id in self._pending:
                self._store_counts[job_id] = (already_stored, not_stored)
            # else its result was handed over already: nobody would read the counts

    def _finish(self, job_id: int, ok: bool, error: str = "") -> None:
        with self._changed:
            if job_id not in self._pending:
                return
            self._pending.discard(job_id)
            already, not_stored = self._store_counts.pop(job_id, (0, 0))
            self._results[job_id] = JobResult(job_id, ok, error, already, not_stored)
            self._changed.notify_all()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, JobResult]:
        """Waits for the jobs to finish and hands over their results."""
        job_ids = list(job_ids)
        with self._changed:
            unknown = [j for j in job_ids if j not in self._pending and j not in self._results]
            if unknown:
                raise KeyError(f"no job {unknown[0]} was submitted, or its result was taken already")
            for j in job_ids:
                self._awaited[j] = self._awaited.get(j, 0) + 1
            try:
                if not self._changed.wait_for(lambda: all(j in self._results for j in job_ids), timeout):
                    left = [j for j in job_ids if j not in self._results]
                    raise TimeoutError(f"{len(left)} job(s) still in flight after {timeout} s: {left[:8]}")
                return {j: self._results.pop(j) for j in job_ids}
            finally:
                for j in job_ids:
                    self._awaited[j] -= 1
                    if not self._awaited[j]:
                        del self._awaited[j]

    def take_finished(self) -> list[JobResult]:
        """Results of every job finished since the last call (and not taken by wait)."""
        with self._lock:
            taken = [r for j, r in self._results.items() if j not in self._awaited]
            for result in taken:
                del self._results[result.job_id]
            return taken

    # ------------------------------------------------------------ operators

    def _operator_call(self, method: str, request):
        connection = self._connection
        if connection is None:
            raise Unavailable(f"kvdepotd is not available on {self.target}")
        return self._call(connection, method, request)

    def stats(self) -> pb.GetStatsResponse:
        return self._operator_call("GetStats", pb.GetStatsRequest())

    def clear(self, namespace_name: str = "") -> pb.ClearResponse:
        return self._operator_call("Clear", pb.ClearRequest(namespace_name=namespace_name))
