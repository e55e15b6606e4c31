"""The native lane and the Python lane are one daemon: the same requests, in a
pool small enough that every store evicts, with jobs held in flight (their
blocks pinned) among the others, get the same answers, the same lookups, the
same bytes back and the same counts, whichever lane runs the jobs. The lanes
keep their own code for the index, eviction and jobs (server/native/src is
a port of server/core); this is what keeps them one."""

from __future__ import annotations

import random

import pytest
import torch
from keyed_blocks import clear_blocks, write_blocks, wrong_blocks
from kvcache import BLOCK_SIZE, HEAD_DIM, KV_HEADS, NUM_BLOCKS, attach_worker, namespace, prompt_keys

binding = pytest.importorskip("kvdepot.server.native.binding")
try:
    binding.load()
except OSError as e:
    pytest.skip(f"the native lane is not built ({e})", allow_module_level=True)

POOL_SLOTS = 24
STEPS = 160
FENCE = 100_000  # job ids of the fences, apart from the steps'


class Run:
    """One daemon's client, doing the steps and noting what it saw."""

    def __init__(self, daemon, client, wide: bool):
        self.daemon = daemon
        self.client = client
        self.models = [attach_worker(client, seed=7)] + ([wide_worker(client)] if wide else [])
        self.seen: list = []
        self.held: list[int] = []

    def store(self, job: int, keys, block_ids, hold: bool, model: int) -> None:
        worker, _, tensors = self.models[model]
        write_blocks(tensors, block_ids, keys)
        if hold:
            self.daemon.hold(job)
            self.held.append(job)
        self.client.submit_store(worker, job, keys, block_ids)
        if hold:
            self.fence(job)
        else:
            result = self.client.wait([job], 10)[job]
            self.seen.append(("store", job, result.ok, result.already_stored, result.not_stored))

    def load(self, job: int, keys, block_ids, hold: bool, model: int) -> None:
        worker, engine, tensors = self.models[model]
        ready = self.client.lookup(engine, keys)
        self.seen.append(("lookup", ready.ready_blocks, ready.not_yet, ready.storing_blocks))
        if not ready.ready_blocks:
            return
        keys, block_ids = keys[: ready.ready_blocks], block_ids[: ready.ready_blocks]
        clear_blocks(tensors, block_ids)
        if hold:
            self.daemon.hold(job)
            self.held.append(job)
        self.client.submit_load(worker, job, keys, block_ids)
        if hold:
            self.fence(job)
        else:
            result = self.client.wait([job], 10)[job]
            wrong = wrong_blocks(tensors, block_ids, keys) if result.ok else None
            self.seen.append(("load", job, result.ok, wrong))

    def fence(self, job: int) -> None:
        """Returns once the daemon has taken held job `job` in. Its submit is
        not answered, and the next step's lookup or stats goes over gRPC, which
        can overtake it: an empty job, on the same socket, is refused only
        after the daemon has read the held one."""
        fence = FENCE + job
        self.client.submit_store(self.models[0][0], fence, [], [])
        assert not self.client.wait([fence], 10)[fence].ok

    def release(self, index: int) -> None:
        job = self.held.pop(index)
        self.daemon.release(job)
        result = self.client.wait([job], 10)[job]
        self.seen.append(("released", job, result.ok, result.already_stored, result.not_stored))

    def stats(self) -> None:
        s = self.client.stats()
        t = s.totals
        namespaces = [(n.name, n.used_slots, n.ready_blocks) for n in s.namespaces]
        self.seen.append(("stats", s.used_slots, s.pinned_slots, t.evicted_blocks, t.stored_blocks,
                          t.loaded_blocks, t.failed_jobs, namespaces))


# A block of 16 KiB in slots of its size, or in runs of 3 slots (2.5 of them);
# or two models, of blocks of 16 KiB and 40 KiB (runs of 1 and 3 slots), in
# extents of 6 slots: whole extents change hands (core/room.py).
SLOTS = {"one_slot": 16 << 10, "runs": 6560, "two_sizes": 16 << 10}


