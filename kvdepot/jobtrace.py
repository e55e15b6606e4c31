"""Per-stage timestamps of jobs: where a job's time goes between the worker's
submit call and its wait returning (`bench/job_trace.py` prints the stages).

Off unless the environment variable KVDEPOT_TRACE_JOBS names a file when the
process starts; off, a stage costs one test of a module constant. On, the
daemon appends one line per finished job to that file (JSON: the job's
session id, id, kind, blocks and {stage: ns}), and a client keeps its own
stamps in memory (`client_stamps`), for a benchmark in the same process to
join with the daemon's. Times are CLOCK_MONOTONIC nanoseconds
(time.perf_counter_ns on Linux), which every process of one host shares.
"""

from __future__ import annotations

import json
import os
import threading
import time

PATH = os.environ.get("KVDEPOT_TRACE_JOBS", "")
ON = bool(PATH)
now = time.perf_counter_ns

# A client's stamps per (session id, job id); bounded so that a long run
# with tracing left on cannot grow without end.
MAX_CLIENT_JOBS = 100_000
client_stamps: dict[tuple[str, int], dict[str, int]] = {}
_lock = threading.Lock()
_file = None


def client_stamp(session_id: str, job_id: int, stage: str) -> None:
    with _lock:
        stamps = client_stamps.get((session_id, job_id))
        if stamps is None:
            if len(client_stamps) >= MAX_CLIENT_JOBS:
                return
            stamps = client_stamps[(session_id, job_id)] = {}
        stamps[stage] = now()


def write_job(session_id: str, job_id: int, kind: str, blocks: int, stamps: dict[str, int]) -> None:
    """Appends a finished job's stamps to the trace file (the daemon's side)."""
    global _file
    if _file is None:
        _file = open(PATH, "a", buffering=1)  # a line per job: readable while the daemon runs
    line = {"session": session_id, "job": job_id, "kind": kind, "blocks": blocks, "stamps": stamps}
    _file.write(json.dumps(line) + "\n")
