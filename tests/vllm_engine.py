"""A scheduler + worker pair running KVDepotConnector against a real daemon, for the vLLM tests."""

from __future__ import annotations

import time
from dataclasses import dataclass

import vllm_harness as h
from vllm_generate import make_prompts

BLOCK = 16
# The tiny model's block: 2 layers x 2 KV heads x 16 tokens x (64 K + 64 V) float32.
DAEMON_OPTIONS = {"pool_size": "8MiB", "slot_size": "64KiB"}


def prompt(seed: int, length: int) -> list[int]:
    return make_prompts(1, length, seed=seed)[0]  # ids from 3 up: 2 is EOS


@dataclass
class Engine:
    config: object
    kv_cache_config: object
    scheduler: object
    worker: h.WorkerSide

    @property
    def side(self):
        """The connector's scheduler side (its bookkeeping)."""
        return self.scheduler.connector._scheduler

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 3, **kw):
        request = h.make_request(req_id, tokens, max_tokens=max_tokens, vllm_config=self.config, **kw)
        self.scheduler.add_request(request)
        return request

    def step(self, **kw) -> h.StepResult:
        return h.step(self.scheduler, self.worker, **kw)

    def finish(self, scheduler_output):
        """Runs the worker on a step the test scheduled itself (one that computes
        nothing: its requests wait for loads) and hands vLLM the connector's output."""
        from vllm.v1.outputs import ModelRunnerOutput

        kv_output, _ = self.worker.execute_model(scheduler_output, compute=False)
        self.scheduler.update_from_output(scheduler_output, ModelRunnerOutput.with_kv_conn_output_only(kv_output))
        return kv_output

    def run(self, max_steps: int = 200, **kw) -> list[h.StepResult]:
        """Steps until every request finished and every transfer is done."""
        results = []
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.side.has_pending_push_work():
                return results
            result = self.step(**kw)
            if not result.scheduled:
                # A real step takes milliseconds, and the connector's lookup
                # thread gets the GIL meanwhile; an empty one here takes none.
                time.sleep(0.002)
            results.append(result)
        raise AssertionError(f"not done after {max_steps} steps")

    def computed_when_scheduled(self, req_id: str, timeout: float = 20.0) -> int:
        """Steps (without computing) until `req_id` is scheduled; the tokens it had then.

        Those came from the GPU prefix cache or from kvdepot: what a lookup hit.
        A deadline, not a count of steps: what it waits for (a load, a block
        committed) takes the daemon's time, which a loaded machine stretches.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            so = self.step(compute=False).scheduler_output
            for req in so.scheduled_new_reqs:
                if req.req_id == req_id:
                    return req.num_computed_tokens
            cached = so.scheduled_cached_reqs
            if req_id in cached.req_ids:
                return cached.num_computed_tokens[cached.req_ids.index(req_id)]
            time.sleep(0.001)
        raise AssertionError(f"{req_id} was never scheduled")

    def reset_gpu_cache(self) -> None:
        """Forget the GPU prefix cache and zero the KV tensors: what is found next comes from kvdepot."""
        assert self.scheduler.reset_prefix_cache()
        for tensor in self.worker.kv_caches.values():
            tensor.zero_()
        wait_for_copy(self.scheduler)

    def close(self) -> None:
        self.worker.close()
        self.scheduler.connector.shutdown()


def wait_for_copy(scheduler, timeout: float = 10.0) -> None:
    """Waits until the scheduler's copy of its namespaces holds every block the daemon has ready.

    The copy follows the daemon by a notification; a test that looks blocks up
    right after storing them waits for it, as an engine would simply miss.
    """
    side = scheduler.connector._scheduler
    deadline = time.monotonic() + timeout
    while True:
        stats = {ns.name: ns.ready_blocks for ns in side.client.stats().namespaces}
        if all(len(e.ready) == stats.get(e.namespace_name, 0) for e in side.engines):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine's copy did not catch up: {stats}")
        time.sleep(0.01)


def make_engine(
    daemon,
    extra: dict | None = None,
    *,
    num_blocks: int = 64,
    groups: str = "full",
    kv_events: bool = False,
    async_scheduling: bool = False,
    **options,
) -> Engine:
    # These engines model a GPU engine's steps (loads async, a step of their
    # own) unless a test asks for a CPU engine's synchronous loads.
    config = h.make_vllm_config(
        "kvdepot.connector",
        "KVDepotConnector",
        {"socket": daemon.socket, "sync_loads": False, **(extra or {})},
        num_gpu_blocks=num_blocks,
        **options,
    )
    if kv_events:
        from vllm.config import KVEventsConfig

        # Events on, published nowhere: a test puts its own recorder in.
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    kv_cache_config = h.make_kv_cache_config(config, num_blocks=num_blocks, groups=groups)
    scheduler = h.make_scheduler(config, kv_cache_config, async_scheduling=async_scheduling)
    worker = h.WorkerSide(config, kv_cache_config)
    return Engine(config, kv_cache_config, scheduler, worker)
