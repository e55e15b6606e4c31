"""A pool smaller than the working set: what goes, what stays."""

from __future__ import annotations

import pytest
import torch
from conftest import wait_until
from kvcache import attach_worker, block_of, prompt_keys

from kvdepot.server.native import build

POOL_SLOTS = 8


@pytest.fixture(params=["lru", "arc"])
def small_daemon(request, start_held_daemon):
    # 8 slots of 16 KiB: eight blocks of the test cache. Tests hold jobs in
    # flight with small_daemon.hold(job_id).
    return start_held_daemon(pool_size=f"{POOL_SLOTS * 16}KiB", eviction=request.param)


@pytest.fixture
def worker_setup(small_daemon, client_factory):
    client = client_factory(small_daemon)
    worker, engine, tensors = attach_worker(client, seed=3)
    return client, engine, worker, tensors


class Jobs:
    def __init__(self):
        self.next = 100

    def __call__(self) -> int:
        self.next += 1
        return self.next


def store_one_by_one(client, worker, keys, first_block: int, job_id) -> None:
    for i, key in enumerate(keys):
        job = client.submit_store(worker, job_id(), [key], [first_block + i])
        assert client.wait([job], 10)[job].ok


def present(client, engine, keys) -> list[bool]:
    return [client.lookup(engine, [key]).ready_blocks == 1 for key in keys]


def test_oldest_unpinned_blocks_are_evicted_first(worker_setup):
    client, engine, worker, _ = worker_setup
    keys = prompt_keys(12, prompt=1)
    jobs = Jobs()
    store_one_by_one(client, worker, keys[:8], 0, jobs)
    assert present(client, engine, keys[:8]) == [True] * 8
    store_one_by_one(client, worker, keys[8:], 8, jobs)
    assert present(client, engine, keys) == [False] * 4 + [True] * 8
    assert client.stats().totals.evicted_blocks == 4


def test_a_block_pinned_by_an_inflight_load_is_never_evicted(worker_setup, small_daemon):
    client, engine, worker, tensors = worker_setup
    keys = prompt_keys(12, prompt=2)
    jobs = Jobs()
    store_one_by_one(client, worker, keys[:8], 0, jobs)
    # A load of the oldest block is submitted but its copy has not run yet.
    load = jobs()
    small_daemon.hold(load)
    client.submit_load(worker, load, [keys[0]], [100])
    wait_until(lambda: client.stats().pinned_slots == 1, what="the load in flight")
    store_one_by_one(client, worker, keys[8:], 8, jobs)
    alive = present(client, engine, keys)
    assert alive[0], "the block pinned by the load was evicted"
    assert alive == [True, False, False, False, False, True, True, True, True, True, True, True]
    small_daemon.release(load)
    assert client.wait([load], 10)[load].ok
    for src, dst in zip(block_of(tensors, "per_layer", 0), block_of(tensors, "per_layer", 100)):
        assert torch.equal(src.view(torch.int16), dst.view(torch.int16))


def test_stores_that_find_every_slot_pinned_store_what_fits(worker_setup, small_daemon):
    client, engine, worker, _ = worker_setup
    keys = prompt_keys(10, prompt=3)
    jobs = Jobs()
    store_one_by_one(client, worker, keys[:8], 0, jobs)
    pin_all = jobs()
    small_daemon.hold(pin_all)
    client.submit_load(worker, pin_all, keys[:8], list(range(20, 28)))
    store = client.submit_store(worker, jobs(), [keys[0], *keys[8:]], [0, 8, 9])
    result = client.wait([store], 10)[store]
    # The caller learns what was left out: one key stored already, two without room.
    assert result.ok and result.already_stored == 1 and result.not_stored == 2
    assert present(client, engine, keys) == [True] * 8 + [False, False]
    small_daemon.release(pin_all)
    assert client.wait([pin_all], 10)[pin_all].ok


