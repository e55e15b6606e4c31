"""With CUDA, the pool is pinned host memory (run with `pytest -m cuda` on a GPU machine)."""

from __future__ import annotations

import pytest
from conftest import wait_until

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("pin", ["on", "auto"])
def test_the_pool_is_registered_as_pinned_memory(start_daemon, client_factory, pin):
    # Only shared-memory pages can be pinned: the pool goes in /dev/shm here.
    # In chunks of 256 MiB: it serves with the first pinned, the rest come up behind.
    daemon = start_daemon(pin=pin, pool_size="4GiB", slot_size="2MiB", pool_dir="/dev/shm",
                          pin_chunk_bytes="256MiB")
    assert "pinned; serving with 256.00 MiB up, the rest coming up behind" in daemon.log()
    client = client_factory(daemon)
    stats = client.stats()
    assert stats.pool.pinned
    assert stats.pool.num_slots == 2048
    wait_until(lambda: client.stats().pool.online_slots == 2048, timeout=60, what="the whole pool up")
    wait_until(lambda: "pool up: all 4.00 GiB faulted in and pinned" in daemon.log(), what="the log saying so")


def test_pinning_a_pool_on_a_disk_filesystem_fails_with_advice(tmp_path):
    import subprocess
    import sys

    from conftest import subprocess_env

    from kvdepot.server.host.pool_folder import filesystem_type

    if filesystem_type(str(tmp_path)) in ("tmpfs", "hugetlbfs", "ramfs"):
        pytest.skip(f"{tmp_path} is in memory here")
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.server", "--listen", str(tmp_path / "s.sock"), "--pin", "on",
         "--pool-size", "64MiB", "--pool-dir", str(tmp_path)],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )
    assert proc.returncode == 1
    assert "set --pool-dir to /dev/shm" in proc.stderr
