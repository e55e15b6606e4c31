"""Job tracing (kvdepot/jobtrace.py, bench/job_trace.py): with KVDEPOT_TRACE_JOBS set, the real
daemon writes each finished job's stages, in order, for the worker's session and job id."""

from __future__ import annotations

import json
import stat

from conftest import wait_until
from kvcache import attach_worker, prompt_keys

from kvdepot import jobtrace


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

    # A job's line is written after its JobDone (the client is told first): wait for the load's.
    text = wait_until(lambda: trace.exists() and trace.read_text().count("\n") == 2 and trace.read_text(),
                      what="two trace lines")
    records = [json.loads(line) for line in text.splitlines()]
    session_id = client._session.connection.session_id
    tag = jobtrace.session_tag(session_id)
    assert [(r["session"], r["job"], r["kind"], r["blocks"]) for r in records] == [
        (tag, 1, "store", 4), (tag, 2, "load", 4)
    ]
    # Whoever knows a session id acts as the session: the trace names it by a hash, and is the daemon user's alone.
    assert session_id not in text
    assert stat.S_IMODE(trace.stat().st_mode) == 0o600
    for record in records:
        stamps = record["stamps"]
        order = ["received", "begin", "finish", "done_sent"]
        assert [stage for stage in order if stage in stamps] == order
        assert all(stamps[a] <= stamps[b] for a, b in zip(order, order[1:])), stamps

