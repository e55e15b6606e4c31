"""The connector's scheduler side: composes lookups, store planning, block ids and KV events, and keeps the jobs.

It never touches KV data. Each step it turns the scheduler's decisions into
transfer jobs for the workers (`build_connector_meta`) and learns from the
workers' answers which jobs are done (`update_connector_output`). The parts:
- lookup.py: lookups, deferral, and the load that follows a hit;
- store_plan.py: which blocks to store, and when;
- block_ids.py: where a request's GPU block ids come from;
- kv_events.py: KV events of stored and dropped blocks;
- state.py: the records of requests and jobs.

Rules it keeps:
- A job is done when every worker reported it (TP x PP ranks); a failed job
  is done too (a failed load is recomputed by vLLM, a failed store is a later
  miss).
- A GPU block that a store job still reads is never handed to another
  request before the workers flushed that job: a preempted request's stores
  are flushed in the step that preempts it (in lazy mode its blocks are
  stored then too), and a finished request keeps its blocks until its stores
  are done (`request_finished` answers True, the workers report it in
  finished_sending).
- Nothing about a request is kept once it finished and its jobs are done.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from kvdepot.connector.block_ids import BlockIds
from kvdepot.connector.config import ConnectorConfig
from kvdepot.connector.engine_keys import GroupInfo, RequestKeys
from kvdepot.connector.kv_events import KVEvents
from kvdepot.connector.lookup import Lookup
from kvdepot.connector.metadata import KVDepotMetadata, KVDepotWorkerMetadata, TransferJob
from kvdepot.connector.metrics import StatsReport
from kvdepot.connector.state import JobState, RequestState
from kvdepot.connector.store_plan import StorePlan

log = logging.getLogger("kvdepot.connector")


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, vllm_config, groups: list[GroupInfo]):
        self.config = config
        self.groups = groups
        self.block_size = groups[0].block_size
        self.num_workers = vllm_config.parallel_config.world_size
        self.lazy = config.mode == "lazy"
        # The parts that need vLLM internals come first: a missing one stops
        # the engine before it contacts the daemon.
        self.events = KVEvents(vllm_config, self.block_size)
        self.block_ids = BlockIds(groups, self.block_size, self.lazy)
        self.store = StorePlan(groups, self.block_ids, self.events)
        self.client = config.client(f"vllm-scheduler-{os.getpid()}")
        # The daemon keeps removals for the KV events only (of the first group's blocks).
        self.engines = [
            self.client.register_engine(g.namespace, track_removed=self.events.enabled and i == 0)
            for i, g in enumerate(groups)
        ]
        self.events.watch(self.client, self.engines[0])
        self.counters = {"lookups": 0, "hit_tokens": 0, "hit_blocks": 0, "miss_blocks": 0, "deferred": 0, "loads": 0,
                         "stores": 0, "flushed": 0, "load_failures": 0, "store_failures": 0}
        self.stats = StatsReport(self.counters)
        self.lookup = Lookup(config, groups, self.client, self.engines, self._state, self.counters)
        # CPU workers copy a load within their step (worker.py); vLLM reports a
        # failed synchronous load by block ids, which it refuses with several groups.
        cpu = vllm_config.device_config.device_type == "cpu"
        self.lookup.sync_loads = config.sync_loads and cpu and len(groups) == 1
        # Answered by the parts themselves: vLLM calls these per request or per
        # step, and a call through this class would cost one more each time.
        self.on_new_request = self.lookup.on_new_request
        self.get_num_new_matched_tokens = self.lookup.get_num_new_matched_tokens
        self.take_events = self.events.take
        self._reqs: dict[str, RequestState] = {}
        self._jobs: dict[int, JobState] = {}
        self._next_job_id = 1
        # What the next build_connector_meta sends the workers.
        self._new_loads: list[TransferJob] = []
        self._new_stores: list[TransferJob] = []
        self._new_flush: set[int] = set()
        self._await_stores: dict[str, list[int]] = {}

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.block_ids.bind(kv_cache_manager)

    # ------------------------------------------------------------ records

    def _state(self, request) -> RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            policy = self.config.policy_for(
                request.request_id, request.num_prompt_tokens, getattr(request, "kv_transfer_params", None)
            )
            st = RequestState(request, RequestKeys(request, self.block_size), policy, [[] for _ in self.groups])
            self.store.start(st)
            self._reqs[request.request_id] = st
        return st

    def _forget(self, req_id: str) -> None:
        del self._reqs[req_id]
        self.store.forget(req_id)

    def _add_job(self, state: JobState, members: Iterable[RequestState]) -> None:
        self._jobs[state.job.job_id] = state
        for st in members:
            st.jobs.add(state.job.job_id)

    def _job_id(self) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        return job_id

    # ------------------------------------------------------------ loads

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        # vLLM calls this for every request it schedules from the waiting queue.
        st = self._reqs.get(request.request_id)
        if st is not None and st.looked_up is not None:
            self.lookup.scheduled(st, num_external_tokens)
        if num_external_tokens == 0:
            return
        if st is None:
            st = self._state(request)
        transfers, keys, end = self.lookup.plan_load(st, blocks, num_external_tokens)
        if self.store.fences:
            # A block a window freed may come back as a load target in the step
            # its store still reads it: that store goes first.
            self._new_flush |= self.store.stores_reading(b for t in transfers for b in t.block_ids)
        job = TransferJob(self._job_id(), False, transfers, request.request_id, sync=self.lookup.sync_loads)
        self._add_job(JobState(job, [request.request_id], self.num_workers, loading_keys=keys), (st,))
        if end > st.stored_upto:
            self.store.stored(st, end)
        self._new_loads.append(job)
        self.counters["loads"] += 1

    # ------------------------------------------------------------ stores

    def _store_job(self, ready: Iterable[tuple[RequestState, int]]) -> TransferJob | None:
        """One store job for the newly computed whole blocks of these requests."""
        planned = self.store.plan(ready)
        if planned is None:
            return None
        transfers, members, runs = planned
        job = TransferJob(self._job_id(), True, transfers)
        state = JobState(job, [st.request.request_id for st in members], self.num_workers, runs=runs)
        if runs:
            self.events.started(runs)
        if self.block_ids.has_windows:
            self.store.fence(state)
        self._add_job(state, members)
        self._new_stores.append(job)
        self.counters["stores"] += 1
        return job

    # ------------------------------------------------------------ each step

    def build_connector_meta(self, scheduler_output) -> KVDepotMetadata:
        if self.block_ids.follows:
            allocated = self.block_ids.follow(scheduler_output, self._reqs)
            if allocated and self.store.fences:
                # Blocks a sliding window freed and vLLM gave to a request in
                # this very step: flush the stores that still read them.
                self._new_flush |= self.store.stores_reading(allocated)

        for req_id in scheduler_output.preempted_req_ids or ():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            # vLLM hands its blocks to other requests in this step: what reads
            # them is flushed first (in lazy mode, that includes storing them now).
            if self.lazy:
                job = self._store_job([(st, st.num_computed)])
                if job is not None:
                    self._new_flush.add(job.job_id)
            self._new_flush.update(j for j in st.jobs if self._jobs[j].job.is_store)
            self.block_ids.forget(st)
            st.num_computed = 0

        if self.lazy:
            self.store.note_computed(scheduler_output, self._reqs)
        elif self.store.store_at:
            ready = self.store.completed_blocks(scheduler_output, self._reqs)
            if ready:
                self._store_job(ready)

        if self._new_flush:
            self.counters["flushed"] += len(self._new_flush)
        meta = KVDepotMetadata(
            loads=self._new_loads,
            stores=self._new_stores,
            flush=sorted(self._new_flush),
            await_stores=self._await_stores,
        )
        self._new_loads, self._new_stores, self._new_flush, self._await_stores = [], [], set(), {}
        return meta

    # ------------------------------------------------------------ completion

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVDepotWorkerMetadata):
            return
        for job_id, count in meta.done.items():
            state = self._jobs.get(job_id)
            if state is None:
                continue
            state.pending -= count
            state.failed |= meta.failed.get(job_id, 0) > 0
            if state.pending <= 0:
                self._job_finished(state)

    def _job_finished(self, state: JobState) -> None:
        job = state.job
        del self._jobs[job.job_id]
        if state.failed:
            self.counters["store_failures" if job.is_store else "load_failures"] += 1
        if state.fenced_blocks:
            self.store.unfence(state)
        if state.loading_keys:
            self.lookup.loaded(state.loading_keys)
        if state.runs:
            self.events.ended(state.runs, ok=not state.failed)
        for req_id in state.req_ids:
            st = self._reqs.get(req_id)
            if st is None:
                continue
            st.jobs.discard(job.job_id)
            if st.finished and not st.jobs:
                self._forget(req_id)

    def request_finished(self, request) -> tuple[bool, None]:
        """True (keep the GPU blocks) while store jobs still read them."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return False, None
        st.finished = True
        ready = self.store.at_finish(st)
        if ready:
            self._store_job(ready)
        stores = sorted(j for j in st.jobs if self._jobs[j].job.is_store)
        if stores:
            self._await_stores[request.request_id] = stores
            return True, None
        if not st.jobs:
            self._forget(request.request_id)
        return False, None

    def has_pending_push_work(self) -> bool:
        # Stores are submitted at the start of the next step: keep the engine
        # stepping until every job is done, or finished requests never free.
        return bool(self._jobs or self._new_stores or self._new_loads or self._await_stores)

    def reset_cache(self) -> bool:
        """Drops this engine's namespaces from the daemon (every engine sharing them loses them too)."""
        ok = True
        for engine in self.engines:
            if not engine.namespace_name:
                continue
            try:
                self.client.clear(engine.namespace_name)
            except Exception as e:
                log.warning("kvdepot: clearing %s failed: %s", engine.namespace_name, e)
                ok = False
        return ok

    def shutdown(self) -> None:
        self.lookup.shutdown()
        self.client.close(timeout=5)
