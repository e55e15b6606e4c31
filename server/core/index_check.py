"""The block index's self-check: its derived counts recomputed from the blocks.

The counts (slots and ready blocks per namespace, slots held and being stored
per scope, the pinned blocks, the pool's slots in use, the eviction order's
size) are kept incrementally on the hot path; a count that drifts from the
blocks would show wrong stats, refuse stores or evict wrongly long after the
change that broke it. With checking on, every mutation ends by recomputing
them, so a test fails at the change itself.
"""

from __future__ import annotations

import functools

# The index's mutations, each checked when checking is on.
MUTATIONS = (
    "reserve_store", "finish_stores", "reserve_load", "finish_loads", "reserve_promotion", "finish_promotion",
    "restore", "clear", "hold", "let_go", "lower_gone",
)


class IndexInconsistent(AssertionError):
    """A derived count disagrees with the blocks (checking on): a daemon bug."""


def check_after_mutations(index) -> None:
    """Wraps `index`'s mutations (on the instance: the hot path pays nothing when off)."""
    for name in MUTATIONS:
        setattr(index, name, _checked(index, getattr(index, name)))


def _checked(index, method):
    @functools.wraps(method)
    def run(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            index.verify()

    return run


def verify(index, blocks, kept_held: dict, kept_storing: dict, pinned: set) -> None:
    used: dict[int, int] = {}
    ready: dict[int, int] = {}
    held: dict[str, int] = {}
    storing: dict[str, int] = {}
    ordered = 0
    for block in blocks:
        ns = block.ns
        slots = sum(map(index.pool.span_at, block.held_slots()))
        used[ns.id] = used.get(ns.id, 0) + slots
        held[ns.scope] = held.get(ns.scope, 0) + slots
        storing[ns.scope] = storing.get(ns.scope, 0) + sum(index.pool.span_at(block.slots[r]) for r in block.writers)
        ready[ns.id] = ready.get(ns.id, 0) + block.ready
        ordered += bool(block.committed)
        _expect(block.ready == (len(block.committed) == ns.tp_size), "a block's readiness is not its commits")
        _expect(not block.committed & block.writers.keys(), "a shard is both committed and being written")
        _expect(all(block.slots[r] is not None for r in (*block.committed, *block.writers)),
                "a committed or written shard has no slot")
    for ns in index.namespaces:
        _expect(ns.used_slots == used.get(ns.id, 0),
                f"{ns.name}: used_slots {ns.used_slots}, blocks hold {used.get(ns.id, 0)}")
        _expect(ns.ready_blocks == ready.get(ns.id, 0),
                f"{ns.name}: ready_blocks {ns.ready_blocks}, {ready.get(ns.id, 0)} are ready")
    for name, kept, actual in (("held", kept_held, held), ("storing", kept_storing, storing)):
        for scope in kept.keys() | actual.keys():
            _expect(kept.get(scope, 0) == actual.get(scope, 0),
                    f"scope {scope}: {name} {kept.get(scope, 0)}, blocks say {actual.get(scope, 0)}")
    _expect(pinned == {b for b in blocks if b.pins > 0}, "the pinned set is not the pinned blocks")
    waiting = index.pool.slots.kept_waiting
    _expect(index.pool.used_slots == sum(held.values()) + waiting,
            f"the pool has {index.pool.used_slots} slots in use, blocks hold {sum(held.values())} and {waiting} "
            "wait for adoption")
    _expect(index.evictions.size() == ordered,
            f"{index.evictions.size()} blocks in the eviction order, {ordered} have a committed shard")


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise IndexInconsistent(f"block index: {what}")

