"""Job tracing (kvdepot/jobtrace.py, bench/job_trace.py): with KVDEPOT_TRACE_JOBS set, the real
daemon writes each finished job's stages, in order, for the worker's session and job id."""

from __future__ import annotations

import json

from kvcache import attach_worker, prompt_keys


def test_a_traced_daemon_writes_the_stages_of_each_job_in_order(start_daemon, client_factory, tmp_path):
    trace = tmp_path / "trace.jsonl"
    daemon = start_daemon(env={"KVDEPOT_TRACE_JOBS": str(trace)})
    client = client_factory(daemon)
    worker, _, _ = attach_worker(client, seed=1)
    keys = prompt_keys(4)
    client.submit_store(worker, 1, keys, [0, 1, 2, 3])
    assert client.wait([1], timeout=30)[1].ok
    client.submit_load(worker, 2, keys, [4, 5, 6, 7])
    assert client.wait([2], timeout=30)[2].ok

    records = [json.loads(line) for line in trace.read_text().splitlines()]
    session_id = client._session.connection.session_id
    assert [(r["session"], r["job"], r["kind"], r["blocks"]) for r in records] == [
        (session_id, 1, "store", 4),
        (session_id, 2, "load", 4),
    ]
    for record in records:
        stamps = record["stamps"]
        order = ["received", "begin", "finish", "done_sent"]
        assert [stage for stage in order if stage in stamps] == order
        assert all(stamps[a] <= stamps[b] for a, b in zip(order, order[1:])), stamps

