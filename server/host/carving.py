"""The pool's slots carved per NUMA node.

The pool's slots are carved into one contiguous range per node, in equal
shares (the first ranges one slot larger where the count does not divide);
free_runs.py keeps each range's free runs. An uncarved pool is one range of
no node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotRange:
    # None: the whole pool, not carved.
    node: int | None
    first: int
    count: int


@dataclass(frozen=True)
class NodeSlots:
    """One NUMA node's part of the pool, as stats show it (proto: NumaNodeStats)."""

    # The node; for a pool not carved, its one memory node, or -1 (several).
    node: int
    first_slot: int
    slots: int
    used_slots: int
    # The kernel took the range's placement (mbind).
    bound: bool
    # PCI addresses of the GPUs on the node.
    gpus: tuple[str, ...]


def carve(num_slots: int, nodes: Sequence[int]) -> list[SlotRange]:
    """Equal contiguous ranges of `num_slots`, one per node, in the nodes' order."""
    if not nodes:
        return [SlotRange(None, 0, num_slots)]
    if num_slots < len(nodes):
        raise ValueError(f"{num_slots} slots cannot be carved over {len(nodes)} NUMA nodes")
    share, extra = divmod(num_slots, len(nodes))
    ranges, first = [], 0
    for i, node in enumerate(nodes):
        count = share + (i < extra)
        ranges.append(SlotRange(node, first, count))
        first += count
    return ranges
