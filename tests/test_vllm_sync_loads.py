"""A CPU engine's hits load synchronously (`sync_loads`, the default there): vLLM schedules the
request in the step of its lookup and the worker loads before the forward pass, so a hit waits
no engine step; a load that fails there is reported by its blocks and recomputed."""

from __future__ import annotations

import pytest
from vllm_engine import BLOCK, DAEMON_OPTIONS, make_engine, prompt

from kvdepot.client import KVDepotClient

pytestmark = pytest.mark.vllm


@pytest.fixture
def engine(start_daemon):
    daemon = start_daemon(**DAEMON_OPTIONS)
    engine = make_engine(daemon, {"sync_loads": True})
    engine.daemon = daemon
    yield engine
    engine.close()


def stored_then_forgotten(engine, tokens) -> None:
    engine.add("a", tokens, max_tokens=1)
    engine.run()
    engine.reset_gpu_cache()


def test_a_hit_is_computed_in_the_step_of_its_lookup(engine):
    tokens = prompt(71, 80)  # 5 whole blocks: 4 load, the last one holds the last token
    stored_then_forgotten(engine, tokens)
    engine.add("b", tokens, max_tokens=2)
    first = engine.step()
    (load,) = first.scheduler_output.kv_connector_metadata.loads
    assert load.req_id == "b" and load.sync
    assert first.scheduler_output.has_sync_kv_loads
    # Scheduled at once, from the loaded tokens on, and the load done before the forward pass.
    (new,) = first.scheduler_output.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens) == ("b", 4 * BLOCK)
    assert first.scheduler_output.num_scheduled_tokens["b"] == len(tokens) - 4 * BLOCK
    assert not first.kv_connector_output.finished_recving and not first.kv_connector_output.invalid_block_ids
    assert engine.worker.check_request_tokens("b", 0, 4 * BLOCK) == []
    engine.run()
    assert not engine.side._jobs and not engine.side.lookup.loading


def test_a_sync_load_that_fails_is_recomputed(engine):
    tokens = prompt(72, 80)
    stored_then_forgotten(engine, tokens)
    engine.add("b", tokens, max_tokens=3)
    # The blocks vanish between the lookup and the load.
    planned = engine.scheduler.schedule()
    (load,) = planned.kv_connector_metadata.loads
    with KVDepotClient(engine.daemon.socket, name="operator") as operator:
        assert operator.connect(10).clear("").cleared_blocks > 0
    from vllm_harness import model_output

    kv_out, order = engine.worker.execute_model(planned)
    # Reported by its blocks (the request runs already: no finished_recving).
    assert kv_out.invalid_block_ids == {b for group in load.groups for b in group.block_ids}
    assert not kv_out.finished_recving and not kv_out.failed_recving
    engine.scheduler.update_from_output(planned, model_output(engine.worker, planned, order, kv_out, 7))
    # vLLM computes the prompt again from its first block, and the KV comes out right.
    again = engine.step().scheduler_output
    cached = again.scheduled_cached_reqs
    assert cached.req_ids == ["b"] and cached.num_computed_tokens == [0]
    assert again.num_scheduled_tokens["b"] == len(tokens)
    assert engine.worker.check_request_tokens("b", 0, len(tokens)) == []
    engine.run()
