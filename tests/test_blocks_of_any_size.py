"""Blocks of any size (issue 28): a block larger than a slot takes a run of
consecutive slots, models of several block sizes share one pool, a big block
costs its bytes, and a kept pool brings runs back after a restart. The test
pool: 4 MiB of 16 KiB slots, extents of 256 KiB (a sixteenth of the pool)."""

from __future__ import annotations

import pytest
import torch
from conftest import lane_env, wait_until
from kvcache import BLOCK_SIZE, HEAD_DIM, KV_HEADS, dram, namespace, prompt_keys

SLOT = 16 << 10
POOL_SLOTS = 256
BLOCKS = 64


def big_worker(client, layers: int, seed: int, model: str):
    """A per_layer worker of `layers` layers: 4 KiB a layer, so 10 layers make
    a 40 KiB block, 2.5 slots (a run of 3)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
               for _ in range(layers)]
    ns = namespace("per_layer", model=model)
    worker = client.register_worker(ns, rank=0, tensors=tensors, block_dim=1)
    engine = client.register_engine(ns)
    return worker, engine, tensors


def store(client, worker, keys, ids, job_id):
    job = client.submit_store(worker, job_id, keys, ids)
    result = client.wait([job], 10)[job]
    assert result.ok, result.error
    return result


def load_and_compare(client, worker, tensors, keys, src_ids, dst_ids, job_id):
    for t in tensors:
        t[:, dst_ids] = 0
    job = client.submit_load(worker, job_id, keys, dst_ids)
    assert client.wait([job], 10)[job].ok
    for t in tensors:
        for s, d in zip(src_ids, dst_ids):
            assert torch.equal(t[:, s].view(torch.int16), t[:, d].view(torch.int16)), f"block {s} came back wrong"


def namespace_row(stats, model: str):
    [row] = [n for n in stats.namespaces if f"/{model}:" in n.name]
    return row


def test_a_block_of_two_and_a_half_slots_round_trips_and_costs_three(start_daemon, client_factory):
    daemon = start_daemon()
    client = client_factory(daemon)
    worker, engine, tensors = big_worker(client, layers=10, seed=1, model="wide")
    keys = prompt_keys(8, prompt=1)
    store(client, worker, keys, list(range(8)), 1)
    assert client.lookup(engine, keys).ready_blocks == 8
    row = namespace_row(client.stats(), "wide")
    assert row.block_bytes == 40 << 10
    assert row.used_slots == 8 * 3 and row.used_bytes == 8 * (40 << 10)
    load_and_compare(client, worker, tensors, keys, list(range(8)), list(range(32, 40)), 2)


def test_two_block_sizes_share_one_pool_and_a_big_block_costs_its_bytes(start_daemon, client_factory):
    daemon = start_daemon()
    client = client_factory(daemon)
    small, small_engine, small_tensors = big_worker(client, layers=4, seed=2, model="narrow")  # 16 KiB: 1 slot
    wide, wide_engine, wide_tensors = big_worker(client, layers=10, seed=3, model="wide")  # 40 KiB: 3 slots
    # The small model fills the pool, 32 blocks a round.
    for r in range(POOL_SLOTS // 32):
        store(client, small, prompt_keys(32, prompt=100 + r), list(range(32)), 10 + r)
    assert client.stats().used_slots == POOL_SLOTS
    # The wide model's blocks evict the oldest small ones: 24 of them cost 72 slots.
    wide_keys = prompt_keys(24, prompt=200)
    store(client, wide, wide_keys, list(range(24)), 30)
    stats = client.stats()
    wide_row, small_row = namespace_row(stats, "wide"), namespace_row(stats, "narrow")
    assert wide_row.used_slots == 72 and wide_row.ready_blocks == 24
    # Runs of 3 need extents of their own: whole extents of small blocks went,
    # the oldest first (an extent's blocks were stored together).
    assert small_row.used_slots + wide_row.used_slots <= POOL_SLOTS
    assert stats.totals.evicted_blocks >= 72
    assert client.lookup(small_engine, prompt_keys(32, prompt=100)).ready_blocks == 0  # the oldest round
    assert client.lookup(small_engine, prompt_keys(32, prompt=107)).ready_blocks == 32  # the newest
    # Both models' blocks come back bit-exact.
    load_and_compare(client, wide, wide_tensors, wide_keys, list(range(24)), list(range(32, 56)), 31)
    store(client, small, prompt_keys(4, prompt=300), list(range(4)), 32)
    load_and_compare(client, small, small_tensors, prompt_keys(4, prompt=300), list(range(4)), list(range(40, 44)), 33)


@pytest.mark.parametrize("lane", ["python", "native"])
def test_a_new_block_size_clears_one_extent_a_block_not_the_pool(start_daemon, client_factory, lane):
    """A pool full of one model's blocks, read since in an order unlike the
    one they were stored in (a block of every extent read again), takes
    another model's wider blocks: each extent they need costs its own 16
    blocks, the oldest block's extent first, and the rest of the pool stays."""
    daemon = start_daemon(env=lane_env(lane))
    assert f"the {lane} lane" in daemon.log().lower()
    client = client_factory(daemon)
    small, small_engine, small_tensors = big_worker(client, layers=4, seed=2, model="narrow")  # 1 slot
    wide, wide_engine, wide_tensors = big_worker(client, layers=10, seed=3, model="wide")  # 3 slots
    rounds = [prompt_keys(32, prompt=100 + r) for r in range(POOL_SLOTS // 32)]
    for r, keys in enumerate(rounds):
        store(client, small, keys, list(range(32)), 10 + r)
    assert client.stats().used_slots == POOL_SLOTS
    # An extent holds 16 slots: round r fills extents 2r and 2r + 1. The last
    # block of each extent is read again, and is now among the newest.
    touched = [rounds[e // 2][(e % 2) * 16 + 15] for e in range(POOL_SLOTS // 16)]
    job = client.submit_load(small, 20, touched, list(range(32, 48)))
    assert client.wait([job], 10)[job].ok
    # Ten runs of 3 slots: two extents of 5 each.
    wide_keys = prompt_keys(10, prompt=200)
    store(client, wide, wide_keys, list(range(10)), 30)
    stats = client.stats()
    assert stats.totals.evicted_blocks == 32
    assert namespace_row(stats, "wide").ready_blocks == 10
    assert namespace_row(stats, "narrow").ready_blocks == POOL_SLOTS - 32
    assert client.lookup(small_engine, rounds[0]).ready_blocks == 0  # the oldest's extents, read block included
    assert all(client.lookup(small_engine, keys).ready_blocks == 32 for keys in rounds[1:])
    load_and_compare(client, wide, wide_tensors, wide_keys, list(range(10)), list(range(48, 58)), 31)
    load_and_compare(client, small, small_tensors, rounds[1][:4], list(range(4)), list(range(58, 62)), 32)


@pytest.mark.parametrize("lane", ["python", "native"])
def test_with_an_extent_of_each_pinned_a_wider_block_still_finds_room(start_held_daemon, client_factory, lane):
    """Loads in flight pin a block of every extent, so none can be cleared. A
    wide block still takes the place of the oldest wide block free to go; it
    was refused, with nothing evicted, while such a block was there."""
    daemon = start_held_daemon(env=lane_env(lane))
    client = client_factory(daemon)
    small, _, _ = big_worker(client, layers=4, seed=2, model="narrow")  # 1 slot
    wide, wide_engine, _ = big_worker(client, layers=10, seed=3, model="wide")  # 3 slots: 5 an extent
    narrow_keys = prompt_keys(192, prompt=100)
    for r in range(6):  # extents 0-11
        store(client, small, narrow_keys[32 * r: 32 * (r + 1)], list(range(32)), 10 + r)
    wide_keys = prompt_keys(20, prompt=200)
    store(client, wide, wide_keys, list(range(20)), 20)  # extents 12-15
    assert client.stats().used_slots == 252
    loads = [(small, 30, narrow_keys[::16], list(range(32, 44))), (wide, 31, wide_keys[::5], list(range(32, 36)))]
    for worker, job, keys, ids in loads:
        daemon.hold(job)
        client.submit_load(worker, job, keys, ids)
    wait_until(lambda: client.stats().pinned_slots == 12 + 4 * 3, what="the loads in flight")
    result = store(client, wide, prompt_keys(1, prompt=300), [20], 32)
    assert result.not_stored == 0
    assert client.stats().totals.evicted_blocks == 1
    assert client.lookup(wide_engine, wide_keys[1:2]).ready_blocks == 0  # the oldest wide block not pinned
    assert client.lookup(wide_engine, wide_keys[2:]).ready_blocks == 18
    for _, job, _, _ in loads:
        daemon.release(job)
        assert client.wait([job], 10)[job].ok


def test_runs_come_back_after_a_restart(start_daemon, client_factory):
    daemon = start_daemon()
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = big_worker(client, layers=10, seed=4, model="wide")
    keys = prompt_keys(20, prompt=5)
    store(client, worker, keys, list(range(20)), 1)
    wait_until(lambda: dram(client.stats()).written_shards >= 20, what="20 records sealed")
    saved = [t.clone() for t in tensors]
    assert daemon.stop() == 0
    daemon.start()
    assert client.wait_connected(15)
    assert "adopted 20 block(s) (60 slots)" in daemon.log()
    tier = dram(client.stats())
    assert tier.recovered_shards == 20 and dict(tier.discarded) == {}
    worker, engine, tensors = big_worker(client, layers=10, seed=99, model="wide")  # other bytes in its cache
    assert client.lookup(engine, keys).ready_blocks == 20
    job = client.submit_load(worker, 2, keys, list(range(20)))
    assert client.wait([job], 10)[job].ok
    for t, s in zip(tensors, saved):
        assert torch.equal(t[:, :20].view(torch.int16), s[:, :20].view(torch.int16))


def test_a_record_moved_off_its_runs_boundary_is_not_adopted(start_daemon, client_factory):
    """A kept record whose run does not start where the extents put runs of its
    span (a corrupt or tampered pool file) is discarded, never served."""
    from kvdepot.server.host.shard_record import RECORD_BYTES

    daemon = start_daemon()
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = big_worker(client, layers=10, seed=6, model="wide")
    keys = prompt_keys(4, prompt=6)
    store(client, worker, keys, list(range(4)), 1)
    wait_until(lambda: dram(client.stats()).written_shards >= 4, what="4 records sealed")
    assert daemon.stop() == 0
    [pool] = daemon.folder.glob("*.pool")
    data = bytearray(pool.read_bytes())
    records = POOL_SLOTS * SLOT
    used = [s for s in range(POOL_SLOTS) if any(data[records + s * RECORD_BYTES: records + (s + 1) * RECORD_BYTES])]
    assert len(used) == 4 and all((s - used[0]) % 3 == 0 for s in used)
    # The last record moves one slot on: inside its extent, off the runs of 3.
    moved = used[-1]
    data[records + (moved + 1) * RECORD_BYTES: records + (moved + 2) * RECORD_BYTES] = \
        data[records + moved * RECORD_BYTES: records + (moved + 1) * RECORD_BYTES]
    data[records + moved * RECORD_BYTES: records + (moved + 1) * RECORD_BYTES] = bytes(RECORD_BYTES)
    pool.write_bytes(bytes(data))
    daemon.start()
    assert client.wait_connected(15)
    tier = dram(client.stats())
    assert tier.recovered_shards == 3 and dict(tier.discarded) == {"misplaced": 1}
    worker, engine, tensors = big_worker(client, layers=10, seed=6, model="wide")
    assert client.lookup(engine, keys).ready_blocks == 3


def test_runs_go_to_disk_and_come_back_from_it_bit_exact(start_daemon, client_factory, tmp_path):
    """Blocks of 3 slots that DRAM evicted are promoted from the disk into runs
    of 3 again (a disk record longer than one slot is no corrupt one)."""
    daemon = start_daemon(pool_size="1MiB", disk_dir=str(tmp_path / "disk"), disk_size="16MiB")
    client = client_factory(daemon)
    worker, engine, tensors = big_worker(client, layers=10, seed=7, model="wide")
    # 1 MiB of 16 KiB slots: 16 extents of 4 slots, a run of 3 each: 16 blocks at most.
    rounds = []
    for r in range(4):
        generator = torch.Generator().manual_seed(r)
        for t in tensors:
            t[:, :10] = torch.randn(t[:, :10].shape, generator=generator).to(t.dtype)
        rounds.append([t[:, :10].clone() for t in tensors])
        store(client, worker, prompt_keys(10, prompt=400 + r), list(range(10)), 1 + r)
        wait_until(lambda r=r: [t for t in client.stats().tiers if t.name == "disk"][0].written_shards
                   >= 10 * (r + 1), what=f"round {r} on disk")
    keys = prompt_keys(10, prompt=400)  # the first round: DRAM evicted it
    wait_until(lambda: client.lookup(engine, keys).ready_blocks == 10, what="round 0 promoted from disk")
    job = client.submit_load(worker, 9, keys, list(range(20, 30)))
    assert client.wait([job], 10)[job].ok
    for t, saved in zip(tensors, rounds[0]):
        assert torch.equal(t[:, 20:30].view(torch.int16), saved.view(torch.int16))
