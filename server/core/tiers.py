"""The tiers under the DRAM blocks, as the block index sees them.

The index tells the stack what happens to DRAM blocks (a store committed, a
lookup that missed in DRAM); the stack hands that to each tier that is on:
the kept pool (warm.py) seals committed shards, the disk tier (mover.py)
writes them behind and promotes what lookups find only there. It also keeps
the tiers' counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot.proto import kvdepot_pb2 as pb


@dataclass
class TierCounters:
    # Blocks (and their shards) the daemon adopted from the kept pool at
    # start, and the shards it discarded there, by reason.
    adopted_blocks: int = 0
    adopted_shards: int = 0
    adopt_discarded: dict[str, int] = field(default_factory=dict)


class TierStack:
    def __init__(self, warm=None, mover=None):
        self.warm = warm
        self.mover = mover
        self.counters = TierCounters()
        # Sends the index's changes to the engines (the depot's ChangeFeed):
        # promotions end outside any call that would.
        self.after_change = lambda: None

    def attach(self, index) -> None:
        if self.mover is not None:
            self.mover.index = index
            self.mover.after_change = lambda: self.after_change()

    def connect(self, after_change, namespaces) -> None:
        """How the tiers tell engines what changed outside any call: the
        depot's change feed, and its namespaces."""
        self.after_change = after_change
        if self.mover is not None:
            self.mover.namespaces = namespaces

    @property
    def on(self) -> bool:
        """Whether a tier below DRAM can hold blocks that DRAM does not."""
        return self.mover is not None

    def holds(self, ns, key: bytes) -> bool:
        """Whether a lower tier holds every rank of `ns`'s block `key`."""
        return self.mover is not None and self.mover.holds(ns, key)

    def lower_keys(self, ns, exclude: set) -> list[bytes]:
        """`ns`'s keys that a lower tier holds whole, but for those in `exclude`."""
        return [] if self.mover is None else self.mover.keys_of(ns, exclude)

    def committed(self, ns, rank: int, blocks: list, length: int) -> None:
        if self.warm is not None:
            self.warm.seal(ns, rank, blocks, length)
        if self.mover is not None:
            self.mover.committed(ns, rank, blocks, length)

    def promote(self, ns, key: bytes) -> bool:
        """Starts bringing `ns`'s block `key` into DRAM from a lower tier;
        False if none holds it (or it cannot start now)."""
        return self.mover is not None and self.mover.promote(ns, key)

    def clear(self, ns) -> None:
        """`kvdepot clear`: `ns`'s blocks (all when None) leave the lower tiers too."""
        if self.mover is not None:
            self.mover.clear(ns)

    def promoted(self, block, records) -> None:
        if self.warm is not None:
            for rank, record in enumerate(records):
                self.warm.seal(block.ns, rank, [block], record.length)

    def adopted(self, blocks: int, shards: int, discarded: dict[str, int]) -> None:
        self.counters.adopted_blocks = blocks
        self.counters.adopted_shards = shards
        self.counters.adopt_discarded = dict(discarded)

    def stats(self, pool) -> list[pb.TierStats]:
        dram = pb.TierStats(
            name="dram",
            shards=pool.used_slots,
            bytes=pool.used_slots * pool.slot_bytes,
            capacity_bytes=pool.size,
            written_shards=self.warm.sealed if self.warm else 0,
            recovered_shards=self.counters.adopted_shards,
        )
        dram.discarded.update(self.counters.adopt_discarded)
        if self.warm is not None and self.warm.skipped:
            dram.discarded["not_sealed"] = self.warm.skipped
        tiers = [dram]
        if self.mover is not None:
            tiers.append(self.mover.stats())
        return tiers

    async def close(self) -> None:
        if self.mover is not None:
            await self.mover.close()
