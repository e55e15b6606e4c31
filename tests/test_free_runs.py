"""The pool's runs of slots for blocks of any size (server/host/free_runs.py):
runs never overlap, stay inside one extent of one span, and every slot is
accounted for, whatever the order of allocations and releases."""

from __future__ import annotations

import random

import pytest

from kvdepot.server.host.carving import carve
from kvdepot.server.host.free_runs import FreeRuns, cut_extents


def check(runs: FreeRuns, held: dict[int, int]) -> None:
    taken = set()
    for slot, span in held.items():
        e = runs.extent_of(slot)
        assert runs._span[e] == span
        assert slot + span <= runs._first[e] + runs._count[e]
        cells = set(range(slot, slot + span))
        assert not cells & taken, "two runs overlap"
        taken |= cells
    assert runs.online - runs.free == sum(held.values())


def test_extents_never_cross_a_chunk_or_a_numa_range():
    ranges = carve(100, [0, 1])
    extents = cut_extents(ranges, chunk_slots=16, extent_slots=6)
    assert sum(c for _, _, c in extents) == 100
    for i, first, count in extents:
        r = ranges[i]
        assert r.first <= first and first + count <= r.first + r.count
        assert first // 16 == (first + count - 1) // 16


def test_a_block_of_many_slots_takes_consecutive_slots_and_gives_them_back():
    runs = FreeRuns(64, extent_slots=16)
    a = runs.allocate(span=5)
    b = runs.allocate(span=5)
    assert {a, b} == {0, 5}  # one extent, runs at its first slot and first + span
    assert runs.free == 64 - 10
    small = runs.allocate(span=1)
    assert small == 16  # another span takes another extent
    runs.release(a, 5)
    runs.release(b, 5)
    assert runs.span_at(0) == 0  # the extent is free again, for any span
    assert runs.allocate(span=16) == 0
    assert runs.allocate(span=17) is None  # more than an extent


def test_the_pool_fills_to_its_extents_tails_for_every_span():
    for span in (1, 3, 7, 16):
        runs = FreeRuns(160, extent_slots=16)
        got = []
        while (slot := runs.allocate(span=span)) is not None:
            got.append(slot)
        assert len(got) == 10 * (16 // span)
        check(runs, dict.fromkeys(got, span))


def test_a_release_of_what_is_not_a_run_in_use_is_refused():
    runs = FreeRuns(32, extent_slots=16)
    slot = runs.allocate(span=4)
    with pytest.raises(ValueError):
        runs.release(slot + 1, 4)
    with pytest.raises(ValueError):
        runs.release(slot, 2)


@pytest.mark.parametrize("seed", range(20))
def test_random_allocations_and_releases_keep_runs_apart(seed):
    rng = random.Random(seed)
    nodes = rng.choice([(), (0, 1)])
    runs = FreeRuns(rng.randint(20, 300), nodes, chunk_slots=rng.randint(8, 64), extent_slots=rng.randint(4, 32))
    held: dict[int, int] = {}
    for _ in range(2000):
        if held and rng.random() < 0.45:
            slot = rng.choice(list(held))
            runs.release(slot, held.pop(slot))
        else:
            span = rng.choice([1, 2, 3, 5, 8])
            slot = runs.allocate(rng.choice([None, 0, 1]), span)
            if slot is not None:
                assert slot not in held
                held[slot] = span
        check(runs, held)


def slots_of(ranges) -> set[int]:
    return {first + k for first, count in ranges for k in range(count)}


def test_kept_runs_come_back_where_they_were_and_bad_ones_are_refused():
    runs = FreeRuns(64, chunk_slots=32, extent_slots=16)
    kept = {0: 4, 4: 4, 16: 2, 34: 1, 33: 2, 20: 3}
    refused = runs.fits(kept)
    # 20 is not on a boundary of runs of 2 (16's extent took span 2); 34 is
    # in the extent whose lowest run (33) ... is not on a boundary of 2 either.
    assert refused == {20: "misplaced", 33: "misplaced"}
    good = {s: n for s, n in kept.items() if s not in refused}
    free = runs.keep_only(good)
    check(runs, good)
    assert slots_of(free) == set(range(64)) - {s + k for s, n in good.items() for k in range(n)}
    assert runs.allocate(span=4) == 8


def test_chunks_come_online_with_their_kept_runs_taken():
    runs = FreeRuns(64, chunk_slots=32, extent_slots=16)
    runs.set_online([(0, 32)])
    assert runs.online == 32
    assert all(runs.allocate(span=16) is not None for _ in range(2))
    assert runs.allocate(span=16) is None
    free = runs.add_online(32, 32, {32: 8})
    assert runs.kept_waiting == 8 and runs.online == 64  # slots, not runs
    assert free == [(40, 8), (48, 16)]  # two extents of 16
    assert runs.allocate(span=8) == 40
    assert runs.allocate(span=16) == 48


def test_a_tib_pool_of_64_kib_slots_is_freed_as_ranges_not_slots():
    # 16M slots in 1 GiB extents: adoption's "every other slot is free" is
    # one range an extent, and one more beside each kept run.
    runs = FreeRuns(1 << 24, chunk_slots=1 << 14, extent_slots=1 << 14)
    free = runs.keep_only({1 << 14: 3})
    assert len(free) == 1024 and free[:2] == [(0, 1 << 14), ((1 << 14) + 3, (1 << 14) - 3)]
    assert sum(count for _, count in free) == runs.free == (1 << 24) - 3


def reference_fits(runs: FreeRuns, kept: dict[int, int]) -> dict[int, str]:
    """FreeRuns.fits as a loop over the runs, one by one, lowest slot first."""
    refused, spans = {}, {}
    for slot in sorted(kept):
        span = kept[slot]
        if not 0 <= slot < runs.num_slots or span < 1:
            refused[slot] = "out_of_pool"
            continue
        e = runs.extent_of(slot)
        offset = slot - runs._first[e]
        if offset % span or offset + span > runs._count[e]:
            refused[slot] = "misplaced"
        elif spans.setdefault(e, span) != span:
            refused[slot] = "misplaced"
    return refused


def test_kept_runs_of_any_kind_are_judged_as_one_by_one():
    """fits judges a kept pool's runs at once (numpy): as the rule reads run by run."""
    rng = random.Random(11)
    for _ in range(300):
        runs = FreeRuns(rng.choice([40, 64, 100]), chunk_slots=rng.choice([16, 32]), extent_slots=rng.choice([8, 16]))
        kept = {rng.randrange(-3, runs.num_slots + 5): rng.choice([0, 1, 2, 3, 4, 5, 8, 20])
                for _ in range(rng.randrange(0, 30))}
        assert runs.fits(kept) == reference_fits(runs, kept), kept
