"""vLLM KV events (medium "CPU") for the blocks this engine stored in kvdepot, and for those the daemon dropped.

For cache-aware routers (`--kv-events-config`). Rules:
- A block is announced (`BlockStored`) only once every worker stored it: a
  failed or partial store is never announced.
- Events carry vLLM's own block hashes of the blocks, as vLLM publishes them
  for its GPU cache, so that a router can match the two.
- A block is retracted (`BlockRemoved`) only if this engine announced it: a
  block another engine stored was never announced by this one.
- The daemon's word that a block is gone can come before the workers' word
  that they stored it (two channels): a removal of a key that one of this
  engine's stores is writing waits for that store's end, and the block is
  retracted right after it is announced unless the engine's copy holds it
  ready again by then.
- With events off (the default) they cost nothing: `take` answers at once,
  store planning records no runs, and the daemon keeps no removals for us.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvdepot.connector import vllm_compat


def events_enabled(vllm_config) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events and events.enable_kv_cache_events)


@dataclass(eq=False)
class StoredRun:
    """Blocks of one request inside a store job, for its BlockStored event."""

    keys: list[bytes]
    block_hashes: list
    parent_hash: object
    token_ids: list[int]
    lora_name: str | None
    lora_id: int | None


class KVEvents:
    def __init__(self, vllm_config, block_size: int):
        self.enabled = events_enabled(vllm_config)
        self._types = vllm_compat.kv_event_types() if self.enabled else None
        self._block_size = block_size
        self._client = None
        self._engine = None
        self._events: list = []
        # Key -> vLLM block hash of the blocks this engine announced as stored.
        self._stored_hashes: dict[bytes, object] = {}
        # Keys of this engine's store jobs that have not ended (bounded by its jobs),
        # and those of them the daemon already said are gone.
        self._writing: Counter = Counter()
        self._gone_early: set[bytes] = set()
        self._retract: list = []

    def watch(self, client, engine) -> None:
        """`engine`: the registration whose dropped keys the daemon reports (made with track_removed)."""
        self._client, self._engine = client, engine

    def run(self, request, start: int, end: int, keys: list[bytes]) -> StoredRun:
        """What an event needs of blocks [start, end) of a request, taken when they are planned."""
        external_hash = self._types.external_hash
        hashes = request.block_hashes
        run_hashes = [external_hash(h) for h in hashes[start:end]] if len(hashes) >= end else []
        parent = hashes[start - 1] if start > 0 and len(hashes) >= start else None
        lora = request.lora_request
        return StoredRun(
            keys=keys,
            block_hashes=run_hashes,
            parent_hash=external_hash(parent) if parent is not None else None,
            token_ids=list(request.all_token_ids[start * self._block_size : end * self._block_size]),
            lora_name=lora.lora_name if lora else None,
            lora_id=lora.lora_int_id if lora else None,
        )

    def started(self, runs: list[StoredRun]) -> None:
        """A store job with these runs was made."""
        for run in runs:
            self._writing.update(run.keys)

    def ended(self, runs: list[StoredRun], ok: bool) -> None:
        """A store job ended: its runs are announced if every worker completed it."""
        if ok:
            self._announce(runs)
        writing, gone_early = self._writing, self._gone_early
        for run in runs:
            for key in run.keys:
                left = writing[key] - 1
                if left > 0:
                    writing[key] = left
                    continue
                del writing[key]
                if key in gone_early:
                    gone_early.discard(key)
                    if ok and key not in self._engine.ready and key in self._stored_hashes:
                        self._retract.append(self._stored_hashes.pop(key))

    def _announce(self, runs: list[StoredRun]) -> None:
        block_stored, medium = self._types.block_stored, self._types.medium_cpu
        for run in runs:
            self._events.append(
                block_stored(
                    block_hashes=run.block_hashes,
                    parent_block_hash=run.parent_hash,
                    token_ids=run.token_ids,
                    block_size=self._block_size,
                    lora_id=run.lora_id,
                    medium=medium,
                    lora_name=run.lora_name,
                )
            )
            self._stored_hashes.update(zip(run.keys, run.block_hashes))

    def take(self) -> list:
        """The events since the last call: blocks stored, then those the daemon dropped since."""
        if not self.enabled:
            return []
        events, self._events = self._events, []
        stored, writing = self._stored_hashes, self._writing
        removed, self._retract = self._retract, []
        for key in self._client.take_removed(self._engine):
            if key in stored:
                removed.append(stored.pop(key))
            elif key in writing:
                self._gone_early.add(key)
        if removed:
            events.append(self._types.block_removed(block_hashes=removed, medium=self._types.medium_cpu))
        return events
