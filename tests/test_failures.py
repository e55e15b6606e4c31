"""Clients and the daemon die; the rest of the node keeps working."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import subprocess_env, wait_until
from kvcache import attach_worker, block_of, make_kv_cache, namespace, prompt_keys

WORKER = str(Path(__file__).resolve().parent / "worker_proc.py")


def start_hanging_worker(daemon, command: str, blocks: int, prompt: int) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, WORKER, command, "--socket", daemon.socket, "--blocks", str(blocks),
         "--prompt", str(prompt), "--seed", "9"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
    )
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(proc.stderr.read())
    return proc, json.loads(line)


@pytest.mark.parametrize("command", ["hang-store", "hang-load"])
def test_kill_9_of_a_client_mid_job_releases_its_pins_and_others_go_on(daemon, client_factory, command):
    survivor = client_factory(daemon, name="survivor")
    worker, engine, tensors = attach_worker(survivor, seed=4)
    mine = prompt_keys(8, prompt=10)
    job = survivor.submit_store(worker, 1, mine, list(range(8)))
    assert survivor.wait([job], 10)[job].ok
    if command == "hang-load":
        # The victim loads blocks that are stored: 16 of them.
        job = survivor.submit_store(worker, 2, prompt_keys(16, prompt=11), list(range(16, 32)))
        assert survivor.wait([job], 10)[job].ok

    victim, report = start_hanging_worker(daemon, command, blocks=16, prompt=11)
    assert report["slots"] == 16
    during = survivor.stats()
    assert during.pinned_slots == 16
    assert any(c.pid == report["pid"] and c.jobs_in_flight == 1 for c in during.clients)

    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)

    def released():
        stats = survivor.stats()
        gone = all(c.pid != report["pid"] for c in stats.clients)
        free = stats.pinned_slots == 0 and stats.quarantined_slots == 0
        return stats if gone and free else None

    after = wait_until(released, timeout=5, what="the killed client's pins released")
    assert after.sessions_ended == 1
    assert after.totals.failed_jobs == 1
    if command == "hang-store":
        # Its half-written blocks are gone, and never visible.
        assert after.used_slots == 8
        assert survivor.lookup(engine, prompt_keys(16, prompt=11)).ready_blocks == 0
    else:
        # What it was loading is still stored.
        assert after.used_slots == 24
        assert survivor.lookup(engine, prompt_keys(16, prompt=11)).ready_blocks == 16

    # The other client's jobs still run, and its blocks are intact.
    job = survivor.submit_load(worker, 3, mine, list(range(64, 72)))
    assert survivor.wait([job], 10)[job].ok
    for i in range(8):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 64 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16))


def test_daemon_killed_and_restarted_client_reconnects_by_itself(daemon, client_factory):
    client = client_factory(daemon, name="engine", backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=5)
    keys = prompt_keys(8, prompt=20)
    job = client.submit_store(worker, 1, keys, list(range(8)))
    assert client.wait([job], 10)[job].ok
    assert client.lookup(engine, keys).ready_blocks == 8
    first_instance = client.daemon_instance
    in_flight = client.begin_store(worker, 10, prompt_keys(4, prompt=21), list(range(8, 12)))

    daemon.kill()
    wait_until(lambda: not client.connected, what="the client noticing the daemon is gone")
    # The job in flight when the daemon died is reported failed, and finishing
    # its copy afterwards raises nothing.
    assert client.wait([10], 10)[10].ok is False
    in_flight.run()
    # Nothing raises while the daemon is away: lookups miss, jobs fail.
    result = client.lookup(engine, keys)
    assert result.ready_blocks == 0 and not result.available
    job = client.submit_store(worker, 2, keys, list(range(8)))
    assert client.wait([job], 10)[job].ok is False

    # The socket file the killed daemon left behind does not stop a new one.
    assert os.path.exists(daemon.socket)
    daemon.start()
    assert client.wait_connected(15), "the client did not reconnect"
    assert client.daemon_instance != first_instance
    # The pool file the killed daemon left was removed: one pool holds RAM, not two.
    assert len(list(daemon.folder.glob("*.pool"))) == 1
    assert "the pool of a daemon on this address that died" in daemon.log()
    assert client.reconnects == 1
    # The lost blocks miss; the worker and engine were registered again by the client.
    result = client.lookup(engine, keys)
    assert result.available and result.ready_blocks == 0
    job = client.submit_store(worker, 3, keys, list(range(8)))
    assert client.wait([job], 10)[job].ok
    assert client.lookup(engine, keys).ready_blocks == 8


# The pid a client claims is not believed: one the daemon cannot see (0, or a
# lie) must not free the slots while the real process lives.
@pytest.mark.parametrize("claimed_pid", ["own", "0"])
def test_slots_of_a_client_that_left_but_lives_on_are_not_reused_until_it_exits(
    start_daemon, client_factory, claimed_pid
):
    daemon = start_daemon(pool_size="512KiB")  # 32 slots
    survivor = client_factory(daemon, name="survivor")
    worker, engine, tensors = attach_worker(survivor, seed=14)
    first = prompt_keys(8, prompt=60)
    job = survivor.submit_store(worker, 1, first, list(range(8)))
    assert survivor.wait([job], 10)[job].ok

    claim = [] if claimed_pid == "own" else [claimed_pid]
    rogue = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "rogue_client.py"),
                              daemon.socket, "8", *claim], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        slots = json.loads(rogue.stdout.readline())["slots"]
        assert len(slots) == 8
        wait_until(lambda: survivor.stats().quarantined_slots == 8, what="the rogue's slots quarantined")
        time.sleep(1.0)  # several rounds of the daemon's housekeeping
        assert survivor.stats().quarantined_slots == 8, "quarantine released while its writer lives"
        # The survivor fills the rest of the pool; none of it may land in the rogue's slots.
        second = prompt_keys(16, prompt=61)
        job = survivor.submit_store(worker, 2, second, list(range(8, 24)))
        assert survivor.wait([job], 10)[job].ok
        rogue.stdin.write("go\n")
        rogue.stdin.flush()
        assert rogue.stdout.readline().strip() == "written"
        everything = first + second
        assert survivor.lookup(engine, everything).ready_blocks == 24
        job = survivor.submit_load(worker, 3, everything, list(range(64, 88)))
        assert survivor.wait([job], 10)[job].ok
        for i in range(24):
            for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 64 + i)):
                assert torch.equal(src.view(torch.int16), dst.view(torch.int16)), f"block {i} corrupted"
    finally:
        rogue.kill()
        rogue.wait(10)
    stats = wait_until(lambda: (s := survivor.stats()).quarantined_slots == 0 and s, what="quarantine released")
    assert stats.used_slots == 24


def test_a_closed_client_does_not_copy_into_slots_it_no_longer_owns(daemon, client_factory):
    client = client_factory(daemon, name="closing")
    tensors, block_dim = make_kv_cache("per_layer", seed=15)
    worker = client.register_worker(namespace("per_layer"), rank=0, tensors=tensors, block_dim=block_dim)
    from kvdepot.client.shm_copy import MappedPool

    transfer = client.begin_store(worker, 1, prompt_keys(4, prompt=62), [0, 1, 2, 3])
    info = client._connection.pool_info
    client.close()
    transfer.run()
    result = client.wait([1], 5)[1]
    assert not result.ok and "closed" in result.error
    pool = MappedPool(info.shm_path, info.slot_bytes, info.num_slots)
    assert int(pool.slots[torch.as_tensor(transfer.slots)].count_nonzero()) == 0
