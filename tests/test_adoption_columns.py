"""Adoption reads a kept pool's records as columns and makes a candidate of a
block only as its chunk comes up (tiers/adoption.py): every kind of record
must still come back, or be discarded, exactly as when each was an object.
A real pool file and catalog, written as a daemon writes them."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvdepot.server.host.pool import HostPool
from kvdepot.server.host.shard_record import RECORD_BYTES, ShardRecord, data_hash, pack
from kvdepot.server.tiers.adoption import Adoption
from kvdepot.server.tiers.catalog import Catalog

SLOT = 16 << 10
SLOTS = 64
PER_CHUNK = 4  # 64 KiB registrations: 16 chunks, chunk 0 up at the start


def identity(model: str, tp: int) -> tuple:
    return ("uid-0", model, "r", "bfloat16", 16, "per_layer", tp, 0, "", 1)


class KeptPool:
    """A pool file and its catalog, records written one by one."""

    def __init__(self, folder):
        self.folder = str(folder)
        self.pool = HostPool(size=SLOTS * SLOT, slot_bytes=SLOT, directory=self.folder, name="p", pin="off",
                             pin_chunk_bytes=PER_CHUNK * SLOT, threads=2)
        self.catalog = Catalog(os.path.join(self.folder, "p.namespaces.json"))
        self.catalog.claim()

    def namespace(self, model: str, tp: int) -> bytes:
        return self.catalog.note(identity(model, tp), {r: ("sig", r) for r in range(tp)})

    def put(self, slot: int, ns: bytes, key: bytes, rank: int = 0, tp: int = 1, generation: int = 1,
            length: int = SLOT) -> None:
        data = os.urandom(SLOT)
        self.pool.buffer[slot * SLOT : (slot + 1) * SLOT] = data
        record = ShardRecord(ns, key, rank, tp, length, data_hash(data[:length]), generation)
        self.pool.records[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES] = pack(record)

    def reopened(self) -> HostPool:
        self.pool.close()
        self.pool = HostPool(size=SLOTS * SLOT, slot_bytes=SLOT, directory=self.folder, name="p", pin="off",
                             pin_chunk_bytes=PER_CHUNK * SLOT, threads=2, adopt=True)
        self.catalog = Catalog(os.path.join(self.folder, "p.namespaces.json"))
        return self.pool


def key(n: int, prefix: bytes = b"") -> bytes:
    return (prefix + n.to_bytes(4, "little") + os.urandom(32))[:32]


def late(adoption: Adoption, chunk: int):
    """Chunk `chunk` comes up, as tiers/warm.py handles it: (its candidates, their check)."""
    every, checked = adoption.check_chunk(adoption.chunk_up(chunk), chunk)
    adoption.settle_chunk(chunk, every)
    return every, checked


@pytest.fixture
def kept(tmp_path):
    kept = KeptPool(tmp_path)
    yield kept
    kept.pool.close(discard=True)


def test_every_kind_of_record_comes_back_or_is_counted_as_before(kept):
    a = kept.namespace("single", 1)
    b = kept.namespace("tensor-parallel", 2)
    singles = {slot: key(slot) for slot in (0, 1, 5, 6, 13, 30, 47, 63)}
    for slot, k in singles.items():
        kept.put(slot, a, k, generation=slot + 1)
    # Two ranks of one block in two chunks, and a block whose second rank never was stored.
    tp_key, half_key = key(100), key(101)
    kept.put(9, b, tp_key, rank=0, tp=2, generation=70)
    kept.put(21, b, tp_key, rank=1, tp=2, generation=71)
    kept.put(22, b, half_key, rank=0, tp=2, generation=72)
    # A key stored twice: the newer copy is the block.
    twice = key(102)
    kept.put(14, a, twice, generation=3)
    kept.put(25, a, twice, generation=80)
    # Two keys that begin alike (the columns tell blocks apart by their first bytes first).
    alike = [b"\x07" * 8 + os.urandom(24), b"\x07" * 8 + os.urandom(24)]
    kept.put(33, a, alike[0], generation=90)
    kept.put(34, a, alike[1], generation=91)
    # A namespace the catalog never named, a torn length, and bytes changed since their seal.
    kept.put(40, os.urandom(16), key(103))
    kept.put(41, a, key(104), length=0)
    kept.put(42, a, key(105), generation=92)
    pool = kept.reopened()
    pool.buffer[42 * SLOT] ^= 0xFF

    adoption = Adoption(pool, kept.catalog, threads=2)
    adoption.find(pytest.fail)
    blocks = adoption.check(adoption.take_up()).blocks
    assert {c.key for c in blocks} == {singles[0], singles[1]}  # chunk 0 is up
    held = adoption.held_runs()
    assert set(held) == {5, 6, 13, 30, 47, 63, 9, 21, 25, 33, 34, 42} and set(held.values()) == {1}
    assert adoption.left == 11

    discarded = {}
    for chunk in range(1, SLOTS // PER_CHUNK):
        _, checked = late(adoption, chunk)
        blocks += checked.blocks
        for reason, n in checked.discarded.items():
            discarded[reason] = discarded.get(reason, 0) + n
    assert adoption.left == 0
    keys = [c.key for c in blocks]
    assert len(keys) == len(set(keys)), "a block came back twice"
    assert set(keys) == set(singles.values()) | {tp_key, twice, *alike}
    tp_block = next(c for c in blocks if c.key == tp_key)
    assert tp_block.slots == [9, 21] and tp_block.generation == 71
    assert next(c for c in blocks if c.key == twice).slots == [25]
    assert discarded == {"data_hash": 1}
    assert adoption.discarded == {"unknown_namespace": 1, "torn": 1, "superseded": 1, "incomplete": 1}
    assert adoption.generation == 92
    adoption.close()


def test_blocks_of_a_cleared_namespace_never_come_back_from_their_chunks(kept):
    a, b = kept.namespace("cleared", 1), kept.namespace("kept", 1)
    cleared = {slot: key(slot) for slot in (0, 8, 9, 20, 50)}
    others = {slot: key(slot) for slot in (1, 12, 51)}
    for slot, k in cleared.items():
        kept.put(slot, a, k)
    for slot, k in others.items():
        kept.put(slot, b, k)
    pool = kept.reopened()
    adoption = Adoption(pool, kept.catalog, threads=2)
    adoption.find(pytest.fail)
    first = adoption.check(adoption.take_up()).blocks
    assert {c.key for c in first} == {cleared[0], others[1]}
    gone = adoption.drop(np.void(a).tobytes())
    assert sorted(slot for c in gone for slot in c.slots) == [8, 9, 20, 50]
    assert all(c.dropped for c in gone) and adoption.left == 2
    back = [c for chunk in range(1, SLOTS // PER_CHUNK) for c in late(adoption, chunk)[1].blocks]
    assert {c.key for c in back} == {others[12], others[51]}
    assert adoption.left == 0
    adoption.close()


def test_a_clear_while_a_chunks_blocks_are_checked_finds_them(kept):
    a = kept.namespace("cleared", 1)
    keys = {slot: key(slot) for slot in (8, 9, 20)}
    for slot, k in keys.items():
        kept.put(slot, a, k)
    pool = kept.reopened()
    adoption = Adoption(pool, kept.catalog, threads=2)
    adoption.find(pytest.fail)
    assert adoption.take_up() == []
    assert adoption.chunk_up(2) == [] and adoption.checking(2)  # slots 8-11: their check under way
    gone = adoption.drop(None)  # the clear comes before the check is back
    assert sorted(c.slots[0] for c in gone) == [8, 9, 20]
    every, checked = adoption.check_chunk([], 2)
    adoption.settle_chunk(2, every)
    assert sorted(c.slots[0] for c in every) == [8, 9]
    assert all(c.dropped for c in every)  # so their late restore skips them (tiers/warm.py)
    assert adoption.chunk_up(5) == [] and not adoption.checking(5) and adoption.left == 0
    # A clear after the check is back, before the blocks are restored, finds them too.
    kept_again = Adoption(pool, kept.catalog, threads=2)
    kept_again.find(pytest.fail)
    kept_again.take_up()
    every, _ = late(kept_again, 2)
    assert sorted(c.slots[0] for c in kept_again.drop(None) if c in every) == [8, 9]
    assert all(c.dropped for c in every)
    kept_again.close()
    adoption.close()
