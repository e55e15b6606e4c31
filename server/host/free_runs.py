"""The pool's free space as runs of slots, for blocks of any size.

A shard of L bytes takes a run of span = ceil(L / slot bytes) consecutive
slots, so that its bytes stay contiguous: the copy kernels, the DMA batches,
the records' hashes and the tiers below read a shard as one range, as before.

Runs of many spans in one free list would fragment the pool: a store of a big
block would find slots enough, but no run of them. So the pool is cut into
extents (at most `extent_slots` slots each, never across a NUMA range or a
registration chunk) and an extent holds runs of one span at a time, at its
first slot, first + span, ... (a tail shorter than a span stays unused). An
extent with no run in use is free again, and the next span to want one takes
it. A store finds room in O(1): a free run in an extent of its span, else a
free extent. The waste is each shard's rounding up to a slot and each
extent's tail.

The pool keeps its NUMA carving (carving.carve): a run asked for on a node
comes from that node's range while it has room, else from the range with the
most free slots that has room. While the pool comes up only some extents are
online; `add_online` brings a chunk's in.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvdepot.server.host.carving import carve


def cut_extents(ranges, chunk_slots: int, extent_slots: int) -> list[tuple[int, int, int]]:
    """(range index, first slot, slots) of every extent, in slot order."""
    extents = []
    for i, r in enumerate(ranges):
        at, end = r.first, r.first + r.count
        while at < end:
            chunk_end = min(end, (at // chunk_slots + 1) * chunk_slots)
            while at < chunk_end:
                count = min(extent_slots, chunk_end - at)
                extents.append((i, at, count))
                at += count
    return extents


class FreeRuns:
    def __init__(self, num_slots: int, nodes: Sequence[int] = (), chunk_slots: int = 0, extent_slots: int = 0):
        self.num_slots = num_slots
        self.ranges = carve(num_slots, nodes)
        self.carved = bool(nodes)
        chunk_slots = chunk_slots or num_slots or 1
        extent_slots = max(1, min(extent_slots or chunk_slots, chunk_slots))
        # The native lane cuts its own extents from these (server/native/src/slots.cpp).
        self.chunk_slots, self.extent_slots = chunk_slots, extent_slots
        extents = cut_extents(self.ranges, chunk_slots, extent_slots)
        self._range = [r for r, _, _ in extents]
        self._first = [f for _, f, _ in extents]
        self._count = [c for _, _, c in extents]
        # The largest span a run can have: the largest extent.
        self.max_span = max(self._count, default=0)
        n = len(extents)
        self._span = [0] * n  # 0: free
        self._runs: list[list[int]] = [[] for _ in range(n)]  # free runs of its span, a stack
        self._used = [0] * n  # runs in use (a block's, or held for a kept block)
        self._online = [False] * n
        # Slots of runs in use, and slots online, per range.
        self._used_in = [0] * len(self.ranges)
        self._online_in = [0] * len(self.ranges)
        self._free_extents: list[list[int]] = [[] for _ in self.ranges]  # a stack: lowest on top
        self._partial: list[dict[int, dict[int, None]]] = [{} for _ in self.ranges]  # span -> extents with a free run
        self.kept_waiting = 0
        self.set_online([(0, num_slots)])

    # ------------------------------------------------------------ counts

    @property
    def online(self) -> int:
        return sum(self._online_in)

    @property
    def free(self) -> int:
        """Slots online and in no run in use (extents' tails included)."""
        return self.online - sum(self._used_in)

    @property
    def free_extent_slots(self) -> int:
        """Slots of the online extents no run holds: room for a block of any size."""
        return sum(self._count[e] for stack in self._free_extents for e in stack)

    def free_in(self, index: int) -> int:
        return self._online_in[index] - self._used_in[index]

    def online_in(self, index: int) -> int:
        return self._online_in[index]

    def extent_of(self, slot: int) -> int:
        return bisect.bisect_right(self._first, slot) - 1

    def span_at(self, slot: int) -> int:
        """The span of the runs of `slot`'s extent (0: a free extent)."""
        return self._span[self.extent_of(slot)]

    # ------------------------------------------------------------ room for another span

    @property
    def extents(self) -> int:
        return len(self._first)

    def extents_of(self, slots: np.ndarray) -> np.ndarray:
        """extent_of for many slots at once."""
        return np.searchsorted(np.asarray(self._first), slots, side="right") - 1

    def bounds(self, e: int) -> tuple[int, int]:
        """Extent `e`'s slots: [first, end)."""
        return self._first[e], self._first[e] + self._count[e]

    def frees_run(self, slots: Iterable[int | None], span: int) -> bool:
        """Whether releasing the runs at `slots` (one block's, None: a rank
        without one) frees a run of `span`: one in an extent of that span, or
        an extent they alone use."""
        within: dict[int, int] = {}
        for slot in slots:
            if slot is None:
                continue
            e = self.extent_of(slot)
            if self._span[e] == span:
                return True
            within[e] = within.get(e, 0) + 1
        return any(self._used[e] == n and self._count[e] >= span for e, n in within.items())

    def can_clear(self, e: int, span: int, runs: int) -> bool:
        """Whether extent `e` is free once `runs` runs of it go (no other run,
        such as one held for a kept block, stays) and then fits a run of `span`."""
        return self._online[e] and self._count[e] >= span and self._used[e] == runs

    # ------------------------------------------------------------ bring-up

    def set_online(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Only the extents inside these (first, count) ranges are online, all free."""
        online = [False] * len(self._first)
        for first, count in ranges:
            for e in self._extents_within(first, count):
                online[e] = True
        self._online = online
        self._online_in = [0] * len(self.ranges)
        for e, up in enumerate(online):
            if up:
                self._online_in[self._range[e]] += self._count[e]
        self.keep_only({})

    def online_runs(self) -> list[tuple[int, int]]:
        """The online slots as (first, count) runs."""
        runs: list[tuple[int, int]] = []
        for e, up in enumerate(self._online):
            if not up:
                continue
            if runs and runs[-1][0] + runs[-1][1] == self._first[e]:
                runs[-1] = (runs[-1][0], runs[-1][1] + self._count[e])
            else:
                runs.append((self._first[e], self._count[e]))
        return runs

    def add_online(self, first: int, count: int, held: Mapping[int, int] = {}) -> list[int]:
        """The extents inside [first, first + count) come online, free but the
        runs `held` ({first slot: span}, kept blocks, taken); returns the
        slots that came online outside those runs, as (first, count) ranges."""
        free = []
        held_by = self._by_extent(held)
        for e in self._extents_within(first, count):
            if self._online[e]:
                continue
            self._online[e] = True
            i = self._range[e]
            self._online_in[i] += self._count[e]
            runs = held_by.pop(e, {})
            self._place(e, runs)
            self.kept_waiting += sum(runs.values())
            free += self._outside(e, runs)
        return free

    def no_longer_waiting(self, n: int) -> None:
        self.kept_waiting -= n

    def keep_only(self, used: Mapping[int, int], kept_waiting: int = 0) -> list[int]:
        """Every online extent free but the runs `used` ({first slot: span},
        which fits() accepted; `kept_waiting` of their slots are held for
        kept blocks); returns the online slots outside those runs, as
        (first, count) ranges: a TiB pool has 16M slots, too many to list."""
        self.kept_waiting = kept_waiting
        self._used_in = [0] * len(self.ranges)
        self._free_extents = [[] for _ in self.ranges]
        self._partial = [{} for _ in self.ranges]
        by_extent = self._by_extent(used)
        free = []
        for e in range(len(self._first) - 1, -1, -1):  # pushed highest first: the lowest is taken first
            self._span[e], self._runs[e], self._used[e] = 0, [], 0
            if not self._online[e]:
                continue
            runs = by_extent.get(e, {})
            self._place(e, runs)
            free += self._outside(e, runs)
        return sorted(free)

    def fits(self, runs: Mapping[int, int]) -> dict[int, str]:
        """Of the runs ({first slot: span}) a kept pool's records name, those
        that cannot be placed as they are, with why: out of the pool, not on
        a run boundary of its extent, or in an extent another span has (the
        lowest run of an extent fixes its span). With numpy: a kept pool
        names hundreds of thousands."""
        slots = np.fromiter(runs.keys(), dtype=np.int64, count=len(runs))
        spans = np.fromiter(runs.values(), dtype=np.int64, count=len(runs))
        order = np.argsort(slots, kind="stable")
        slots, spans = slots[order], spans[order]
        out = (slots < 0) | (slots >= self.num_slots) | (spans < 1)
        firsts = np.asarray(self._first, dtype=np.int64)
        extent = np.where(out, 0, np.searchsorted(firsts, slots, side="right") - 1)
        offset = slots - firsts[extent]
        counts = np.asarray(self._count, dtype=np.int64)
        unaligned = ~out & ((offset % np.maximum(spans, 1) != 0) | (offset + spans > counts[extent]))
        placed = np.flatnonzero(~out & ~unaligned)
        # Sorted by slot, so each extent's first placed run is its lowest.
        extents, lowest = np.unique(extent[placed], return_index=True)
        fixed = np.zeros(len(firsts), dtype=np.int64)
        fixed[extents] = spans[placed[lowest]]
        other_span = np.zeros(len(slots), dtype=bool)
        other_span[placed] = spans[placed] != fixed[extent[placed]]
        refused = dict.fromkeys(slots[out].tolist(), "out_of_pool")
        refused.update(dict.fromkeys(slots[unaligned | other_span].tolist(), "misplaced"))
        return refused

    # ------------------------------------------------------------ runs

    def allocate(self, node: int | None = None, span: int = 1) -> int | None:
        """The first slot of a free run of `span` slots, of `node`'s range
        while it has room; None when no range has."""
        if not 1 <= span <= self.max_span:
            return None
        own = [i for i, r in enumerate(self.ranges) if node is not None and r.node == node]
        others = sorted((i for i in range(len(self.ranges)) if i not in own), key=self.free_in, reverse=True)
        for i in own + others:
            slot = self._take(i, span)
            if slot is not None:
                return slot
        return None

    def release(self, slot: int, span: int = 1) -> None:
        e = self.extent_of(slot)
        if self._span[e] != span or (slot - self._first[e]) % span:
            raise ValueError(f"slot {slot} is not the first of a run of {span} in use")
        i = self._range[e]
        self._used[e] -= 1
        self._used_in[i] -= span
        if self._used[e] == 0:
            self._partial[i].get(span, {}).pop(e, None)
            self._span[e], self._runs[e] = 0, []
            self._free_extents[i].append(e)
            return
        self._runs[e].append(slot)
        if len(self._runs[e]) == 1:
            self._partial[i].setdefault(span, {})[e] = None

    def _take(self, i: int, span: int) -> int | None:
        partial = self._partial[i].get(span)
        if partial:
            e = next(iter(partial))
        else:
            e = self._free_extent(i, span)
            if e is None:
                return None
            self._span[e] = span
            count = self._count[e] // span
            self._runs[e] = [self._first[e] + k * span for k in range(count - 1, -1, -1)]
            self._partial[i].setdefault(span, {})[e] = None
        slot = self._runs[e].pop()
        self._used[e] += 1
        self._used_in[i] += span
        if not self._runs[e]:
            del self._partial[i][span][e]
        return slot

    def _free_extent(self, i: int, span: int) -> int | None:
        stack = self._free_extents[i]
        for at in range(len(stack) - 1, -1, -1):  # the top, unless it is too short (a chunk's tail)
            if self._count[stack[at]] >= span:
                return stack.pop(at)
        return None

    def _place(self, e: int, runs: Mapping[int, int]) -> None:
        """Extent `e` (online) with `runs` in use: free when there are none."""
        i = self._range[e]
        if not runs:
            self._span[e], self._runs[e], self._used[e] = 0, [], 0
            self._free_extents[i].append(e)
            return
        span = next(iter(runs.values()))
        first, count = self._first[e], self._count[e]
        self._span[e] = span
        self._used[e] = len(runs)
        self._used_in[i] += span * len(runs)
        self._runs[e] = [s for s in range(first + (count // span - 1) * span, first - 1, -span) if s not in runs]
        if self._runs[e]:
            self._partial[i].setdefault(span, {})[e] = None

    def _outside(self, e: int, runs: Mapping[int, int]) -> list[tuple[int, int]]:
        """Extent `e`'s slots outside `runs`, as (first, count) ranges."""
        out, at = [], self._first[e]
        for slot in sorted(runs):
            if slot > at:
                out.append((at, slot - at))
            at = max(at, slot + runs[slot])
        end = self._first[e] + self._count[e]
        if at < end:
            out.append((at, end - at))
        return out

    def _by_extent(self, runs: Mapping[int, int]) -> dict[int, dict[int, int]]:
        by: dict[int, dict[int, int]] = {}
        for slot, span in runs.items():
            by.setdefault(self.extent_of(slot), {})[slot] = span
        return by

    def _extents_within(self, first: int, count: int) -> list[int]:
        e = max(0, self.extent_of(max(first, 0)))
        out = []
        while e < len(self._first) and self._first[e] + self._count[e] <= first + count:
            if self._first[e] >= first:
                out.append(e)
            e += 1
        return out
