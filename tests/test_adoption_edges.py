"""Kept blocks that wait for their part of the pool to come up, against what
else happens meanwhile: a clear, a worker of another layout, the same key
stored anew and a restart, engines that cache the namespace's keys, and a
failure while they come back. The bring-up is held at a gate
(tests/daemon_with_held_bring_up.py) so that only chunk 0 is up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import wait_until
from kvcache import BLOCK_SIZE, HEAD_DIM, KV_HEADS, NUM_BLOCKS, attach_worker, dram, namespace, prompt_keys
from test_warm_restart import SLOT_BYTES, flip, slot_of

LAUNCHER = str(Path(__file__).with_name("daemon_with_held_bring_up.py"))
SLOTS_PER_CHUNK = 4  # 1 MiB pool of 16 KiB slots, 64 KiB chunks: 16 chunks


def gated_daemon(start_daemon, tmp_path, lane):
    gate = tmp_path / "bring-up-gate"
    daemon = start_daemon(pool_size="1MiB", pin_chunk_bytes="64KiB", launcher=LAUNCHER,
                          env={"KVDEPOT_TEST_BRING_UP_GATE": str(gate), "KVDEPOT_LANE": lane})
    return daemon, gate


def store(client, worker, job_id, keys):
    job = client.submit_store(worker, job_id, keys, list(range(len(keys))))
    assert client.wait([job], 30)[job].ok


def kept_and_restarted_behind_gate(start_daemon, client_factory, tmp_path, lane, n=24, prompt=7):
    """A daemon stores `n` blocks, seals them and stops; the next starts with only chunk 0 up."""
    daemon, gate = gated_daemon(start_daemon, tmp_path, lane)
    first = client_factory(daemon, name="first", backoff_max=0.5)
    wait_until(lambda: first.stats().pool.online_slots == 64, what="the first pool up")
    worker, engine, tensors = attach_worker(first, seed=9)
    keys = prompt_keys(n, prompt=prompt)
    store(first, worker, 1, keys)
    wait_until(lambda: dram(first.stats()).written_shards >= n, what="every record sealed")
    first.close()
    assert daemon.stop() == 0
    return daemon, gate, keys, tensors


def started_with_kept_blocks_waiting(start_daemon, client_factory, tmp_path, lane):
    """kept_and_restarted_behind_gate, started: also the keys whose kept copy waits, and a client."""
    daemon, gate, keys, _ = kept_and_restarted_behind_gate(start_daemon, client_factory, tmp_path, lane)
    [pool] = daemon.folder.glob("*.pool")
    waiting = [key for key in keys if slot_of(pool, key) >= SLOTS_PER_CHUNK]
    gate.touch()
    daemon.start()
    return daemon, gate, keys, waiting, client_factory(daemon, name="second", backoff_max=0.5)


@pytest.mark.parametrize("lane", ["python", "native"])
def test_a_clear_while_kept_blocks_wait_for_their_chunk_holds_once_it_comes_up(
        start_daemon, client_factory, tmp_path, lane):
    daemon, gate, keys, _ = kept_and_restarted_behind_gate(start_daemon, client_factory, tmp_path, lane)
    gate.touch()
    daemon.start()
    client = client_factory(daemon, name="second", backoff_max=0.5)
    engine = client.register_engine(namespace("per_layer"))
    stats = client.stats()
    assert stats.pool.online_slots == SLOTS_PER_CHUNK
    early = dram(stats).recovered_shards
    assert early < len(keys)  # at least 20 of the 24 wait for their chunk

    # The operator empties the namespace: nothing of it may be served afterwards.
    client.clear(engine.namespace_name)
    assert client.lookup(engine, keys).ready_blocks == 0

    gate.unlink()
    wait_until(lambda: client.stats().pool.online_slots == 64, what="the whole pool up")
    wait_until(lambda: "the last as their part of the pool came up" in daemon.log(), what="the late adoption")
    back = sum(client.lookup(engine, [key]).ready_blocks for key in keys)
    assert back == 0, f"{back} cleared block(s) came back as their chunks came up"


@pytest.mark.parametrize("lane", ["python", "native"])
def test_a_kept_block_adopted_late_never_serves_a_worker_of_another_layout(
        start_daemon, client_factory, tmp_path, lane):
    """As test_warm_restart's test of the same name, but the kept blocks' chunks
    come up after a worker of another layout registered: the same bytes a block
    (4 layers of [2, heads, block_size, head_dim] pages, HND, where the blocks
    were stored as [2, block_size, heads, head_dim], NHD)."""
    from kvdepot.errors import InvalidArgument

    daemon, gate, keys, _ = kept_and_restarted_behind_gate(start_daemon, client_factory, tmp_path, lane)
    # Whatever chunk 0 holds of the namespace is made unadoptable (a byte of its
    # KV changed), so that every block of it waits for a later chunk.
    [pool] = daemon.folder.glob("*.pool")
    for key in keys:
        slot = slot_of(pool, key)
        if slot < SLOTS_PER_CHUNK:
            flip(pool, slot * SLOT_BYTES + 100)
    gate.touch()
    daemon.start()
    client = client_factory(daemon, name="second", backoff_max=0.5)
    assert client.stats().pool.online_slots == SLOTS_PER_CHUNK
    assert dram(client.stats()).recovered_shards == 0
    hnd = [torch.zeros(2, NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype=torch.bfloat16) for _ in range(4)]
    try:
        worker = client.register_worker(namespace("per_layer"), rank=0, tensors=hnd, block_dim=1)
    except InvalidArgument:
        return  # refused, as it is when the blocks come back at the start: fine
    engine = client.register_engine(namespace("per_layer"))
    gate.unlink()
    wait_until(lambda: "the last as their part of the pool came up" in daemon.log(), what="the late adoption")
    served = sum(client.lookup(engine, [key]).ready_blocks for key in keys)
    job = client.submit_load(worker, 99, keys[-4:], [0, 1, 2, 3])
    loaded = client.wait([job], 30)[job].ok
    assert served == 0 and not loaded, (
        f"{served} blocks of the NHD layout served to an HND worker (load ok: {loaded}, "
        f"{sum(bool(t[:, :4].any()) for t in hnd)} of its layers written)")


@pytest.mark.parametrize("lane", ["python", "native"])
def test_a_key_stored_anew_while_its_kept_copy_waits_survives_the_next_restart(
        start_daemon, client_factory, tmp_path, lane):
    """A restart while the pool still comes up (a large pool takes minutes):
    the key stored anew meanwhile was committed and sealed, and must come back."""
    daemon, gate, keys, waiting, client = started_with_kept_blocks_waiting(start_daemon, client_factory, tmp_path,
                                                                            lane)
    worker, engine, _ = attach_worker(client, seed=9)
    anew = waiting[-1]
    store(client, worker, 2, [anew])  # its kept copy still waits for its chunk
    wait_until(lambda: dram(client.stats()).written_shards >= 1, what="its record sealed")
    assert client.lookup(engine, [anew]).ready_blocks == 1
    assert daemon.stop() == 0  # SIGTERM while the pool still comes up
    gate.unlink()
    daemon.start()
    assert client.wait_connected(15)
    wait_until(lambda: client.stats().pool.online_slots == 64, what="the whole pool up")
    wait_until(lambda: "the last as their part of the pool came up" in daemon.log()
               or "more wait" not in daemon.log(), what="adoption over")
    discarded = dict(dram(client.stats()).discarded)
    assert client.lookup(engine, [anew]).ready_blocks == 1, f"the block stored anew is lost: discarded {discarded}"


@pytest.mark.parametrize("lane", ["python", "native"])
def test_a_key_stored_anew_while_its_kept_copy_waits_is_served_with_its_new_bytes(
        start_daemon, client_factory, tmp_path, lane):
    """When its chunk comes up, the kept copy of a key stored anew meanwhile is
    discarded (stored_anew), never served over the new bytes; every other kept
    block of the chunks comes back."""
    from kvcache import block_of

    daemon, gate, keys, waiting, client = started_with_kept_blocks_waiting(start_daemon, client_factory, tmp_path,
                                                                            lane)
    worker, engine, tensors = attach_worker(client, seed=11)  # other bytes than the kept ones
    anew = waiting[len(waiting) // 2]
    store(client, worker, 2, [anew])
    gate.unlink()
    wait_until(lambda: "the last as their part of the pool came up" in daemon.log(), what="the late adoption")
    assert dict(dram(client.stats()).discarded).get("stored_anew") == 1
    assert sum(client.lookup(engine, [key]).ready_blocks for key in keys) == len(keys)
    expected = [t.clone() for t in block_of(tensors, "per_layer", 0)]
    for t in tensors:
        t.zero_()
    job = client.submit_load(worker, 3, [anew], [5])
    assert client.wait([job], 30)[job].ok
    for want, got in zip(expected, block_of(tensors, "per_layer", 5), strict=True):
        assert torch.equal(want.view(torch.int16), got.view(torch.int16)), "the kept copy was served over the new one"


@pytest.mark.parametrize("lane", ["python", "native"])
def test_engines_hear_of_blocks_adopted_late(start_daemon, client_factory, tmp_path, lane):
    """An engine's copy of its namespace (cached_lookup, what the connector asks)
    learns of blocks adopted as their chunk comes up, without another call."""
    daemon, gate, keys, _ = kept_and_restarted_behind_gate(start_daemon, client_factory, tmp_path, lane)
    gate.touch()
    daemon.start()
    client = client_factory(daemon, name="second", backoff_max=0.5)
    engine = client.register_engine(namespace("per_layer"))
    early = dram(client.stats()).recovered_shards
    gate.unlink()
    wait_until(lambda: "the last as their part of the pool came up" in daemon.log(), what="the late adoption")
    assert early < len(keys)
    wait_until(lambda: sum(client.cached_lookup(engine, [k]).ready_blocks for k in keys) == len(keys),
               what="every kept block in the engine's copy")


@pytest.mark.parametrize("lane", ["python", "native"])
def test_a_failure_in_a_late_adoption_is_logged(start_daemon, client_factory, tmp_path, lane):
    daemon, gate, keys, _ = kept_and_restarted_behind_gate(start_daemon, client_factory, tmp_path, lane)
    daemon.launcher = str(Path(__file__).with_name("daemon_with_failing_late_restore.py"))
    gate.touch()
    daemon.start()
    client = client_factory(daemon, name="second", backoff_max=0.5)
    engine = client.register_engine(namespace("per_layer"))
    gate.unlink()
    wait_until(lambda: client.stats().pool.online_slots == 64, what="the whole pool up")
    wait_until(lambda: "the last as their part of the pool came up" in daemon.log(), what="the late adoption")
    stats = client.stats()
    back = sum(client.lookup(engine, [key]).ready_blocks for key in keys)
    assert "injected failure in a late restore" in daemon.log(), (
        f"nothing logged; {len(keys) - back} kept block(s) neither served nor freed, "
        f"{stats.used_slots - back} slot(s) held for good")
