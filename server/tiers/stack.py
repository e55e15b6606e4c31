"""The tiers under the DRAM blocks, as the block index sees them.

The index tells the stack what happens to DRAM blocks (a store committed, a
block dropped); the stack hands that to each tier that is on: the kept pool
(warm.py) seals committed shards. It also keeps the tiers' counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.server.tiers.warm import WarmPool


@dataclass
class TierCounters:
    # Blocks the daemon adopted from the kept pool at start, and the shards it
    # discarded there (by reason: torn, format, data_hash, incomplete...).
    adopted_blocks: int = 0
    adopted_shards: int = 0
    adopt_discarded: dict[str, int] = field(default_factory=dict)


class TierStack:
    def __init__(self, warm: WarmPool | None = None):
        self.warm = warm
        self.counters = TierCounters()

    def committed(self, ns, rank: int, shards: list[tuple[bytes, int]], length: int) -> None:
        if self.warm is not None:
            self.warm.seal(ns, rank, shards, length)

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
        return [dram]
