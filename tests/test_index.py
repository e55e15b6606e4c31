"""The block index on a real pool: TP shards, pins and eviction under pressure,
with its derived counts checked after every mutation."""

from __future__ import annotations

import itertools

import pytest

from kvdepot.keys import KEY_VERSION
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.index_check import IndexInconsistent
from kvdepot.server.core.namespaces import Namespaces
from kvdepot.server.core.requests import NamespaceSpec
from kvdepot.server.core.shares import ScopedEviction
from kvdepot.server.host.pool import HostPool


@pytest.fixture
def pool(tmp_path):
    pool = HostPool(size=64 * 4096, slot_bytes=4096, directory=str(tmp_path), name="idx", pin="off")
    yield pool
    pool.close()


_ids = itertools.count(1)
NAMESPACES = Namespaces(lambda: next(_ids))


def index_of(pool, policy: str = "lru", on_evict=lambda block: None) -> BlockIndex:
    global NAMESPACES
    NAMESPACES = Namespaces(lambda: next(_ids))
    return BlockIndex(pool, ScopedEviction(policy, pool.num_slots), NAMESPACES, on_evict, check=True)


def Namespace(id: int, name: str, tp_size: int, scope: str):  # noqa: N802 - reads like the class it makes
    return NAMESPACES.of(NamespaceSpec(model=name, block_size=16, tp_size=tp_size, key_version=KEY_VERSION), scope)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_tp2_blocks_become_ready_round_after_round_in_a_full_pool(pool, policy):
    """Rank 1's stores of the keys rank 0 just stored must not evict rank 0's shards."""
    evicted = []
    index = index_of(pool, policy, evicted.append)
    ns = Namespace(id=1, name="tp2", tp_size=2, scope="t")
    for round_ in range(12):
        keys = [bytes([round_, i]) * 16 for i in range(8)]
        for rank in (0, 1):
            reservation = index.reserve_store(ns, rank, keys, job_id=round_ * 2 + rank)
            assert reservation.not_stored == 0
            index.finish_stores([block for _, block in reservation.writes], rank, ok=True, length=4096)
        assert index.lookup(ns, keys).ready == 8, f"round {round_}"
    assert pool.used_slots == 64
    assert ns.ready_blocks == 32 and len(evicted) == 12 * 8 - 32


def test_a_failed_shard_never_exposes_the_block_and_frees_its_slot(pool):
    index = index_of(pool)
    ns = Namespace(id=1, name="tp2", tp_size=2, scope="t")
    keys = [bytes([9, i]) * 16 for i in range(4)]
    for rank, ok in ((0, True), (1, False)):
        reservation = index.reserve_store(ns, rank, keys, job_id=rank)
        index.finish_stores([block for _, block in reservation.writes], rank, ok=ok, length=4096)
    assert index.lookup(ns, keys).ready == 0
    assert pool.used_slots == 4  # rank 0's shards wait for rank 1 to try again
    reservation = index.reserve_store(ns, 1, keys, job_id=3)
    index.finish_stores([block for _, block in reservation.writes], 1, ok=True, length=4096)
    assert index.lookup(ns, keys).ready == 4 and pool.used_slots == 8


def test_a_promotion_that_finds_no_slot_leaves_the_tenants_room_to_store(pool):
    """A TP-2 promotion that gets one slot and not the second gives back all it took,
    the count of slots being filled included: else every such miss shrank the
    tenant's room for stores in flight, until its stores were all refused."""
    index = index_of(pool)
    ns = Namespace(id=1, name="tp2", tp_size=2, scope="t")
    # 63 of 64 slots hold ready blocks that loads in flight pin: one free slot,
    # none evictable, and the tenant has no store in flight.
    other = Namespace(id=2, name="one", tp_size=1, scope="t")
    keys = [bytes([1, i]) * 16 for i in range(63)]
    index.finish_stores([block for _, block in index.reserve_store(other, 0, keys, job_id=1).writes], 0, True, 4096)
    loading = index.reserve_load(other, keys, 0, 4096)
    room = index._storing_room("t")
    for attempt in range(5):
        assert index.reserve_promotion(ns, bytes([2, attempt]) * 16, (4096, 4096)) is None
    assert index._storing_room("t") == room and pool.used_slots == 63
    index.finish_loads(loading)
    reservation = index.reserve_store(ns, 0, [bytes([3, i]) * 16 for i in range(8)], job_id=2)
    assert reservation.not_stored == 0


