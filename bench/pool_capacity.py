"""How much of the pool real models' blocks can use: each model alone, then
all of them sharing one pool.

    python bench/pool_capacity.py [--pool-size 256MiB] [--slot-size 2MiB]

A real kvdepotd (no GPU needed: CPU workers over the shared-memory transport)
is filled with blocks of each model's size for one rank until stores stop
taking new slots; usable capacity is the bytes of KV the pool then holds
(ready blocks x block bytes) over the pool's bytes. A worker whose block is
larger than a slot is refused at registration, and shows 0. The mix runs the
models' workers in turn against one pool.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kvdepotd import BenchDaemon  # noqa: E402

from kvdepot.client import KVDepotClient  # noqa: E402
from kvdepot.errors import KVDepotError  # noqa: E402
from kvdepot.keys import KEY_VERSION  # noqa: E402
from kvdepot.settings import parse_size  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def kv_block(layers: int, kv_heads: int, head_dim: int, tokens: int, tp: int = 1) -> int:
    """Bytes of one block of one rank: K and V, bf16."""
    return 2 * layers * (kv_heads // tp) * head_dim * tokens * 2


# (name, bytes of one block of one rank)
MODELS = [
    *((f"Llama-3.1-8B TP{tp}", kv_block(32, 8, 128, 16, tp)) for tp in (1, 2, 4, 8)),
    *((f"Llama-3.1-70B TP{tp}", kv_block(80, 8, 128, 16, tp)) for tp in (1, 2, 4, 8)),
    ("Qwen2.5-7B", kv_block(28, 4, 128, 16)),
    # MLA: one latent of 512 + 64 rope values a token and layer, 61 layers, 64-token blocks.
    ("DeepSeek-V3 (MLA)", 61 * 576 * 64 * 2),
    ("vLLM CPU default (Llama-3.1-8B, 128 tokens)", kv_block(32, 8, 128, 128)),
]


def fill(client: KVDepotClient, block_bytes: int, pool_bytes: int, tag: int):
    """Stores twice `pool_bytes` of distinct blocks of `block_bytes`; returns
    a function that counts those ready, or a refusal's reason."""
    batch = max(1, min(64, (64 * MiB) // block_bytes))
    cache = torch.zeros(batch, block_bytes // 2, dtype=torch.bfloat16)
    spec = dict(model=f"capacity-{tag}", kv_dtype="bfloat16", block_size=16, layout="block_major", tp_size=1,
                key_version=KEY_VERSION)
    try:
        worker = client.register_worker(spec, rank=0, tensors=[cache], block_dim=0)
    except KVDepotError as e:
        return str(e).split(":")[0]
    engine = client.register_engine(spec)
    keys: list[bytes] = []
    job = 0
    # Twice the blocks the pool could hold at best: the rest are evictions.
    while len(keys) * block_bytes < 2 * pool_bytes:
        chunk = [f"{tag}:{len(keys) + i}".encode().ljust(32, b".")[:32] for i in range(batch)]
        keys += chunk
        job += 1
        result = client.wait([client.submit_store(worker, tag * 100000 + job, chunk, list(range(batch)))], 60)
        if not next(iter(result.values())).ok:
            break
    return lambda: sum(client.lookup(engine, [key]).ready_blocks for key in keys)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-size", default="256MiB")
    parser.add_argument("--slot-size", default="2MiB")
    args = parser.parse_args()
    pool_bytes, slot_bytes = parse_size(args.pool_size), parse_size(args.slot_size)
    print(f"pool {pool_bytes / MiB:.0f} MiB, --slot-size {slot_bytes / MiB:g} MiB; usable capacity = KV bytes held "
          "/ pool bytes")
    print(f"{'model':<46} {'block':>10} {'blocks held':>12} {'usable':>12}")
    refusal = ""
    for tag, (name, block_bytes) in enumerate(MODELS):
        with BenchDaemon(args.pool_size, slot_bytes, pin="off") as daemon:
            daemon.wait_ready()
            client = KVDepotClient(daemon.socket, name="pool-capacity").connect(30)
            counted = fill(client, block_bytes, pool_bytes, tag)
            ready = 0 if isinstance(counted, str) else counted()
            client.close()
        shown = "0 (refused)" if isinstance(counted, str) else f"{ready * block_bytes / pool_bytes:.3f}"
        refusal = counted if isinstance(counted, str) else refusal
        print(f"{name:<46} {block_bytes / MiB:>6.3f} MiB {ready:>12} {shown:>12}", flush=True)
    if refusal:
        print(f"(refused: {refusal})")
    with BenchDaemon(args.pool_size, slot_bytes, pin="off") as daemon:
        daemon.wait_ready()
        client = KVDepotClient(daemon.socket, name="pool-capacity").connect(30)
        counts = [(fill(client, block_bytes, pool_bytes // len(MODELS), 100 + tag), block_bytes)
                  for tag, (_, block_bytes) in enumerate(MODELS)]
        held = sum(counted() * block_bytes for counted, block_bytes in counts if not isinstance(counted, str))
        stats = client.stats()
        client.close()
    print(f"{'all of them in one pool, in turn':<46} {'':>10} {'':>12} {held / pool_bytes:>12.3f}")
    print(f"the daemon's stats for the mix: {stats.kv_bytes / MiB:.0f} MiB of KV in "
          f"{stats.used_slots * slot_bytes / MiB:.0f} MiB of slots, fragmentation {stats.fragmentation:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
