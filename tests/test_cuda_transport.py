"""The CUDA transport through the real daemon: `pytest -m cuda` on a GPU machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import subprocess_env, wait_until  # noqa: E402
from kvcache import NUM_BLOCKS, block_of, make_kv_cache, namespace, prompt_keys  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORKER = str(Path(__file__).resolve().parent / "worker_proc.py")
# Runs a daemon whose stores do not wait for the compute (injected by the test).
WITHOUT_COMPUTE_WAIT = str(Path(__file__).resolve().parent / "daemon_without_compute_wait.py")


def gpu_daemon(start_daemon, **options):
    # Pinning needs shared memory: the pool goes in /dev/shm (a folder of its own there, see conftest).
    options = {"slot_size": "16KiB", **options}
    return start_daemon(pin="on", pool_dir="/dev/shm", pool_size="64MiB", **options)


def gpu_worker(client, seed: int):
    """A random per-layer KV cache on the GPU, registered as rank 0."""
    tensors, block_dim = make_kv_cache("per_layer", seed=seed)
    tensors = [t.cuda() for t in tensors]
    return client.register_worker(namespace("per_layer"), rank=0, tensors=tensors, block_dim=block_dim), tensors


def run_worker(*args: str) -> dict:
    proc = subprocess.run([sys.executable, WORKER, *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def same(a, b) -> bool:
    return torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                       b.view(torch.uint8) if b.dtype != torch.uint8 else b)


# The default copies; staging buffers of 4 slots, so that a job is many chunks
# and the ring of buffers wraps inside one job; the kernel-only mode; and both
# with 6 KiB slots, where a 16 KiB block takes a run of 3 (8 KiB ones 2) and a
# staging row is a run, not a slot.
COPY_MODES = {
    "dma": {},
    "dma-small-staging": {"staging_bytes": str(4 * 16384)},
    "kernel": {"copy_mode": "kernel"},
    "dma-runs": {"slot_size": "6KiB", "staging_bytes": str(4 * 16384)},
    "kernel-runs": {"copy_mode": "kernel", "slot_size": "6KiB"},
}


@pytest.mark.parametrize("mode", list(COPY_MODES))
@pytest.mark.parametrize("layout", ["per_layer", "block_major", "mla", "group1"])
def test_gpu_blocks_round_trip_bit_exact_between_processes(start_daemon, tmp_path, layout, mode):
    daemon = gpu_daemon(start_daemon, **COPY_MODES[mode])
    a_out, b_before, b_out = tmp_path / "a.pt", tmp_path / "b0.pt", tmp_path / "b.pt"
    stored = run_worker("store", "--socket", daemon.socket, "--layout", layout, "--device", "cuda",
                        "--seed", "1", "--blocks", "64", "--first-block", "0", "--out", str(a_out))
    assert stored["ok"], stored
    loaded = run_worker("load", "--socket", daemon.socket, "--layout", layout, "--device", "cuda",
                        "--seed", "2", "--blocks", "64", "--first-block", "50",
                        "--before", str(b_before), "--out", str(b_out))
    assert loaded["ok"] and loaded["ready"] == 64, loaded
    a, before, b = torch.load(a_out), torch.load(b_before), torch.load(b_out)
    for i in range(64):
        for src, dst in zip(block_of(a, layout, i), block_of(b, layout, 50 + i)):
            assert same(src, dst), f"block {i} differs"
    for block_id in [*range(0, 50), *range(114, NUM_BLOCKS)]:
        for orig, now in zip(block_of(before, layout, block_id), block_of(b, layout, block_id)):
            assert same(orig, now), f"block {block_id} was touched"


def test_two_kv_cache_groups_with_different_page_sizes_in_one_worker(start_daemon, client_factory):
    daemon = gpu_daemon(start_daemon)
    client = client_factory(daemon)
    workers = []
    for group, layout in enumerate(("per_layer", "group1")):
        tensors, block_dim = make_kv_cache(layout, seed=20 + group)
        tensors = [t.cuda() for t in tensors]
        ns = dict(namespace(layout), kv_group=group)
        workers.append((client.register_worker(ns, rank=0, tensors=tensors, block_dim=block_dim), tensors, layout))
    keys = prompt_keys(32, prompt=90)
    for job, (worker, _, _) in enumerate(workers):
        client.submit_store(worker, job, keys, list(range(32)))
    assert all(r.ok for r in client.wait([0, 1], 30).values())
    for job, (worker, _, _) in enumerate(workers):
        client.submit_load(worker, 10 + job, keys, list(range(64, 96)))
    assert all(r.ok for r in client.wait([10, 11], 30).values())
    for _worker, tensors, layout in workers:
        for i in range(32):
            for src, dst in zip(block_of(tensors, layout, i), block_of(tensors, layout, 64 + i)):
                assert same(src, dst)


def write_late_then_store(client, worker, tensors, keys, value: float, job_id: int):
    """A kernel that spins, then writes the blocks; the store is submitted at once."""
    torch.cuda._sleep(100_000_000)  # some tens of ms on the current stream
    for t in tensors:
        t[:, :8].fill_(value)
    client.submit_store(worker, job_id, keys, list(range(8)))


def corrupt_stores(daemon, client_factory, tries: int, reuse: str | None = None) -> int:
    """Stores blocks a late kernel writes, loads them back and counts the tries
    whose loaded blocks are not what that kernel wrote.

    reuse: after submitting the store, the blocks go to another request (are
    overwritten), either after waiting for the store ("after_flush", as on
    preemption) or without waiting ("without_flush").
    """
    client = client_factory(daemon)
    worker, tensors = gpu_worker(client, seed=30)
    corrupt = 0
    for attempt in range(tries):
        keys = prompt_keys(8, prompt=1000 + attempt)
        value = float(attempt + 1)
        store, load = 2 * attempt, 2 * attempt + 1
        write_late_then_store(client, worker, tensors, keys, value, job_id=store)
        if reuse == "after_flush":
            assert client.wait([store], 30)[store].ok
        if reuse:
            for t in tensors:
                t[:, :8].fill_(-1.0)
        if reuse != "after_flush":
            assert client.wait([store], 30)[store].ok
        client.submit_load(worker, load, keys, list(range(100, 108)))
        assert client.wait([load], 30)[load].ok
        torch.cuda.synchronize()
        corrupt += any(not bool((t[:, 100:108] == value).all()) for t in tensors)
    return corrupt


def test_a_store_waits_for_the_compute_that_wrote_the_blocks(start_daemon, client_factory):
    assert corrupt_stores(gpu_daemon(start_daemon), client_factory, tries=30) == 0


def test_without_the_event_wait_the_same_test_sees_corruption(start_daemon, client_factory):
    assert corrupt_stores(gpu_daemon(start_daemon, launcher=WITHOUT_COMPUTE_WAIT), client_factory, tries=5) > 0


def test_a_flushed_store_is_not_hurt_by_reusing_its_blocks(start_daemon, client_factory):
    assert corrupt_stores(gpu_daemon(start_daemon), client_factory, tries=30, reuse="after_flush") == 0


def test_reusing_blocks_without_the_flush_corrupts_the_store(start_daemon, client_factory):
    assert corrupt_stores(gpu_daemon(start_daemon), client_factory, tries=5, reuse="without_flush") > 0


def test_kill_9_of_a_worker_while_its_copies_run(start_daemon, client_factory, tmp_path):
    daemon = gpu_daemon(start_daemon)
    proc = subprocess.Popen([sys.executable, WORKER, "hang-store", "--socket", daemon.socket,
                             "--device", "cuda", "--blocks", "32", "--spin"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    survivor = client_factory(daemon, name="survivor")
    assert survivor.stats().open_ipc_mappings >= 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)

    def cleaned():
        stats = survivor.stats()
        return stats if stats.open_ipc_mappings == 0 and stats.pinned_slots == 0 else None

    stats = wait_until(cleaned, timeout=30, what="the killed worker's mappings closed")
    assert stats.totals.failed_jobs == 1 and daemon.running
    # The daemon reports what it holds on the GPU: its context, streams and staging.
    [gpu] = stats.gpus
    assert gpu.daemon_memory_bytes > 100 << 20, gpu
    # A new worker is served.
    worker, tensors = gpu_worker(survivor, seed=32)
    keys = prompt_keys(16, prompt=3000)
    survivor.submit_store(worker, 1, keys, list(range(16)))
    assert survivor.wait([1], 30)[1].ok
    survivor.submit_load(worker, 2, keys, list(range(64, 80)))
    assert survivor.wait([2], 30)[2].ok
    torch.cuda.synchronize()
    for i in range(16):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 64 + i)):
            assert same(src, dst)


def test_jobs_whose_slots_cross_two_pinned_registrations(start_daemon, client_factory):
    # 1 MiB registrations of 16 KiB slots: a 100-block job spans two of them.
    daemon = gpu_daemon(start_daemon, pin_chunk_bytes=str(1 << 20))
    client = client_factory(daemon)
    (a, source), (b, target) = gpu_worker(client, seed=40), gpu_worker(client, seed=41)
    keys = prompt_keys(100, prompt=4000)
    client.submit_store(a, 1, keys, list(range(100)))
    assert client.wait([1], 30)[1].ok
    client.submit_load(b, 2, keys, list(range(28, 128)))
    assert client.wait([2], 30)[2].ok
    torch.cuda.synchronize()
    for i in range(100):
        for src, dst in zip(block_of(source, "per_layer", i), block_of(target, "per_layer", 28 + i)):
            assert same(src, dst), f"block {i} differs"


@pytest.mark.parametrize("mode", list(COPY_MODES))
def test_stores_and_loads_at_once_stay_bit_exact(start_daemon, client_factory, mode):
    """Both directions run together, several jobs of each in flight, so the
    chunks of consecutive jobs share the staging ring."""
    daemon = gpu_daemon(start_daemon, **COPY_MODES[mode])
    client = client_factory(daemon)
    (a, source), (b, target) = gpu_worker(client, seed=50), gpu_worker(client, seed=51)
    first = [prompt_keys(30, prompt=5000 + j) for j in range(2)]
    second = [prompt_keys(30, prompt=6000 + j) for j in range(2)]
    for j, keys in enumerate(first):
        client.submit_store(a, j, keys, list(range(30 * j, 30 * j + 30)))
    assert all(r.ok for r in client.wait([0, 1], 30).values())
    # Loads of the first stores into b, stores of a's next blocks, interleaved.
    for j in range(2):
        client.submit_load(b, 10 + j, first[j], list(range(30 * j, 30 * j + 30)))
        client.submit_store(a, 20 + j, second[j], list(range(60 + 30 * j, 90 + 30 * j)))
    assert all(r.ok for r in client.wait([10, 11, 20, 21], 30).values())
    for j in range(2):
        client.submit_load(b, 30 + j, second[j], list(range(60 + 30 * j, 90 + 30 * j)))
    assert all(r.ok for r in client.wait([30, 31], 30).values())
    torch.cuda.synchronize()
    for i in range(120):
        for src, dst in zip(block_of(source, "per_layer", i), block_of(target, "per_layer", i)):
            assert same(src, dst), f"block {i} differs"
