"""The engine keeps serving when kvdepot fails: failed loads are recomputed, a dead or
restarted daemon means no offloading (logged once), never an error, and it comes back."""

from __future__ import annotations

import logging

import pytest
from conftest import wait_until
from vllm_engine import BLOCK, DAEMON_OPTIONS, make_engine, prompt, wait_for_copy

from kvdepot.client import KVDepotClient

pytestmark = pytest.mark.vllm


def stats(daemon):
    with KVDepotClient(daemon.socket, name="test-stats") as client:
        return client.connect(10).stats().totals


@pytest.mark.parametrize(
    "groups, transfer_api",
    [("full", "get_transfer_results"), ("hybrid", "get_transfer_results"), ("full", "get_finished")],
)
def test_a_load_that_fails_is_reported_failed_and_recomputed(start_daemon, groups, transfer_api):
    daemon = start_daemon(**DAEMON_OPTIONS)
    engine = make_engine(daemon, groups=groups)  # vLLM's default kv_load_failure_policy, "fail"
    engine.worker.transfer_api = transfer_api
    try:
        # A cache miss must never fail a request: the connector asks for recompute.
        assert engine.scheduler.recompute_kv_load_failures
        tokens = prompt(70, 80)
        engine.add("a", tokens, max_tokens=1)
        engine.run()
        engine.reset_gpu_cache()
        engine.add("b", tokens, max_tokens=1)
        planned = engine.scheduler.schedule()
        (load,) = planned.kv_connector_metadata.loads
        assert load.req_id == "b"
        # The blocks vanish between the lookup and the load.
        with KVDepotClient(daemon.socket, name="operator") as operator:
            assert operator.connect(10).clear("").cleared_blocks > 0
        kv_output = engine.finish(planned)
        # Finished either way: that releases the request from its wait.
        assert kv_output.finished_recving == {"b"}
        if transfer_api == "get_transfer_results":
            # Reported for the request, and only so: block ids are not unique
            # across KV-cache groups, and vLLM refuses them for hybrid models.
            assert kv_output.failed_recving == {"b"}
            assert kv_output.invalid_block_ids == set()
        else:
            # get_finished has no failed set: the load's GPU blocks say it.
            assert kv_output.invalid_block_ids == {b for group in load.groups for b in group.block_ids}
        # vLLM computes the whole prompt instead (it would have started from
        # block 4 had it taken the empty blocks as loaded), and the request completes.
        assert engine.computed_when_scheduled("b") == 0
        engine.run()
    finally:
        engine.close()


def test_daemon_killed_mid_run_then_restarted(start_daemon, caplog):
    caplog.set_level(logging.WARNING, logger="kvdepot.client")
    daemon = start_daemon(**DAEMON_OPTIONS)
    engine = make_engine(daemon, {"call_timeout_s": 2})
    try:
        engine.add("a", prompt(80, 40), max_tokens=30)
        engine.add("b", prompt(81, 40), max_tokens=30)
        for _ in range(5):
            engine.step()
        daemon.kill()
        for i in range(10):
            engine.add(f"late{i}", prompt(90 + i, 50), max_tokens=2)
        engine.run()  # everything finishes: no offloading, no error
        gone = [r for r in caplog.records if r.name == "kvdepot.client" and "not available" in r.getMessage()]
        # Once per client (the scheduler's and the worker's), not once per step.
        assert 1 <= len(gone) <= 2

        daemon.start()
        wait_until(lambda: engine.side.client.connected and engine.worker.connector._worker.client.connected,
                   what="both clients reconnected")
        engine.add("after", prompt(99, 70), max_tokens=1)
        engine.run()
        assert stats(daemon).stored_blocks == 4
        # And the copies went to the new daemon's pool: another engine reads them.
        reader = make_engine(daemon)
        try:
            wait_for_copy(reader.scheduler)
            reader.add("again", prompt(99, 70), max_tokens=1)
            assert reader.computed_when_scheduled("again") == 4 * BLOCK
            assert reader.worker.check_request_tokens("again", 0, 4 * BLOCK) == []
            reader.run()
        finally:
            reader.close()
    finally:
        engine.close()


def test_engine_starts_without_the_daemon_and_attaches_later(start_daemon, tmp_path):
    daemon = start_daemon(wait=False, **DAEMON_OPTIONS)
    daemon.kill()
    engine = make_engine(daemon, {"connect_timeout_s": 0.2})
    try:
        engine.add("early", prompt(100, 70), max_tokens=1)
        engine.run()
        daemon.start()
        wait_until(lambda: engine.worker.connector._worker.client.connected, what="the worker attached")
        wait_until(lambda: engine.side.client.connected, what="the scheduler attached")
        engine.add("later", prompt(101, 70), max_tokens=1)
        engine.run()
        assert stats(daemon).stored_blocks == 4
    finally:
        engine.close()


def test_engines_of_another_namespace_share_nothing(start_daemon):
    daemon = start_daemon(**DAEMON_OPTIONS)
    first = make_engine(daemon)
    other = make_engine(daemon, block_size=32)
    try:
        tokens = prompt(110, 100)
        first.add("a", tokens, max_tokens=1)
        first.run()
        other.add("b", tokens, max_tokens=1)
        assert other.computed_when_scheduled("b") == 0
        other.run()
    finally:
        first.close()
        other.close()


def test_lazy_sliding_window_never_stores_blocks_the_window_gave_away(start_daemon):
    daemon = start_daemon(**DAEMON_OPTIONS)
    engine = make_engine(daemon, {"mode": "lazy"}, groups="hybrid", num_blocks=24)
    try:
        first = prompt(130, 100)
        engine.add("a", first, max_tokens=40)
        for _ in range(3):
            engine.step()
        # Others get the blocks a's window freed, and write their own KV there.
        engine.add("x", prompt(131, 100), max_tokens=40)
        engine.add("y", prompt(132, 60), max_tokens=40)
        engine.run()
        engine.reset_gpu_cache()
        # Shares a's first 3 blocks, whose window blocks a no longer held at
        # the end: whatever it finds must be a's bytes.
        engine.add("b", first[:60] + prompt(133, 30), max_tokens=1)
        computed = engine.computed_when_scheduled("b")
        assert engine.worker.check_request_tokens("b", 0, computed) == []
        engine.run()
        engine.reset_gpu_cache()
        # a's whole sequence (the harness samples token 7): a lazy store kept
        # every full-attention block and the sliding window's last blocks.
        engine.add("c", first + [7] * 40, max_tokens=1)
        computed = engine.computed_when_scheduled("c")
        assert computed == 8 * BLOCK
        assert engine.worker.check_request_tokens("c", 0, computed) == []
        engine.run()
    finally:
        engine.close()


@pytest.mark.parametrize("groups", ["hybrid", "mla"])
def test_hybrid_and_mla_round_trip(start_daemon, groups):
    daemon = start_daemon(pool_size="8MiB", slot_size="64KiB")
    engine = make_engine(daemon, groups=groups)
    try:
        tokens = prompt(120, 100)  # 6 whole blocks
        engine.add("a", tokens, max_tokens=1)
        engine.run()
        engine.reset_gpu_cache()
        engine.add("b", tokens, max_tokens=1)
        assert engine.computed_when_scheduled("b") == 6 * BLOCK
        # Every layer's blocks the request holds are the stored bytes (the
        # sliding-window layers hold only the window; the rest are null blocks).
        assert engine.worker.check_request_tokens("b", 0, 6 * BLOCK) == []
        engine.run()
    finally:
        engine.close()
