"""The disk tier in the real daemon: blocks evicted from DRAM come back from
disk bit-exact, a corrupt record is a miss, a full disk drops, and the tier
survives restarts within its size."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
from conftest import settled, subprocess_env, wait_until
from kvcache import NUM_BLOCKS, attach_worker, block_of, prompt_keys, tier

POOL_SLOTS = 256  # the test daemons' 4 MiB pool of 16 KiB slots


def disk(stats):
    return tier(stats, "disk")


def start(start_daemon, tmp_path, size="32MiB", **options):
    return start_daemon(disk_dir=str(tmp_path / "disk"), disk_size=size, **options)


def fill_round(client, worker, tensors, round_: int, job_id: int) -> list[torch.Tensor]:
    """Stores NUM_BLOCKS new blocks (keys of prompt `round_`); returns their bytes."""
    generator = torch.Generator().manual_seed(round_)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))
    saved = [t.clone() for t in tensors]
    job = client.submit_store(worker, job_id, prompt_keys(NUM_BLOCKS, prompt=round_), list(range(NUM_BLOCKS)))
    assert client.wait([job], 10)[job].ok
    return saved


def fill_rounds(client, worker, tensors, rounds: int, first_job: int, below: str = "disk") -> list[list[torch.Tensor]]:
    """Stores `rounds` rounds, each in the tier `below` DRAM before the next is
    stored: a block DRAM evicts before the tier's writer reached it is not
    written (by design), and one the writer holds is not evicted, so without
    the wait a busy machine decides which rounds the tier has and which DRAM
    still holds. (The tier hears of commits after the store's answer: at once
    in the Python lane, a moment later in the native one.)"""
    saved = []
    for r in range(rounds):
        saved.append(fill_round(client, worker, tensors, r, first_job + r))
        wait_until(lambda r=r: tier(client.stats(), below).written_shards >= (r + 1) * NUM_BLOCKS,
                   what=f"round {r} in the {below} tier")
    return saved


def wait_ready(client, engine, keys, timeout=20.0) -> int:
    """Looks up (a Lookup call: it starts promotions) until every key is ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = client.lookup(engine, keys)
        if result.ready_blocks == len(keys):
            return result.ready_blocks
        if not result.not_yet and result.ready_blocks < len(keys):
            return result.ready_blocks
        time.sleep(0.02)
    return client.lookup(engine, keys).ready_blocks


def load_and_check(client, worker, tensors, keys, saved, job_id):
    for start in range(0, len(keys), 32):
        chunk = keys[start : start + 32]
        job = client.submit_load(worker, job_id + start, chunk, list(range(start, start + len(chunk))))
        assert client.wait([job], 10)[job].ok
    for i in range(len(keys)):
        for want, got in zip(block_of(saved, "per_layer", i), block_of(tensors, "per_layer", i)):
            assert torch.equal(want.view(torch.int16), got.view(torch.int16)), f"block {i} differs"


def test_a_working_set_three_times_the_pool_cycles_through_disk_and_loads_bit_exact(
    start_daemon, client_factory, tmp_path
):
    daemon = start(start_daemon, tmp_path)
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=1)
    rounds = 3 * POOL_SLOTS // NUM_BLOCKS  # 768 blocks through a pool of 256
    saved = fill_rounds(client, worker, tensors, rounds, 100)
    for r in range(rounds):
        keys = prompt_keys(NUM_BLOCKS, prompt=r)
        assert wait_ready(client, engine, keys) == NUM_BLOCKS, f"round {r} did not come back"
        load_and_check(client, worker, tensors, keys, saved[r], 1000 * (r + 1))
    stats = client.stats()
    tier = disk(stats)
    assert tier.promotions >= (rounds - 1) * NUM_BLOCKS - POOL_SLOTS
    assert tier.failed_promotions == 0 and tier.write_errors == 0
    # Hits by tier add up: every block loaded was looked up ready, some of them from disk.
    assert stats.totals.disk_hit_blocks == tier.promotions
    assert stats.totals.failed_jobs == 0


def test_an_engine_copy_waits_for_disk_blocks_and_its_cached_lookup_brings_them_up(
    start_daemon, client_factory, tmp_path
):
    daemon = start(start_daemon, tmp_path)
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=2)
    first = fill_rounds(client, worker, tensors, 3, 1)[0]  # round 2 evicts round 0 from DRAM
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    wait_until(lambda: keys[0] in engine.lower, what="the engine's copy listing round 0 on disk")
    answer = client.cached_lookup(engine, keys)
    assert answer.ready_blocks == 0 and answer.not_yet  # wait for it, do not recompute
    # The cached lookup asked the daemon (off the caller's path); the copy
    # follows. 128 blocks are twice what the daemon promotes at once (a
    # quarter of its 256 slots): asked again, as an engine does each step
    # while it waits, the rest come up too rather than turning into misses.
    wait_until(lambda: client.cached_lookup(engine, keys).ready_blocks == NUM_BLOCKS, what="promoted blocks ready")
    assert disk(client.stats()).failed_promotions == 0
    load_and_check(client, worker, tensors, keys, first, 500)


