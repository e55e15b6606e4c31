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
from kvcache import attach_worker, block_of, dram, prompt_keys

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
def test_kill_9_of_a_client_mid_job_releases_its_pins_and_others_go_on(start_held_daemon, client_factory, command):
    daemon = start_held_daemon()
    survivor = client_factory(daemon, name="survivor")
    worker, engine, tensors = attach_worker(survivor, seed=4)
    mine = prompt_keys(8, prompt=10)
    job = survivor.submit_store(worker, 1, mine, list(range(8)))
    assert survivor.wait([job], 10)[job].ok
    if command == "hang-load":
        # The victim loads blocks that are stored: 16 of them.
        job = survivor.submit_store(worker, 2, prompt_keys(16, prompt=11), list(range(16, 32)))
        assert survivor.wait([job], 10)[job].ok

    daemon.hold(1)
    victim, report = start_hanging_worker(daemon, command, blocks=16, prompt=11)
    assert report["submitted"] == 16
    during = wait_until(lambda: (s := survivor.stats()).pinned_slots == 16 and s, what="the victim's job in flight")
    assert any(c.pid == report["pid"] and c.jobs_in_flight == 1 for c in during.clients)

    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    wait_until(lambda: all(c.pid != report["pid"] for c in survivor.stats().clients), what="its session ended")
    # The daemon's own copy still runs; when it ends, the job fails.
    daemon.release(1)

    def released():
        stats = survivor.stats()
        return stats if stats.pinned_slots == 0 else None

    after = wait_until(released, timeout=20, what="the killed client's pins released")
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


def test_daemon_killed_and_restarted_client_reconnects_by_itself(start_held_daemon, client_factory):
    daemon = start_held_daemon()
    client = client_factory(daemon, name="engine", backoff_max=0.5)
    worker, engine, tensors = attach_worker(client, seed=5)
    keys = prompt_keys(8, prompt=20)
    job = client.submit_store(worker, 1, keys, list(range(8)))
    assert client.wait([job], 10)[job].ok
    assert client.lookup(engine, keys).ready_blocks == 8
    # kill -9 keeps only sealed records, and sealing follows a commit by a
    # moment (longer on a loaded machine): the test kills once they are sealed.
    wait_until(lambda: dram(client.stats()).written_shards >= 8, what="8 records sealed")
    first_instance = client.daemon_instance
    daemon.hold(10)
    client.submit_store(worker, 10, prompt_keys(4, prompt=21), list(range(8, 12)))
    wait_until(lambda: client.stats().pinned_slots == 4, what="the store in flight")

    daemon.kill()
    daemon.release(10)
    wait_until(lambda: not client.connected, what="the client noticing the daemon is gone")
    # The job in flight when the daemon died is reported failed.
    assert client.wait([10], 10)[10].ok is False
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
    # The new daemon adopted the pool the killed one left (one pool file, not two):
    # what was committed comes back; the store in flight when it died does not.
    assert len(list(daemon.folder.glob("*.pool"))) == 1
    assert "adopted 8 block(s)" in daemon.log()
    assert client.reconnects == 1
    # The worker and engine were registered again by the client.
    result = client.lookup(engine, keys)
    assert result.available and result.ready_blocks == 8
    assert client.lookup(engine, prompt_keys(4, prompt=21)).ready_blocks == 0
    job = client.submit_load(worker, 3, keys, list(range(16, 24)))
    assert client.wait([job], 10)[job].ok
    for i in range(8):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 16 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16))


def test_a_client_that_left_mid_store_but_lives_on_cannot_reach_slots_others_use(
    start_held_daemon, client_factory
):
    daemon = start_held_daemon(pool_size="512KiB")  # 32 slots
    survivor = client_factory(daemon, name="survivor")
    worker, engine, tensors = attach_worker(survivor, seed=14)
    first = prompt_keys(8, prompt=60)
    job = survivor.submit_store(worker, 101, first, list(range(8)))
    assert survivor.wait([job], 10)[job].ok

    daemon.hold(1)  # the rogue's store is in flight when its session ends
    rogue = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "rogue_client.py"),
                              daemon.socket, "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=subprocess_env())
    try:
        assert json.loads(rogue.stdout.readline()) == {"submitted": 8}
        wait_until(lambda: len(survivor.stats().clients) == 0, what="the rogue's session ended")
        daemon.release(1)
        wait_until(lambda: survivor.stats().pinned_slots == 0, what="the rogue's store failed")
        # The survivor fills the rest of the pool, the rogue's old slots too,
        # while the rogue writes everything it can reach.
        second = prompt_keys(24, prompt=61)
        job = survivor.submit_store(worker, 102, second, list(range(8, 32)))
        assert survivor.wait([job], 10)[job].ok
        everything = first + second
        assert survivor.lookup(engine, everything).ready_blocks == 32
        time.sleep(0.5)
        job = survivor.submit_load(worker, 103, everything, list(range(64, 96)))
        assert survivor.wait([job], 10)[job].ok
        for i in range(32):
            for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 64 + i)):
                assert torch.equal(src.view(torch.int16), dst.view(torch.int16)), f"block {i} corrupted"
        assert rogue.poll() is None, rogue.stderr.read()
    finally:
        rogue.kill()
        rogue.wait(10)
