"""KVDepotClient: the library that engines (the vLLM connector) and tools use.

It is synchronous, for callers like vLLM's scheduler and workers. Its parts:
- session.py: the session (attach, reconnect with backoff, registering every
  engine and worker again), on a background thread that holds the Attach stream;
- jobs.py: job bookkeeping (in flight, results, waits, take_finished);
- job_channel.py: how jobs reach the daemon (the job socket, or gRPC calls);
- key_copy.py: each engine's copy of its namespace's keys, for lookups
  that never wait for the daemon;
- workers.py, shm_copy.py, cuda_worker.py: a worker's tensors and their transport.

While the daemon is away lookups answer "nothing stored" and jobs fail at
once, so the engine recomputes instead of raising. Bad requests raise the
typed errors of kvdepot.errors.

Threads and locks. Callers (an engine's steps, in any thread), the session's
stream thread, the job socket's reader and gRPC's callback threads all touch
the client's state. Each part keeps its state under one lock of its own
(JobBook, EngineCopies, Session, SocketJobChannel, and here the count of
copies running). A lock is held only around its own part's state: nothing
calls into another part, the daemon or a callback while holding one, so no
thread ever holds two. The one exception is the session's registration
lock, held across registration calls and always taken first (session.py).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from kvdepot.client.jobs import JobBook, JobResult
from kvdepot.client.key_copy import EngineCopies, EngineHandle
from kvdepot.client.rpc import Tls
from kvdepot.client.session import Connection, Session
from kvdepot.client.workers import WorkerHandle, make_worker
from kvdepot.defaults import default_socket_path, grpc_target
from kvdepot.errors import KVDepotError, Unavailable
from kvdepot.keys import KEY_VERSION
from kvdepot.proto import kvdepot_pb2 as pb

log = logging.getLogger("kvdepot.client")

__all__ = ["EngineHandle", "JobResult", "KVDepotClient", "LookupResult", "Transfer", "WorkerHandle"]


@dataclass
class LookupResult:
    # Leading keys whose blocks are stored and loadable now.
    ready_blocks: int
    # True when blocks right after the ready ones are being stored: ask again.
    not_yet: bool = False
    # False when the daemon could not be asked; the answer is then "nothing".
    available: bool = True


@dataclass(eq=False)
class Transfer:
    """A submitted shared-memory job whose bytes this process still has to copy.

    `run()` copies and reports completion to the daemon; the daemon keeps the
    job's blocks pinned until then.
    """

    client: KVDepotClient
    kind: str
    job_id: int
    worker: WorkerHandle | None = None
    connection: Connection | None = None
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
            self.client._jobs.finish(self.job_id, False, "the client was closed before the copy")
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
        tls: Tls | None = None,
        call_timeout: float = 10.0,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
    ):
        self.target = grpc_target(target or default_socket_path())
        self.name = name
        self._jobs = JobBook()
        self._copies = EngineCopies()
        self._copies_running = 0
        self._copies_changed = threading.Condition()
        metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        credentials = tls.credentials() if tls is not None else None
        self._session = Session(
            self.target, name, metadata, credentials, call_timeout, (backoff_initial, backoff_max), self._jobs,
            self._copies,
        )

    # ------------------------------------------------------------ connection

    def connect(self, timeout: float = 10.0) -> KVDepotClient:
        """Waits until attached to the daemon; raises Unavailable after `timeout`."""
        if not self.wait_connected(timeout):
            raise Unavailable(f"kvdepotd is not answering on {self.target} after {timeout:.1f} s")
        return self

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._session.wait_connected(timeout)

    @property
    def connected(self) -> bool:
        return self._session.connection is not None

    @property
    def _connection(self) -> Connection | None:
        return self._session.connection

    @property
    def daemon_instance(self) -> str | None:
        connection = self._session.connection
        return connection.instance if connection else None

    @property
    def reconnects(self) -> int:
        return self._session.reconnects

    def close(self, timeout: float = 30.0) -> None:
        """Ends the session. Copies already running finish first: the daemon
        reuses a session's slots once its stream closes."""
        with self._copies_changed:
            self._session.closing.set()
            self._copies_changed.wait_for(lambda: self._copies_running == 0, timeout)
        self._session.stop()

    def __enter__(self) -> KVDepotClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _copy_started(self) -> bool:
        with self._copies_changed:
            if self._session.closing.is_set():
                return False
            self._copies_running += 1
            return True

    def _copy_ended(self) -> None:
        with self._copies_changed:
            self._copies_running -= 1
            self._copies_changed.notify_all()

    # ------------------------------------------------------------ registration

    def register_engine(self, namespace: pb.NamespaceSpec | Mapping, track_removed: bool = False) -> EngineHandle:
        """Declares the namespace this process looks up; kept across reconnects.

        track_removed: keep the keys the daemon drops, for take_removed().
        """
        engine = EngineHandle(namespace_spec(namespace), track_removed=track_removed)
        self._session.add(engine)
        return engine

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
        worker = make_worker(namespace_spec(namespace), rank, tensors, block_dim, device, names)
        self._session.add(worker)
        return worker

    # ------------------------------------------------------------ lookup

    def lookup(self, engine: EngineHandle, keys: Sequence[bytes]) -> LookupResult:
        """How many leading keys are ready; "not yet" while the next ones are being stored."""
        connection, engine_id = self._session.connection, engine.engine_id
        if connection is None or engine_id is None:
            return LookupResult(0, available=False)
        request = pb.LookupRequest(session_id=connection.session_id, engine_id=engine_id, keys=keys)
        try:
            response = self._session.call(connection, "Lookup", request)
        except Unavailable:
            return LookupResult(0, available=False)
        return LookupResult(response.ready_blocks, not_yet=response.status == pb.LookupResponse.NOT_YET)

    def cached_lookup(self, engine: EngineHandle, keys: Sequence[bytes], start: int = 0) -> LookupResult:
        """Lookup answered from the engine's copy of the namespace: no call, no wait.

        Leading ready keys from `start`; not_yet when the next one is being
        stored. The copy lags the daemon by a notification (key_copy.py).
        """
        if self._session.connection is None or engine.engine_id is None:
            return LookupResult(0, available=False)
        ready, not_yet = engine.lookup(keys, start)
        return LookupResult(ready_blocks=ready, not_yet=not_yet)

    def report_lookups(self, engine: EngineHandle, lookups: int, hit_blocks: int, miss_blocks: int) -> bool:
        """Adds cached lookups to the daemon's stats; False when it could not be told."""
        connection, engine_id = self._session.connection, engine.engine_id
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
            self._session.call(connection, "ReportLookups", request)
        except KVDepotError:
            return False
        return True

    def take_removed(self, engine: EngineHandle) -> list[bytes]:
        """Keys of the engine's namespace that the daemon evicted or cleared since the last call."""
        return self._copies.take_removed(engine)

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
        tracked_here = self._jobs.begin(job_id)
        connection, worker_id = self._session.connection, worker.worker_id
        transfer = Transfer(self, kind, job_id, worker, connection, done=True)
        if connection is None or worker_id is None:
            if tracked_here:
                self._jobs.finish(job_id, False, "kvdepotd is not available")
            return transfer
        fields = dict(session_id=connection.session_id, worker_id=worker_id, job_id=job_id, keys=keys, block_ids=block_ids)
        if kind == "store" and worker.compute_fence is not None:
            fields["cuda_event_handle"], fields["cuda_fence_seq"] = worker.compute_fence.mark()
        request = pb.SubmitStoreRequest(**fields) if kind == "store" else pb.SubmitLoadRequest(**fields)
        if not worker.copies_itself and tracked_here:
            # The daemon copies and reports the end: the caller (an engine step)
            # need not wait for the submit's answer either.
            connection.jobs.submit(kind, job_id, request)
            return transfer
        try:
            response = connection.jobs.call("submit_" + kind, request)
        except Unavailable as e:
            if tracked_here:
                self._jobs.finish(job_id, False, str(e))
            return transfer
        except KVDepotError:
            if tracked_here:
                self._jobs.drop(job_id)
            raise
        transfer.slots = list(response.slots)
        if kind == "store":
            transfer.block_ids = [block_ids[i] for i in response.copy_indices]
            self._jobs.store_counts(job_id, response.already_stored, response.not_stored)
        else:
            transfer.block_ids = block_ids
        # The daemon copies for CUDA workers and reports the end itself.
        transfer.done = not worker.copies_itself
        return transfer

    def _complete(self, connection: Connection, job_id: int, ok: bool, error: str = "") -> None:
        request = pb.CompleteJobRequest(session_id=connection.session_id, job_id=job_id, ok=ok, error=error)
        try:
            connection.jobs.call("complete_job", request)
        except KVDepotError as e:
            ok, error = False, f"the daemon did not take the job's completion: {e}"
        self._jobs.finish(job_id, ok, error)

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, JobResult]:
        """Waits for the jobs to finish and hands over their results."""
        return self._jobs.wait(job_ids, timeout)

    def take_finished(self) -> list[JobResult]:
        """Results of every job finished since the last call (and not taken by wait)."""
        return self._jobs.take_finished()

    # ------------------------------------------------------------ operators

    def _operator_call(self, method: str, request):
        connection = self._session.connection
        if connection is None:
            raise Unavailable(f"kvdepotd is not available on {self.target}")
        return self._session.call(connection, method, request)

    def stats(self) -> pb.GetStatsResponse:
        return self._operator_call("GetStats", pb.GetStatsRequest(session_id=self._session_id()))

    def clear(self, namespace_name: str = "") -> pb.ClearResponse:
        request = pb.ClearRequest(namespace_name=namespace_name, session_id=self._session_id())
        return self._operator_call("Clear", request)

    def _session_id(self) -> str:
        connection = self._session.connection
        return connection.session_id if connection is not None else ""
