"""Where store planning finds a request's GPU block ids: one interface over three sources.

- vLLM's KV-cache manager's own per-group block lists (`req_to_blocks`, see
  vllm_compat.manager_block_lists): exact, with vLLM's null block where a
  sliding window freed one, and read a slice at a time. Used while the manager
  holds the request's blocks.
- The ids this side follows from each SchedulerOutput: new requests' lists,
  cached requests' new ids, a resumed request's list that replaces its old
  one. Needed where the manager no longer has them: lazy mode stores a
  preempted request after vLLM freed its blocks, and a sliding window frees
  blocks while its request runs. Followed only then, and until vLLM binds its
  KV-cache manager (without one there is no other source).
- `kv_cache_manager.get_block_ids`: public, but copies every id of the
  request; the answer when neither of the others has one.

Rules:
- A block a sliding window has left is forgotten (set to 0, vLLM's null block,
  which no store reads), counted from the tokens computed once this step has
  run: a few blocks forgotten too many are merely not stored, one too few
  would store whatever vLLM writes there next.
- Block ids are unique only within a KV-cache group: every list here is per
  offloaded group, in the order of `groups`.
"""

from __future__ import annotations

from kvdepot.connector import vllm_compat
from kvdepot.connector.engine_keys import GroupInfo
from kvdepot.connector.state import RequestState


class BlockIds:
    def __init__(self, groups: list[GroupInfo], block_size: int, lazy: bool):
        self.groups = groups
        self.block_size = block_size
        self.has_windows = any(g.kind == "sliding_window" for g in groups)
        self._must_follow = lazy or self.has_windows
        self.follows = True  # until a KV-cache manager is bound
        self._manager = None
        # Per offloaded group, the manager's req_id -> [KVCacheBlock].
        self.lists: list[dict] | None = None
        # The lists of the only offloaded group, when there is one: store
        # planning reads them inline, without a call per request.
        self.single: dict | None = None
        vllm_compat.check_scheduler_output()

    def bind(self, kv_cache_manager) -> None:
        self._manager = kv_cache_manager
        self.follows = self._must_follow
        self.lists = vllm_compat.manager_block_lists(kv_cache_manager, [g.group_idx for g in self.groups])
        self.single = self.lists[0] if self.lists is not None and len(self.groups) == 1 else None

    def forget(self, st: RequestState) -> None:
        """vLLM freed the request's blocks (preemption); a resumed request gets a new list."""
        st.block_ids = [[] for _ in self.groups]

    def follow(self, scheduler_output, reqs: dict[str, RequestState]) -> set[int]:
        """Takes this step's block ids; returns the ids vLLM allocated in this step (with sliding windows only)."""
        new_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        windows = self.has_windows
        allocated: set[int] = set()
        for req_id, group_block_ids, resumed in _scheduled_block_ids(scheduler_output):
            st = reqs.get(req_id)
            if st is None or group_block_ids is None:
                continue
            for pos, group in enumerate(self.groups):
                ids = list(group_block_ids[group.group_idx])
                if resumed or req_id in new_ids:
                    st.block_ids[pos] = ids
                else:
                    st.block_ids[pos].extend(ids)
                if windows:
                    allocated.update(b for b in ids if b)
        if windows:
            self._forget_left_windows(scheduler_output, reqs)
        return allocated

    def _forget_left_windows(self, scheduler_output, reqs: dict[str, RequestState]) -> None:
        bs = self.block_size
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            st = reqs.get(req_id)
            if st is None:
                continue
            computed = st.request.num_computed_tokens + num_tokens
            for pos, group in enumerate(self.groups):
                if group.window_tokens is not None:
                    ids = st.block_ids[pos]
                    cut = min(len(ids), max(0, (computed - group.window_tokens + 1) // bs))
                    # Those below stored_upto are planned: no store reads these ids again.
                    for i in range(st.stored_upto, cut):
                        ids[i] = 0

    def of(self, st: RequestState, start: int, end: int) -> list[list[int]]:
        """GPU block ids [start, end) of each group (fewer where the request has fewer)."""
        req_id = st.request.request_id
        lists = self.lists
        if lists is not None and req_id in lists[0]:
            return [[b.block_id for b in group_lists.get(req_id, ())[start:end]] for group_lists in lists]
        if self.follows:
            return [ids[start:end] for ids in st.block_ids]
        ids = self._manager.get_block_ids(req_id)
        return [ids[g.group_idx][start:end] for g in self.groups]


def _scheduled_block_ids(scheduler_output):
    """(req_id, new block ids per group or None, resumed) for every scheduled request."""
    for req in scheduler_output.scheduled_new_reqs:
        yield req.req_id, req.block_ids, False
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for req_id, ids in zip(cached.req_ids, cached.new_block_ids):
        yield req_id, ids, req_id in resumed
