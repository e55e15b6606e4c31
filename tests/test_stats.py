"""`kvdepot stats` reports exactly what a known sequence of requests caused."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import lane_env, subprocess_env
from kvcache import attach_worker, dram, namespace, prompt_keys

BLOCK_BYTES = 16 * 1024


def cli(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvdepot.client.cli", "--socket", daemon.socket, *args],
        capture_output=True, text=True, env=subprocess_env(), timeout=60,
    )


def test_stats_json_counts_exactly_what_happened(start_daemon, client_factory):
    daemon = start_daemon(pool_size="128KiB")  # 8 slots
    client = client_factory(daemon, name="stats-test")
    worker, engine, tensors = attach_worker(client, seed=6)
    keys = prompt_keys(10, prompt=30)

    assert client.lookup(engine, keys).ready_blocks == 0          # 10 misses
    job = client.submit_store(worker, 1, keys[:6], list(range(6)))  # 6 stored
    assert client.wait([job], 10)[job].ok
    job = client.submit_store(worker, 2, keys[4:10], list(range(4, 10)))  # 2 already, 4 stored, 2 evicted
    assert client.wait([job], 10)[job].ok
    assert client.lookup(engine, keys).ready_blocks == 0          # keys[0:2] evicted: 10 misses
    assert client.lookup(engine, keys[2:]).ready_blocks == 8      # 8 hits
    job = client.submit_load(worker, 3, keys[2:5], [40, 41, 42])  # 3 loaded
    assert client.wait([job], 10)[job].ok

    proc = cli(daemon, "stats", "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    totals = stats["totals"]
    expected = {
        "lookups": 3,
        "hit_blocks": 8,
        "miss_blocks": 20,
        "stored_blocks": 10,
        "stored_bytes": 10 * BLOCK_BYTES,
        "loaded_blocks": 3,
        "loaded_bytes": 3 * BLOCK_BYTES,
        "evicted_blocks": 2,
        "failed_jobs": 0,
    }
    assert {k: totals[k] for k in expected} == expected
    assert totals["store_gbps"] > 0 and totals["load_gbps"] > 0
    assert stats["used_slots"] == 8 and stats["pinned_slots"] == 0
    assert stats["occupancy"] == 1.0
    assert stats["pool"]["num_slots"] == 8 and stats["eviction_policy"] == "lru"
    [ns_stats] = stats["namespaces"]
    assert ns_stats["ready_blocks"] == 8 and ns_stats["used_slots"] == 8
    assert {k: ns_stats["counters"][k] for k in expected} == expected
    [me] = stats["clients"]  # the CLI itself opens no session
    assert me["client_name"] == "stats-test" and me["workers"] == 1
    assert {k: me["counters"][k] for k in expected if k != "evicted_blocks"} == {
        k: v for k, v in expected.items() if k != "evicted_blocks"
    }

    table = cli(daemon, "stats")
    assert table.returncode == 0
    assert "8 blocks hit, 20 missed" in table.stdout
    assert ns_stats["name"] in table.stdout and "stats-test" in table.stdout


def test_clear_and_health_from_the_cli(daemon, client_factory):
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=7)
    other = client.register_engine(namespace("per_layer", model="other-model"))
    keys = prompt_keys(5, prompt=31)
    job = client.submit_store(worker, 1, keys, list(range(5)))
    assert client.wait([job], 10)[job].ok

    health = cli(daemon, "health")
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"

    unknown = cli(daemon, "clear", "no-such-namespace")
    assert unknown.returncode == 1 and "no namespace 'no-such-namespace'" in unknown.stderr
    cleared = cli(daemon, "clear", engine.namespace_name)
    assert cleared.returncode == 0, cleared.stderr
    assert "cleared 5 block(s)" in cleared.stdout
    assert client.lookup(engine, keys).ready_blocks == 0
    assert client.lookup(other, keys).ready_blocks == 0
    assert client.stats().used_slots == 0


def test_cli_says_clearly_when_no_daemon_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.client.cli", "--socket", str(tmp_path / "none.sock"),
         "--timeout", "1", "health"],
        capture_output=True, text=True, env=subprocess_env(), timeout=60,
    )
    assert proc.returncode == 1
    assert "none.sock" in proc.stderr


WEDGED = """
import asyncio, sys
import grpc
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc

