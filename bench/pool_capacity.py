"""How much of the pool real models' blocks can use: each model alone, then
all of them sharing one pool.

    python bench/pool_capacity.py [--pool-size 256MiB] [--slot-size SIZE] [--compare ../previous-checkout]

A real kvdepotd (no GPU needed: CPU workers over the shared-memory transport)
is filled with blocks of each model's size for one rank until stores stop
taking new slots; usable capacity is the bytes of KV the pool then holds
(ready blocks x block bytes) over the pool's bytes. A worker whose block the
pool cannot hold is refused at registration, and shows 0. The mix runs the
models' workers in turn against one pool. With --compare, another source
tree's daemon (the previous version) is measured first, in the same run.
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
        result = next(iter(client.wait([client.submit_store(worker, tag * 100000 + job, chunk,
                                                             list(range(batch)))], 60).values()))
        if not result.ok:  # shown: a fill cut short would read as capacity lost
            print(f"  (a store of {block_bytes} B blocks failed after {len(keys) - batch} blocks: {result.error})",
                  file=sys.stderr, flush=True)
            break
    return lambda: sum(client.lookup(engine, [key]).ready_blocks for key in keys)


def connect_when_up(daemon) -> KVDepotClient:
    """A client, once the whole pool is up: the daemon serves with its first
    chunk, and a fill that outran the rest would count their slots as lost."""
    daemon.wait_pool()
    return KVDepotClient(daemon.socket, name="pool-capacity").connect(30)


def capacity(repo: Path, pool_size: str, slot_bytes: int | None) -> dict:
    """Each model alone, then the mix, with the daemon of source tree `repo`."""
    pool_bytes = parse_size(pool_size)
    alone = []
    for tag, (_, block_bytes) in enumerate(MODELS):
        with BenchDaemon(pool_size, slot_bytes, pin="off", repo=repo) as daemon:
            daemon.wait_ready()
            client = connect_when_up(daemon)
            counted = fill(client, block_bytes, pool_bytes, tag)
            alone.append(counted if isinstance(counted, str) else counted())
            client.close()
    with BenchDaemon(pool_size, slot_bytes, pin="off", repo=repo) as daemon:
        daemon.wait_ready()
        client = connect_when_up(daemon)
        counts = [(fill(client, block_bytes, pool_bytes // len(MODELS), 100 + tag), block_bytes)
                  for tag, (_, block_bytes) in enumerate(MODELS)]
        held = sum(counted() * block_bytes for counted, block_bytes in counts if not isinstance(counted, str))
        stats = client.stats()
        client.close()
    return dict(alone=alone, mix=held / pool_bytes, stats=stats)


def simulate(pool_bytes: int, slot_bytes: int) -> dict:
    """The same fills on the pool's allocator alone (host/free_runs.py, as the
    daemon cuts it for a pool of `pool_bytes`), with the
    index's rule for room (evict the oldest block until the store's run fits):
    node-scale pools, which this machine cannot hold in RAM."""
    from collections import deque

    from kvdepot.server.host.free_runs import FreeRuns
    from kvdepot.server.host.pool import extent_bytes

    num_slots = pool_bytes // slot_bytes
    extent = max(1, extent_bytes(pool_bytes) // slot_bytes)

    def run(fills) -> int:
        runs = FreeRuns(num_slots, chunk_slots=(1 << 30) // slot_bytes, extent_slots=extent)
        held: deque = deque()  # (slot, block bytes), oldest first
        for block_bytes, nbytes in fills:
            span = -(-block_bytes // slot_bytes)
            for _ in range(nbytes // block_bytes):
                while (slot := runs.allocate(None, span)) is None:
                    old, old_bytes = held.popleft()
                    runs.release(old, -(-old_bytes // slot_bytes))
                held.append((slot, block_bytes))
        return sum(b for _, b in held)

    alone = [run([(block_bytes, 2 * pool_bytes)]) / block_bytes for _, block_bytes in MODELS]
    mix = run([(block_bytes, pool_bytes // len(MODELS)) for _, block_bytes in MODELS]) / pool_bytes
    return dict(alone=[int(a) for a in alone], mix=mix)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-size", default="256MiB")
    parser.add_argument("--slot-size", default=None, help="the daemon's --slot-size (default: each tree's own)")
    parser.add_argument("--compare", type=Path, help="another source tree, measured first")
    parser.add_argument("--label", default="this", help="this tree's name in the table")
    parser.add_argument("--simulate", metavar="SIZE",
                        help="instead, fill a pool of SIZE on this tree's allocator alone (no daemon, no RAM)")
    args = parser.parse_args()
    if args.simulate:
        return print_simulation(parse_size(args.simulate), parse_size(args.slot_size or "64KiB"))
    pool_bytes = parse_size(args.pool_size)
    slot_bytes = parse_size(args.slot_size) if args.slot_size else None
    trees = ([("previous", args.compare.resolve())] if args.compare else []) + [(args.label, REPO)]
    results = [(name, capacity(repo, args.pool_size, slot_bytes)) for name, repo in trees]
    print(f"pool {pool_bytes / MiB:.0f} MiB; usable capacity = KV bytes held / pool bytes")
    for name, result in results:
        print(f"  {name}: slots of {result['stats'].pool.slot_bytes / KiB:g} KiB")
    print(f"{'model':<46} {'block':>10}" + "".join(f" {name + ' held':>14} {'usable':>8}" for name, _ in results))
    refusals = set()
    for i, (model, block_bytes) in enumerate(MODELS):
        cells = ""
        for _, result in results:
            got = result["alone"][i]
            if isinstance(got, str):
                refusals.add(got)
                cells += f" {'refused':>14} {0:>8.3f}"
            else:
                cells += f" {got:>14} {got * block_bytes / pool_bytes:>8.3f}"
        print(f"{model:<46} {block_bytes / MiB:>6.3f} MiB{cells}", flush=True)
    print(f"{'all of them in one pool, in turn':<46} {'':>10}" + "".join(
        f" {'':>14} {result['mix']:>8.3f}" for _, result in results))
    for refusal in sorted(refusals):
        print(f"(refused: {refusal})")
    for name, result in results:
        stats = result["stats"]
        print(f"{name}: the daemon's stats for the mix: {stats.kv_bytes / MiB:.0f} MiB of KV in "
              f"{stats.used_slots * stats.pool.slot_bytes / MiB:.0f} MiB of slots, "
              f"fragmentation {stats.fragmentation:.2f}")
    return 0


def print_simulation(pool_bytes: int, slot_bytes: int) -> int:
    result = simulate(pool_bytes, slot_bytes)
    print(f"simulated pool {pool_bytes / 2**30:.0f} GiB of {slot_bytes / KiB:g} KiB slots (the allocator alone); "
          "usable capacity = KV bytes held / pool bytes")
    print(f"{'model':<46} {'block':>10} {'blocks held':>12} {'usable':>8}")
    for (model, block_bytes), held in zip(MODELS, result["alone"]):
        print(f"{model:<46} {block_bytes / MiB:>6.3f} MiB {held:>12} {held * block_bytes / pool_bytes:>8.3f}",
              flush=True)
    print(f"{'all of them in one pool, in turn':<46} {'':>10} {'':>12} {result['mix']:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