def test_a_corrupt_record_on_disk_is_a_miss_never_served(start_daemon, client_factory, tmp_path):
    daemon = start(start_daemon, tmp_path)
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=3)
    fill_rounds(client, worker, tensors, 3, 1)  # and no write is under way while the test edits the files
    # Flip a byte in the data of every record of round 0's first block: find
    # its header page by the key, then the data page after it.
    key = prompt_keys(1, prompt=0)[0]
    flipped = 0
    for segment in sorted((tmp_path / "disk").glob("seg-*.kvd")):
        data = bytearray(segment.read_bytes())
        at = data.find(key)
        while at != -1:
            header = at - at % 4096
            data[header + 4096 + 100] ^= 0x40
            flipped += 1
            at = data.find(key, at + 1)
        segment.write_bytes(bytes(data))
    assert flipped >= 1
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    assert wait_ready(client, engine, keys) == 0  # a miss: the engine recomputes
    tier = disk(client.stats())
    assert tier.failed_promotions >= 1 and tier.discarded["corrupt"] >= 1
    assert client.stats().totals.failed_jobs == 0


def test_a_full_disk_drops_blocks_and_fails_nothing(start_daemon, client_factory, tmp_path):
    daemon = start(start_daemon, tmp_path, size="2MiB")  # a tenth of what goes through
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=4)
    # Each round waits for the writer: a block it has not written yet is not
    # evicted from DRAM, so without the wait a slow writer keeps round 0 in
    # DRAM and the miss below would be a hit.
    fill_rounds(client, worker, tensors, 10, 1)
    tier = disk(client.stats())
    assert tier.evicted_shards > 0
    assert tier.bytes <= tier.capacity_bytes == 2 << 20
    assert client.stats().totals.failed_jobs == 0
    # What the disk dropped is a plain miss.
    assert wait_ready(client, engine, prompt_keys(NUM_BLOCKS, prompt=0)) == 0


def test_the_disk_tier_survives_a_restart_within_its_size(start_daemon, client_factory, tmp_path):
    daemon = start(start_daemon, tmp_path, size="8MiB")
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=5)
    saved = []
    for r in range(4):
        saved.append(fill_round(client, worker, tensors, r, 1 + r))
        # A block evicted from DRAM before the disk writer reaches it is dropped, not
        # kept: each round waits for the writer, so that every round reaches the disk.
        wait_until(lambda r=r: disk(client.stats()).written_shards >= (r + 1) * NUM_BLOCKS,
                   what=f"round {r} on disk")
    used_before = disk(client.stats()).bytes
    assert daemon.stop() == 0
    for pool in daemon.folder.glob("*.pool"):
        pool.unlink()  # DRAM lost (a reboot): only the disk can serve
    daemon.start()
    assert client.wait_connected(15)
    tier = disk(client.stats())
    assert tier.recovered_shards >= 2 * NUM_BLOCKS and 0 < tier.bytes <= 8 << 20 and used_before <= 8 << 20
    keys = prompt_keys(NUM_BLOCKS, prompt=3)
    assert wait_ready(client, engine, keys) == NUM_BLOCKS
    load_and_check(client, worker, tensors, keys, saved[3], 700)
    # More stores after the restart: the size still holds, counting what was there.
    for r in range(4, 10):
        fill_round(client, worker, tensors, r, 1 + r)
    assert disk(client.stats()).bytes <= 8 << 20


def test_a_second_daemon_cannot_use_the_same_disk_folder(start_daemon, tmp_path):
    start(start_daemon, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.server", "--listen", str(tmp_path / "other.sock"), "--pool-size", "4MiB",
         "--slot-size", "16KiB", "--pin", "off", "--pool-dir", str(tmp_path), "--disk-dir", str(tmp_path / "disk"),
         "--disk-size", "16MiB"],
        capture_output=True, text=True, env=subprocess_env(), timeout=60,
    )
    assert proc.returncode == 1
    assert "disk" in proc.stderr and "Traceback" not in proc.stderr


