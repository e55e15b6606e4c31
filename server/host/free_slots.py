"""The pool's free slots, kept per NUMA node.

The pool's slots are carved into one contiguous range per node, in equal
shares (the first ranges one slot larger where the count does not divide),
and each range's free slots are a stack of their own. A slot asked for on a
node comes from that node's range while it has one free, else from the range
with the most free slots (so that stores with no node, and spills, keep the
nodes even). Nodes are few (numa.MAX_NODES at most): allocate and release
cost O(1) in the number of slots. An uncarved pool is one range of no node.

While the pool comes up (host/bring_up.py) only some slots are online: the
others are neither free nor used until `add_online` brings their chunk in.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Sequence
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


class FreeSlots:
    def __init__(self, num_slots: int, nodes: Sequence[int] = ()):
        self.ranges = carve(num_slots, nodes)
        self.carved = bool(nodes)
        self._starts = [r.first for r in self.ranges]
        self._online = bytearray(b"\x01") * num_slots
        self._online_in = [r.count for r in self.ranges]
        self.online = num_slots
        # Slots taken for kept blocks that wait for their other chunks (HostPool.hold).
        self.kept_waiting = 0
        self.keep_only(())

    def set_online(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Only these (first, count) ranges are online, every slot of them free."""
        self._online = bytearray(len(self._online))
        for first, count in ranges:
            self._online[first : first + count] = b"\x01" * len(self._online[first : first + count])
        self._online_in = [self._online.count(1, r.first, r.first + r.count) for r in self.ranges]
        self.online = sum(self._online_in)
        self.keep_only(())

    def online_runs(self) -> list[tuple[int, int]]:
        """The online slots as (first, count) runs."""
        runs, online, at = [], self._online, 0
        while (start := online.find(1, at)) >= 0:
            end = online.find(0, start)
            end = len(online) if end < 0 else end
            runs.append((start, end - start))
            at = end
        return runs

    def add_online(self, first: int, count: int, held: Collection[int] = ()) -> list[int]:
        """Slots [first, first + count) come online, free but those `held`
        (taken); returns the ones that came online free."""
        added = [s for s in range(min(first + count, len(self._online)) - 1, max(first, 0) - 1, -1)
                 if not self._online[s]]
        free, held = [], set(held)
        for slot in added:  # highest first: the chunk's lowest slots are taken first
            self._online[slot] = 1
            i = self._range_of(slot)
            self._online_in[i] += 1
            if slot in held:
                self.kept_waiting += 1
            else:
                self._stacks[i].append(slot)
                free.append(slot)
        self.online += len(added)
        self.free += len(free)
        return free

    def no_longer_waiting(self, n: int) -> None:
        self.kept_waiting -= n

    def keep_only(self, used: Iterable[int], kept_waiting: int = 0) -> list[int]:
        """Every online slot free but `used` (of which `kept_waiting` are held
        for kept blocks, not a block's yet); returns the free slots."""
        self.kept_waiting = kept_waiting
        used = set(used)
        online = self._online
        # Popped from the end: lowest slots first.
        self._stacks = [
            [s for s in range(r.first + r.count - 1, r.first - 1, -1) if online[s] and s not in used]
            for r in self.ranges
        ]
        self._by_node = {r.node: stack for r, stack in zip(self.ranges, self._stacks) if r.node is not None}
        self._only = self._stacks[0] if len(self._stacks) == 1 else None
        self.free = sum(map(len, self._stacks))
        return [s for stack in self._stacks for s in stack]

    def allocate(self, node: int | None = None) -> int | None:
        """A free slot, of `node`'s range while it has one; None when none is free."""
        stack = self._by_node.get(node)
        if not stack:
            stack = self._only if self._only is not None else max(self._stacks, key=len)
            if not stack:
                return None
        self.free -= 1
        return stack.pop()

    def release(self, slot: int) -> None:
        self._stacks[self._range_of(slot)].append(slot)
        self.free += 1

    def _range_of(self, slot: int) -> int:
        return bisect.bisect_right(self._starts, slot) - 1

    def free_in(self, index: int) -> int:
        """Free slots of the `index`th range."""
        return len(self._stacks[index])

    def online_in(self, index: int) -> int:
        """Online slots of the `index`th range."""
        return self._online_in[index]