class Wedged(pb_grpc.KVDepotServicer):
    async def Attach(self, request, context):
        await asyncio.Event().wait()  # answers HTTP/2, never starts the session
        yield

async def main():
    server = grpc.aio.server()
    pb_grpc.add_KVDepotServicer_to_server(Wedged(), server)
    server.add_insecure_port("unix:" + sys.argv[1])
    await server.start()
    print("up", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def test_cli_gives_up_on_a_wedged_daemon_after_its_timeout(tmp_path):
    sock = str(tmp_path / "wedged.sock")
    wedged = subprocess.Popen([sys.executable, "-c", WEDGED, sock], stdout=subprocess.PIPE, text=True,
                              env=subprocess_env())
    try:
        assert wedged.stdout.readline() == "up\n"
        for args in (["stats"], ["stats", "--json"], ["clear", "--all"]):
            started = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "kvdepot.client.cli", "--socket", sock, "--timeout", "2", *args],
                capture_output=True, text=True, env=subprocess_env(), timeout=60,
            )
            assert proc.returncode == 1, (args, proc.stderr)
            assert "did not start a session within 2 s (--timeout)" in proc.stderr, proc.stderr
            assert time.monotonic() - started < 20  # the interpreter's start, then 2 s
    finally:
        wedged.kill()
        wedged.wait(10)


@pytest.mark.parametrize("lane", ["python", "native"])
def test_stats_say_what_the_dram_holds_by_namespace_and_block_size(start_daemon, client_factory, lane):
    # 16 KiB slots in extents of 4; a per-layer block fills one, an MLA block
    # (one latent tensor a layer) fills half of one.
    daemon = start_daemon(pool_size="1MiB", env=lane_env(lane))
    client = client_factory(daemon, name="holds-test")
    full, _, _ = attach_worker(client, seed=1)
    half, _, _ = attach_worker(client, seed=2, layout="mla")
    for worker, n, prompt in ((full, 10, 40), (half, 20, 41)):
        job = client.submit_store(worker, prompt, prompt_keys(n, prompt=prompt), list(range(n)))
        assert client.wait([job], 10)[job].ok

    proc = cli(daemon, "stats", "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    kv = 10 * BLOCK_BYTES + 20 * BLOCK_BYTES // 2
    assert int(stats["kv_bytes"]) == kv
    assert int(stats["free_bytes"]) == (64 - 30) * BLOCK_BYTES
    # 30 one-slot runs fill 7 extents and half an 8th: the other 8 are free for any size.
    assert int(stats["free_any_size_bytes"]) == 8 * 4 * BLOCK_BYTES
    assert abs(stats["fragmentation"] - (1 - kv / (30 * BLOCK_BYTES))) < 1e-9
    by_name = {ns["name"]: ns for ns in stats["namespaces"]}
    [mla] = [ns for name, ns in by_name.items() if "mla" in name]
    assert int(mla["block_bytes"]) == BLOCK_BYTES // 2 and int(mla["used_bytes"]) == 20 * BLOCK_BYTES // 2
    sizes = {int(b["block_bytes"]): (int(b["used_slots"]), int(b["used_bytes"])) for b in stats["block_sizes"]}
    assert sizes == {BLOCK_BYTES // 2: (20, 10 * BLOCK_BYTES), BLOCK_BYTES: (10, 10 * BLOCK_BYTES)}

    text = cli(daemon, "stats").stdout
    assert "of slots (33% of those slots' bytes empty: fragmentation)" in text
    assert "blocks of 8 KiB: 20 slots" in text and "1 slot a block, 50% full" in text
    assert " GiB free, 0.00 GiB of it for blocks of any size" in text


def test_the_dram_tier_counts_shards_not_slots(start_daemon, client_factory):
    # 4 KiB slots: a per-layer block of 16 KiB takes four.
    daemon = start_daemon(pool_size="1MiB", slot_size="4KiB")
    client = client_factory(daemon)
    worker, _, _ = attach_worker(client, seed=1)
    job = client.submit_store(worker, 1, prompt_keys(10, prompt=50), list(range(10)))
    assert client.wait([job], 10)[job].ok
    stats = client.stats()
    assert stats.used_slots == 40
    assert dram(stats).shards == 10 and dram(stats).bytes == 40 * 4096
