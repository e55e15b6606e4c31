"""The native lane and the Python lane are one daemon: the same requests, in a
pool small enough that every store evicts, with jobs held in flight (their
blocks pinned) among the others, get the same answers, the same lookups, the
same bytes back and the same counts, whichever lane runs the jobs. The lanes
keep their own code for the index, eviction and jobs (server/native/src is
a port of server/core); this is what keeps them one."""

from __future__ import annotations

import random

import pytest
from keyed_blocks import clear_blocks, write_blocks, wrong_blocks
from kvcache import attach_worker, prompt_keys

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

    def __init__(self, daemon, client):
        self.daemon = daemon
        self.client = client
        self.worker, self.engine, self.tensors = attach_worker(client, seed=7)
        self.seen: list = []
        self.held: list[int] = []

    def store(self, job: int, keys, block_ids, hold: bool) -> None:
        write_blocks(self.tensors, block_ids, keys)
        if hold:
            self.daemon.hold(job)
            self.held.append(job)
        self.client.submit_store(self.worker, job, keys, block_ids)
        if hold:
            self.fence(job)
        else:
            result = self.client.wait([job], 10)[job]
            self.seen.append(("store", job, result.ok, result.already_stored, result.not_stored))

    def load(self, job: int, keys, block_ids, hold: bool) -> None:
        ready = self.client.lookup(self.engine, keys)
        self.seen.append(("lookup", ready.ready_blocks, ready.not_yet, ready.storing_blocks))
        if not ready.ready_blocks:
            return
        keys, block_ids = keys[: ready.ready_blocks], block_ids[: ready.ready_blocks]
        clear_blocks(self.tensors, block_ids)
        if hold:
            self.daemon.hold(job)
            self.held.append(job)
        self.client.submit_load(self.worker, job, keys, block_ids)
        if hold:
            self.fence(job)
        else:
            result = self.client.wait([job], 10)[job]
            wrong = wrong_blocks(self.tensors, block_ids, keys) if result.ok else None
            self.seen.append(("load", job, result.ok, wrong))

    def fence(self, job: int) -> None:
        """Returns once the daemon has taken held job `job` in. Its submit is
        not answered, and the next step's lookup or stats goes over gRPC, which
        can overtake it: an empty job, on the same socket, is refused only
        after the daemon has read the held one."""
        fence = FENCE + job
        self.client.submit_store(self.worker, fence, [], [])
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


# A block of 16 KiB in slots of its size, or in runs of 3 slots (2.5 of them).
SLOTS = {"one_slot": 16 << 10, "runs": 6560}


@pytest.mark.parametrize("slot", sorted(SLOTS))
@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_both_lanes_answer_the_same_requests_the_same(start_held_daemon, client_factory, eviction, slot):
    runs = []
    slot_bytes = SLOTS[slot]
    span = -(-(16 << 10) // slot_bytes)
    for lane in ("python", "native"):
        daemon = start_held_daemon(env={"KVDEPOT_LANE": lane}, pool_size=str(POOL_SLOTS * span * slot_bytes),
                                   slot_size=str(slot_bytes), eviction=eviction)
        assert f"the {lane} lane" in daemon.log().lower()
        runs.append(Run(daemon, client_factory(daemon, name=lane)))
    keys = prompt_keys(48, prompt=77)
    rng = random.Random(f"lanes-{eviction}")
    # Block ids a held job still reads or writes: a worker never reuses them meanwhile.
    busy: dict[int, list[int]] = {}
    for job in range(1, STEPS + 1):
        step = rng.choices(["store", "load", "release", "stats"], weights=[6, 5, 2, 1])[0]
        hold = rng.random() < 0.15 and len(runs[0].held) < 4
        chosen = [keys[rng.randrange(len(keys))] for _ in range(rng.randint(1, 6))]
        taken = {i for ids in busy.values() for i in ids}
        if step == "store":
            ids = rng.sample(sorted(set(range(0, 64)) - taken), len(chosen))
            for run in runs:
                run.store(job, chosen, ids, hold)
        elif step == "load":
            ids = rng.sample(sorted(set(range(64, 128)) - taken), len(chosen))
            for run in runs:
                run.load(job, chosen, ids, hold)
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
    assert final[3] > 0 and any(s[0] == "released" for s in python)
    assert final[1] == sum(used for _, used, _ in final[7]) > 0
    assert all(used == span * ready for _, used, ready in final[7]), "a block's run of slots was miscounted"
    assert any(s[0] == "load" and s[2] and s[3] == [] for s in python)
    assert not any(s[0] == "load" and s[2] and s[3] for s in python), "a load that ended ok brought wrong bytes"
