"""The connector's scheduler side: lookups, load and store planning, completion bookkeeping.

It never touches KV data. Each step it turns the scheduler's decisions into
transfer jobs for the workers (`build_connector_meta`) and learns from the
workers' answers which jobs are done (`update_connector_output`).

Rules it keeps:
- A lookup never waits for the daemon: the daemon keeps this process's copy
  of each namespace's ready and storing keys up to date (BlocksChanged), and
  lookups are answered from it; their counts reach the daemon's stats once a
  second.
- Per-step work is proportional to what changed: a running request costs one
  lookup in a small dict unless it completed a block this step. Its own state
  is not read then: after the forward pass those objects are out of the CPU
  caches, and reading each one costs more than the comparison itself.
- A hit never covers the last prompt token (vLLM must compute one for logits),
  and counts whole blocks only.
- Blocks this engine is loading already are not loaded twice: a request whose
  hit overlaps an in-flight load waits for it and then finds those blocks in
  the GPU prefix cache. Requests whose hits do not overlap are not held back.
- A GPU block that a store job still reads is never handed to another request
  before the workers flushed that job; a finished request keeps its blocks
  until its stores are done.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable

from kvdepot.connector import vllm_compat
from kvdepot.connector.config import ConnectorConfig, StorePolicy
from kvdepot.connector.keys import GroupInfo, RequestKeys
from kvdepot.connector.metadata import GroupTransfer, KVDepotMetadata, KVDepotWorkerMetadata, TransferJob

log = logging.getLogger("kvdepot.connector")

REPORT_INTERVAL_S = 1.0


@dataclass(eq=False)
class RequestState:
    request: object
    keys: RequestKeys
    policy: StorePolicy
    # Whole blocks the policy lets this request store; None: no limit.
    limit_blocks: int | None
    # GPU block ids of each offloaded group, kept only where the KV-cache
    # manager cannot tell them later (lazy mode, sliding windows).
    block_ids: list[list[int]]
    # Blocks [0, stored_upto) are in the daemon already or in a store job.
    stored_upto: int = 0
    # Tokens whose KV exists once the last scheduled step has run.
    num_computed: int = 0
    # Tokens the GPU prefix cache had at the last lookup.
    num_local: int = 0
    jobs: set[int] = field(default_factory=set)
    deferred_since: float | None = None
    finished: bool = False


@dataclass(eq=False)
class StoredRun:
    """Blocks [start, end) of one request inside a store job, for the KV events."""

    req_id: str
    start: int
    end: int
    keys: list[bytes]
    block_hashes: list
    parent_hash: object
    token_ids: list[int]
    lora_name: str | None
    lora_id: int | None


@dataclass(eq=False)
class JobState:
    job: TransferJob
    req_ids: list[str]
    # Workers that have not reported the job yet.
    pending: int
    failed: bool = False
    loading_keys: list[bytes] = field(default_factory=list)
    runs: list[StoredRun] = field(default_factory=list)
    fenced_blocks: list[int] = field(default_factory=list)


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, vllm_config, groups: list[GroupInfo]):
        self.config = config
        self.groups = groups
        self.block_size = groups[0].block_size
        self.num_workers = vllm_config.parallel_config.world_size
        self.client = config.client(f"vllm-scheduler-{os.getpid()}")
        events = getattr(vllm_config, "kv_events_config", None)
        self._events_enabled = bool(events and events.enable_kv_cache_events)
        self._event_types = vllm_compat.kv_event_types() if self._events_enabled else None
        vllm_compat.check_scheduler_output()
        # Removals are kept for the KV events only (of the first group's blocks).
        self.engines = [
            self.client.register_engine(g.namespace, track_removed=self._events_enabled and i == 0)
            for i, g in enumerate(groups)
        ]
        # Lazy stores at preemption need the blocks vLLM has just freed, and a
        # sliding window frees blocks while its request runs: only then does
        # this side follow each request's block ids step by step.
        self._track_blocks = config.mode == "lazy" or any(g.kind == "sliding_window" for g in groups)
        self._has_windows = any(g.kind == "sliding_window" for g in groups)
        self.kv_cache_manager = None  # bound by the connector (bind_kv_cache_manager)
        self._block_lists = None
        # Lookups are answered here; the daemon's stats learn of them once a second.
        self._report = {"lookups": 0, "hit_blocks": 0, "miss_blocks": 0}
        self._report_lock = threading.Lock()
        self._closing = threading.Event()
        self._reporter = threading.Thread(target=self._report_lookups, name="kvdepot-report", daemon=True)
        self._reporter.start()
        self._reqs: dict[str, RequestState] = {}
        # Request id -> tokens computed once its next block can be stored;
        # absent when the request may store nothing more.
        self._store_at: dict[str, int] = {}
        self._jobs: dict[int, JobState] = {}
        self._next_job_id = 1
        # Keys of blocks this engine is loading now -> number of loads.
        self._loading: dict[bytes, int] = {}
        # GPU block id -> store jobs that still read it.
        self._fences: dict[int, set[int]] = {}
        self._new_loads: list[TransferJob] = []
        self._new_stores: list[TransferJob] = []
        self._new_flush: set[int] = set()
        self._await_stores: dict[str, list[int]] = {}
        self._events: list = []
        # Key -> vLLM block hash of the blocks this engine announced as stored.
        self._stored_hashes: dict[bytes, object] = {}
        self.counters = {"lookups": 0, "hit_tokens": 0, "deferred": 0, "loads": 0, "stores": 0, "flushed": 0}

    # ------------------------------------------------------------ requests

    def _state(self, request) -> RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            bs = self.block_size
            policy = self.config.policy_for(
                request.request_id, request.num_prompt_tokens, getattr(request, "kv_transfer_params", None)
            )
            limit = policy.store_limit_tokens(request.num_prompt_tokens, math.inf)
            limit_blocks = None if limit == math.inf else int(limit) // bs
            st = RequestState(request, RequestKeys(request, bs), policy, limit_blocks, [[] for _ in self.groups])
            if limit_blocks != 0:
                self._store_at[request.request_id] = bs
            self._reqs[request.request_id] = st
        return st

    def _set_stored(self, st: RequestState, blocks: int) -> None:
        st.stored_upto = blocks
        if st.limit_blocks is not None and blocks >= st.limit_blocks:
            self._store_at.pop(st.request.request_id, None)
        else:
            self._store_at[st.request.request_id] = (blocks + 1) * self.block_size

    def _forget(self, req_id: str) -> None:
        del self._reqs[req_id]
        self._store_at.pop(req_id, None)

    def on_new_request(self, request) -> None:
        """Hashes the prompt now, outside the scheduling step."""
        st = self._state(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks > 0 and st.policy.load:
            st.keys.extend(max_blocks)

    # ------------------------------------------------------------ lookups

    def _lookup(self, keys: list[bytes], start: int) -> tuple[int, bool, bool]:
        """(first block past `start` every group can serve, "being stored", available).

        Answered from the copy of each namespace that the daemon keeps this
        process up to date with, so it costs no call and never waits.
        """
        hit, not_yet = len(keys), False
        windows = []
        for group, engine in zip(self.groups, self.engines):
            answer = self.client.cached_lookup(engine, keys[:hit], start)
            if not answer.available:
                return start, False, False
            if group.kind == "sliding_window":
                windows.append((group, engine, start + answer.ready_blocks))
                continue
            if start + answer.ready_blocks < hit or answer.not_yet:
                hit, not_yet = start + answer.ready_blocks, answer.not_yet
        for group, engine, leading in windows:
            # A sliding-window group needs only the window below the hit.
            low = max(start, hit - group.window_blocks)
            if leading < hit and not all(k in engine.ready for k in keys[low:hit]):
                hit, not_yet = leading, False
        return hit, not_yet, True

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if st.jobs:
            # Its own stores (a preemption flush) or load are still in flight.
            return self._defer(st)
        if not st.policy.load or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        start = num_computed_tokens // bs
        st.num_local = num_computed_tokens
        if start >= max_blocks:
            return self._answer(st, 0)
        keys = st.keys.upto(max_blocks)
        hit, not_yet, available = self._lookup(keys, start)
        if not available:
            return self._answer(st, 0)
        if st.deferred_since is None:  # count each request's lookup once, not every deferred step
            self.counters["lookups"] += 1
            with self._report_lock:
                report = self._report
                report["lookups"] += 1
                report["hit_blocks"] += hit - start
                report["miss_blocks"] += max_blocks - hit
        if not_yet and not self._waited_too_long(st):
            # The next blocks are being stored (by this engine or another):
            # wait for them rather than compute them again.
            return self._defer(st)
        if hit <= start:
            return self._answer(st, 0)
        if self._loading and not self._waited_too_long(st) and any(k in self._loading for k in keys[start:hit]):
            # This engine is loading some of these blocks for another request:
            # once that lands they are GPU prefix-cache hits, one transfer in all.
            return self._defer(st)
        return self._answer(st, (hit - start) * bs)

    def _defer(self, st: RequestState) -> tuple[None, bool]:
        if st.deferred_since is None:
            st.deferred_since = time.monotonic()
        self.counters["deferred"] += 1
        return None, False

    def _waited_too_long(self, st: RequestState) -> bool:
        return st.deferred_since is not None and time.monotonic() - st.deferred_since > self.config.max_defer_s

    def _answer(self, st: RequestState, tokens: int) -> tuple[int, bool]:
        st.deferred_since = None
        self.counters["hit_tokens"] += tokens
        return tokens, tokens > 0

    # ------------------------------------------------------------ loads

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        st = self._state(request)
        bs = self.block_size
        start = st.num_local // bs
        end = start + num_external_tokens // bs
        keys = st.keys.range(start, end)
        transfers = []
        for group in self.groups:
            group_blocks = blocks.blocks[group.group_idx][start:end]
            pairs = [(k, b.block_id) for k, b in zip(keys, group_blocks) if not b.is_null]
            transfers.append(GroupTransfer(group.group_idx, [k for k, _ in pairs], [b for _, b in pairs]))
        if self._fences:
            # A block a window freed may come back as a load target in the step
            # its store still reads it: that store goes first.
            for transfer in transfers:
                for b in transfer.block_ids:
                    self._new_flush.update(self._fences.get(b, ()))
        job = TransferJob(self._job_id(), False, transfers, request.request_id)
        self._jobs[job.job_id] = JobState(job, [request.request_id], self.num_workers, loading_keys=keys)
        for k in keys:
            self._loading[k] = self._loading.get(k, 0) + 1
        st.jobs.add(job.job_id)
        if end > st.stored_upto:
            self._set_stored(st, end)
        self._new_loads.append(job)
        self.counters["loads"] += 1

    def _job_id(self) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        return job_id

    # ------------------------------------------------------------ each step

    def build_connector_meta(self, scheduler_output) -> KVDepotMetadata:
        if self.kv_cache_manager is None and not self._track_blocks:
            # A vLLM that does not bind its KV-cache manager to connectors.
            self._track_blocks = True
        if self._track_blocks:
            self._track_block_ids(scheduler_output)

        for req_id in scheduler_output.preempted_req_ids or ():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            if self.config.mode == "lazy":
                job = self._store_job([(st, st.num_computed)])
                if job is not None:
                    self._new_flush.add(job.job_id)
            self._new_flush.update(j for j in st.jobs if self._jobs[j].job.is_store)
            st.block_ids = [[] for _ in self.groups]
            st.num_computed = 0

        if self.config.mode == "eager":
            ready = self._completed_blocks(scheduler_output) if self._store_at else None
            if ready:
                self._store_job(ready)
        else:
            reqs = self._reqs
            for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                st = reqs.get(req_id)
                if st is not None:
                    st.num_computed = st.request.num_computed_tokens + num_tokens

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

    def _completed_blocks(self, scheduler_output) -> list[tuple[RequestState, int]]:
        """(state, tokens computed after this step) of the requests that complete a block to store.

        Reads vLLM's per-step lists and `_store_at` only (see the module's rules).
        """
        store_at, scheduled, reqs = self._store_at, scheduler_output.num_scheduled_tokens, self._reqs
        ready = []
        for new in scheduler_output.scheduled_new_reqs:
            at = store_at.get(new.req_id)
            if at is not None and (computed := new.num_computed_tokens + scheduled[new.req_id]) >= at:
                ready.append((reqs[new.req_id], computed))
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            at = store_at.get(req_id)
            if at is not None and (computed := computed + scheduled[req_id]) >= at:
                ready.append((reqs[req_id], computed))
        return ready

    def _track_block_ids(self, scheduler_output) -> None:
        new_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        allocated: set[int] = set()
        for req_id, group_block_ids, resumed in _scheduled_block_ids(scheduler_output):
            st = self._reqs.get(req_id)
            if st is None or group_block_ids is None:
                continue
            for pos, group in enumerate(self.groups):
                ids = list(group_block_ids[group.group_idx])
                if resumed or req_id in new_ids:
                    st.block_ids[pos] = ids
                else:
                    st.block_ids[pos].extend(ids)
                allocated.update(b for b in ids if b)
        if self._has_windows:
            # vLLM frees (and may hand out again) the blocks a sliding window has
            # left; forget them, as vLLM's null block does, so that no store reads
            # them. Cut by the tokens computed after this step: a few blocks too
            # many are merely not stored, one too few would be wrong data.
            for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                st = self._reqs.get(req_id)
                if st is None:
                    continue
                computed = st.request.num_computed_tokens + num_tokens
                for pos, group in enumerate(self.groups):
                    if group.window_tokens is not None:
                        ids = st.block_ids[pos]
                        cut = min(len(ids), max(0, (computed - group.window_tokens + 1) // self.block_size))
                        for i in range(st.stored_upto, cut):
                            ids[i] = 0
        if self._has_windows:
            # Blocks a sliding window freed and vLLM gave to a request in this
            # very step: flush the stores that still read them.
            for block_id in allocated & self._fences.keys():
                self._new_flush.update(self._fences[block_id])

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self._block_lists = vllm_compat.manager_block_lists(kv_cache_manager, [g.group_idx for g in self.groups])

    def _block_ids_of(self, st: RequestState, start: int, end: int) -> list[list[int]]:
        """GPU block ids [start, end) of each group (fewer where the request has fewer)."""
        req_id = st.request.request_id
        if self._block_lists is not None and req_id in self._block_lists[0]:
            # Exact, with vLLM's null block where a window freed one.
            return [[b.block_id for b in lists.get(req_id, ())[start:end]] for lists in self._block_lists]
        if self._track_blocks:
            return [ids[start:end] for ids in st.block_ids]
        ids = self.kv_cache_manager.get_block_ids(req_id)
        return [ids[g.group_idx][start:end] for g in self.groups]

    def _store_job(self, ready: Iterable[tuple[RequestState, int]]) -> TransferJob | None:
        """One store job for the newly computed whole blocks of these requests."""
        bs = self.block_size
        keys: list[list[bytes]] = [[] for _ in self.groups]
        block_ids: list[list[int]] = [[] for _ in self.groups]
        runs: list[StoredRun] = []
        members: list[RequestState] = []
        block_ids_of, events = self._block_ids_of, self._events_enabled
        # One full-attention group whose block lists vLLM keeps (the common
        # case): read them here, without a call per request.
        lists = self._block_lists[0] if self._block_lists is not None and len(self.groups) == 1 else None
        for st, computed in ready:
            request = st.request
            end = min(computed, request.num_tokens) // bs
            if st.limit_blocks is not None:
                end = min(end, st.limit_blocks)
            start = st.stored_upto
            if end <= start:
                continue
            blocks = lists.get(request.request_id) if lists is not None else None
            if blocks is not None:
                group_ids = [[b.block_id for b in blocks[start:end]]]
            else:
                group_ids = block_ids_of(st, start, end)
            end = start + (len(group_ids[0]) if len(group_ids) == 1 else min(len(ids) for ids in group_ids))
            if end <= start:
                continue
            run_keys = st.keys.range(start, end)
            for pos, ids in enumerate(group_ids):
                if len(ids) == len(run_keys) and 0 not in ids:  # no null block (only windows free them)
                    keys[pos] += run_keys
                    block_ids[pos] += ids
                    continue
                for k, b in zip(run_keys, ids):
                    if b:
                        keys[pos].append(k)
                        block_ids[pos].append(b)
            if events:
                runs.append(_stored_run(request, start, end, bs, run_keys, self._event_types))
            self._set_stored(st, end)
            members.append(st)
        if not members:
            return None
        transfers = [GroupTransfer(g.group_idx, keys[pos], block_ids[pos]) for pos, g in enumerate(self.groups)]
        job = TransferJob(self._job_id(), True, transfers)
        state = JobState(job, [st.request.request_id for st in members], self.num_workers, runs=runs)
        if self._has_windows:
            state.fenced_blocks = sorted({b for ids in block_ids for b in ids})
            for b in state.fenced_blocks:
                self._fences.setdefault(b, set()).add(job.job_id)
        self._jobs[job.job_id] = state
        for st in members:
            st.jobs.add(job.job_id)
        self._new_stores.append(job)
        self.counters["stores"] += 1
        return job

    # ------------------------------------------------------------ completion

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
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
        for b in state.fenced_blocks:
            jobs = self._fences.get(b)
            if jobs is not None:
                jobs.discard(job.job_id)
                if not jobs:
                    del self._fences[b]
        for k in state.loading_keys:
            left = self._loading.get(k, 0) - 1
            if left > 0:
                self._loading[k] = left
            else:
                self._loading.pop(k, None)
        if job.is_store and not state.failed:
            for run in state.runs:
                self._events.append(_stored_event(run, self.block_size, self._event_types))
                self._stored_hashes.update(zip(run.keys, run.block_hashes))
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
        # Whole blocks not yet planned: in lazy mode all of them. In eager mode,
        # with async scheduling (vLLM's default on GPUs), a block's last token
        # id arrives a step after its KV, so the block the last step completed
        # can be stored only now; without async scheduling there is none.
        store_at = self._store_at.pop(request.request_id, None)  # never scheduled again
        if store_at is not None and min(request.num_computed_tokens, request.num_tokens) >= store_at:
            self._store_job([(st, request.num_computed_tokens)])
            self._store_at.pop(request.request_id, None)
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

    def take_events(self) -> list:
        """vLLM KV events, medium CPU: blocks this engine stored, and those the daemon dropped since."""
        if not self._events_enabled:
            return []
        events, self._events = self._events, []
        # Hashes are known for the blocks this engine stored; a block another
        # engine stored was never announced by this one, so it is not retracted.
        removed = [self._stored_hashes.pop(k) for k in self.client.take_removed(self.engines[0]) if k in self._stored_hashes]
        if removed:
            types = self._event_types
            events.append(types.block_removed(block_hashes=removed, medium=types.medium_cpu))
        return events

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

    def _report_lookups(self) -> None:
        while not self._closing.wait(REPORT_INTERVAL_S):
            self._send_report()

    def _send_report(self) -> None:
        with self._report_lock:
            report, self._report = self._report, {"lookups": 0, "hit_blocks": 0, "miss_blocks": 0}
        if report["lookups"] and not self.client.report_lookups(self.engines[0], **report):
            # Not told (daemon away): keep the counts for the next report.
            with self._report_lock:
                for name, value in report.items():
                    self._report[name] += value

    def shutdown(self) -> None:
        self._closing.set()
        self._reporter.join(timeout=5)
        self._send_report()
        self.client.close(timeout=5)


def _scheduled_block_ids(scheduler_output):
    """(req_id, new block ids per group or None, resumed) for every scheduled request."""
    for req in scheduler_output.scheduled_new_reqs:
        yield req.req_id, req.block_ids, False
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for req_id, ids in zip(cached.req_ids, cached.new_block_ids):
        yield req_id, ids, req_id in resumed


def _stored_run(request, start: int, end: int, block_size: int, keys: list[bytes], types) -> StoredRun:
    maybe_convert_block_hash = types.external_hash
    hashes = list(request.block_hashes[start:end]) if len(request.block_hashes) >= end else []
    parent = request.block_hashes[start - 1] if start > 0 and len(request.block_hashes) >= start else None
    lora = request.lora_request
    return StoredRun(
        req_id=request.request_id,
        start=start,
        end=end,
        keys=keys,
        block_hashes=[maybe_convert_block_hash(h) for h in hashes],
        parent_hash=maybe_convert_block_hash(parent) if parent is not None else None,
        token_ids=list(request.all_token_ids[start * block_size : end * block_size]),
        lora_name=lora.lora_name if lora else None,
        lora_id=lora.lora_int_id if lora else None,
    )


def _stored_event(run: StoredRun, block_size: int, types):
    return types.block_stored(
        block_hashes=run.block_hashes,
        parent_block_hash=run.parent_hash,
        token_ids=run.token_ids,
        block_size=block_size,
        lora_id=run.lora_id,
        medium=types.medium_cpu,
        lora_name=run.lora_name,
    )
