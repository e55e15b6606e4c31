"""KVDepotConnector inside vLLM's real Scheduler, with a real daemon, steps driven by the test.

The worker side runs the connector's worker hooks against real CPU KV tensors
(tests/vllm_harness.py); "compute" writes a known value per (layer, token,
position), so a block that comes back from kvdepot can be checked bit for bit.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import wait_until
from vllm_engine import BLOCK, DAEMON_OPTIONS, make_engine, prompt, wait_for_copy

from kvdepot.client import KVDepotClient

pytestmark = pytest.mark.vllm


@pytest.fixture
def daemon(start_daemon):
    return start_daemon(**DAEMON_OPTIONS)


@pytest.fixture
def make_engines():
    """engines_of(daemon) -> make(extra=None, **options): engines on that daemon, closed at the end."""
    made = []

    def engines_of(daemon):
        def make(extra=None, **options):
            engine = make_engine(daemon, extra, **options)
            made.append(engine)
            return engine

        return make

    yield engines_of
    for engine in made:
        engine.close()


@pytest.fixture
def engines(daemon, make_engines):
    return make_engines(daemon)


def totals(daemon):
    with KVDepotClient(daemon.socket, name="test-stats") as client:
        return client.connect(10).stats().totals


def test_store_then_load_exact_blocks_and_bytes(engines, daemon):
    engine = engines()
    tokens = prompt(1, 70)  # 4 whole blocks and 6 tokens
    engine.add("a", tokens, max_tokens=2)
    engine.run()
    # Whole blocks only: 71 tokens have KV (70 + one decode), 4 blocks.
    assert totals(daemon).stored_blocks == 4

    engine.reset_gpu_cache()
    engine.add("b", tokens, max_tokens=2)
    assert engine.computed_when_scheduled("b") == 4 * BLOCK
    assert totals(daemon).loaded_blocks == 4
    assert engine.worker.check_request_tokens("b", 0, 4 * BLOCK) == []
    engine.run()


def test_partial_hit_never_covers_last_token_and_keys_chain(engines, daemon):
    engine = engines()
    base = prompt(2, 64)
    engine.add("a", base + prompt(3, 20), max_tokens=1)
    engine.run()
    engine.reset_gpu_cache()

    # Same first 40 tokens: 2 whole blocks shared.
    engine.add("partial", base[:40] + prompt(4, 30), max_tokens=1)
    assert engine.computed_when_scheduled("partial") == 2 * BLOCK
    engine.run()
    engine.reset_gpu_cache()

    # Exactly 4 stored blocks long: the last token must be computed, so 3 blocks.
    engine.add("exact", base, max_tokens=1)
    assert engine.computed_when_scheduled("exact") == 3 * BLOCK
    engine.run()
    engine.reset_gpu_cache()

    # Differs only in its last token: every earlier whole block is shared.
    changed = base + prompt(3, 20)
    changed[-1] = (changed[-1] + 1) % 500 + 3
    engine.add("last", changed, max_tokens=1)
    assert engine.computed_when_scheduled("last") == 5 * BLOCK
    engine.run()


def test_load_starts_after_gpu_prefix_hit(engines, daemon):
    engine = engines()
    tokens = prompt(5, 100)  # 6 whole blocks
    engine.add("a", tokens, max_tokens=1)
    engine.run()
    engine.reset_gpu_cache()
    engine.add("short", tokens[:40], max_tokens=1)  # puts 2 blocks back in the GPU cache
    engine.run()
    loaded = totals(daemon).loaded_blocks
    assert loaded == 2

    engine.add("b", tokens, max_tokens=1)
    assert engine.computed_when_scheduled("b") == 6 * BLOCK
    assert totals(daemon).loaded_blocks - loaded == 4  # blocks 2..5 only
    engine.run()


def test_lookups_never_wait_for_the_daemon(engines, daemon):
    engine = engines()
    tokens = prompt(12, 80)
    engine.add("a", tokens, max_tokens=1)
    engine.run()
    engine.reset_gpu_cache()
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # the daemon cannot answer anything now
    try:
        engine.add("b", tokens, max_tokens=1)
        started = time.monotonic()
        out = engine.scheduler.schedule()
        # Answered from the engine's copy of the namespace, at once.
        assert time.monotonic() - started < 2.0  # never the call timeout (10 s): no call waited
        assert [(job.req_id, len(job.groups[0].keys)) for job in out.kv_connector_metadata.loads] == [("b", 4)]
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    engine.finish(out)
    assert engine.computed_when_scheduled("b") == 4 * BLOCK
    assert engine.worker.check_request_tokens("b", 0, 4 * BLOCK) == []
    engine.run()


def test_lookup_counts_reach_the_daemon_stats(engines, daemon):
    engine = engines()
    tokens = prompt(14, 80)
    engine.add("a", tokens, max_tokens=1)
    engine.run()
    engine.reset_gpu_cache()
    engine.add("b", tokens, max_tokens=1)
    engine.run()
    engine.side.shutdown()  # sends what the once-a-second report has not yet
    stats = totals(daemon)
    assert stats.lookups == 2
    assert stats.hit_blocks == 4  # b: its 4 loadable blocks; a found nothing
    assert stats.miss_blocks == 4  # a: 4 blocks


def test_blocks_another_engine_is_storing_are_waited_for_not_recomputed(start_held_daemon, make_engines):
    daemon = start_held_daemon(**DAEMON_OPTIONS)
    engines = make_engines(daemon)
    writer, reader = engines(), engines()
    tokens = prompt(13, 80)
    writer.add("w", tokens, max_tokens=1)
    writer.step()  # prefill: its store job is queued in the worker, to go at the next step
    side = writer.worker.connector._worker
    (job,) = side._unsubmitted
    (group,) = job.groups
    # Submit it by hand and hold the copy: the daemon sees a store in flight.
    daemon.hold(990_001)
    side.client.submit_store(side.workers[0], 990_001, group.keys, group.block_ids)
    # The daemon tells every engine of the namespace (BlocksChanged).
    wait_until(lambda: reader.side.client.cached_lookup(reader.side.engines[0], group.keys).not_yet, what="storing")

    reader.add("r", tokens, max_tokens=1)
    for _ in range(5):
        assert "r" not in reader.step(compute=False).scheduled
        time.sleep(0.01)
    assert reader.side.counters["deferred"] >= 5
    daemon.release(990_001)
    assert reader.computed_when_scheduled("r") == 4 * BLOCK
    assert reader.worker.check_request_tokens("r", 0, 4 * BLOCK) == []
    assert totals(daemon).loaded_blocks == 4
    reader.run()
    writer.run()


def test_disjoint_prefixes_load_in_the_same_step(engines, daemon):
    engine = engines()
    first, second = prompt(7, 80), prompt(8, 80)
    engine.add("a", first, max_tokens=1)
    engine.add("b", second, max_tokens=1)
    engine.run()
    engine.reset_gpu_cache()

    engine.add("ra", first, max_tokens=1)
    engine.add("rb", second, max_tokens=1)
    out = engine.scheduler.schedule()
    meta = out.kv_connector_metadata
    assert sorted(job.req_id for job in meta.loads) == ["ra", "rb"]
    assert engine.side.counters["deferred"] == 0
    engine.finish(out)
    engine.run()
    assert totals(daemon).loaded_blocks == 8


def test_abort_during_load_keeps_blocks_until_done(engines, daemon):
    import vllm_harness as h

    engine = engines()
    tokens = prompt(9, 80)
    engine.add("a", tokens, max_tokens=1)
    engine.run()
    engine.reset_gpu_cache()

    pool = engine.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    engine.add("r", tokens, max_tokens=1)
    out = engine.scheduler.schedule()
    assert [job.req_id for job in out.kv_connector_metadata.loads] == ["r"]
    h.abort(engine.scheduler, "r")
    # The load has not run yet: its destination blocks stay allocated.
    assert pool.get_num_free_blocks() < free_before
    assert engine.finish(out).finished_recving == {"r"}
    engine.run()
    assert pool.get_num_free_blocks() == free_before


def step_zeroing_load_targets(engine):
    """One step in which the GPU blocks of each load are zeroed before it runs: what they hold after it came from
    kvdepot."""
    import vllm_harness as h

    so = engine.scheduler.schedule()
    for job in so.kv_connector_metadata.loads:
        engine.worker.zero_blocks(b for group in job.groups for b in group.block_ids)
    kv_output, order = engine.worker.execute_model(so)
    output = h.model_output(engine.worker, so, order, kv_output)
    return h.StepResult(so, output, engine.scheduler.update_from_output(so, output), kv_output)


def run_checking_resumed_loads(engine, max_steps: int = 300):
    """Runs until done; returns (the steps that preempted a request, {request: blocks it loaded back}).

    When a preempted request is scheduled again, every block it loaded must
    hold exactly what its first run computed (a known value per layer, token
    and position), and vLLM must count those blocks as computed: they were
    zeroed before the load, and nothing wrote them since.
    """
    preempting, preempted, loads, loaded = [], set(), {}, {}
    for _ in range(max_steps):
        if not engine.scheduler.has_requests() and not engine.side.has_pending_push_work():
            return preempting, loaded
        result = step_zeroing_load_targets(engine)
        so = result.scheduler_output
        if result.preempted_req_ids:
            preempting.append(result)
            preempted |= result.preempted_req_ids
        loads.update((job.req_id, job) for job in so.kv_connector_metadata.loads if job.req_id in preempted)
        for req_id in [r for r in loads if r in so.num_scheduled_tokens]:
            (group,) = loads.pop(req_id).groups
            worker_state = engine.worker.requests[req_id]
            for block_id in group.block_ids:
                index = worker_state.block_ids[0].index(block_id)
                assert worker_state.num_computed_tokens >= (index + 1) * BLOCK, (req_id, index)
                assert engine.worker.check_request_tokens(req_id, index * BLOCK, (index + 1) * BLOCK) == [], (
                    req_id, index
                )
            loaded[req_id] = loaded.get(req_id, 0) + len(group.block_ids)
        if not result.scheduled:
            time.sleep(0.002)  # as Engine.run: let the client's threads in
    raise AssertionError(f"not done after {max_steps} steps")


def test_preemption_flushes_stores_and_resumes_from_them(engines, daemon):
    # 9 GPU blocks (8 usable): when both requests need a 5th, the first takes
    # the preempted one's last block, in that very step.
    engine = engines(num_blocks=9, max_num_seqs=2)
    engine.add("p0", prompt(10, 60), max_tokens=40)
    engine.add("p1", prompt(11, 60), max_tokens=40)
    preempting, loaded = run_checking_resumed_loads(engine)
    assert preempting, "the test needs a preemption"
    assert any(result.scheduler_output.kv_connector_metadata.flush for result in preempting), (
        "the preempted request's stores were not flushed"
    )
    # The resumed request loaded what was stored before the preemption, byte for byte.
    assert sum(loaded.values()) >= 2, loaded
    assert totals(daemon).failed_jobs == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_finished_requests_leave_no_bookkeeping_behind(engines, daemon, async_scheduling):
    # An engine runs for weeks: whatever way a request ends (finished, aborted
    # while its stores are in flight, preempted and resumed, limited by its
    # policy), the connector must forget it once its transfers are done.
    import vllm_harness as h

    engine = engines(num_blocks=12, max_num_seqs=4, async_scheduling=async_scheduling)
    engine.add("preempted-0", prompt(60, 60), max_tokens=40)
    engine.add("preempted-1", prompt(61, 60), max_tokens=40)
    engine.add("limited", prompt(62, 70), max_tokens=5, kv_transfer_params={"kvdepot_store": 40})
    engine.add("aborted", prompt(63, 70), max_tokens=30)
    side = engine.side
    loop = h.AsyncLoop(engine.scheduler, engine.worker) if async_scheduling else None
    aborted = preempted = False
    for _ in range(400):
        in_flight = loop is not None and loop.in_flight is not None
        if not engine.scheduler.has_requests() and not side.has_pending_push_work() and not in_flight:
            break
        result = loop.step() if loop is not None else engine.step()
        preempted |= bool(result and result.preempted_req_ids)
        if not aborted and "aborted" in side._reqs and side._reqs["aborted"].jobs:
            h.abort(engine.scheduler, "aborted")  # its prompt blocks' store is not done yet
            aborted = True
    else:
        raise AssertionError("not done after 400 steps")
    assert preempted and aborted, "the test needs a preemption and an abort"
    worker = engine.worker.connector._worker
    assert (side._reqs, side.store.store_at, side._jobs, side.lookup.loading, side.store.fences) == ({}, {}, {}, {}, {})
    assert (worker._inflight, worker._awaiting, worker._unsubmitted) == ({}, {}, [])
    assert totals(daemon).failed_jobs == 0


def test_lazy_mode_stores_a_preempted_request_before_its_blocks_go(engines, daemon):
    engine = engines({"mode": "lazy"}, num_blocks=9, max_num_seqs=2)
    engine.add("p0", prompt(15, 60), max_tokens=40)
    engine.add("p1", prompt(16, 60), max_tokens=40)
    preempting, loaded = run_checking_resumed_loads(engine)
    assert preempting, "the test needs a preemption"
    for result in preempting:
        meta = result.scheduler_output.kv_connector_metadata
        # The preempted request's blocks are stored in that very step, and
        # flushed before vLLM gives them to another request.
        assert meta.stores and set(meta.flush) >= {job.job_id for job in meta.stores}
    # What the GPU prefix cache lost of it (the blocks another request took)
    # comes back byte for byte; stored any later, it would hold that request's KV.
    assert sum(loaded.values()) >= 2, loaded
    assert totals(daemon).failed_jobs == 0


def test_selective_offload(engines, daemon):
    engine = engines({"min_prompt_tokens": 20})
    engine.add("none", prompt(20, 70), max_tokens=1, kv_transfer_params={"kvdepot_store": "none"})
    engine.add("tokens", prompt(21, 70), max_tokens=1, kv_transfer_params={"kvdepot_store": 40})
    engine.add("half", prompt(22, 70), max_tokens=1, kv_transfer_params={"kvdepot_store": 0.5})
    engine.add("short", prompt(23, 19), max_tokens=1)
    engine.add("bad", prompt(24, 70), max_tokens=1, kv_transfer_params={"kvdepot_store": "lots"})
    engine.run()
    # none: 0; 40 tokens: 2 blocks; half of 70: 35 tokens, 2 blocks; short: 0
    # (below min_prompt_tokens); a bad value falls back to the whole prompt: 4.
    assert totals(daemon).stored_blocks == 0 + 2 + 2 + 0 + 4


def test_decode_tokens_stored_only_when_asked(engines, daemon):
    engine = engines()
    engine.add("decode", prompt(30, 40), max_tokens=30)  # 70 tokens of KV: 4 blocks
    engine.add("nodecode", prompt(31, 40), max_tokens=30, kv_transfer_params={"kvdepot_store_decode": False})
    engine.run()
    assert totals(daemon).stored_blocks == 4 + 2


def test_eager_mode_stores_each_block_in_the_step_that_completes_it(engines, daemon):
    # A small token budget chunks the prefills of requests that keep arriving
    # while others decode, so steps mix one-token and many-token requests.
    engine = engines(max_num_seqs=6, max_num_batched_tokens=40, num_blocks=200)
    lengths = [23, 70, 41, 96, 16, 55, 33, 80, 47, 64]
    planned: dict[str, set[int]] = {}
    added = chunked_steps = decode_only_steps = 0
    for step in range(400):
        if step % 4 == 0 and added < len(lengths):
            engine.add(f"r{added}", prompt(50 + added, lengths[added]), max_tokens=12 + 3 * added)
            added += 1
        if added == len(lengths) and not engine.scheduler.has_requests():
            break
        result = engine.step()
        so = result.scheduler_output
        new_ids = {r.req_id for r in so.scheduled_new_reqs}
        if any(n > 1 and r not in new_ids for r, n in so.num_scheduled_tokens.items()):
            chunked_steps += 1
        elif so.num_scheduled_tokens and not new_ids:
            decode_only_steps += 1
        owner = {}
        for req_id in so.num_scheduled_tokens:
            for index, block in enumerate(engine.worker.block_ids_of(req_id)[0]):
                owner[block] = (req_id, index)
        for job in so.kv_connector_metadata.stores:
            for block in job.groups[0].block_ids:
                req_id, index = owner[block]
                planned.setdefault(req_id, set()).add(index)
        for req_id in so.num_scheduled_tokens:
            request = engine.scheduler.requests.get(req_id)
            if request is None:  # finished in this step
                continue
            whole = request.num_computed_tokens // BLOCK
            assert planned.get(req_id, set()) == set(range(whole)), (step, req_id)
    else:
        raise AssertionError("not done after 400 steps")
    assert chunked_steps and decode_only_steps, "the test needs both kinds of step"
    engine.run()
    assert totals(daemon).failed_jobs == 0


def test_async_scheduling_stores_every_block_and_loads_it_back_exactly(engines, daemon):
    # vLLM on GPUs schedules step t+1 before it has step t's sampled token
    # (async scheduling, on by default there). A block whose KV is complete
    # may then still lack its last token id, which its key covers: it must be
    # stored a step later, with the right key, not skipped nor mis-keyed.
    import vllm_harness as h

    engine = engines(async_scheduling=True)
    assert type(engine.scheduler).__name__ == "AsyncScheduler"
    requests = {"a": (prompt(70, 40), 45), "b": (prompt(71, 64), 33), "c": (prompt(72, 17), 60)}
    for req_id, (tokens, max_tokens) in requests.items():
        engine.add(req_id, tokens, max_tokens=max_tokens)
    results = h.run_async(engine.scheduler, engine.worker)
    assert any(r.scheduler_output.num_scheduled_tokens for r in results)
    engine.run()  # the last stores
    # KV exists for every token but the last sampled one; every whole block of it is stored.
    assert totals(daemon).stored_blocks == sum((len(t) + n - 1) // BLOCK for t, n in requests.values())
    assert totals(daemon).failed_jobs == 0

    # The whole sequence of "a" (prompt and its 45 sampled tokens, all 7) comes back bit for bit.
    tokens, max_tokens = requests["a"]
    engine.reset_gpu_cache()
    engine.add("again", tokens + [7] * max_tokens, max_tokens=1)
    whole = (len(tokens) + max_tokens - 1) // BLOCK
    assert engine.computed_when_scheduled("again") == whole * BLOCK
    assert engine.worker.check_request_tokens("again", 0, whole * BLOCK) == []
    engine.run()


def test_lazy_mode_stores_at_finish(engines, daemon):
    engine = engines({"mode": "lazy"})
    engine.add("a", prompt(40, 70), max_tokens=5)
    engine.step()
    engine.step()
    assert totals(daemon).stored_blocks == 0
    engine.run()
    assert totals(daemon).stored_blocks == 4


class RecordingPublisher:
    """Stands in for vLLM's ZMQ event publisher: keeps what the Scheduler publishes."""

    def __init__(self):
        self.events = []

    def publish(self, batch):
        self.events.extend(batch.events)

    def shutdown(self):
        pass


