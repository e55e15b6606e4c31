"""A restarted daemon adopts the pool its predecessor left: the blocks come
back, and nothing that was not committed, or that changed since, is served."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env, wait_until
from kvcache import NUM_BLOCKS, attach_worker, block_of, dram, prompt_keys

WORKER = str(Path(__file__).resolve().parent / "worker_proc.py")
RECORD_BYTES = 128
SLOT_BYTES = 16 * 1024  # the test daemons' slot size


def run_worker(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, WORKER, *args], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def store(client, worker, keys, job_id=1):
    job = client.submit_store(worker, job_id, keys, list(range(len(keys))))
    assert client.wait([job], 10)[job].ok


def sealed(client, n):
    wait_until(lambda: dram(client.stats()).written_shards >= n, what=f"{n} records sealed")


def stored_and_stopped(start_daemon, client_factory, seed: int, prompt: int):
    """A daemon that stored 8 blocks, sealed them and stopped; and its client."""
    daemon = start_daemon()
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=seed)
    store(client, worker, prompt_keys(8, prompt=prompt))
    sealed(client, 8)
    assert daemon.stop() == 0
    return daemon, client


def slot_of(pool: Path, key: bytes) -> int:
    """The slot whose record names `key` (record: 8+4+4+8+16 bytes, then the key)."""
    data = pool.read_bytes()
    num_slots = (len(data) - 4096) // (SLOT_BYTES + RECORD_BYTES)
    records = num_slots * SLOT_BYTES
    for slot in range(num_slots):
        at = records + slot * RECORD_BYTES + 40
        if data[at : at + 32] == key:
            return slot
    raise AssertionError("no record names the key")


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_blocks_stored_before_a_sigterm_load_bit_exact_after_the_restart(daemon, tmp_path):
    a_out, b_before, b_out = tmp_path / "a.pt", tmp_path / "b0.pt", tmp_path / "b.pt"
    assert run_worker("store", "--socket", daemon.socket, "--seed", "1", "--blocks", "64", "--out", str(a_out))["ok"]
    assert daemon.stop() == 0
    daemon.start()
    assert "adopted 64 block(s) (64 slots)" in daemon.log()
    loaded = run_worker("load", "--socket", daemon.socket, "--seed", "2", "--blocks", "64", "--first-block", "50",
                        "--before", str(b_before), "--out", str(b_out))
    assert loaded["ok"] and loaded["ready"] == 64
    a, b = torch.load(a_out), torch.load(b_out)
    for i in range(64):
        for src, dst in zip(block_of(a, "per_layer", i), block_of(b, "per_layer", 50 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16)), f"block {i} differs"


def test_a_daemon_killed_idle_comes_back_warm_and_counts_what_it_adopted(start_daemon, client_factory):
    daemon = start_daemon()
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=3)
    keys = prompt_keys(16, prompt=1)
    store(client, worker, keys)
    sealed(client, 16)
    daemon.kill()
    daemon.start()
    assert client.wait_connected(15)
    assert client.lookup(engine, keys).ready_blocks == 16
    tier = dram(client.stats())
    assert tier.recovered_shards == 16 and dict(tier.discarded) == {}
    assert tier.shards == 16 and tier.capacity_bytes == 4 << 20


def test_a_corrupted_slot_and_a_torn_record_are_discarded_never_served(start_daemon, client_factory):
    daemon = start_daemon()
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=4)
    keys = prompt_keys(16, prompt=2)
    store(client, worker, keys)
    sealed(client, 16)
    assert daemon.stop() == 0
    [pool] = daemon.folder.glob("*.pool")
    flip(pool, slot_of(pool, keys[5]) * SLOT_BYTES + 1000)  # a byte of block 5's KV
    num_slots = (pool.stat().st_size - 4096) // (SLOT_BYTES + RECORD_BYTES)
    flip(pool, num_slots * SLOT_BYTES + slot_of(pool, keys[9]) * RECORD_BYTES + 64)  # block 9's record
    daemon.start()
    assert client.wait_connected(15)
    tier = dram(client.stats())
    assert dict(tier.discarded) == {"data_hash": 1, "torn": 1}
    assert tier.recovered_shards == 14
    # And as the operator's CLI shows it.
    cli = subprocess.run([sys.executable, "-m", "kvdepot.client.cli", "--socket", daemon.socket, "stats", "--json"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert cli.returncode == 0, cli.stderr
    [shown] = [t for t in json.loads(cli.stdout)["tiers"] if t["name"] == "dram"]
    assert shown["discarded"] == {"data_hash": 1, "torn": 1} and shown["recovered_shards"] == 14
    assert client.lookup(engine, keys).ready_blocks == 5
    assert client.lookup(engine, keys[6:9]).ready_blocks == 3
    assert client.lookup(engine, keys[9:10]).ready_blocks == 0
    assert client.lookup(engine, keys[10:]).ready_blocks == 6
    # What does come back is byte for byte what was stored.
    job = client.submit_load(worker, 2, keys[:5], list(range(40, 45)))
    assert client.wait([job], 10)[job].ok
    for i in range(5):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 40 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16))


def test_a_store_cut_by_kill_9_is_not_served_after_the_restart(start_held_daemon, client_factory):
    daemon = start_held_daemon()
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=5)
    done, cut = prompt_keys(8, prompt=3), prompt_keys(8, prompt=4)
    store(client, worker, done)
    sealed(client, 8)
    daemon.hold(7)
    client.submit_store(worker, 7, cut, list(range(8, 16)))
    wait_until(lambda: client.stats().pinned_slots == 8, what="the store in flight")
    daemon.kill()
    daemon.release(7)
    daemon.start()
    assert client.wait_connected(15)
    assert client.lookup(engine, done).ready_blocks == 8
    assert client.lookup(engine, cut).ready_blocks == 0
    assert client.stats().used_slots == 8


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"pool_size": "8MiB"}, "it has 256 slots of 16384 bytes, --pool-size asks for 512 of those"),
        ({"fresh": ""}, "--fresh was given"),
    ],
)
def test_a_pool_of_another_layout_or_fresh_starts_empty_and_says_why(start_daemon, client_factory, change, reason):
    daemon = start_daemon()
    client = client_factory(daemon, backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=6)
    keys = prompt_keys(8, prompt=5)
    store(client, worker, keys)
    sealed(client, 8)
    assert daemon.stop() == 0
    daemon.options.update(change)
    if "fresh" in change:  # a flag without a value
        daemon.options.pop("fresh")
        daemon.args = (lambda args: lambda: [*args(), "--fresh"])(daemon.args)
    daemon.start()
    assert reason in daemon.log()
    assert len(list(daemon.folder.glob("*.pool"))) == 1
    assert client.wait_connected(15)
    worker, engine, tensors = attach_worker(client, seed=6)
    assert client.lookup(engine, keys).ready_blocks == 0
    assert client.stats().used_slots == 0


def test_a_kept_pool_of_another_slot_size_is_adopted_with_its_own(start_daemon, client_factory):
    """--slot-size is a hint for a new pool: an upgrade that changes it (2 MiB
    was the default before blocks of any size) keeps the blocks it had."""
    daemon, client = stored_and_stopped(start_daemon, client_factory, seed=8, prompt=7)
    daemon.options["slot_size"] = "4KiB"
    daemon.start()
    assert "has slots of 16384 bytes (--slot-size asks for 4096 for a new pool): adopted with its own" in daemon.log()
    assert client.wait_connected(15)
    stats = client.stats()
    assert stats.pool.slot_bytes == 16384 and dram(stats).recovered_shards == 8
    worker, engine, tensors = attach_worker(client, seed=8)
    assert client.lookup(engine, prompt_keys(8, prompt=7)).ready_blocks == 8


def test_a_pool_file_others_could_write_is_not_adopted(start_daemon, client_factory):
    daemon, client = stored_and_stopped(start_daemon, client_factory, seed=7, prompt=6)
    [pool] = daemon.folder.glob("*.pool")
    # As a file another user planted, or one whose mode was opened up: its
    # bytes could have been written by anyone, and would reach the GPUs.
    os.chmod(pool, 0o620)
    daemon.start()
    assert "not to this user alone" in daemon.log()
    assert client.wait_connected(15)
    assert client.stats().used_slots == 0
    [new] = daemon.folder.glob("*.pool")
    assert new.stat().st_mode & 0o777 == 0o600


def test_a_namespace_catalog_others_could_write_is_not_trusted(start_daemon, client_factory):
    daemon, client = stored_and_stopped(start_daemon, client_factory, seed=9, prompt=8)
    [catalog] = daemon.folder.glob("*.namespaces.json")
    os.chmod(catalog, 0o666)  # as one another user put in a shared /dev/shm first
    daemon.start()
    assert "is not this user's alone" in daemon.log()
    assert client.wait_connected(15)
    tier = dram(client.stats())
    assert tier.recovered_shards == 0 and dict(tier.discarded) == {"unknown_namespace": 8}
    assert client.stats().used_slots == 0


def test_a_pool_file_of_another_uid_is_not_adopted(start_daemon, client_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another uid")
    daemon, client = stored_and_stopped(start_daemon, client_factory, seed=8, prompt=7)
    [pool] = daemon.folder.glob("*.pool")
    os.chown(pool, 65534, 65534)  # mode 0600 still, but nobody's
    daemon.start()
    assert "belongs to uid 65534" in daemon.log()
    assert client.wait_connected(15)
    assert client.stats().used_slots == 0


def test_the_header_names_format_slot_size_and_slots(daemon):
    daemon.stop()
    [pool] = daemon.folder.glob("*.pool")
    with open(pool, "rb") as f:
        f.seek(-4096, os.SEEK_END)
        magic, version, key_version, slot_bytes, num_slots, size, kept_at, address = struct.unpack(
            "<8sIIQQQd256s", f.read(304))
    assert (magic, slot_bytes, num_slots, size) == (b"KVDPOOL2", SLOT_BYTES, 256, pool.stat().st_size)
    assert address.rstrip(b"\0").decode() == "unix:" + daemon.socket and kept_at > 0
    daemon.start()


def test_a_kept_block_never_loads_into_a_worker_of_another_layout(start_daemon, client_factory):
    """The kept pool's catalog remembers each rank's layout: after the restart a
    worker of the same namespace with smaller blocks (2 layers instead of 4) is
    refused at registration, as it would have been before the restart."""
    from kvcache import BLOCK_SIZE, HEAD_DIM, KV_HEADS, namespace

    from kvdepot.errors import InvalidArgument

    daemon, client = stored_and_stopped(start_daemon, client_factory, seed=10, prompt=9)
    daemon.start()
    assert client.wait_connected(15)
    tensors = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(InvalidArgument, match="registered with another layout"):
        client.register_worker(namespace("per_layer"), rank=0, tensors=tensors, block_dim=1)
