"""Clients and the daemon killed with SIGKILL at random points (tests/chaos.py):
no corrupt byte is ever loaded, every surviving client reconnects by itself,
and nothing stays pinned. bench/chaos.py runs many more rounds.

KVDEPOT_CHAOS_ROUNDS and KVDEPOT_CHAOS_SEED run it longer, or from elsewhere.
"""

from __future__ import annotations

import os

from chaos import run_chaos

ROUNDS = int(os.environ.get("KVDEPOT_CHAOS_ROUNDS", "6"))
SEED = int(os.environ.get("KVDEPOT_CHAOS_SEED", "3"))


def test_kill_9_of_clients_and_daemon_loses_no_byte_and_no_slot(tmp_path):
    summary = run_chaos(tmp_path, rounds=ROUNDS, clients=4, seed=SEED)
    assert summary["problems"] == [], "\n".join(summary["problems"])
    # The run did what it is for: both kinds of kill, and loads checked across them.
    assert summary["daemon_kills"] >= 1 and summary["client_kills"] >= 1, summary
    assert summary["counts"].get("blocks verified", 0) > 0, summary
