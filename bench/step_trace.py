"""Per-step trace of the connector inside a benchmark's in-process vLLM engine (bench/hit_ttft.py).

Off unless the engine process sets KVDEPOT_STEP_TRACE to a file: `install()` then wraps
KVDepotConnector's hooks, the worker's staging copies and waits, and `LLMEngine.step`,
and `dump()` writes every stamp (perf_counter seconds) as JSON. Nothing in the product
imports this; it costs nothing when off.

Events: ("step", i, t0, t1), and per hook (name, step, t0, t1, detail).
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

PATH = os.environ.get("KVDEPOT_STEP_TRACE", "")
events: list = []
_step = [0]


def _wrap(cls, name: str, detail=None):
    original = getattr(cls, name)

    @functools.wraps(original)
    def traced(*args, **kwargs):
        t0 = time.perf_counter()
        result = original(*args, **kwargs)
        t1 = time.perf_counter()
        events.append((name, _step[0], t0, t1, detail(args, kwargs, result) if detail else None))
        return result

    setattr(cls, name, traced)


def install() -> None:
    if not PATH:
        return
    from kvdepot.client.client import KVDepotClient
    from kvdepot.client.shm_copy import BlockCopier
    from kvdepot.connector.connector import KVDepotConnector

    _wrap(KVDepotConnector, "get_num_new_matched_tokens", lambda a, k, r: [a[1].request_id, a[2], r[0], r[1]])
    _wrap(KVDepotConnector, "update_state_after_alloc", lambda a, k, r: [a[1].request_id, a[3]])

    def meta(a, k, r):
        so = a[1]
        return {"scheduled": dict(so.num_scheduled_tokens), "loads": [j.req_id for j in r.loads],
                "stores": sum(len(g.block_ids) for j in r.stores for g in j.groups), "flush": len(r.flush)}

    _wrap(KVDepotConnector, "build_connector_meta", meta)
    _wrap(KVDepotConnector, "start_load_kv")
    _wrap(KVDepotConnector, "wait_for_save")
    _wrap(KVDepotConnector, "get_finished", lambda a, k, r: sorted(r[1] or ()))
    _wrap(KVDepotConnector, "get_transfer_results", lambda a, k, r: sorted(r.finished_recving or ()))
    _wrap(KVDepotConnector, "update_connector_output")
    _wrap(BlockCopier, "to_staging", lambda a, k, r: len(a[1]))
    _wrap(BlockCopier, "from_staging", lambda a, k, r: len(a[1]))
    _wrap(KVDepotClient, "wait", lambda a, k, r: len(r))
    _wrap(KVDepotClient, "submit_store", lambda a, k, r: len(a[4]))
    _wrap(KVDepotClient, "submit_load", lambda a, k, r: len(a[4]))


def wrap_engine(engine) -> None:
    if not PATH:
        return
    step = engine.step

    def traced_step():
        _step[0] += 1
        t0 = time.perf_counter()
        out = step()
        events.append(("step", _step[0], t0, time.perf_counter(), None))
        return out

    engine.step = traced_step


def mark(name: str, detail=None) -> None:
    if PATH:
        t = time.perf_counter()
        events.append((name, _step[0], t, t, detail))


def dump() -> None:
    if PATH:
        from kvdepot import jobtrace

        # The client's job stamps (KVDEPOT_TRACE_JOBS on), by the daemon's session tag.
        jobs = [[jobtrace.session_tag(s), j, st] for (s, j), st in jobtrace.client_stamps.items()]
        Path(PATH).write_text(json.dumps(events))
        Path(PATH + ".jobs").write_text(json.dumps(jobs))