def test_arc_keeps_a_block_used_twice_through_a_scan(small_daemon, worker_setup):
    client, engine, worker, _ = worker_setup
    keys = prompt_keys(8, prompt=4)
    scan = prompt_keys(12, prompt=5)
    jobs = Jobs()
    store_one_by_one(client, worker, keys, 0, jobs)
    # keys[0] is used a second time: loaded.
    load = client.submit_load(worker, jobs(), [keys[0]], [64])
    assert client.wait([load], 10)[load].ok
    # A scan of blocks used once, larger than the pool.
    store_one_by_one(client, worker, scan, 8, jobs)
    survived = present(client, engine, [keys[0]])[0]
    if small_daemon.options["eviction"] == "arc":
        assert survived, "ARC evicted the block used twice during a scan"
        assert present(client, engine, keys[1:]) == [False] * 7
    else:
        assert not survived, "LRU keeps only the most recent blocks"
    assert present(client, engine, scan[-7:]) == [True] * 7


def test_engines_of_the_namespace_keep_a_copy_of_its_blocks(worker_setup, small_daemon, client_factory):
    client, engine, worker, _ = worker_setup
    engine.track_removed = True
    keys = prompt_keys(12, prompt=5)
    jobs = Jobs()
    store_one_by_one(client, worker, keys[:2], 0, jobs)
    # A second engine registered later gets the blocks stored so far, then every change.
    watcher = client_factory(small_daemon, name="watcher")
    watching = watcher.register_engine(engine.namespace, track_removed=True)
    wait_until(lambda: watcher.cached_lookup(watching, keys).ready_blocks == 2, what="the snapshot")
    store_one_by_one(client, worker, keys[2:], 2, jobs)  # 12 blocks into 8 slots: 4 evicted

    for owner, handle in ((client, engine), (watcher, watching)):
        wait_until(lambda handle=handle: handle.ready == set(keys[4:]), what="the copy to follow the evictions")
        assert owner.cached_lookup(handle, keys).ready_blocks == 0  # block 0 was evicted
        assert owner.cached_lookup(handle, keys, start=4).ready_blocks == 8
        assert sorted(owner.take_removed(handle)) == sorted(keys[:4])

    # A store in flight shows as "not yet"; the copy agrees with the daemon.
    more = prompt_keys(2, prompt=6)
    storing = jobs()
    small_daemon.hold(storing)
    client.submit_store(worker, storing, more, [0, 1])
    wait_until(lambda: watcher.cached_lookup(watching, more).not_yet, what="storing")
    assert client.lookup(engine, more).not_yet
    small_daemon.release(storing)
    wait_until(lambda: watcher.cached_lookup(watching, more).ready_blocks == 2, what="ready")

    # The pool holds 8: the 2 new blocks evicted 2 more. Then everything is cleared.
    assert client.clear(engine.namespace_name).cleared_blocks == 8
    wait_until(lambda: not watching.ready, what="the clear")
    assert len(watcher.take_removed(watching)) == 2 + 8


def test_a_block_stored_and_evicted_between_two_notifications_is_still_reported_removed(
    start_held_daemon, client_factory
):
    # The native lane runs and answers jobs on its own threads; the daemon's
    # Python side sends the engines what changed when it gets to it, and a
    # block that became ready and was evicted in between reaches the copies
    # as dropped only. An engine announced it as stored from its JobDone
    # (connector/kv_events.py) and must still hear that it is gone.
    if build.compiler() is None:
        pytest.skip("no C++ compiler here")
    daemon = start_held_daemon(env={"KVDEPOT_LANE": "native"}, pool_size=f"{POOL_SLOTS * 16}KiB")
    client = client_factory(daemon)
    worker, engine, _ = attach_worker(client, seed=3)
    engine.track_removed = True
    keys = prompt_keys(POOL_SLOTS + 1, prompt=7)
    daemon.hold("events")
    store_one_by_one(client, worker, keys, 0, Jobs())  # the last one evicts keys[0]
    assert engine.ready == set(), "the copy heard of the stores while the daemon's Python side was held"
    daemon.release("events")
    wait_until(lambda: engine.ready == set(keys[1:]), what="the copy to hear of the stores")
    assert client.take_removed(engine) == [keys[0]]
