"""A CPU client never maps the daemon's pool: it hands the daemon a staging
memory of its own, and the daemon copies. Across a daemon restart the same
memory is handed to the new daemon, and nothing of the old pool stays mapped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env

POOL_CLIENT = str(Path(__file__).resolve().parent / "pool_client.py")


def mapped_pools(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if ".pool" in line}


def staging_mappings(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[0] for line in f if "memfd:kvdepot-staging" in line}


def test_a_cpu_client_never_maps_the_pool_and_keeps_its_staging_across_a_restart(daemon):
    proc = subprocess.Popen([sys.executable, POOL_CLIENT, daemon.socket], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())

    def ask(command: str) -> dict:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        return json.loads(line)

    try:
        started = json.loads(proc.stdout.readline())
        assert ask("store 1")["ok"]
        assert mapped_pools(proc.pid) == set()
        staging = staging_mappings(proc.pid)
        assert len(staging) == 1

        daemon.stop()
        daemon.start()
        now = ask(f"attached {started['instance']}")["instance"]
        assert now != started["instance"]
        assert ask("store 2") == {"ok": True, "instance": now}
        assert mapped_pools(proc.pid) == set()
        assert staging_mappings(proc.pid) == staging
    finally:
        proc.kill()
        proc.wait(10)
