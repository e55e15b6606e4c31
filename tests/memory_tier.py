"""A tier that keeps shards in this process's memory: for the tests alone.

It shows that a tier below DRAM is one implementation of core/tiers.py's
`Tier` and one more entry in the daemon's list (the launcher
daemon_with_memory_tier.py adds it under the kept pool and the disk): no
change to the block index or the depot. Like a remote store it answers
promotions later, on the event loop, and drops its oldest shards when full.
"""

from __future__ import annotations

from collections import OrderedDict

from kvdepot.server.core.tiers import Tier, TierStats


class MemoryTier(Tier):
    name = "memory"

    def __init__(self, pool, loop, capacity_shards: int):
        self.pool = pool
        self.loop = loop
        self.capacity = capacity_shards
        # (namespace digest, key, rank) -> the shard's bytes, oldest first.
        self.shards: OrderedDict[tuple[bytes, bytes, int], bytes] = OrderedDict()
        self.counts = dict(written=0, written_bytes=0, read=0, read_bytes=0, promotions=0, evicted=0)

    def holds(self, ns, key: bytes) -> bool:
        return all((ns.digest, key, rank) in self.shards for rank in range(ns.tp_size))

    def keys_of(self, ns, exclude: set) -> list[bytes]:
        keys = dict.fromkeys(k for digest, k, _ in self.shards if digest == ns.digest and k not in exclude)
        return [k for k in keys if self.holds(ns, k)]

    def demote(self, ns, rank: int, blocks, length: int) -> None:
        for block in blocks:
            name = (ns.digest, block.key, rank)
            if name in self.shards or not self.host.holds(block):
                continue
            # A copy now, on the loop: DRAM still holds the shard, and the
            # test tier has no thread to pin it for.
            self.shards[name] = bytes(self.pool.slot_view(block.slots[rank], length))
            self.counts["written"] += 1
            self.counts["written_bytes"] += length
        gone = set()
        while len(self.shards) > self.capacity:
            (digest, key, _), _ = self.shards.popitem(last=False)
            self.counts["evicted"] += 1
            gone.add((digest, key))
        if gone:
            self.host.lower_gone(gone)

    def promotable(self, ns, key: bytes) -> tuple | None:
        if not self.holds(ns, key):
            return None
        return tuple(len(self.shards[(ns.digest, key, rank)]) for rank in range(ns.tp_size))

    def promote(self, ns, key: bytes, slots: list[int], done) -> None:
        def fill() -> None:
            for rank, slot in enumerate(slots):
                data = self.shards.get((ns.digest, key, rank))
                if data is None:  # dropped since: a miss
                    done(False)
                    return
                self.pool.slot_view(slot, len(data))[:] = data
                self.counts["read"] += 1
                self.counts["read_bytes"] += len(data)
            self.counts["promotions"] += 1
            done(True)

        self.loop.call_soon(fill)

    def clear(self, ns) -> None:
        for name in [n for n in self.shards if ns is None or n[0] == ns.digest]:
            del self.shards[name]

    def stats(self) -> TierStats:
        c = self.counts
        return TierStats(
            self.name, shards=len(self.shards), bytes=sum(map(len, self.shards.values())),
            written_shards=c["written"], written_bytes=c["written_bytes"], read_shards=c["read"],
            read_bytes=c["read_bytes"], promotions=c["promotions"], evicted_shards=c["evicted"],
        )