def wide_worker(client):
    """A worker of another model, of 10 layers: blocks of 40 KiB."""
    generator = torch.Generator().manual_seed(8)
    tensors = [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
               for _ in range(10)]
    ns = namespace("per_layer", model="wide")
    return client.register_worker(ns, rank=0, tensors=tensors, block_dim=1), client.register_engine(ns), tensors


@pytest.mark.parametrize("slot", sorted(SLOTS))
@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_both_lanes_answer_the_same_requests_the_same(start_held_daemon, client_factory, eviction, slot):
    runs = []
    slot_bytes = SLOTS[slot]
    span = -(-(16 << 10) // slot_bytes)
    two_sizes = slot == "two_sizes"
    for lane in ("python", "native"):
        pool_slots = POOL_SLOTS * (4 if two_sizes else span)
        daemon = start_held_daemon(env={"KVDEPOT_LANE": lane}, pool_size=str(pool_slots * slot_bytes),
                                   slot_size=str(slot_bytes), eviction=eviction)
        assert f"the {lane} lane" in daemon.log().lower()
        runs.append(Run(daemon, client_factory(daemon, name=lane), wide=two_sizes))
    keys = prompt_keys(48, prompt=77)
    rng = random.Random(f"lanes-{eviction}")
    # Block ids a held job still reads or writes: a worker never reuses them meanwhile.
    busy: dict[int, list[int]] = {}
    for job in range(1, STEPS + 1):
        step = rng.choices(["store", "load", "release", "stats"], weights=[6, 5, 2, 1])[0]
        hold = rng.random() < 0.15 and len(runs[0].held) < 4
        chosen = [keys[rng.randrange(len(keys))] for _ in range(rng.randint(1, 6))]
        model = 0
        if len(runs[0].models) > 1:
            # With two models no job is held: a held native copy kept the
            # next fence from its answer there.
            model, hold = rng.randrange(2), False
        taken = {i for ids in busy.values() for i in ids}
        if step == "store":
            ids = rng.sample(sorted(set(range(0, 64)) - taken), len(chosen))
            for run in runs:
                run.store(job, chosen, ids, hold, model)
        elif step == "load":
            ids = rng.sample(sorted(set(range(64, 128)) - taken), len(chosen))
            for run in runs:
                run.load(job, chosen, ids, hold, model)
        elif step == "release" and runs[0].held:
            at = rng.randrange(len(runs[0].held))
            busy.pop(runs[0].held[at], None)
            for run in runs:
                run.release(at)
        else:
            for run in runs:
                run.stats()
        if hold and step in ("store", "load") and runs[0].held and runs[0].held[-1] == job:
            busy[job] = ids
    while runs[0].held:
        for run in runs:
            run.release(0)
    for run in runs:
        run.stats()
    python, native = (run.seen for run in runs)
    for step, (a, b) in enumerate(zip(python, native)):
        assert a == b, f"step {step}: the Python lane saw {a}, the native lane {b}"
    assert len(python) == len(native)
    # The sequence did what it is for: evictions, pins in flight, loads checked byte for byte.
    final = python[-1]
    assert final[3] > 0 and (two_sizes or any(s[0] == "released" for s in python))
    assert final[1] == sum(used for _, used, _ in final[7]) > 0
    spans = {name: 3 if "/wide:" in name else span for name, _, _ in final[7]}
    assert all(used == spans[name] * ready for name, used, ready in final[7]), "a block's run was miscounted"
    assert len([n for n, used, _ in final[7] if used]) == (2 if two_sizes else 1)
    assert any(s[0] == "load" and s[2] and s[3] == [] for s in python)
    assert not any(s[0] == "load" and s[2] and s[3] for s in python), "a load that ended ok brought wrong bytes"