def test_stats_and_metrics_show_each_tier(start_daemon, client_factory, tmp_path):
    from test_metrics import metrics_url, scrape, value

    daemon = start(start_daemon, tmp_path, metrics_listen="127.0.0.1:0")
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=6)
    saved = fill_rounds(client, worker, tensors, 3, 1)
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    assert wait_ready(client, engine, keys) == NUM_BLOCKS
    load_and_check(client, worker, tensors, keys, saved[0], 100)

    proc = subprocess.run([sys.executable, "-m", "kvdepot.client.cli", "--socket", daemon.socket, "stats"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tier dram" in proc.stdout and "tier disk" in proc.stdout
    promoted = disk(client.stats()).promotions
    assert f"{promoted} promoted (0 failed)" in proc.stdout
    assert f"{NUM_BLOCKS} from disk" in proc.stdout

    samples = scrape(metrics_url(daemon))
    assert value(samples, "kvdepot_tier_promotions_total", tier="disk") == promoted
    assert value(samples, "kvdepot_tier_capacity_bytes", tier="disk") == 32 << 20
    assert value(samples, "kvdepot_tier_capacity_bytes", tier="dram") == 4 << 20
    assert value(samples, "kvdepot_lookup_blocks_total", result="disk_hit") == NUM_BLOCKS


def test_a_disk_folder_others_can_write_is_refused(tmp_path):
    """Anyone can compute a record's hashes: records planted in a folder another
    user can write would reach the GPUs, so the daemon will not start on one."""
    folder = tmp_path / "shared-disk"
    folder.mkdir()
    os.chmod(folder, 0o777)
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.server", "--listen", str(tmp_path / "d.sock"), "--pool-size", "4MiB",
         "--slot-size", "16KiB", "--pin", "off", "--pool-dir", str(tmp_path), "--disk-dir", str(folder),
         "--disk-size", "16MiB"],
        capture_output=True, text=True, env=subprocess_env(), timeout=60,
    )
    assert proc.returncode == 1
    assert "writable by it alone" in proc.stderr and "mode 777" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_block_from_disk_never_loads_into_a_worker_of_another_layout(start_daemon, client_factory, tmp_path):
    """The disk keeps no layout: after a restart that lost DRAM, a worker of the
    same namespace with smaller blocks (2 layers instead of 4) gets the block
    promoted, but its load fails with the reason, writes nothing, and the block
    goes; it never gets half a block of other bytes."""
    from kvcache import BLOCK_SIZE, HEAD_DIM, KV_HEADS, namespace

    daemon = start(start_daemon, tmp_path)
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=8)
    fill_round(client, worker, tensors, 0, 1)
    wait_until(lambda: disk(client.stats()).written_shards >= NUM_BLOCKS, what="the blocks on disk")
    client.close()
    assert daemon.stop() == 0
    for pool in daemon.folder.glob("*.pool"):
        pool.unlink()
    daemon.start()
    small = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
    other = client_factory(daemon, name="other-layout")
    worker = other.register_worker(namespace("per_layer"), rank=0, tensors=small, block_dim=1)
    engine = other.register_engine(namespace("per_layer"))
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    assert wait_ready(other, engine, keys[:4]) == 4
    job = other.submit_load(worker, 2, keys[:1], [0])
    result = other.wait([job], 10)[job]
    assert not result.ok and "layout changed" in result.error
    assert all(not t.any() for t in small)
    assert other.lookup(engine, keys[:1]).ready_blocks == 0


def test_kvdepot_clear_empties_the_disk_too_and_stays_cleared_after_a_restart(start_daemon, client_factory, tmp_path):
    daemon = start(start_daemon, tmp_path)
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=9)
    for r in range(3):
        fill_round(client, worker, tensors, r, 1 + r)
    wait_until(lambda: disk(client.stats()).written_shards >= NUM_BLOCKS, what="the blocks on disk")
    written = settled(lambda: disk(client.stats()).written_shards)  # the writer caught up
    [ns] = client.stats().namespaces
    assert client.clear(ns.name).cleared_blocks > 0
    for r in range(3):
        assert wait_ready(client, engine, prompt_keys(NUM_BLOCKS, prompt=r)) == 0
    after = fill_round(client, worker, tensors, 7, 10)  # stored after the clear: kept
    wait_until(lambda: disk(client.stats()).written_shards >= written + NUM_BLOCKS, what="the new blocks on disk")
    assert daemon.stop() == 0
    for pool in daemon.folder.glob("*.pool"):
        pool.unlink()  # only the disk can bring anything back
    daemon.start()
    assert client.wait_connected(15)
    for r in range(3):
        assert wait_ready(client, engine, prompt_keys(NUM_BLOCKS, prompt=r)) == 0, f"round {r} came back"
    keys = prompt_keys(NUM_BLOCKS, prompt=7)
    assert wait_ready(client, engine, keys) == NUM_BLOCKS
    load_and_check(client, worker, tensors, keys, after, 300)
