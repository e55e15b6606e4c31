"""The client library's own bookkeeping, against the real daemon."""

from __future__ import annotations

import time

from kvcache import namespace, prompt_keys


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
