"""TP = 2: one scheduler, two workers (ranks), one daemon. A block counts as stored only
when both ranks stored their shard, and each rank loads back its own shard."""

from __future__ import annotations

import copy

import pytest
import vllm_harness as h
from vllm_engine import BLOCK, DAEMON_OPTIONS, prompt, wait_for_copy

pytestmark = pytest.mark.vllm


def rank_values(rank):
    # Different bytes per rank, so a shard loaded into the wrong rank shows.
    def value(layer, token, position, shape):
        return h.default_kv_value(layer, token, position, shape) + 1000 * (rank + 1)

    return value


@pytest.fixture
def tp_engine(start_daemon):
    daemon = start_daemon(**DAEMON_OPTIONS)
    config = h.make_vllm_config(
        "kvdepot.connector",
        "KVDepotConnector",
        {"socket": daemon.socket, "sync_loads": False},
        num_gpu_blocks=64,
        tp_size=2,
    )
    from vllm.config import KVEventsConfig

    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    kv_cache_config = h.make_kv_cache_config(config, num_blocks=64)
    scheduler = h.make_scheduler(config, kv_cache_config)
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    # The executor's aggregator: it counts each request's finished transfers
    # across steps until both ranks reported them.
    scheduler.test_aggregator = KVOutputAggregator(2)
    workers = []
    for rank in (0, 1):
        worker_config = copy.deepcopy(config)
        worker_config.parallel_config.rank = rank
        workers.append(
            h.WorkerSide(
                worker_config, kv_cache_config, kv_value=rank_values(rank), copy_config=False, install_global=rank == 0
            )
        )
    yield daemon, scheduler, workers
    for worker in workers:
        worker.close()
    scheduler.connector.shutdown()


def model_output(scheduler_output, workers, kv_outputs, order):
    from vllm.v1.outputs import ModelRunnerOutput

    if scheduler_output.total_num_scheduled_tokens == 0:
        # Copies: for an empty KV output vLLM returns its module-level
        # EMPTY_MODEL_RUNNER_OUTPUT, and KVOutputAggregator.aggregate assigns the
        # aggregated kv_connector_output onto outputs[0]; without the copy that
        # output (finished_sending={"c"}) leaks into every later test's empty step.
        return [copy.copy(ModelRunnerOutput.with_kv_conn_output_only(kv)) for kv in kv_outputs]
    sampled = []
    for req_id in order:
        if workers[0].wants_sample(scheduler_output, req_id):
            for worker in workers:
                worker.record_sampled(req_id, 7)
            sampled.append([7])
        else:
            sampled.append([])
    return [
        ModelRunnerOutput(
            req_ids=order,
            req_id_to_index={r: i for i, r in enumerate(order)},
            sampled_token_ids=sampled,
            kv_connector_output=kv,
        )
        for kv in kv_outputs
    ]


def tp_step(scheduler, workers, compute=True, held_back=None):
    """One step on both ranks; `held_back` collects rank 1's connector output instead of reporting it."""
    from vllm.v1.outputs import KVConnectorOutput

    so = scheduler.schedule()
    results = [w.execute_model(so, compute=compute) for w in workers]
    kv_outputs = [kv for kv, _ in results]
    if held_back is not None:
        held_back.append(kv_outputs[1])
        kv_outputs[1] = KVConnectorOutput()
    outputs = model_output(so, workers, kv_outputs, results[0][1])
    scheduler.update_from_output(so, scheduler.test_aggregator.aggregate(outputs))
    return so


def run(scheduler, workers, compute=True):
    side = scheduler.connector._scheduler
    for _ in range(100):
        if not scheduler.has_requests() and not side.has_pending_push_work():
            return
        tp_step(scheduler, workers, compute)
    raise AssertionError("not done after 100 steps")


def test_each_rank_stores_and_loads_its_own_shard(tp_engine):
    daemon, scheduler, workers = tp_engine
    tokens = prompt(60, 70)
    scheduler.add_request(h.make_request("a", tokens, max_tokens=1))
    run(scheduler, workers)
    assert scheduler.reset_prefix_cache()
    wait_for_copy(scheduler)
    for worker in workers:
        for tensor in worker.kv_caches.values():
            tensor.zero_()

    scheduler.add_request(h.make_request("b", tokens, max_tokens=1))
    for _ in range(20):
        so = tp_step(scheduler, workers, compute=False)
        if "b" in so.num_scheduled_tokens:
            break
    assert [r.num_computed_tokens for r in so.scheduled_new_reqs] == [4 * BLOCK]
    for worker in workers:
        assert worker.check_request_tokens("b", 0, 4 * BLOCK) == []
    run(scheduler, workers)


def test_store_completes_only_when_both_ranks_reported(tp_engine):
    from vllm.distributed.kv_events import BlockStored

    daemon, scheduler, workers = tp_engine
    side = scheduler.connector._scheduler
    published = []
    scheduler.kv_event_publisher = type("Recorder", (), {
        "publish": lambda self, b: published.extend(b.events),
        "shutdown": lambda self: None,
    })()

    scheduler.add_request(h.make_request("c", prompt(61, 70), max_tokens=1))
    first = tp_step(scheduler, workers)  # prefill; the store job is planned
    (job,) = first.kv_connector_metadata.stores
    held = []
    tp_step(scheduler, workers, held_back=held)  # both ranks store; only rank 0 reports
    assert job.job_id in side._jobs
    assert "c" in scheduler.requests  # its blocks are still held for rank 1
    assert not [e for e in published if isinstance(e, BlockStored) and e.medium == "CPU"]

    # Rank 1's report arrives with the next step's.
    so = scheduler.schedule()
    results = [w.execute_model(so) for w in workers]
    late, now = held[0], results[1][0]
    now.finished_sending = (now.finished_sending or set()) | (late.finished_sending or set())
    now.kv_connector_worker_meta = (
        late.kv_connector_worker_meta.aggregate(now.kv_connector_worker_meta)
        if now.kv_connector_worker_meta
        else late.kv_connector_worker_meta
    )
    outputs = model_output(so, workers, [results[0][0], now], results[0][1])
    scheduler.update_from_output(so, scheduler.test_aggregator.aggregate(outputs))
    assert job.job_id not in side._jobs
    assert "c" not in scheduler.requests
    assert sum(len(e.block_hashes) for e in published if isinstance(e, BlockStored) and e.medium == "CPU") == 4
