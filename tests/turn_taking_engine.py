"""An engine process for tests/test_engine_turns.py: serves `count` requests through
bench/engine_turns.py's EngineSide, logging when each starts and ends; exits 3 before request
`die_at` (an engine that dies mid-run)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import engine_turns  # noqa: E402

label, count, die_at, log_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
side = engine_turns.EngineSide.from_env()
with open(log_path, "a") as log:
    for i in range(count):
        if i == die_at:
            sys.exit(3)
        side.before(f"req-{i}")
        log.write(f"{label} start {i} {time.monotonic()}\n")
        log.flush()
        time.sleep(0.02)  # the request's work
        log.write(f"{label} end {i} {time.monotonic()}\n")
        log.flush()
        side.after(f"req-{i}")
