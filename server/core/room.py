"""Room for a block of another size in a full pool: which blocks go.

An extent of the pool holds runs of one span at a time (host/free_runs.py). A
store in a full pool evicts in policy order while the oldest block frees a run
of its span: it holds one in an extent of that span, or the last runs of an
extent. When the oldest would not, policy order frees runs nobody asked for
until some extent happens to empty; a store of a new block size in a pool of
another evicted nearly all of it. So that store clears one extent instead: the
oldest block's own where it can, else the one that costs the fewest runs (the
first of equals). The blocks of an extent all go, each through the policy
(ARC remembers them), in slot order.

An extent can be cleared only when every block in it could go for this store:
ready and unpinned (a block waiting for its other ranks' shards is as old as
its first, and those stores follow at once), of the storing scope or of one
that gives up room to it (shares.py), and when no run in it is held for a
kept block still waiting. When none can, the first block in the scopes'
policy order that is ready, unpinned and frees a run of the span goes (a
newer block of that size); when there is none either, the block is not
stored and nothing is evicted for it, and the scope's stores of that span are
refused for NO_ROOM_S without searching again (NoRoom): the search walks
every block, and a pool in that state (every extent pinned, or shared with a
tenant that keeps its share) would otherwise pay it once a request. The
native lane does the same (server/native/src/index.cpp, room_for and clearing).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import numpy as np

from kvdepot.server.core.blocks import Block

NO_ROOM_S = 1.0


class NoRoom:
    """(scope, span) pairs whose search for room found none, until when."""

    def __init__(self, clock=time.monotonic):
        self._until: dict[tuple[str, int], float] = {}
        self._clock = clock

    def recent(self, scope: str, span: int) -> bool:
        return self._clock() < self._until.get((scope, span), 0.0)

    def note(self, scope: str, span: int) -> None:
        now = self._clock()
        if len(self._until) >= 4096:  # spans and scopes are bounded; their pairs, kept short
            self._until = {k: t for k, t in self._until.items() if t > now}
        self._until[(scope, span)] = now + NO_ROOM_S


def room_for(span: int, oldest: Block, blocks: Mapping, runs, orders: list[Iterable], allowed: set[str]
             ) -> list[Block] | None:
    """The blocks to evict for a run of `span` when the policy's oldest block
    frees none; `orders`: the keys of the scopes that give up room, each in its
    policy's order. None when nothing can make room."""
    going = clearing(blocks.values(), runs, oldest, span, allowed)
    if going is not None:
        return going
    for keys in orders:
        for key in keys:
            block = blocks[key]
            if block.ready and block.pins == 0 and runs.frees_run(block.slots, span):
                return [block]
    return None


def clearing(blocks: Iterable[Block], runs, oldest: Block, span: int, allowed: set[str]) -> list[Block] | None:
    """The blocks to evict so that an extent of `runs` (free_runs.FreeRuns)
    empties for a run of `span`; None when no extent can be cleared. One pass
    over the blocks, the extents found for all their slots at once (numpy):
    it runs once an extent, and a pool holds up to millions of blocks."""
    blocks = list(blocks)
    owners, slots, barring = [], [], []
    for i, block in enumerate(blocks):
        barred = not block.ready or block.pins != 0 or block.ns.scope not in allowed
        for slot in block.slots:
            if slot is not None:
                owners.append(i)
                slots.append(slot)
                barring.append(barred)
    slots = np.asarray(slots, dtype=np.int64)
    extents = runs.extents_of(slots)
    held = np.bincount(extents, minlength=runs.extents)
    barred = np.bincount(extents, weights=np.asarray(barring, dtype=np.float64), minlength=runs.extents) > 0

    def clearable(e: int) -> bool:
        return held[e] > 0 and not barred[e] and runs.can_clear(e, span, int(held[e]))

    choice = next((e for e in map(runs.extent_of, oldest.held_slots()) if clearable(e)), None)
    if choice is None:
        fits = [e for e in range(runs.extents) if clearable(e)]
        if not fits:
            return None
        choice = min(fits, key=lambda e: (held[e], e))
    # Each block once, at its lowest slot in the extent, in slot order.
    within = np.flatnonzero(extents == choice)
    lowest: dict[int, int] = {}
    for at in within[np.argsort(slots[within], kind="stable")].tolist():
        lowest.setdefault(owners[at], at)
    return [blocks[i] for i in lowest]
