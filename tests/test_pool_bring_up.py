"""The daemon serves once the first part of its pool is up, and the rest comes
up behind it: no slot is handed out before its chunk is up, every chunk comes
up, and blocks stored over many chunks survive a restart bit-exact."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from conftest import wait_until
from kvcache import attach_worker, block_of, prompt_keys
from test_warm_restart import SLOT_BYTES, flip, slot_of

from kvdepot.server.host import numa
from kvdepot.server.host.pool import HostPool
from kvdepot.server.host.shard_record import MAGIC

SLOT = 64 << 10
CHUNK = 16 * SLOT  # 16 slots a chunk


def open_pool(tmp_path, size=64 * CHUNK, placement=None, name="p", adopt=False) -> HostPool:
    return HostPool(size=size, slot_bytes=SLOT, directory=str(tmp_path), name=name, pin="off",
                    pin_chunk_bytes=CHUNK, threads=2, placement=placement, adopt=adopt)


def bring_up_rest(pool: HostPool) -> list[tuple[int, int]]:
    """Brings the rest up; returns the chunks in the order they came, once all have."""
    came: list[tuple[int, int]] = []
    done = threading.Event()
    lock = threading.Lock()

    def online(first: int, count: int) -> None:
        with lock:
            came.append((first, count))
            if sum(c for _, c in came) + 16 * len(pool.slots.ranges) >= pool.num_slots:
                done.set()

    pool.bring_up_rest(online)
    assert done.wait(30), f"only {came} came up"
    return came


def test_a_new_pool_serves_with_its_first_chunk_and_hands_out_only_slots_that_are_up(tmp_path):
    pool = open_pool(tmp_path)
    try:
        assert pool.num_slots == 1024 and pool.online_slots == 16
        taken = [pool.allocate() for _ in range(16)]
        assert sorted(taken) == list(range(16))
        assert pool.allocate() is None  # the other 1008 slots are not up yet
        assert pool.used_slots == 16
        came = bring_up_rest(pool)
        assert came == [(first, 16) for first in range(16, 1024, 16)]  # in order, each once
        for first, count in came:
            pool.add_online(first, count)
        assert pool.online_slots == 1024 and pool.used_slots == 16
        rest = {pool.allocate() for _ in range(1008)}
        assert rest == set(range(16, 1024)) and pool.allocate() is None
    finally:
        pool.close(discard=True)


def test_after_a_restart_the_chunks_holding_the_newest_kept_blocks_come_up_first(tmp_path):
    pool = open_pool(tmp_path, name="kept")
    for first, count in bring_up_rest(pool):
        pool.add_online(first, count)
    # Sealed records (their magic and generation) in chunks 3, 40 and 20, stored in that order;
    # chunk 9 holds a record of another format.
    for chunk, generation in ((3, 11), (40, 12), (20, 13)):
        slot = chunk * 16 + 2
        pool.records[slot * 128 : slot * 128 + 24] = MAGIC + bytes(8) + generation.to_bytes(8, "little")
    pool.records[9 * 16 * 128 : 9 * 16 * 128 + 8] = b"x" * 8
    pool.close()
    kept = open_pool(tmp_path, name="kept", adopt=True)
    try:
        came = bring_up_rest(kept)
        assert came[:4] == [(20 * 16, 16), (40 * 16, 16), (3 * 16, 16), (9 * 16, 16)]
        assert sorted(came) == [(first, 16) for first in range(16, 1024, 16)]
    finally:
        kept.close(discard=True)


def test_numa_ranges_come_up_together(tmp_path):
    placement = numa.Placement(nodes=(0, 1), detected=(0, 1))
    pool = open_pool(tmp_path, placement=placement)
    try:
        # One chunk of each node's range first: a GPU's stores find its node's slots.
        assert pool.online_slots == 32
        assert [n.slots for n in pool.numa_nodes()] == [512, 512]
        assert pool.allocate(node=1) == 512 and pool.allocate(node=0) == 0
        came = bring_up_rest(pool)
        starts = [first for first, _ in came]
        assert starts[:4] == [16, 528, 32, 544]  # taking the nodes in turn
        assert sorted(starts) == sorted(set(range(16, 512, 16)) | set(range(528, 1024, 16)))
    finally:
        pool.close(discard=True)


def test_a_kept_pool_brings_up_the_chunks_holding_its_blocks_first(tmp_path):
    pool = open_pool(tmp_path, name="kept")
    for first, count in bring_up_rest(pool):
        pool.add_online(first, count)
    # A record in chunks 3 and 40 (a non-empty record is all it looks at).
    for slot in (3 * 16 + 5, 40 * 16):
        pool.records[slot * 128 : slot * 128 + 8] = b"x" * 8
    pool.close()
    kept = open_pool(tmp_path, name="kept", adopt=True)
    try:
        assert kept.online_slots == 16  # it serves with its first chunk, as a new pool does
        came = bring_up_rest(kept)
        assert came[:2] == [(48, 16), (640, 16)]  # then the chunks holding kept records
        assert sorted(came) == [(first, 16) for first in range(16, 1024, 16)]
    finally:
        kept.close(discard=True)


def test_stats_show_the_pool_up_and_blocks_over_many_chunks_come_back_after_a_restart(
    start_daemon, client_factory
):
    # 512 slots of 16 KiB in chunks of 16 slots: the daemon serves with one.
    daemon = start_daemon(pool_size="8MiB", pin_chunk_bytes="256KiB")
    assert "serving with 0.25 MiB up, the rest coming up behind" in daemon.log()
    client = client_factory(daemon, backoff_max=0.5)
    wait_until(lambda: client.stats().pool.online_slots == 512, what="the whole pool up")
    wait_until(lambda: "pool up: all 8.00 MiB faulted in" in daemon.log(), what="the log saying so")
    worker, engine, tensors = attach_worker(client, seed=7)
    keys = prompt_keys(384, prompt=3)  # 24 chunks' worth
    for i in range(0, 384, 96):
        job = client.submit_store(worker, i + 1, keys[i : i + 96], list(range(96)))
        assert client.wait([job], 30)[job].ok
    assert client.lookup(engine, keys).ready_blocks == 384
    wait_until(lambda: [t for t in client.stats().tiers if t.name == "dram"][0].written_shards >= 384,
               what="every record sealed")
    assert daemon.stop() == 0

    [pool] = daemon.folder.glob("*.pool")
    flip(pool, slot_of(pool, keys[200]) * SLOT_BYTES + 100)  # a byte of one kept block's KV

    daemon.start()
    # It serves with the first chunk up; the others come back as their chunks come up.
    assert "more wait for their part of the pool to come up" in daemon.log()
    assert client.wait_connected(15)
    # New blocks stored meanwhile take free slots, never those the kept blocks
    # wait in (once a chunk with free slots is up: chunk 0 is full of kept ones).
    wait_until(lambda: (s := client.stats()).pool.online_slots - s.used_slots >= 8, what="8 free slots up")
    fresh = prompt_keys(8, prompt=4)
    job = client.submit_store(worker, 800, fresh, list(range(8)))
    assert client.wait([job], 30)[job].ok
    kept = keys[:200] + keys[201:]
    wait_until(lambda: client.lookup(engine, kept).ready_blocks == 383, what="every intact kept block back")
    wait_until(lambda: client.stats().pool.online_slots == 512, what="the whole pool up after the restart")
    assert "adopted 383 block(s) (383 slots) from the kept pool, the last as" in daemon.log()
    [dram] = [t for t in client.stats().tiers if t.name == "dram"]
    assert dram.recovered_shards == 383 and dict(dram.discarded) == {"data_hash": 1}
    assert client.lookup(engine, [keys[200]]).ready_blocks == 0  # the changed one is never served
    assert client.lookup(engine, fresh).ready_blocks == 8
    # Keys 288-383 were stored from blocks 0-95: load them into blocks 100-127 and compare.
    job = client.submit_load(worker, 900, keys[288:316], list(range(100, 128)))
    assert client.wait([job], 30)[job].ok
    for i in range(28):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 100 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16)), f"block {i} differs"


class FailingPinning:
    """Pins the first `ok` registrations, then refuses (a locked-memory limit reached)."""

    def __init__(self, ok: int):
        self.ok, self.calls = ok, 0

    def register(self, address, length):
        self.calls += 1
        return 0 if self.calls <= self.ok else 2  # CUDA_ERROR_OUT_OF_MEMORY

    def unregister(self, address):
        return 0


def test_a_chunk_that_cannot_be_pinned_stops_the_bring_up_and_says_why(tmp_path, monkeypatch):
    from kvdepot.server.host import pool as pool_module

    monkeypatch.setattr(pool_module, "pinning", lambda pin: FailingPinning(ok=3))
    pool = HostPool(size=64 * CHUNK, slot_bytes=SLOT, directory=str(tmp_path), name="p", pin="on",
                    pin_chunk_bytes=CHUNK, threads=2)
    try:
        assert pool.pinned and pool.online_slots == 16
        came, failed = [], threading.Event()
        errors = []
        pool.bring_up_rest(lambda first, count: came.append((first, count)),
                           lambda error: (errors.append(error), failed.set()))
        assert failed.wait(30)
        # Two more chunks pinned, then the refusal: the rest stay down (and the
        # daemon stops under --pin on: daemon/main.py), and stats say why.
        assert came == [(16, 16), (32, 16)]
        assert "(cuMemHostRegister) failed with CUDA error 2" in errors[0] == pool.bring_up_error
    finally:
        pool.close(discard=True)


def test_the_native_lanes_counts_agree_at_every_call_while_kept_blocks_wait(tmp_path):
    # The native lane's thread checks its index after each of its rounds (with
    # KVDEPOT_CHECK_INDEX=1, as the tests run it), between any two calls: each
    # call must leave the counts agreeing.
    import pytest

    from kvdepot.server.native import binding
    from kvdepot.server.native.depot import NativeSlots
    from kvdepot.server.native.lane import Lane

    try:
        library = binding.load()
    except OSError as e:
        pytest.skip(f"the native lane is not built: {e}")
    pool = open_pool(tmp_path, name="n")
    lane = Lane(library, pool, arc=False, tracing=False, max_unread=1024, max_frame_bytes_per_uid=64 << 20,
                check=True)
    try:
        pool.slots = NativeSlots(lane, pool.slots)
        # Kept shards' runs in chunks 5 and 7, not up yet: one slot, and three.
        pool.hold({5 * 16 + 1: 1, 7 * 16 + 3: 3})
        pool.keep_only(dict(pool.held))
        assert lane.verify() == ""
        pool.add_online(5 * 16, 16)
        assert lane.verify() == ""
        lane.release_slots([5 * 16 + 1], waited=True)  # its block failed its check
        pool.let_go_held([5 * 16 + 1])
        assert lane.verify() == ""
        pool.add_online(7 * 16, 16)
        assert lane.verify() == "" and pool.used_slots == 3 and pool.span_at(7 * 16 + 3) == 3
    finally:
        lane.close()
        pool.close(discard=True)


def test_kept_blocks_come_back_over_many_small_chunks_while_stores_go_on(start_daemon, client_factory):
    import time

    # 2048 slots in chunks of 4: 512 chunks come up while the lane serves stores.
    daemon = start_daemon(pool_size="32MiB", pin_chunk_bytes="64KiB")
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=7)
    keys = prompt_keys(1800, prompt=5)
    # Stores that outran this daemon's own bring-up would evict the first
    # blocks (the pool up so far is full): every block must be kept to count.
    wait_until(lambda: client.stats().pool.online_slots == 2048, timeout=30, what="the first pool up")
    for i in range(0, 1800, 100):
        job = client.submit_store(worker, i + 1, keys[i : i + 100], list(range(100)))
        assert client.wait([job], 30)[job].ok
    wait_until(lambda: [t for t in client.stats().tiers if t.name == "dram"][0].written_shards >= 1800,
               timeout=60, what="every record sealed")
    assert [t for t in client.stats().tiers if t.name == "dram"][0].shards == 1800
    assert daemon.stop() == 0
    daemon.start()
    assert client.wait_connected(15)
    fresh = prompt_keys(200, prompt=6)
    deadline = time.monotonic() + 20
    for n in range(200):
        job = client.submit_store(worker, 5000 + n, [fresh[n]], [0])
        assert client.wait([job], 10)[job].ok
        if time.monotonic() > deadline:
            break
    wait_until(lambda: client.stats().pool.online_slots == 2048, timeout=30, what="the whole pool up")
    # Every kept block back but those the 200 new ones (in 248 free slots) pushed out.
    wait_until(lambda: "the last as their part of the pool came up" in daemon.log(), timeout=30,
               what="the last kept blocks adopted")
    assert daemon.running and "inconsistent" not in daemon.log()
    [dram] = [t for t in client.stats().tiers if t.name == "dram"]
    assert dram.recovered_shards == 1800 and dict(dram.discarded) == {}


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_blocks_adopted_as_their_chunk_comes_up_go_before_blocks_stored_since_the_restart(
    start_daemon, client_factory, tmp_path, eviction
):
    """Kept blocks were stored before the restart: one adopted late, once its
    chunk came up, still goes before a block stored since (it went in as the
    newest, and a full pool evicted the blocks the engines use now)."""
    gate = tmp_path / "bring-up-gate"
    # 64 slots in 16 chunks of 4.
    daemon = start_daemon(pool_size="1MiB", pin_chunk_bytes="64KiB", eviction=eviction,
                          launcher=str(Path(__file__).with_name("daemon_with_held_bring_up.py")),
                          env={"KVDEPOT_TEST_BRING_UP_GATE": str(gate)})
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=9)

    def store(job_id: int, keys: list[bytes]) -> None:
        job = client.submit_store(worker, job_id, keys, list(range(len(keys))))
        assert client.wait([job], 30)[job].ok

    def held(keys: list[bytes]) -> int:
        return sum(client.lookup(engine, [key]).ready_blocks for key in keys)

    wait_until(lambda: client.stats().pool.online_slots == 64, what="the first pool up")
    kept = prompt_keys(24, prompt=7)
    store(1, kept)  # 6 of the 16 chunks' worth
    wait_until(lambda: [t for t in client.stats().tiers if t.name == "dram"][0].written_shards >= 24,
               what="every record sealed")
    assert daemon.stop() == 0
    gate.touch()
    daemon.start()
    assert client.wait_connected(15)
    # Chunk 0 alone is up: its kept blocks (`early`, by where the lane put
    # them) are back. Stored now, these take its free slots and evict those.
    stats = client.stats()
    assert stats.pool.online_slots == 4
    early = [t for t in stats.tiers if t.name == "dram"][0].recovered_shards
    since = prompt_keys(4, prompt=8)
    store(2, since)
    gate.unlink()
    wait_until(lambda: "the last as their part of the pool came up" in daemon.log(), what="the late adoption")
    # Chunks without kept blocks come up after those with: the last of them may be on its way.
    wait_until(lambda: client.stats().pool.online_slots == 64, what="the whole pool up")
    # (Counted, not looked up: a lookup is a use, and would make them the newest.)
    stats = client.stats()
    assert [t for t in stats.tiers if t.name == "dram"][0].recovered_shards == 24
    free = stats.pool.online_slots - stats.used_slots
    assert free == 64 - 4 - (24 - early)
    store(3, prompt_keys(free, prompt=9))  # the pool full
    store(4, prompt_keys(4, prompt=10))  # 4 evicted: kept ones, not those stored since
    assert held(since) == 4
    assert held(kept) == 24 - early - 4


def test_a_daemon_stopped_while_its_pool_comes_up_does_not_say_the_pool_is_up(start_daemon, tmp_path):
    gate = tmp_path / "bring-up-gate"
    gate.touch()
    daemon = start_daemon(pool_size="1MiB", pin_chunk_bytes="64KiB",
                          launcher=str(Path(__file__).with_name("daemon_with_held_bring_up.py")),
                          env={"KVDEPOT_TEST_BRING_UP_GATE": str(gate)})
    assert daemon.stop() == 0
    log = daemon.log()
    assert "pool up: all" not in log
    assert "stopped bringing the pool up with" in log and "of 1.00 MiB up" in log
