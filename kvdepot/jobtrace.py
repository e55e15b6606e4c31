"""Per-stage timestamps of jobs: where a job's time goes between the worker's
submit call and its wait returning (`bench/job_trace.py` prints the stages).

Off unless the environment variable KVDEPOT_TRACE_JOBS names a file when the
process starts; off, a stage costs one test of a module constant. On, the
daemon appends one line per finished job to that file (JSON: `session_tag` of
the job's session, its id, kind, blocks and {stage: ns}; the file is the
daemon user's alone, and grows a line a job: for diagnosis, not to leave on),
and a client keeps its own stamps in memory (`client_stamps`), for a benchmark
in the same process to join with the daemon's. Times are CLOCK_MONOTONIC
nanoseconds (time.perf_counter_ns on Linux), which every process of one host
shares.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time

log = logging.getLogger("kvdepot.jobtrace")

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


def session_tag(session_id: str) -> str:
    """What the trace names a session by: a session id is a secret (whoever
    knows it acts as the session), so the file holds a hash of it, which the
    session's own client can compute."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:16]


def write_job(session_id: str, job_id: int, kind: str, blocks: int, stamps: dict[str, int]) -> None:
    """Appends a finished job's stamps to the trace file (the daemon's side).
    A file that cannot be written turns tracing off, with a warning: it runs
    after the job's end, which must not fail for it."""
    global _file, ON
    line = {"session": session_tag(session_id), "job": job_id, "kind": kind, "blocks": blocks, "stamps": stamps}
    try:
        if _file is None:
            fd = os.open(PATH, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            _file = os.fdopen(fd, "a", buffering=1)  # a line a job: readable while the daemon runs
        _file.write(json.dumps(line) + "\n")
    except OSError as e:
        ON = False
        log.warning("job tracing is off: cannot write %s (%s)", PATH, e)
