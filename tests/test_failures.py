"""Clients and the daemon die; the rest of the node keeps working."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import subprocess_env, wait_until
from kvcache import block_of, make_kv_cache, namespace, prompt_keys

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
    ns = namespace("per_layer")
    tensors, block_dim = make_kv_cache("per_layer", seed=4)
    worker = survivor.register_worker(ns, rank=0, tensors=tensors, block_dim=block_dim)
    engine = survivor.register_engine(ns)
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
        return stats if gone and stats.pinned_slots == 0 else None

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
    ns = namespace("per_layer")
    tensors, block_dim = make_kv_cache("per_layer", seed=5)
    worker = client.register_worker(ns, rank=0, tensors=tensors, block_dim=block_dim)
    engine = client.register_engine(ns)
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
    assert client.reconnects == 1
    # The lost blocks miss; the worker and engine were registered again by the client.
    result = client.lookup(engine, keys)
    assert result.available and result.ready_blocks == 0
    job = client.submit_store(worker, 3, keys, list(range(8)))
    assert client.wait([job], 10)[job].ok
    assert client.lookup(engine, keys).ready_blocks == 8
