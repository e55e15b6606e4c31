"""A load its engine gave up on (KVDepotClient.cancel, a CPU engine's synchronous load past its
wait) may still be running in the daemon, which then copies into the worker's staging rows: until
the daemon's own end comes, no job uses those rows, so no store can send the daemon's late bytes
as its own blocks and no load reads them. Tried against the real daemon with the load held."""

from __future__ import annotations

import time

import pytest
import torch
from kvcache import attach_worker, prompt_keys

from kvdepot.errors import AlreadyExists


def test_a_cancelled_loads_rows_wait_for_the_daemons_end(start_held_daemon, client_factory):
    daemon = start_held_daemon()
    client = client_factory(daemon)
    worker, _, tensors = attach_worker(client, seed=11)
    stored = prompt_keys(2, prompt=1)
    assert client.wait([client.submit_store(worker, 1, stored, [0, 1])], 30)[1].ok

    daemon.hold(2)
    client.submit_load(worker, 2, stored, [5, 6])
    time.sleep(0.2)  # in the daemon, held
    client.cancel(2, "the engine stopped waiting")
    assert not client.wait([2], 5)[2].ok

    # The daemon may still write rows 5 and 6: jobs on them fail at once.
    store = client.submit_store(worker, 3, prompt_keys(1, prompt=2), [5])
    load = client.submit_load(worker, 4, stored[:1], [6])
    results = client.wait([store, load], 5)
    assert not results[store].ok and "cancelled load" in results[store].error
    assert not results[load].ok and "cancelled load" in results[load].error
    with pytest.raises(AlreadyExists):
        client.submit_load(worker, 2, stored, [8, 9])  # the daemon still runs job 2
    # Other rows are untouched.
    assert client.wait([client.submit_store(worker, 5, prompt_keys(1, prompt=3), [7])], 30)[5].ok

    daemon.release(2)  # the daemon ends job 2; its rows are free again
    deadline = time.monotonic() + 10
    job = 6
    while True:
        job += 1
        result = client.wait([client.submit_store(worker, job, prompt_keys(1, prompt=4), [5])], 30)[job]
        if result.ok or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert result.ok, result.error
    # And a load into them brings the stored bytes, exactly.
    job += 1
    assert client.wait([client.submit_load(worker, job, stored, [5, 6])], 30)[job].ok
    for tensor in tensors:
        assert torch.equal(tensor[:, 5:7], tensor[:, 0:2])