def test_store_events_and_removal_events(engines, daemon):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    engine = engines(kv_events=True)
    publisher = engine.scheduler.kv_event_publisher = RecordingPublisher()
    request = engine.add("a", prompt(50, 70), max_tokens=1)
    engine.run()
    stored = [e for e in publisher.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    # The hashes vLLM gives the same blocks in its own (GPU) events, so a router can match them.
    expected = [maybe_convert_block_hash(h) for h in request.block_hashes[:4]]
    assert [h for e in stored for h in e.block_hashes] == expected
    assert all(e.block_size == BLOCK for e in stored)

    with KVDepotClient(daemon.socket, name="operator") as operator:
        operator.connect(10).clear("")
    # The daemon tells the engine over its session stream; the next step publishes it.
    deadline = time.monotonic() + 10
    removed = []
    while time.monotonic() < deadline and not removed:
        engine.step()
        removed = [e for e in publisher.events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
        time.sleep(0.05)
    assert removed and sorted(removed[0].block_hashes) == sorted(expected)


def test_a_block_dropped_before_the_workers_report_its_store_is_still_retracted(start_held_daemon, make_engines):
    # The daemon's BlocksChanged (to the scheduler's copy) and its JobDone (to
    # the workers, then to the scheduler a step later) travel apart: the
    # scheduler can hear that a block is gone before it hears that its store
    # ended, and must not announce the block as stored for good.
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    daemon = start_held_daemon(**DAEMON_OPTIONS)
    engine = make_engines(daemon)(kv_events=True)
    publisher = engine.scheduler.kv_event_publisher = RecordingPublisher()
    request = engine.add("a", prompt(51, 70), max_tokens=1)
    expected = [maybe_convert_block_hash(h) for h in request.block_hashes[:4]]
    copy = engine.side.engines[0]
    daemon.hold()  # the store stays in flight: no step hears of its end
    for _ in range(3):
        engine.step()
    assert engine.side.counters["stores"] == 1
    daemon.release()
    wait_until(lambda: len(copy.ready) == 4, what="the copy to hear that the blocks are ready")
    with KVDepotClient(daemon.socket, name="operator") as operator:
        operator.connect(10).clear("")
    wait_until(lambda: not copy.ready, what="the copy to hear that the blocks are gone")
    # vLLM takes the events of a step (update_from_output) whose workers had
    # not seen the JobDone yet.
    early = engine.scheduler.connector.take_events()
    engine.run()

    events = [*early, *publisher.events]
    stored = [h for e in events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes]
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes]
    assert stored == expected
    assert sorted(removed) == sorted(expected), "blocks the daemon dropped are still announced as stored"
    last = {}
    for e in events:
        for h in getattr(e, "block_hashes", ()):
            if e.medium == "CPU":
                last[h] = type(e).__name__
    assert set(last.values()) == {"BlockRemoved"}, "a retraction came before its announcement"


def test_requests_that_wait_for_kv_space_count_one_lookup_each(engines, daemon):
    prompts = [prompt(300 + i, 5 * BLOCK + 3) for i in range(6)]  # 5 whole blocks each
    writer = engines()
    for i, tokens in enumerate(prompts):
        writer.add(f"w{i}", tokens, max_tokens=2)
    writer.run()
    assert totals(daemon).stored_blocks == 30
    # Room for two requests at a time: the others wait for KV space, and vLLM
    # asks the connector again at every step they wait.
    reader = engines(num_blocks=14)
    wait_for_copy(reader.scheduler)  # its namespace's keys, sent on its session stream
    for i, tokens in enumerate(prompts):
        reader.add(f"r{i}", tokens, max_tokens=2)
    reader.run()
    writer.close()
    reader.close()  # sends the lookup counts it has not reported yet
    stats = totals(daemon)
    assert stats.loaded_blocks == 30
    assert stats.lookups == 12  # six requests in each engine, once each
    assert stats.hit_blocks == stats.loaded_blocks
    assert stats.miss_blocks == 30  # the writer's
