"""Requests from hypothesis, from a process of their own, against the real
daemon while a well-behaved client works beside them (tests/fuzz_client.py,
tests/fuzz_messages.py): every answer is a typed error or a success, the
daemon stays up and does not grow, its log stays its own, and the good
client's loads give back exactly the bytes it stored.

KVDEPOT_FUZZ_EXAMPLES and KVDEPOT_FUZZ_SEED run it longer, or from elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from conftest import subprocess_env, wait_until
from keyed_blocks import KeyedEngine
from kvcache import prompt_keys

from kvdepot.proto import kvdepot_pb2 as pb

FUZZER = str(Path(__file__).resolve().parent / "fuzz_client.py")
EXAMPLES = int(os.environ.get("KVDEPOT_FUZZ_EXAMPLES", "800"))
SEED = int(os.environ.get("KVDEPOT_FUZZ_SEED", "14"))
# A line of the daemon's text log; anything else (a traceback, a line a client
# forged with a newline in a name) is not the daemon speaking.
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def footprint(pid: int) -> tuple[int, int]:
    """The process's resident memory (bytes) and open file descriptors."""
    with open(f"/proc/{pid}/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kib << 10, len(os.listdir(f"/proc/{pid}/fd"))


def run_fuzzer(daemon, *args: str, timeout: float = 600) -> tuple[int, dict, str]:
    # Hypothesis keeps its caches in the test's folder, not the checkout.
    env = subprocess_env(HYPOTHESIS_STORAGE_DIRECTORY=str(daemon.folder / "hypothesis"))
    proc = subprocess.run(
        [sys.executable, FUZZER, daemon.socket, "--daemon-pid", str(daemon.proc.pid), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if lines else {}, proc.stderr[-5000:]


class GoodClient(threading.Thread):
    """Rounds of store, load and check, until told to stop."""

    def __init__(self, client):
        super().__init__(daemon=True)
        self.engine = KeyedEngine(client, model="good-model", seed=3)
        self.stop = threading.Event()
        self.rounds = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.engine.round(prompt_keys(4, prompt=5000 + self.rounds))
                self.rounds += 1
        except BaseException as e:
            self.error = e

    def halt(self) -> None:
        """Stops it, whatever happened: a thread left in a gRPC call when the
        interpreter exits aborts it (std::terminate)."""
        self.stop.set()
        self.join(60)

    def finish(self) -> None:
        self.halt()
        assert self.error is None, repr(self.error)


def test_fuzzed_requests_get_typed_errors_and_harm_no_other_client(start_daemon, client_factory):
    daemon = start_daemon(pool_size="16MiB")
    good = GoodClient(client_factory(daemon, name="good"))
    # Warm up first: the daemon's footprint is measured once it has served a client.
    for _ in range(3):
        good.engine.round(prompt_keys(4, prompt=4000 + good.rounds))
        good.rounds += 1
    before = footprint(daemon.proc.pid)
    verified_before = good.engine.counts["blocks verified"]
    good.start()
    try:
        code, report, stderr = run_fuzzer(daemon, "--seed", str(SEED), "--examples", str(EXAMPLES))
        assert daemon.running, f"the daemon died under fuzzing:\n{daemon.log()[-5000:]}"
        assert report, f"the fuzzer printed no report (exit {code}):\n{stderr}"
        assert report["problems"] == [], json.dumps(report["problems"][:10], indent=1)
        assert code == 0, stderr
        assert report["counts"]["examples"] == EXAMPLES

        # The fuzzer's sessions end with its process; the good client's lives on
        # (stats list every session but the asking one).
        wait_until(lambda: not good.engine.client.stats().clients, what="the fuzzer's sessions ended")
    finally:
        good.halt()
    good.finish()
    engine = good.engine
    assert engine.wrong == [], engine.wrong
    assert engine.counts["blocks verified"] > verified_before, engine.counts
    assert engine.counts.get("store ok", 0) == good.rounds, engine.counts

    # Connections that never had a session close as the daemon reads their end.
    wait_until(lambda: footprint(daemon.proc.pid)[1] - before[1] <= 16, what="the fuzzer's connections closed")
    rss, fds = footprint(daemon.proc.pid)
    assert rss - before[0] < 64 << 20, f"the daemon grew from {before[0] >> 20} MiB to {rss >> 20} MiB"
    assert fds - before[1] <= 16, f"the daemon holds {fds} file descriptors, {before[1]} before"
    foreign = [line for line in daemon.log().splitlines() if not LOG_LINE.match(line)]
    assert foreign == [], "lines the daemon did not write as log lines:\n" + "\n".join(map(repr, foreign[:20]))


def test_request_bytes_that_are_no_message_are_refused_as_invalid_argument(daemon):
    code, report, stderr = run_fuzzer(daemon, "--garbage", timeout=60)
    assert report, stderr
    assert report["problems"] == [], json.dumps(report["problems"], indent=1)
    # One call of each RPC of the service.
    methods = len(pb.DESCRIPTOR.services_by_name["KVDepot"].methods)
    assert report["counts"] == {"raw INVALID_ARGUMENT": methods}
    assert "Traceback" not in daemon.log()
