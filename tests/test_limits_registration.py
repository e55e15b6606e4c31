"""What one client can make the daemon hold, compute or count is bounded.

Each attack runs in a second process (tests/hostile_client.py, raw gRPC)
against the real daemon, while a well-behaved client of this process checks
that it is still served and that its blocks are intact.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from conftest import subprocess_env, wait_until
from kvcache import attach_worker, prompt_keys

from kvdepot.proto import kvdepot_pb2 as pb

HOSTILE = str(Path(__file__).resolve().parent / "hostile_client.py")
# A lookup the daemon does not answer within this long means its loop is stuck.
ANSWER_WITHIN_S = 10


class Hostile:
    """tests/hostile_client.py running as a second process, its answers read as they come."""

    def __init__(self, daemon, *args: str):
        self.proc = subprocess.Popen([sys.executable, HOSTILE, daemon.socket, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=subprocess_env())
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def until(self, case: str, timeout: float = 120) -> list[dict]:
        """Its answers up to the first of `case`, that one last."""
        got = []
        while True:
            try:
                answer = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"the hostile client reported no {case} within {timeout} s") from None
            assert answer is not None, f"the hostile client ended without reporting {case}"
            got.append(answer)
            if answer["case"] == case:
                return got

    def all(self, timeout: float = 300) -> list[dict]:
        """Every answer, once it has exited."""
        assert self.proc.wait(timeout) == 0
        got = []
        while (answer := self.lines.get(timeout=10)) is not None:
            got.append(answer)
        return got

    def finish(self) -> None:
        """Lets a client waiting on its stdin exit."""
        self.proc.communicate("\n", timeout=30)


@pytest.fixture
def hostile():
    started: list[Hostile] = []

    def start(daemon, *args: str) -> Hostile:
        started.append(Hostile(daemon, *args))
        return started[-1]

    yield start
    for h in started:
        if h.proc.poll() is None:
            h.proc.kill()
            h.proc.wait(10)


def stored(client, worker, job_id: int, keys) -> int:
    """Stores keys into blocks 0...; how many were not stored for want of a free slot."""
    job = client.submit_store(worker, job_id, keys, list(range(len(keys))))
    result = client.wait([job], 10)[job]
    assert result.ok, result.error
    return result.not_stored


def lookup(client, engine, keys) -> int:
    """A raw Lookup with a deadline: the daemon answers, or the test fails."""
    request = pb.LookupRequest(session_id=client._connection.session_id, engine_id=engine.engine_id, keys=keys)
    return client._connection.stub.Lookup(request, timeout=ANSWER_WITHIN_S).ready_blocks


def served_while(h: Hostile, client, engine, keys) -> list[dict]:
    """Looks up `keys` again and again until the hostile process ends: every
    lookup must be answered, and find every block."""
    looked_up = 0
    while h.proc.poll() is None:
        assert lookup(client, engine, keys) == len(keys)
        looked_up += 1
    assert looked_up > 0
    return h.all()


EXPECTED = {
    "tp_size": ("INVALID_ARGUMENT", "namespace.tp_size 4294967295 is more than --max-tp-size (64)"),
    "tp_size_worker": ("INVALID_ARGUMENT", "more than --max-tp-size (64)"),
    "rank": ("INVALID_ARGUMENT", "rank 4294967295 is outside tp_size 1"),
    "long_model": ("INVALID_ARGUMENT", "namespace.model has 1048576 characters, more than --max-name-length (512)"),
    "newline_model": ("INVALID_ARGUMENT", "namespace.model has control characters"),
    "long_extra": ("INVALID_ARGUMENT", "namespace.extra has 1048576 characters"),
    "long_device": ("INVALID_ARGUMENT", "device has 1048576 characters"),
    "long_tensor_name": ("INVALID_ARGUMENT", "tensor 0 name has 1048576 characters"),
    "long_dtype": ("INVALID_ARGUMENT", "unknown dtype 'xxxx"),
    "many_tensors": ("INVALID_ARGUMENT", "4096 tensors; a worker registers at most 1024 (--max-tensors-per-worker)"),
    "many_dims": ("INVALID_ARGUMENT", "1 to 8 dimensions, not 64"),
    "huge_dims": ("INVALID_ARGUMENT", "sizes and strides are at most 281474976710656 (2^48) elements"),
    "huge_stride": ("INVALID_ARGUMENT", "sizes and strides are at most 281474976710656 (2^48) elements"),
    "huge_offset": ("INVALID_ARGUMENT", "byte_offset 9223372036854775807 is outside 0 to 2^62"),
    "far_end": ("INVALID_ARGUMENT", "past 2^62"),
    "clear_unknown": ("NOT_FOUND", "no namespace 'xxxx"),
    "unknown_session": ("NOT_FOUND", "unknown session: attach first"),
    "negative_dims_0": ("INVALID_ARGUMENT", "tensor 511 ('t'): every dimension must be at least 1"),
    "negative_dims_1": ("INVALID_ARGUMENT", "every dimension must be at least 1"),
    "negative_dims_2": ("INVALID_ARGUMENT", "every dimension must be at least 1"),
    # The most work a registration may ask for is done in full (its layout),
    # up to the last check: this worker handed over no staging memory.
    "most_pages": ("INVALID_ARGUMENT", "no staging memory 0 in this session"),
}


def test_the_worst_registrations_get_their_error_and_others_keep_being_served(start_daemon, client_factory, hostile):
    # 2 MiB slots, the default: a slot of 1-byte pages is 2M page offsets to compute.
    daemon = start_daemon(pool_size="16MiB", slot_size="2MiB")
    client = client_factory(daemon, name="good")
    worker, engine, _ = attach_worker(client, seed=3)
    keys = prompt_keys(4, prompt=5)
    assert stored(client, worker, 1, keys) == 0

    got = {answer["case"]: answer for answer in served_while(hostile(daemon, "registrations"), client, engine, keys)}
    assert set(got) == set(EXPECTED)
    for case, (code, message) in EXPECTED.items():
        assert (got[case]["code"], case) == (code, case), got[case]["details"]
        assert message in got[case]["details"], (case, got[case]["details"][:300])
        # An error repeats a client's string only in part: it stays small.
        assert len(got[case]["details"]) < 1000, case
    assert daemon.running
    assert "forged log line" not in daemon.log().replace("\\n2026 ERROR forged log line", "")
    assert lookup(client, engine, keys) == len(keys)


@pytest.mark.parametrize("what, option, limit, options", [
    ("engines", "--max-engines-per-session", 64, {}),
    ("workers", "--max-workers-per-session", 64, {}),
    ("jobs", "--max-jobs-per-session", 16, {"max_jobs_per_session": 16}),
])
def test_a_session_registers_and_runs_a_bounded_number_of_things(start_held_daemon, client_factory, hostile, what,
                                                                 option, limit, options):
    daemon = start_held_daemon(**options)
    client = client_factory(daemon, name="good")
    worker, engine, _ = attach_worker(client, seed=3)
    if what == "jobs":
        for job_id in range(1, limit + 2):
            daemon.hold(job_id)  # the flood's stores stay in flight
    flood = hostile(daemon, "flood", what, "2000")
    *got, done = flood.until("flood")
    assert done["done"] == limit
    refused = got[-1]
    assert refused["code"] == "RESOURCE_EXHAUSTED"
    assert f"({option} {limit})" in refused["details"]
    # The other sessions are not held to this one's count.
    keys = prompt_keys(4, prompt=6)
    assert stored(client, worker, 1000, keys) == 0
    assert client.lookup(engine, keys).ready_blocks == 4
    flood.finish()


@pytest.mark.parametrize("kind", ["store", "load"])
def test_a_client_that_never_reads_its_replies_cannot_keep_the_pool_pinned(daemon, client_factory, hostile, kind):
    """Only the daemon writes the pool: a job ends when the daemon's copy does,
    whatever its client does next (here, nothing at all)."""
    client = client_factory(daemon, name="good")  # 256 slots
    worker, engine, _ = attach_worker(client, seed=3)
    keys = prompt_keys(4, prompt=7)

    rogue = hostile(daemon, "stall", "256", kind)
    assert rogue.until("stall")[-1]["blocks"] == 256
    stats = wait_until(lambda: (s := client.stats()).pinned_slots == 0 and s, timeout=20, what="its job done")
    assert stats.used_slots == 256 and stats.totals.failed_jobs == 0
    # The rogue's blocks are evicted for new ones like any others.
    assert stored(client, worker, 1, keys) == 0
    assert client.lookup(engine, keys).ready_blocks == 4
    rogue.finish()


def test_counts_a_client_reports_cannot_break_stats(daemon, client_factory, hostile):
    client = client_factory(daemon, name="good")
    got = hostile(daemon, "counters").all()
    huge = [a for a in got if a["case"] == "huge_counts"]
    assert len(huge) == 3
    for answer in huge:
        assert answer["code"] == "INVALID_ARGUMENT"
        assert "one report counts at most 4294967296" in answer["details"]
    assert all(a["code"] == "OK" for a in got if a["case"] == "many_counts")
    # 5000 reports of 2^52 hit blocks each pass 2^64: the counters stop there.
    stats = client.stats()
    assert stats.totals.hit_blocks == 2**64 - 1
    assert stats.totals.lookups == 5000 << 32
    cli = subprocess.run([sys.executable, "-m", "kvdepot.client.cli", "--socket", daemon.socket, "stats"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=60, check=False)
    assert cli.returncode == 0, cli.stderr
    assert f"lookups   {5000 << 32}: {2**64 - 1} blocks hit" in cli.stdout


def test_namespaces_of_ended_sessions_are_freed(daemon, client_factory, hostile):
    client = client_factory(daemon, name="good")
    attach_worker(client, seed=3)
    baseline = client.stats()
    assert len(baseline.namespaces) == 1
    # More than --max-namespaces (1024): were they kept, the last would be refused.
    got = hostile(daemon, "namespaces", "1500").all()
    assert got[-1] == {"case": "namespaces", "done": 1500}

    def back_to_baseline():
        stats = client.stats()
        return len(stats.namespaces) + stats.namespaces_omitted == 1 and stats
    stats = wait_until(back_to_baseline, what="namespaces freed")
    assert stats.namespaces[0].name == baseline.namespaces[0].name
    assert stats.ByteSize() < 16384


def test_live_namespaces_are_bounded_and_stats_lists_are_capped(start_daemon, client_factory, hostile):
    daemon = start_daemon(max_namespaces=8, stats_max_entries=3)
    client = client_factory(daemon, name="good")
    attach_worker(client, seed=3)
    flood = hostile(daemon, "flood", "namespaces", "100")
    assert flood.until("flood")[-1]["done"] == 7
    stats = client.stats()
    assert len(stats.namespaces) == 3 and stats.namespaces_omitted == 5
    # The hostile session; the asking one is not listed.
    assert len(stats.clients) == 1 and stats.clients_omitted == 0
    # The daemon holds no more; the good client's own namespace still works.
    with pytest.raises(grpc.RpcError) as refused:
        client._connection.stub.RegisterEngine(pb.RegisterEngineRequest(
            session_id=client._connection.session_id,
            namespace=pb.NamespaceSpec(model="one-more", block_size=16, tp_size=1, key_version=1)))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "(--max-namespaces 8)" in refused.value.details()
    # Once the flooding session ends, its namespaces go, and room comes back.
    flood.finish()
    wait_until(lambda: client.stats().namespaces_omitted == 0 and len(client.stats().namespaces) == 1,
               what="namespaces freed")
    client.register_engine({"model": "one-more", "block_size": 16, "tp_size": 1, "key_version": 1})


def test_limits_are_options_that_must_be_positive(tmp_path):
    from kvdepot.server.daemon.config import ConfigError, load_config

    config = load_config(["--max-tp-size", "8", "--max-shm-worker-bytes", "1GiB"],
                         environ={"KVDEPOT_MAX_NAMESPACES": "10"})
    limits = config.limits
    assert (limits.max_tp_size, limits.max_shm_worker_bytes, limits.max_namespaces) == (8, 1 << 30, 10)
    assert limits.max_engines_per_session == 64
    for argv in (["--max-tp-size", "0"], ["--max-shm-worker-bytes", "0"], ["--stats-max-entries", "-1"]):
        with pytest.raises(ConfigError, match=argv[0][2:].replace("-", "_")):
            load_config(argv, environ={})
