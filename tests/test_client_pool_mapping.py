"""A CPU client maps the daemon's pool; once that daemon is gone the pool's
memory is freed only when no process maps it any more. A client that lives
across a daemon restart must not keep the old pool mapped (its RAM in use
beside the new daemon's pool) until it happens to copy again."""

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


def test_a_restarted_daemons_old_pool_is_unmapped_by_a_client_that_reattaches(daemon):
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
        old_pools = mapped_pools(proc.pid)
        assert len(old_pools) == 1
        old_pool = old_pools.pop()

        daemon.stop()
        daemon.start()
        now = ask(f"attached {started['instance']}")["instance"]
        assert now != started["instance"]
        # No copy has run since: the old pool is unmapped all the same (neither
        # the file nor its deleted pages), and the new one is mapped.
        pools = mapped_pools(proc.pid)
        assert not [p for p in pools if p.startswith(old_pool)], pools
        assert len(pools) == 1 and not pools.pop().endswith("(deleted)")
        assert ask("store 2") == {"ok": True, "instance": now}
    finally:
        proc.kill()
        proc.wait(10)
