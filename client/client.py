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
(JobBook, EngineCopies, Session, SocketJobChannel). A lock is held only around its own part's state: nothing
calls into another part, the daemon or a callback while holding one, so no
thread ever holds two. The one exception is the session's registration
lock, held across registration calls and always taken first (session.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvdepot import jobtrace
from kvdepot.client.daemon_identity import daemon_uids_setting, trusted_uids
from kvdepot.client.jobs import JobBook, JobResult
from kvdepot.client.key_copy import EngineCopies, EngineHandle
from kvdepot.client.promote import Promoter
from kvdepot.client.rpc import Tls
from kvdepot.client.session import Connection, Session
from kvdepot.client.workers import WorkerHandle, make_worker
from kvdepot.defaults import default_socket_path, grpc_target
from kvdepot.errors import AlreadyExists, KVDepotError, Unavailable
from kvdepot.keys import KEY_VERSION
from kvdepot.proto import kvdepot_pb2 as pb

log = logging.getLogger("kvdepot.client")

__all__ = ["EngineHandle", "JobResult", "KVDepotClient", "LookupResult", "WorkerHandle"]


@dataclass
class LookupResult:
    # Leading keys whose blocks are stored and loadable now.
    ready_blocks: int
    # True when blocks right after the ready ones are being stored: ask again.
    not_yet: bool = False
    # False when the daemon could not be asked; the answer is then "nothing".
    available: bool = True
    # Blocks after the ready ones being stored or promoted (a Lookup call only).
    storing_blocks: int = 0


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
        daemon_uids: Iterable[int] | None = None,
    ):
        """`daemon_uids`: uids besides root and this process's own whose daemon
        this client may talk to (default: $KVDEPOT_DAEMON_UIDS, comma-separated);
        on a unix socket the kernel names the daemon's uid before anything is sent."""
        self.target = grpc_target(target or default_socket_path())
        self.name = name
        self._jobs = JobBook()
        # Shared-memory jobs in flight: (copier, block ids), for cancel.
        self._staged: dict[int, tuple] = {}
        self._copies = EngineCopies()
        self._promoter = Promoter(self.lookup)
        metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        credentials = tls.credentials() if tls is not None else None
        self._session = Session(
            self.target, name, metadata, credentials, call_timeout, (backoff_initial, backoff_max), self._jobs,
            self._copies, trusted_uids(daemon_uids_setting(daemon_uids)),
        )

    # ------------------------------------------------------------ connection

    def connect(self, timeout: float = 10.0) -> KVDepotClient:
        """Waits until attached to the daemon; raises Unavailable after `timeout`,
        and UntrustedDaemon at once when its socket is not a trusted daemon's."""
        if not self._session.wait_connected_or_refused(timeout):
            raise Unavailable(f"kvdepotd is not answering on {self.target} after {timeout:.1f} s")
        refusal = self._session.refusal
        if self._session.connection is None and refusal is not None:
            raise refusal
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
        """Ends the session once its jobs in flight have ended, or after
        `timeout` seconds: the daemon fails the jobs of a session that ends."""
        self._jobs.wait_idle(timeout)
        self._promoter.close()
        self._session.closing.set()
        self._session.stop()

    def __enter__(self) -> KVDepotClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

        CPU tensors use the shared-memory transport (the daemon copies through
        a staging memory this process hands it; shm_copy.py); CUDA tensors the
        CUDA transport (the daemon copies over CUDA IPC, on its own streams). `block_dim` says which dimension of
        each tensor indexes
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
        return LookupResult(
            response.ready_blocks,
            not_yet=response.status == pb.LookupResponse.NOT_YET,
            storing_blocks=response.storing_blocks,
        )

    def cached_lookup(self, engine: EngineHandle, keys: Sequence[bytes], start: int = 0) -> LookupResult:
        """Lookup answered from the engine's copy of the namespace: no call, no wait.

        Leading ready keys from `start`; not_yet when the next one is being
        stored. The copy lags the daemon by a notification (key_copy.py).
        """
        if self._session.connection is None or engine.engine_id is None:
            return LookupResult(0, available=False)
        ready, not_yet = engine.lookup(keys, start)
        if not_yet and engine.lower:
            self._promoter.ask(engine, keys[start + ready :])
        return LookupResult(ready_blocks=ready, not_yet=not_yet)

    def ask_ahead(self, engine: EngineHandle, keys: Sequence[bytes]) -> None:
        """A request arrived with these keys: where the daemon shares the
        namespace through a remote store, it starts looking for the keys the
        copy does not have now (no wait here), and lookups say "not yet" until
        it answers."""
        self._promoter.ask_ahead(engine, keys)

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
        CPU workers: the blocks are copied into the staging memory before it
        returns. It never waits for the daemon's answer: a job the daemon
        refuses (a bad request) ends failed, with the daemon's message.
        """
        self._submit("store", worker, job_id, keys, block_ids)
        return job_id

    def submit_load(self, worker: WorkerHandle, job_id: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Loads blocks; a failed load is reported so the engine recomputes them.
        CPU workers: the blocks are written when the job's result is filed."""
        self._submit("load", worker, job_id, keys, block_ids)
        return job_id

    def _submit(self, kind: str, worker: WorkerHandle, job_id: int, keys, block_ids) -> None:
        if jobtrace.ON and self._session.connection is not None:
            jobtrace.client_stamp(self._session.connection.session_id, job_id, "submit")
        block_ids = [int(b) for b in block_ids]
        copier = worker.copier
        on_end = None
        if copier is not None:
            on_end = _staging_end(kind, copier, block_ids, lambda: self._staged.pop(job_id, None))
        if not self._jobs.begin(job_id, on_end):
            raise AlreadyExists(f"job id {job_id} is in flight already in this client; wait for its result")
        if copier is not None:
            if copier.staging.quarantined(block_ids):
                self._jobs.finish(job_id, False, "the staging rows of these blocks belong to a cancelled load "
                                  "that the daemon has not ended yet")
                return
            copier.staging.take(block_ids)  # kept in memory until the job ends (on_end releases them)
            self._staged[job_id] = (copier, block_ids)
        connection, worker_id = self._session.connection, worker.worker_id
        if connection is None or worker_id is None:
            self._jobs.finish(job_id, False, "kvdepotd is not available")
            return
        fields = dict(
            session_id=connection.session_id, worker_id=worker_id, job_id=job_id, keys=keys, block_ids=block_ids
        )
        if kind == "store" and worker.compute_fence is not None:
            fields["cuda_event_handle"], fields["cuda_fence_seq"] = worker.compute_fence.mark()
        elif kind == "store" and copier is not None and all(0 <= b < worker.layout.num_blocks for b in block_ids):
            # Out-of-range ids are left to the daemon, which refuses them and says why.
            try:
                copier.to_staging(block_ids)
            except Exception as e:  # a failed copy fails the job, never the caller
                log.exception("store job %d: copy into the staging memory failed", job_id)
                self._jobs.finish(job_id, False, f"copy into the staging memory failed: {e}")
                return
        request = pb.SubmitStoreRequest(**fields) if kind == "store" else pb.SubmitLoadRequest(**fields)
        connection.jobs.submit(kind, job_id, request)
        if jobtrace.ON:
            jobtrace.client_stamp(connection.session_id, job_id, "sent")

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> dict[int, JobResult]:
        """Waits for the jobs to finish and hands over their results."""
        connection = self._session.connection
        return self._jobs.wait(job_ids, timeout, connection.jobs.lead if connection is not None else None)

    def cancel(self, job_id: int, reason: str) -> None:
        """Ends a job in flight here, failed, without waiting for the daemon:
        a CPU worker's load copies nothing into its blocks. The daemon may
        still be copying into the job's staging rows, so until its own end
        comes a job that needs one of them fails at once (a store is not
        stored, a load is recomputed), and the job's id is not taken again."""
        staged = self._staged.get(job_id)
        if staged is not None:
            staged[0].staging.quarantine(staged[1])
        after = (lambda: staged[0].staging.lift_quarantine(staged[1])) if staged is not None else (lambda: None)
        self._jobs.cancel(job_id, reason, after)

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


def _staging_end(kind: str, copier, block_ids: list[int], forget=lambda: None):
    """What a shared-memory job does when it ends: a load's blocks come out of
    the staging rows the daemon wrote; then the rows are released (kept in
    memory within the staging's budget, shm_copy.py)."""

    def ended(ok: bool, error: str) -> tuple[bool, str]:
        try:
            if ok and kind == "load":
                copier.from_staging(block_ids)
        except Exception as e:
            log.exception("load: copy out of the staging memory failed")
            ok, error = False, f"copy out of the staging memory failed: {e}"
        finally:
            forget()
            copier.staging.release(block_ids)
        return ok, error

    return ended