def test_the_check_catches_a_count_that_drifts_from_the_blocks(pool):
    """The derived counts are checked against the blocks after each mutation:
    one changed behind the index's back fails the next mutation."""
    index = index_of(pool)
    ns = Namespace(id=1, name="drift", tp_size=1, scope="t")
    keys = [bytes([7, i]) * 16 for i in range(4)]
    index.finish_stores([b for _, b in index.reserve_store(ns, 0, keys, job_id=1).writes], 0, True, 4096)
    ns.used_slots += 1
    with pytest.raises(IndexInconsistent, match="used_slots"):
        index.reserve_load(ns, keys, 0, 4096)


def fill_alternately(index, a, b, count: int) -> list[bytes]:
    """`count` one-slot blocks of `a` and `b` in turn: every extent holds both."""
    keys = []
    for i in range(count):
        ns = (a, b)[i % 2]
        key = bytes([5, i]) * 16
        index.finish_stores([blk for _, blk in index.reserve_store(ns, 0, [key], job_id=100 + i).writes], 0, True, 4096)
        keys.append(key)
    return keys


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_new_block_size_clears_the_oldest_blocks_extent_and_no_more(pool, policy):
    """A full pool of one-slot blocks, whose oldest were read again: a block of
    two slots evicts the four blocks of one extent (the oldest block's), not
    every block older than the ones read."""
    evicted = []
    index = index_of(pool, policy, evicted.append)
    narrow = Namespace(id=1, name="narrow", tp_size=1, scope="t")
    wide = Namespace(id=2, name="wide", tp_size=1, scope="t")
    keys = [bytes([6, i]) * 16 for i in range(64)]
    index.finish_stores([blk for _, blk in index.reserve_store(narrow, 0, keys, job_id=1).writes], 0, True, 4096)
    # The last block of each extent of 4 is read: the newest in the order.
    index.finish_loads(index.reserve_load(narrow, keys[3::4], 0, 4096))
    reservation = index.reserve_store(wide, 0, [b"w" * 32], job_id=2, span=2)
    assert reservation.not_stored == 0
    index.finish_stores([blk for _, blk in reservation.writes], 0, True, 8192)
    assert sorted(block.key for block in evicted) == keys[:4]
    assert narrow.ready_blocks == 60 and index.lookup(wide, [b"w" * 32]).ready == 1


def test_a_scope_at_its_share_clears_no_extent_that_holds_another_scopes_blocks(pool):
    """Tenants a and b each hold half of a full pool, in every extent. A block
    of another size of a's needs an extent cleared, and each holds b's blocks:
    it is not stored, and none of a's blocks is evicted for it."""
    evicted = []
    index = index_of(pool, "lru", evicted.append)
    a = Namespace(id=1, name="a", tp_size=1, scope="a")
    b = Namespace(id=2, name="b", tp_size=1, scope="b")
    fill_alternately(index, a, b, 64)
    reservation = index.reserve_store(a, 0, [b"w" * 32], job_id=2, span=2)
    assert reservation.not_stored == 1 and evicted == []
    assert a.ready_blocks == 32 and b.ready_blocks == 32
    # Blocks of a's own size still take the place of a's oldest.
    reservation = index.reserve_store(a, 0, [b"n" * 32], job_id=3)
    assert reservation.not_stored == 0 and [blk.ns.scope for blk in evicted] == ["a"]


