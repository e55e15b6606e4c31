"""On a GPU host the CUDA transport comes up after the daemon serves (torch
takes seconds to import; the pool is pinned without it). A worker that
registers before then waits for it rather than being refused, everything
else is answered meanwhile, and if the transport never comes up the worker
is told why. Tried with the shared-memory transport held the same way
(tests/daemon_with_late_transport.py), since CI has no GPU."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from kvcache import make_kv_cache, namespace, prompt_keys
from test_edge_bounds import attack_as_nobody
from test_trust import needs_second_uid, start_shared

from kvdepot.errors import COMING_UP, FailedPrecondition

LAUNCHER = str(Path(__file__).with_name("daemon_with_late_transport.py"))


def late_daemon(start_daemon, tmp_path, lane, fails=""):
    gate = tmp_path / "transport-gate"
    gate.touch()
    env = {"KVDEPOT_TEST_TRANSPORT_GATE": str(gate), "KVDEPOT_LANE": lane}
    if fails:
        env["KVDEPOT_TEST_TRANSPORT_FAILS"] = fails
    return start_daemon(launcher=LAUNCHER, env=env), gate


def register_in_background(client, tensors, block_dim):
    result = {}

    def run():
        try:
            result["worker"] = client.register_worker(namespace("per_layer"), rank=0, tensors=tensors,
                                                      block_dim=block_dim)
        except Exception as e:  # the test looks at it
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def stores_and_loads_back(client, worker, tensors, keys) -> None:
    """Blocks 0.. stored under `keys`, zeroed, loaded back: every byte as it was."""
    n = len(keys)
    job = client.submit_store(worker, 1, keys, list(range(n)))
    assert client.wait([job], 30)[job].ok
    saved = [t[:, 0:n].clone() for t in tensors]
    for t in tensors:
        t[:, 0:n] = 0
    job = client.submit_load(worker, 2, keys, list(range(n)))
    assert client.wait([job], 30)[job].ok
    for t, want in zip(tensors, saved, strict=True):
        assert torch.equal(t[:, 0:n], want)


@pytest.mark.parametrize("lane", ["python", "native"])
def test_a_worker_registering_before_its_transport_is_up_waits_for_it(start_daemon, client_factory, tmp_path, lane):
    daemon, gate = late_daemon(start_daemon, tmp_path, lane)
    client = client_factory(daemon, name="early")
    tensors, block_dim = make_kv_cache("per_layer", 3)
    thread, result = register_in_background(client, tensors, block_dim)
    # Meanwhile the daemon answers (another client: one client's registrations go one at a time).
    other = client_factory(daemon, name="meanwhile")
    engine = other.register_engine(namespace("per_layer"))
    keys = prompt_keys(8, prompt=1)
    assert other.lookup(engine, keys).ready_blocks == 0
    thread.join(1.0)
    assert thread.is_alive() and not result, f"the registration did not wait: {result}"

    gate.unlink()
    thread.join(10)
    assert not thread.is_alive() and "error" not in result, result
    stores_and_loads_back(client, result["worker"], tensors, keys)
    assert other.lookup(engine, keys).ready_blocks == 8


def test_a_worker_asks_again_when_its_transport_outlasts_its_calls_deadline(start_daemon, client_factory, tmp_path):
    """The daemon answers "coming up" before the caller's deadline (not a
    timeout, which a client takes for a daemon gone), and the client asks
    again until the transport is up."""
    daemon, gate = late_daemon(start_daemon, tmp_path, "native")
    client = client_factory(daemon, name="impatient", call_timeout=2.0)
    tensors, block_dim = make_kv_cache("per_layer", 4)
    thread, result = register_in_background(client, tensors, block_dim)
    time.sleep(4.5)  # two of its calls' deadlines
    assert thread.is_alive() and not result, f"the registration gave up or went on: {result}"
    gate.unlink()
    thread.join(10)
    assert not thread.is_alive() and "error" not in result, result
    keys = prompt_keys(4, prompt=5)
    job = client.submit_store(result["worker"], 1, keys, list(range(4)))
    assert client.wait([job], 30)[job].ok


def test_a_transport_that_never_comes_up_refuses_its_workers_and_says_why(start_daemon, client_factory, tmp_path):
    daemon, gate = late_daemon(start_daemon, tmp_path, "native", fails="CUDA's libraries did not load (a test)")
    client = client_factory(daemon, name="early")
    tensors, block_dim = make_kv_cache("per_layer", 3)
    thread, result = register_in_background(client, tensors, block_dim)
    thread.join(1.0)
    assert thread.is_alive()
    gate.unlink()
    thread.join(10)
    error = result.get("error")
    assert isinstance(error, FailedPrecondition), result
    assert "transport did not start: CUDA's libraries did not load (a test)" in str(error)
    # The daemon goes on serving everything else.
    engine = client_factory(daemon, name="after").register_engine(namespace("per_layer"))
    assert engine.namespace_name


@needs_second_uid
def test_one_user_cannot_pile_up_waiting_registrations_and_anothers_registration_goes_on(
    open_folder, start_daemon, client_factory, tmp_path
):
    """A second uid floods RegisterWorker calls while the transport comes up:
    past --max-waiting-registrations-per-uid they are answered at once, coming
    up (each waiting call holds its request), the count comes back down as
    its calls end, and this uid's own registration waits and then registers."""
    gate = tmp_path / "transport-gate"
    gate.touch()
    daemon = start_shared(start_daemon, open_folder, launcher=LAUNCHER, max_waiting_registrations_per_uid="4",
                          env={"KVDEPOT_TEST_TRANSPORT_GATE": str(gate)})
    attacker, report = attack_as_nobody("wait-flood", daemon.socket, "40:4")
    try:
        assert report["waiting"] == 4, report
        assert report["codes"] == {"UNAVAILABLE": 36}, report
        assert report["refusal"].startswith(COMING_UP), report
        assert "--max-waiting-registrations-per-uid 4" in report["refusal"], report
        client = client_factory(daemon, name="victim")
        tensors, block_dim = make_kv_cache("per_layer", 3)
        thread, result = register_in_background(client, tensors, block_dim)
        thread.join(1.0)
        assert thread.is_alive() and not result, f"this uid's registration did not wait: {result}"
        # Its calls cancelled, the attacker's uid may wait again, as many as before and no more.
        attacker.stdin.write("\n")
        attacker.stdin.flush()
        again = json.loads(attacker.stdout.readline())
        assert again["waiting"] == 4 and again["codes"] == {"UNAVAILABLE": 1}, again
    except BaseException:
        attacker.kill()  # told nothing more: it would flood again for minutes
        raise
    finally:
        attacker.stdin.close()
        attacker.wait(30)
    gate.unlink()
    thread.join(10)
    assert not thread.is_alive() and "error" not in result, result
    stores_and_loads_back(client, result["worker"], tensors, prompt_keys(8, prompt=7))
    assert daemon.running
