"""The native lane's runs of slots (server/native/src/slots.cpp) against
host/free_runs.py, call by call: the same run for every allocation, the same
refusals and the same counts, whatever the carving, the chunks, the extents
and the order of allocations, releases, bring-up and adoption. The lanes
must put blocks in the same slots (tests/test_lanes_agree.py compares what
they answer; this compares the choices themselves, with spans > 1)."""

from __future__ import annotations

import ctypes
import random

import pytest

from kvdepot.server.host.free_runs import FreeRuns

binding = pytest.importorskip("kvdepot.server.native.binding")
try:
    LIB = binding.load()
except OSError as e:
    pytest.skip(f"the native lane is not built ({e})", allow_module_level=True)

_I64, _I32, _P = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
_ARRAY = ctypes.POINTER(_I64)
for name, args, result in [
    ("kvd_probe_open", [_I64, ctypes.POINTER(_I32), _ARRAY, _ARRAY, ctypes.c_size_t, _I64, _I64], _P),
    ("kvd_probe_close", [_P], None),
    ("kvd_probe_allocate", [_P, _I32, _I64], _I64),
    ("kvd_probe_release", [_P, _I64], ctypes.c_int),
    ("kvd_probe_span_at", [_P, _I64], _I64),
    ("kvd_probe_counts", [_P, _ARRAY], None),
    ("kvd_probe_set_online", [_P, _ARRAY, _ARRAY, ctypes.c_size_t], None),
    ("kvd_probe_add_online", [_P, _I64, _I64, _ARRAY, _ARRAY, ctypes.c_size_t], _I64),
    ("kvd_probe_keep_only", [_P, _ARRAY, _ARRAY, ctypes.c_size_t, _I64], None),
]:
    getattr(LIB, name).argtypes, getattr(LIB, name).restype = args, result


def _ints(values) -> ctypes.Array:
    values = list(values)
    return (_I64 * max(1, len(values)))(*values)


class Native:
    """slots.cpp's Slots with FreeRuns' face."""

    def __init__(self, python: FreeRuns):
        r = python.ranges
        nodes = (_I32 * len(r))(*[-1 if x.node is None else x.node for x in r])
        self._ranges = len(r)
        self._h = LIB.kvd_probe_open(python.num_slots, nodes, _ints(x.first for x in r), _ints(x.count for x in r),
                                     len(r), python.chunk_slots, python.extent_slots)

    def close(self) -> None:
        LIB.kvd_probe_close(self._h)

    def allocate(self, node, span):
        slot = LIB.kvd_probe_allocate(self._h, -1 if node is None else node, span)
        return None if slot < 0 else slot

    def release(self, slot) -> bool:
        return LIB.kvd_probe_release(self._h, slot) == 0

    def span_at(self, slot) -> int:
        return LIB.kvd_probe_span_at(self._h, slot)

    def counts(self) -> list[int]:
        out = (_I64 * (4 + 2 * self._ranges))()
        LIB.kvd_probe_counts(self._h, out)
        return list(out)

    def set_online(self, ranges) -> None:
        ranges = list(ranges)
        LIB.kvd_probe_set_online(self._h, _ints(f for f, _ in ranges), _ints(c for _, c in ranges), len(ranges))

    def add_online(self, first, count, held) -> int:
        return LIB.kvd_probe_add_online(self._h, first, count, _ints(held), _ints(held.values()), len(held))

    def keep_only(self, used, kept_waiting) -> None:
        LIB.kvd_probe_keep_only(self._h, _ints(used), _ints(used.values()), len(used), kept_waiting)


def python_counts(runs: FreeRuns) -> list[int]:
    out = [runs.free, runs.online, runs.kept_waiting, runs.max_span]
    for i in range(len(runs.ranges)):
        out += [runs.free_in(i), runs.online_in(i)]
    return out


@pytest.mark.parametrize("seed", range(30))
def test_the_native_runs_make_free_runs_choices(seed):
    rng = random.Random(seed)
    num_slots = rng.randint(20, 400)
    chunk = rng.randint(8, 64)
    python = FreeRuns(num_slots, rng.choice([(), (0, 1), (0, 1, 2)]), chunk, rng.randint(3, 40))
    native = Native(python)
    try:
        assert python_counts(python) == native.counts()
        held: dict[int, int] = {}
        if rng.random() < 0.5:  # a pool coming up a chunk at a time, kept runs in some chunks
            up = [(0, chunk)]
            python.set_online(up)
            native.set_online(up)
            for first in range(chunk, num_slots, chunk):
                count = min(chunk, num_slots - first)
                kept = {}
                if rng.random() < 0.3:
                    span = rng.choice([1, 2, 3])
                    kept = {s: span for s in range(first, first + count - span + 1, span) if rng.random() < 0.3}
                    kept = {s: n for s, n in kept.items() if s not in python.fits(kept)}
                python.add_online(first, count, kept)
                assert native.add_online(first, count, kept) == count
                held.update(kept)
        for step in range(1500):
            roll = rng.random()
            if roll < 0.01:  # adoption: the runs in use stay, every other slot is free
                python.keep_only(held)
                native.keep_only(held, 0)
            elif held and roll < 0.45:
                slot = rng.choice(list(held))
                assert python.span_at(slot) == native.span_at(slot) == held[slot]
                python.release(slot, held.pop(slot))
                assert native.release(slot)
                assert not native.release(slot)  # twice: refused
            else:
                node, span = rng.choice([None, 0, 1]), rng.choice([1, 1, 2, 3, 5, 8, 40])
                slot = python.allocate(node, span)
                assert native.allocate(node, span) == slot, f"step {step}"
                if slot is not None:
                    held[slot] = span
            assert python_counts(python) == native.counts(), f"step {step}"
    finally:
        native.close()
