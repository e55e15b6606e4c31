"""What this engine stores, and when: whole blocks, batched into one store job per step.

Rules:
- Stores are whole blocks, up to what the request's policy allows (a share of
  its prompt, and decode blocks), never a block the request loaded.
- Eager mode plans each block in the step that computes its last token's KV;
  lazy mode plans a request's blocks when it finishes or is preempted.
- Per-step work is proportional to what changed: a running request costs one
  lookup in a small dict (`store_at`, the tokens it needs computed before its
  next block can be stored) unless it completed a block this step. Its own
  state is not read then: after the forward pass those objects are out of the
  CPU caches, and reading each one costs more than the comparison itself.
- With async scheduling (vLLM's default on GPUs) a block's last token id
  reaches the scheduler a step after its KV, and a block's key covers its
  token ids: the block is planned when its tokens are known, a step later, or
  when the request finishes.
- A GPU block that a store job still reads is never handed to another request
  before the workers flushed that job. Preempted and finished requests are
  kept so by scheduler.py; here, with sliding windows, each block a store reads
  is fenced until the store is done, and a fenced block that vLLM gives out
  again (a window freed it) gets its stores flushed first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from kvdepot.connector.block_ids import BlockIds
from kvdepot.connector.engine_keys import GroupInfo
from kvdepot.connector.kv_events import KVEvents, StoredRun
from kvdepot.connector.metadata import GroupTransfer
from kvdepot.connector.state import JobState, RequestState


class StorePlan:
    def __init__(self, groups: list[GroupInfo], block_ids: BlockIds, events: KVEvents):
        self.groups = groups
        self.block_size = groups[0].block_size
        self.block_ids = block_ids
        self.events = events
        # Request id -> tokens computed once its next block can be stored;
        # absent when the request may store nothing more.
        self.store_at: dict[str, int] = {}
        # GPU block id -> store jobs that still read it (sliding windows only).
        self.fences: dict[int, set[int]] = {}

    # ------------------------------------------------------------ requests

    def start(self, st: RequestState) -> None:
        """A new request: how much of it the policy lets it store."""
        bs = self.block_size
        request = st.request
        limit = st.policy.store_limit_tokens(request.num_prompt_tokens, math.inf)
        st.limit_blocks = None if limit == math.inf else int(limit) // bs
        if st.limit_blocks != 0:
            self.store_at[request.request_id] = bs

    def stored(self, st: RequestState, blocks: int) -> None:
        """Blocks [0, blocks) of the request are in the daemon or in a job."""
        st.stored_upto = blocks
        req_id = st.request.request_id
        if st.finished or (st.limit_blocks is not None and blocks >= st.limit_blocks):
            self.store_at.pop(req_id, None)
        else:
            self.store_at[req_id] = (blocks + 1) * self.block_size

    def forget(self, req_id: str) -> None:
        self.store_at.pop(req_id, None)

    # ------------------------------------------------------------ when

    def completed_blocks(self, scheduler_output, reqs: dict[str, RequestState]) -> list[tuple[RequestState, int]]:
        """Eager mode: (state, tokens computed after this step) of the requests that complete a block to store.

        Reads vLLM's per-step lists and `store_at` only (see the module's rules).
        """
        store_at = self.store_at
        if not store_at:
            return []
        scheduled = scheduler_output.num_scheduled_tokens
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

    @staticmethod
    def note_computed(scheduler_output, reqs: dict[str, RequestState]) -> None:
        """Lazy mode: what a preemption or the finish will find computed."""
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            st = reqs.get(req_id)
            if st is not None:
                st.num_computed = st.request.num_computed_tokens + num_tokens

    def at_finish(self, st: RequestState) -> list[tuple[RequestState, int]]:
        """The request's whole blocks not yet planned; `st.finished` must be set.

        In lazy mode, all of them. In eager mode, with async scheduling, the
        block its last step completed; without async scheduling there is none.
        """
        request = st.request
        store_at = self.store_at.pop(request.request_id, None)
        if store_at is None or min(request.num_computed_tokens, request.num_tokens) < store_at:
            return []
        return [(st, request.num_computed_tokens)]

    # ------------------------------------------------------------ what

    def plan(self, ready: Iterable[tuple[RequestState, int]]):
        """(transfers per group, the requests in them, their runs for the KV events), or None: nothing to store.

        The newly computed whole blocks of these requests; `stored` is called for each.
        """
        bs = self.block_size
        num_groups = len(self.groups)
        keys: list[list[bytes]] = [[] for _ in range(num_groups)]
        block_ids: list[list[int]] = [[] for _ in range(num_groups)]
        runs: list[StoredRun] = []
        members: list[RequestState] = []
        block_ids_of, single = self.block_ids.of, self.block_ids.single
        events = self.events if self.events.enabled else None
        for st, computed in ready:
            request = st.request
            end = min(computed, request.num_tokens) // bs
            if st.limit_blocks is not None:
                end = min(end, st.limit_blocks)
            start = st.stored_upto
            if end <= start:
                continue
            blocks = single.get(request.request_id) if single is not None else None
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
            if events is not None:
                runs.append(events.run(request, start, end, run_keys))
            self.stored(st, end)
            members.append(st)
        if not members:
            return None
        transfers = [GroupTransfer(g.group_idx, keys[pos], block_ids[pos]) for pos, g in enumerate(self.groups)]
        return transfers, members, runs

    # ------------------------------------------------------------ fences

    def fence(self, state: JobState) -> None:
        """The store's blocks are read until it is done (with sliding windows; nothing else frees a running
        request's blocks)."""
        state.fenced_blocks = sorted({b for transfer in state.job.groups for b in transfer.block_ids})
        job_id = state.job.job_id
        for b in state.fenced_blocks:
            self.fences.setdefault(b, set()).add(job_id)

    def unfence(self, state: JobState) -> None:
        job_id = state.job.job_id
        for b in state.fenced_blocks:
            jobs = self.fences.get(b)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self.fences[b]

    def stores_reading(self, block_ids: Iterable[int]) -> set[int]:
        """The store jobs that still read any of these GPU blocks."""
        fences = self.fences
        jobs: set[int] = set()
        for b in block_ids:
            fenced = fences.get(b)
            if fenced:
                jobs |= fenced
        return jobs
