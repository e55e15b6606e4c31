"""The connector's worker side: registers the KV caches and runs the jobs the scheduler planned.

Per step, in the order vLLM calls it:
- `handle_preemptions` (before the step's inputs are prepared): submit the
  stores queued last step, then submit and wait for the jobs to flush, whose
  GPU blocks this step is about to give to other requests.
- `start_load_kv`: submit this step's loads. A synchronous load (a CPU
  engine's, metadata.py) ends before it returns: vLLM calls it before the
  forward pass in a step that has one.
- `wait_for_save` (after the forward pass): queue this step's stores. They are
  submitted at the start of the next step, after the sampled tokens' copy,
  and each waits for the compute that wrote its blocks (the client records an
  interprocess event on the current stream at submit).
- `get_transfer_results` (or `get_finished`), `get_block_ids_with_load_errors`,
  `build_connector_worker_meta`: report finished and failed jobs.

Each job becomes one daemon job per KV-cache group. With the shared-memory
transport (CPU engines) this process copies, in the calling thread: torch
copies from a second thread deadlock against vLLM's CPU worker (OpenMP).
With CUDA the daemon copies on its own streams and submit returns at once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from kvdepot.connector import vllm_compat
from kvdepot.connector.config import ConnectorConfig
from kvdepot.connector.engine_keys import GroupInfo
from kvdepot.connector.metadata import KVDepotMetadata, KVDepotWorkerMetadata, TransferJob
from kvdepot.errors import KVDepotError

log = logging.getLogger("kvdepot.connector")

# Daemon job ids are the scheduler's job id times this, plus the group index.
MAX_GROUPS = 16
FLUSH_TIMEOUT_S = 60.0
# How long a step waits for a job of workers in host memory it submitted.
HOST_JOB_WAIT_S = 10.0
# How long a step waits for a synchronous load, whose forward pass reads it:
# past that it is cancelled here (failed, recomputed), as a flush gives up.
SYNC_LOAD_WAIT_S = FLUSH_TIMEOUT_S


@dataclass(eq=False)
class WorkerJob:
    job: TransferJob
    pending: set[int] = field(default_factory=set)
    failed: bool = False


def block_dim(tensor, num_blocks: int, name: str) -> int:
    """The dimension that indexes blocks: of those as long as the block count, the outermost."""
    dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
    if not dims:
        raise ValueError(
            f"KV cache {name} has shape {tuple(tensor.shape)}: no dimension of {num_blocks} blocks "
            "(kernel block splitting is not supported by kvdepot)"
        )
    return max(dims, key=lambda d: tensor.stride(d))


class WorkerSide:
    def __init__(self, config: ConnectorConfig, vllm_config, kv_cache_config, groups: list[GroupInfo]):
        if len(groups) > MAX_GROUPS or max(g.group_idx for g in groups) >= MAX_GROUPS:
            raise ValueError(f"kvdepot handles at most {MAX_GROUPS} KV-cache groups")
        self.groups = groups
        self.num_blocks = kv_cache_config.num_blocks
        self.rank = vllm_compat.world_rank(vllm_config)
        self.client = config.client(f"vllm-worker-{self.rank}-{os.getpid()}")
        self.workers: dict[int, object] = {}
        self._unsubmitted: list[TransferJob] = []
        self._inflight: dict[int, WorkerJob] = {}
        self._daemon_jobs: dict[int, int] = {}
        self._awaiting: dict[str, set[int]] = {}
        self._step_meta: KVDepotMetadata | None = None
        self._report = KVDepotWorkerMetadata()
        self._finished_loads: set[str] = set()
        # Loads that failed and were not reported yet, with their block ids.
        self._failed_loads: list[TransferJob] = []
        # GPU blocks of failed loads for get_block_ids_with_load_errors.
        self._load_error_block_ids: set[int] = set()

    def register_kv_caches(self, kv_caches: dict) -> None:
        for group in self.groups:
            tensors, dims, names, seen = [], [], [], set()
            for name in group.layer_names:
                tensor = kv_caches[name]
                # Layers that share another layer's cache appear twice.
                ident = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
                if ident in seen:
                    continue
                seen.add(ident)
                tensors.append(tensor)
                dims.append(block_dim(tensor, self.num_blocks, name))
                names.append(name)
            self.workers[group.group_idx] = self.client.register_worker(
                group.namespace, rank=self.rank, tensors=tensors, block_dim=dims, names=names
            )

    # ------------------------------------------------------------ each step

    def _begin_step(self, meta: KVDepotMetadata) -> None:
        """Once per step, whichever hook comes first: submit last step's stores."""
        if self._step_meta is meta:
            return
        self._step_meta = meta
        flush = set(meta.flush)
        queued, self._unsubmitted = self._unsubmitted, []
        for job in queued:
            self._submit(job)
        for job in meta.stores:
            if job.job_id in flush:
                self._submit(job)
        for req_id, job_ids in meta.await_stores.items():
            self._awaiting[req_id] = set(job_ids)
        if flush:
            self._flush(flush)

    def handle_preemptions(self, meta: KVDepotMetadata) -> None:
        self._begin_step(meta)

    def start_load_kv(self, meta: KVDepotMetadata) -> None:
        self._begin_step(meta)
        for job in meta.loads:
            self._submit(job)

    def wait_for_save(self, meta: KVDepotMetadata) -> None:
        self._begin_step(meta)
        flush = set(meta.flush)
        self._unsubmitted.extend(job for job in meta.stores if job.job_id not in flush)

    def _submit(self, job: TransferJob) -> None:
        state = WorkerJob(job)
        self._inflight[job.job_id] = state
        for transfer in job.groups:
            if not transfer.keys:
                continue
            daemon_id = job.job_id * MAX_GROUPS + transfer.group_idx
            worker = self.workers[transfer.group_idx]
            submit = self.client.submit_store if job.is_store else self.client.submit_load
            try:
                submit(worker, daemon_id, transfer.keys, transfer.block_ids)
            except KVDepotError as e:
                log.warning("kvdepot refused %s job %d: %s", "store" if job.is_store else "load", job.job_id, e)
                state.failed = True
                continue
            except Exception:  # nothing here may fail the engine's step
                kind = "store" if job.is_store else "load"
                log.exception("kvdepot %s job %d could not be submitted", kind, job.job_id)
                state.failed = True
                continue
            self._daemon_jobs[daemon_id] = job.job_id
            state.pending.add(daemon_id)
        if not state.pending:
            self._job_done(state)
        elif any(w.copier is not None for w in self.workers.values()):
            self._await_host_job(state)

    def _await_host_job(self, state: WorkerJob) -> None:
        """Workers in host memory (CPU engines): the daemon copies a job in
        about the time of a memcpy, so it is waited for here and reported in
        this step, as when these workers copied themselves, instead of costing
        the request a scheduler round trip."""
        sync = state.job.sync and not state.job.is_store
        try:
            results = self.client.wait(list(state.pending), timeout=SYNC_LOAD_WAIT_S if sync else HOST_JOB_WAIT_S)
        except TimeoutError as e:
            if not sync:
                return  # reported by a later step, as a GPU engine's are
            # This step's forward pass reads the blocks: end the load failed now
            # (nothing is copied into them later) and let vLLM recompute them.
            log.error("kvdepot: a load timed out (%s); its blocks are recomputed", e)
            pending = list(state.pending)
            for daemon_id in pending:
                self.client.cancel(daemon_id, "the engine's step stopped waiting for the load")
            try:
                results = self.client.wait(pending, timeout=FLUSH_TIMEOUT_S)
            except (TimeoutError, KeyError):  # its end is running in another thread, and stuck
                for daemon_id in pending:
                    self._daemon_jobs.pop(daemon_id, None)
                state.pending.clear()
                state.failed = True
                self._job_done(state)
                return
        self._collect(results.values())

    def _flush(self, job_ids: set[int]) -> None:
        daemon_ids = [d for j in job_ids if j in self._inflight for d in self._inflight[j].pending]
        if not daemon_ids:
            return
        try:
            results = self.client.wait(daemon_ids, timeout=FLUSH_TIMEOUT_S)
        except TimeoutError as e:
            log.error("kvdepot: preemption flush timed out (%s); the blocks are reused anyway", e)
            return
        self._collect(results.values())

    def _collect(self, results) -> None:
        for result in results:
            job_id = self._daemon_jobs.pop(result.job_id, None)
            state = self._inflight.get(job_id) if job_id is not None else None
            if state is None:
                continue
            state.pending.discard(result.job_id)
            if not result.ok:
                state.failed = True
                log.debug("kvdepot job %d failed: %s", job_id, result.error)
            if not state.pending:
                self._job_done(state)

    def _job_done(self, state: WorkerJob) -> None:
        job = state.job
        del self._inflight[job.job_id]
        self._report.done[job.job_id] = 1
        if state.failed:
            self._report.failed[job.job_id] = 1
        if job.is_store:
            return
        if job.sync:
            # vLLM scheduled the request already: no finished_recving; a
            # failure reaches it as the blocks' ids, in this step.
            if state.failed:
                for transfer in job.groups:
                    self._load_error_block_ids.update(transfer.block_ids)
            return
        self._finished_loads.add(job.req_id)
        if state.failed:
            self._failed_loads.append(job)

    def transfer_results(self, *, failed_as_block_ids: bool) -> tuple[set[str], set[str], set[str]]:
        """(stores done of finished requests, loads done, loads failed) since the last call.

        What vLLM's get_transfer_results, get_finished and
        get_block_ids_with_load_errors answer all comes from here, so that a
        failed load is reported as failed whichever of them vLLM uses:
        - Every load that ended is in the loads done, failed or not: that is
          what releases its request from waiting (vLLM's contract).
        - A failed load is reported as failed exactly once: per request, in
          the third set (failed_recving of get_transfer_results); or, with
          `failed_as_block_ids` (get_finished, which has no failed set), by
          the GPU block ids it was loading into, which the next
          get_block_ids_with_load_errors answers. Per request is the way that
          always works: block ids are only unique within a KV-cache group, so
          with several groups those are the ids of all of them (more blocks
          recomputed, never fewer), and vLLM 0.32 and 0.33 refuse block ids for
          hybrid models (their runners call get_transfer_results).
        """
        self._collect(self.client.take_finished())
        open_jobs = set(self._inflight) | {j.job_id for j in self._unsubmitted}
        sending = {req_id for req_id, jobs in self._awaiting.items() if not jobs & open_jobs}
        for req_id in sending:
            del self._awaiting[req_id]
        recving, self._finished_loads = self._finished_loads, set()
        failed_jobs, self._failed_loads = self._failed_loads, []
        if not failed_as_block_ids:
            return sending, recving, {job.req_id for job in failed_jobs}
        for job in failed_jobs:
            for transfer in job.groups:
                self._load_error_block_ids.update(transfer.block_ids)
        return sending, recving, set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The GPU blocks of the failed loads that transfer_results reported by block ids."""
        block_ids, self._load_error_block_ids = self._load_error_block_ids, set()
        return block_ids

    def build_connector_worker_meta(self) -> KVDepotWorkerMetadata | None:
        if not self._report.done:
            return None
        report, self._report = self._report, KVDepotWorkerMetadata()
        return report

    def shutdown(self) -> None:
        queued, self._unsubmitted = self._unsubmitted, []
        for job in queued:
            self._submit(job)
        self.client.close(timeout=30)

