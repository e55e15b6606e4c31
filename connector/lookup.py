"""What a request loads from kvdepot: its lookup, when it waits instead, and what its load moves.

Rules:
- A lookup never waits for the daemon: the daemon keeps this process's copy
  of each namespace's ready and storing keys up to date (BlocksChanged), and
  lookups are answered from it. Their counts reach the daemon's stats once a
  second, from a thread. A lookup counts when vLLM schedules its request, with
  the blocks vLLM accepted as hits: a request that waits (for blocks being
  stored or loaded, or for KV space) is looked up again every step, and counts
  once.
- A hit counts whole blocks only, starts after the GPU prefix-cache hit, and
  never covers the last prompt token (vLLM must compute one for logits).
- A hit needs every offloaded group; a sliding-window group needs only the
  window below the end of the hit.
- Blocks this engine is loading already are not loaded twice: a request whose
  hit overlaps an in-flight load waits for it and then finds those blocks in
  the GPU prefix cache. Requests whose hits do not overlap are not held back,
  and neither are those overlapping another engine's load (its GPU memory is
  not ours).
- A request whose next blocks some engine is still storing waits for them
  rather than computing them again.
- A request's blocks below DRAM (on the daemon's disk, or, where the daemon
  shares the namespace through a remote store, any the copy does not list)
  are asked for when it arrives (`promote_on_arrival`; else at its first
  lookup), and its lookups wait for the answer and the promotions: by the
  time it is scheduled they are usually in DRAM.
- A request whose own jobs are in flight (its load, or the stores a
  preemption flushes) waits for them before it is looked up again.
- A request waits ("not yet", one step at a time) at most `max_defer_s`; then
  it loads what is ready and computes the rest.
- Where the workers copy in host memory (a CPU engine) and the model has one
  KV-cache group, a hit loads synchronously: vLLM schedules the request in the
  step of its lookup and the workers load before the forward pass, instead of
  an engine step that only loads (`sync_loads`). Elsewhere loads are async.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvdepot.connector.config import ConnectorConfig
from kvdepot.connector.engine_keys import GroupInfo
from kvdepot.connector.metadata import GroupTransfer
from kvdepot.connector.state import RequestState

REPORT_INTERVAL_S = 1.0


class Lookup:
    def __init__(
        self,
        config: ConnectorConfig,
        groups: list[GroupInfo],
        client,
        engines: list,
        state_of: Callable[[object], RequestState],
        counters: dict[str, int],
    ):
        self.config = config
        self.groups = groups
        self.block_size = groups[0].block_size
        self.client = client
        self.engines = engines
        self._state_of = state_of
        self.counters = counters
        self.sync_loads = False
        # Keys of blocks this engine is loading now -> number of loads.
        self.loading: dict[bytes, int] = {}
        self._report = {"lookups": 0, "hit_blocks": 0, "miss_blocks": 0}
        self._report_lock = threading.Lock()
        self._closing = threading.Event()
        self._reporter = threading.Thread(target=self._report_lookups, name="kvdepot-report", daemon=True)
        self._reporter.start()

    def on_new_request(self, request) -> None:
        """Hashes the prompt when the request arrives, outside the scheduling
        step, and asks the daemon to look for its blocks in a remote store
        (where it shares the namespace through one): they come up into DRAM
        while the request waits to be scheduled."""
        st = self._state_of(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks > 0 and st.policy.load:
            st.keys.extend(max_blocks)
            if self.config.promote_on_arrival:
                self._ask_below(st, st.keys.upto(max_blocks))

    def _ask_below(self, st: RequestState, keys: list[bytes]) -> None:
        # An engine not registered yet (the daemon was away) is asked at a later lookup.
        st.asked_below = all(engine.registered for engine in self.engines)
        for engine in self.engines:
            self.client.ask_ahead(engine, keys)

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
            # Only the window below the end of the hit.
            low = max(start, hit - group.window_blocks)
            if leading < hit and not all(k in engine.ready for k in keys[low:hit]):
                hit, not_yet = leading, False
        return hit, not_yet, True

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state_of(request)
        if st.jobs:
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
        if not st.asked_below:
            self._ask_below(st, keys)
        hit, not_yet, available = self._lookup(keys, start)
        if not available:
            return self._answer(st, 0)
        st.looked_up = max_blocks - start
        if not_yet and not self._waited_too_long(st):
            # The next blocks are being stored: wait for them rather than compute them again.
            return self._defer(st)
        if hit <= start:
            return self._answer(st, 0)
        if self.loading and not self._waited_too_long(st) and any(k in self.loading for k in keys[start:hit]):
            # Once this engine's load of them lands they are GPU prefix-cache hits.
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
        return tokens, tokens > 0 and not self.sync_loads

    def scheduled(self, st: RequestState, num_external_tokens: int) -> None:
        """vLLM scheduled the request with this many tokens from kvdepot: its lookup counts now."""
        looked_up, st.looked_up = st.looked_up, None
        hit = num_external_tokens // self.block_size
        counters = self.counters
        counters["lookups"] += 1
        counters["hit_blocks"] += hit
        counters["miss_blocks"] += looked_up - hit
        with self._report_lock:
            report = self._report
            report["lookups"] += 1
            report["hit_blocks"] += hit
            report["miss_blocks"] += looked_up - hit

    # ------------------------------------------------------------ the load that follows a hit

    def plan_load(
        self, st: RequestState, blocks, num_external_tokens: int
    ) -> tuple[list[GroupTransfer], list[bytes], int]:
        """(transfers per group, keys, end block) of the load of the hit vLLM accepted into `blocks`.

        The load starts after the GPU prefix-cache hit of the lookup. Its keys
        count as loading (`loading`) until `loaded` is called with them.
        """
        bs = self.block_size
        start = st.num_local // bs
        end = start + num_external_tokens // bs
        keys = st.keys.range(start, end)
        transfers = []
        for group in self.groups:
            group_blocks = blocks.blocks[group.group_idx][start:end]
            # A sliding window's blocks below its window are vLLM's null block: nothing to load.
            pairs = [(k, b.block_id) for k, b in zip(keys, group_blocks) if not b.is_null]
            transfers.append(GroupTransfer(group.group_idx, [k for k, _ in pairs], [b for _, b in pairs]))
        loading = self.loading
        for k in keys:
            loading[k] = loading.get(k, 0) + 1
        return transfers, keys, end

    def loaded(self, keys: list[bytes]) -> None:
        loading = self.loading
        for k in keys:
            left = loading.get(k, 0) - 1
            if left > 0:
                loading[k] = left
            else:
                loading.pop(k, None)

    # ------------------------------------------------------------ lookup counts

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
        """Stops the reporter and sends what it has not yet."""
        self._closing.set()
        self._reporter.join(timeout=5)
        self._send_report()
