"""Wrong credentials on TCP: a guesser from another uid is logged now and then
and slowed, while a right token is answered as before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env
from test_daemon_lifecycle import free_port
from test_trust import as_uid, needs_second_uid

from kvdepot.server.api import auth_throttle
from kvdepot.server.api.auth_throttle import WrongCredentialThrottle, peer_host

ATTACKER = str(Path(__file__).with_name("attacker.py"))


@needs_second_uid
def test_wrong_tokens_are_logged_now_and_then_and_slowed(start_daemon, tmp_path):
    from kvdepot.client import OperatorClient

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(listen=address, auth_token_file=str(token_file))

    guesses = 12
    proc = subprocess.run([*as_uid(65534), sys.executable, ATTACKER, "guess", address, str(guesses)],
                          capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    answers = json.loads(proc.stdout)
    assert answers["codes"] == ["UNAUTHENTICATED"] * guesses
    # Past the free ones, each wrong answer waits twice as long as the one before (up to a bound).
    free = auth_throttle.FREE_FAILURES
    delays = [min(auth_throttle.MOST_DELAY_S, auth_throttle.FIRST_DELAY_S * 2**i) for i in range(guesses - free)]
    # (Less a tenth: an event loop's timers may round to milliseconds.)
    assert sum(answers["seconds"][free:]) >= 0.9 * sum(delays)
    assert answers["seconds"][-1] >= 0.9 * auth_throttle.MOST_DELAY_S
    refusals = [line for line in daemon.log().splitlines() if "refused a TCP call from ipv4:127.0.0.1" in line]
    assert 1 <= len(refusals) <= 2, refusals
    # The right token still gets in from the guesser's host (only wrong answers wait).
    assert OperatorClient(address, auth_token="s3cret").stats().pool.num_slots


def test_wrong_answers_to_one_peer_are_spaced_out_however_many_at_once():
    now = [100.0]
    throttle = WrongCredentialThrottle(clock=lambda: now[0], max_peers=3)
    peer = "ipv4:10.0.0.7:40000"
    assert [throttle.failed(peer)[0] for _ in range(auth_throttle.FREE_FAILURES)] == [0.0] * 5
    # Calls made at once (no time passes) are answered one delay after another.
    waits = [throttle.failed(f"ipv4:10.0.0.7:{40001 + i}")[0] for i in range(6)]
    assert waits == sorted(waits) and waits[1] - waits[0] >= auth_throttle.FIRST_DELAY_S * 2 - 1e-9
    assert max(waits) <= auth_throttle.MAX_WAIT_S
    # Another host is not slowed by this one's failures.
    assert throttle.failed("ipv4:10.0.0.8:1")[0] == 0.0
    # Memory of peers is bounded; a quiet peer is forgotten.
    for i in range(10):
        throttle.failed(f"ipv6:[fd00::{i}]:1")
    assert throttle.peers == 3
    now[0] += auth_throttle.FORGET_AFTER_S + 1
    assert throttle.failed("ipv6:[fd00::9]:2") == (0.0, 1)


def test_peer_host_drops_the_port():
    assert peer_host("ipv4:127.0.0.1:5000") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:%5B::1%5D:5000") == "ipv6:%5B::1%5D"
    assert peer_host("unix:/run/kvdepot.sock") == "unix:/run/kvdepot.sock"
