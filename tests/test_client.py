"""The client library's own bookkeeping, against the real daemon."""

from __future__ import annotations

import threading
import time

from kvcache import make_kv_cache, namespace, prompt_keys


def test_take_finished_leaves_the_jobs_a_wait_is_blocked_on(daemon, client_factory):
    client = client_factory(daemon)
    tensors, block_dim = make_kv_cache("per_layer", seed=16)
    worker = client.register_worker(namespace("per_layer"), rank=0, tensors=tensors, block_dim=block_dim)
    flush = client.begin_store(worker, 1, prompt_keys(4, prompt=70), [0, 1, 2, 3])
    client.submit_store(worker, 2, prompt_keys(4, prompt=71), [4, 5, 6, 7])
    waited = {}
    waiter = threading.Thread(target=lambda: waited.update(client.wait([1], timeout=10)))
    waiter.start()
    time.sleep(0.3)  # the waiter is blocked on job 1
    flush.run()
    taken = client.take_finished()
    waiter.join(15)
    assert [r.job_id for r in taken] == [2]
    assert waited[1].ok
    assert client.take_finished() == []


def test_an_engine_registered_while_the_daemon_is_away_is_registered_when_it_returns(daemon, client_factory):
    client = client_factory(daemon, backoff_max=0.3)
    keys = prompt_keys(2, prompt=72)
    daemon.kill()
    while client.connected:
        time.sleep(0.05)
    engine = client.register_engine(namespace("per_layer"))
    assert engine.engine_id is None and not client.lookup(engine, keys).available
    daemon.start()
    assert client.wait_connected(15)
    assert engine.engine_id is not None
    assert client.lookup(engine, keys).available
