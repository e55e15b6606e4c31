"""Records the GPU seals (`pytest -m cuda` on a GPU machine): the native lane's
CUDA stores carry host/shard_hash.py's hash of their bytes, which the GPU
computed as it gathered them (transports/hash_kernel.py). It is the hash the
CPU computes of the same bytes; a restarted daemon adopts those blocks and
loads them back bit-exact, and a byte changed in a slot since is caught."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import wait_until  # noqa: E402
from kvcache import block_of, make_kv_cache, namespace, prompt_keys  # noqa: E402
from test_warm_restart import RECORD_BYTES, dram, flip  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SLOT = 16 * 1024


@pytest.mark.parametrize("length", [8, 4096, 4104, 12288, 16384])
def test_the_gpus_hash_of_each_row_is_the_cpus(length):
    from kvdepot.server.host import shard_hash
    from kvdepot.server.transports import hash_kernel

    rows = 5
    buffer = torch.randint(0, 256, (rows * SLOT,), dtype=torch.uint8, device="cuda")
    keys = hash_kernel.keys_on(buffer.device)
    scratch = torch.zeros(rows * hash_kernel.blocks_per_row(SLOT), dtype=torch.int64, device="cuda")
    dest = torch.zeros(rows, dtype=torch.int64, device="cuda")
    hash_kernel.hash_rows(buffer, rows, SLOT, length, keys, scratch, dest)
    torch.cuda.synchronize()
    host = buffer.cpu().numpy()
    for r in range(rows):
        want = shard_hash.gpu_hash(host[r * SLOT : (r + 1) * SLOT].tobytes(), length)
        assert int(dest[r]) & (2**64 - 1) == want, f"row {r}"


def slots_of(pool, keys: list[bytes], slot_bytes: int = SLOT) -> dict[bytes, int]:
    data = pool.read_bytes()
    num_slots = (len(data) - 4096) // (slot_bytes + RECORD_BYTES)
    found = {}
    for slot in range(num_slots):
        at = num_slots * slot_bytes + slot * RECORD_BYTES
        key = data[at + 40 : at + 72]
        if key in keys:
            flags = int.from_bytes(data[at + 12 : at + 16], "little")
            found[key] = (slot, flags)
    return found


def store_sealed_and_stop(daemon, client, worker, keys: list[bytes], slot_bytes: int = SLOT):
    """Stores `keys` from blocks 0.. of `worker`, waits for their records, stops
    the daemon and checks each record was sealed with the GPU's hash: (the
    pool file, each key's (slot, flags))."""
    job = client.submit_store(worker, 1, keys, list(range(len(keys))))
    assert client.wait([job], 30)[job].ok
    wait_until(lambda: dram(client.stats()).written_shards >= len(keys), what=f"{len(keys)} records sealed")
    assert daemon.stop() == 0
    [pool] = Path(daemon.options["pool_dir"]).glob("*.pool")
    slots = slots_of(pool, keys, slot_bytes)
    assert len(slots) == len(keys) and all(flags & 2 for _, flags in slots.values()), (
        "records sealed with the GPU's hash")
    return pool, slots


def test_blocks_the_gpu_sealed_come_back_after_a_restart_and_a_changed_byte_is_caught(start_daemon, client_factory):
    daemon = start_daemon(pin="on", pool_dir="/dev/shm", pool_size="64MiB", slot_size="16KiB", lane="native")
    client = client_factory(daemon, backoff_max=0.5)
    tensors, block_dim = make_kv_cache("per_layer", seed=61)
    tensors = [t.cuda() for t in tensors]
    worker = client.register_worker(namespace("per_layer"), rank=0, tensors=tensors, block_dim=block_dim)
    engine = client.register_engine(namespace("per_layer"))
    keys = prompt_keys(12, prompt=610)
    pool, slots = store_sealed_and_stop(daemon, client, worker, keys)
    flip(pool, slots[keys[4]][0] * SLOT + 500)  # a byte of block 4's KV
    daemon.start()
    assert client.wait_connected(15)
    tier = dram(client.stats())
    assert tier.recovered_shards == 11 and dict(tier.discarded) == {"data_hash": 1}
    assert client.lookup(engine, keys).ready_blocks == 4
    assert client.lookup(engine, keys[5:]).ready_blocks == 7
    load = client.submit_load(worker, 2, keys[:4], list(range(60, 64)))
    assert client.wait([load], 30)[load].ok
    for i in range(4):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 60 + i)):
            assert torch.equal(src.cpu().view(torch.int16), dst.cpu().view(torch.int16))


@pytest.mark.parametrize("staging", ["128MiB", "8MiB"])
def test_a_big_store_alone_is_sealed_with_its_bytes_hash(start_daemon, client_factory, staging):
    """A store of 1 MiB blocks takes both streams: its hash runs beside its
    transfers, and alone it starts with a small chunk (24 MiB: 3 blocks, then
    21; with 8 MiB buffers no small one, three chunks of 8 through the two
    buffers in turn). Each record carries the hash of its slot's bytes: a
    restarted daemon adopts every block, discarding none, and loads them back
    bit-exact."""
    mib = 1 << 20
    daemon = start_daemon(pin="on", pool_dir="/dev/shm", pool_size="64MiB", slot_size="1MiB", lane="native",
                          staging_bytes=str(int(staging[:-3]) * mib))
    client = client_factory(daemon, backoff_max=0.5)
    generator = torch.Generator().manual_seed(62)
    # Per layer [2, blocks, 16 tokens, 32 heads, 128]: pages of 128 KiB, 1 MiB a block.
    tensors = [torch.randn(2, 64, 16, 32, 128, generator=generator).to(torch.bfloat16).cuda() for _ in range(4)]
    ns = namespace("per_layer", model="big-blocks")
    worker = client.register_worker(ns, rank=0, tensors=tensors, block_dim=1)
    keys = prompt_keys(24, prompt=620)
    store_sealed_and_stop(daemon, client, worker, keys, mib)
    daemon.start()
    assert client.wait_connected(15)
    tier = dram(client.stats())
    assert tier.recovered_shards == 24 and not dict(tier.discarded)
    load = client.submit_load(worker, 2, keys, list(range(40, 64)))
    assert client.wait([load], 30)[load].ok
    for i in range(24):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 40 + i)):
            assert torch.equal(src.cpu().view(torch.int16), dst.cpu().view(torch.int16))