def store_all(index, ns, keys, job_id: int, span: int = 1, rank: int = 0):
    reservation = index.reserve_store(ns, rank, keys, job_id=job_id, span=span)
    index.finish_stores([blk for _, blk in reservation.writes], rank, True, 4096 * span)
    return reservation


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_with_no_extent_to_clear_a_newer_block_of_the_size_makes_room(pool, policy):
    """Loads in flight pin a block of every extent, so none can be cleared; a
    block of two slots is still stored, in the place of the oldest block of
    that size, not refused while one could go."""
    evicted = []
    index = index_of(pool, policy, evicted.append)
    narrow = Namespace(id=1, name="narrow", tp_size=1, scope="t")
    wide = Namespace(id=2, name="wide", tp_size=1, scope="t")
    narrow_keys = [bytes([1, i]) * 16 for i in range(48)]
    wide_keys = [bytes([2, i]) * 16 for i in range(8)]
    store_all(index, narrow, narrow_keys, 1)  # extents 0-11
    store_all(index, wide, wide_keys, 2, span=2)  # extents 12-15, two blocks each
    index.reserve_load(narrow, narrow_keys[3::4], 0, 4096)
    index.reserve_load(wide, wide_keys[1::2], 0, 8192)
    for attempt in range(3):
        assert store_all(index, wide, [bytes([3, attempt]) * 16], 10 + attempt, span=2).not_stored == 0
    assert [block.key for block in evicted] == wide_keys[0:6:2]


def test_clearing_never_takes_a_block_whose_other_ranks_are_on_their_way(pool):
    """Rank 0 has just stored three TP-2 blocks, in the oldest block's extent;
    rank 1's stores follow. A block of another size cleared that extent and
    took them, and rank 1 then wrote shards of blocks that could never be
    ready. Now another extent is cleared, and the three become ready."""
    evicted = []
    index = index_of(pool, "lru", evicted.append)
    old = Namespace(id=1, name="old", tp_size=1, scope="t")
    tp2 = Namespace(id=2, name="tp2", tp_size=2, scope="t")
    wide = Namespace(id=3, name="wide", tp_size=1, scope="t")
    old_keys = [bytes([1, i]) * 16 for i in range(64)]
    store_all(index, old, old_keys, 1)
    index.finish_loads(index.reserve_load(old, [old_keys[0]] + old_keys[4:], 0, 4096))  # 1-3 the oldest
    tp2_keys = [bytes([2, i]) * 16 for i in range(3)]
    store_all(index, tp2, tp2_keys, 2)  # rank 0's shards in slots 1-3, in place of old 1-3
    store_all(index, wide, [b"w" * 32], 3, span=2)
    assert not any(block.ns is tp2 for block in evicted)
    store_all(index, tp2, tp2_keys, 4, rank=1)
    assert index.lookup(tp2, tp2_keys).ready == 3


def test_a_search_that_found_no_room_is_not_made_again_for_a_second(pool):
    """The search for room walks every block: after one that found none, the
    scope's stores of that size are refused for a second without it, even
    once room has come back; then they search again and are stored."""
    from kvdepot.server.core import room

    now = [0.0]
    index = index_of(pool)
    index._no_room = room.NoRoom(clock=lambda: now[0])
    a = Namespace(id=1, name="a", tp_size=1, scope="a")
    b = Namespace(id=2, name="b", tp_size=1, scope="b")
    fill_alternately(index, a, b, 64)
    assert index.reserve_store(a, 0, [b"w" * 32], job_id=2, span=2).not_stored == 1
    index.clear(b)  # every extent now holds a's blocks alone: one could be cleared
    now[0] += room.NO_ROOM_S / 2
    assert index.reserve_store(a, 0, [b"x" * 32], job_id=3, span=2).not_stored == 1
    now[0] += room.NO_ROOM_S
    assert index.reserve_store(a, 0, [b"y" * 32], job_id=4, span=2).not_stored == 0
