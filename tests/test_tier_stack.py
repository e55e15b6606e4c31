"""Tiers stack under DRAM with no change to the index or the depot: the tests'
in-memory tier (memory_tier.py), added to the real daemon's list by a
launcher, serves what DRAM and the disk let go, bit-exact, and shows in stats."""

from __future__ import annotations

from pathlib import Path

from kvcache import NUM_BLOCKS, attach_worker, prompt_keys, tier
from test_disk_tier_daemon import POOL_SLOTS, fill_rounds, load_and_check, wait_ready

LAUNCHER = str(Path(__file__).with_name("daemon_with_memory_tier.py"))


def test_a_third_tier_serves_what_dram_evicted(start_daemon, client_factory):
    daemon = start_daemon(launcher=LAUNCHER)
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=1)
    rounds = 3 * POOL_SLOTS // NUM_BLOCKS
    saved = fill_rounds(client, worker, tensors, rounds, 100, below="memory")
    assert tier(client.stats(), "memory").written_shards == rounds * NUM_BLOCKS
    for r in range(rounds):
        keys = prompt_keys(NUM_BLOCKS, prompt=r)
        assert wait_ready(client, engine, keys) == NUM_BLOCKS, f"round {r} did not come back"
        load_and_check(client, worker, tensors, keys, saved[r], 1000 * (r + 1))
    stats = client.stats()
    assert [t.name for t in stats.tiers] == ["dram", "memory"]
    assert tier(stats, "memory").promotions >= (rounds - 1) * NUM_BLOCKS - POOL_SLOTS


def test_under_the_disk_the_third_tier_serves_what_the_disk_dropped(start_daemon, client_factory, tmp_path):
    """The disk holds about one pool's worth; older rounds come back from the
    memory tier below it, newer ones from the disk: each tier is asked in turn.
    (Newest first: a block promoted from below is written to the disk again,
    which then drops the rounds it held.)"""
    daemon = start_daemon(launcher=LAUNCHER, disk_dir=str(tmp_path / "disk"), disk_size="12MiB")
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=2)
    rounds = 4 * POOL_SLOTS // NUM_BLOCKS
    saved = fill_rounds(client, worker, tensors, rounds, 100)
    assert tier(client.stats(), "disk").evicted_shards > 0
    for r in reversed(range(rounds)):
        keys = prompt_keys(NUM_BLOCKS, prompt=r)
        assert wait_ready(client, engine, keys) == NUM_BLOCKS, f"round {r} did not come back"
        load_and_check(client, worker, tensors, keys, saved[r], 1000 * (r + 1))
    stats = client.stats()
    assert [t.name for t in stats.tiers] == ["dram", "disk", "memory"]
    assert tier(stats, "disk").promotions > 0 and tier(stats, "memory").promotions > 0
    # A disk promotion can fail as the disk drops a segment the blocks promoted
    # from the memory tier push out: that block's next lookup finds it below.
    assert tier(stats, "memory").failed_promotions == 0
