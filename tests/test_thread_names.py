"""The daemon's threads carry their names in the kernel (`top -H`, /proc/PID/task/*/comm),
so that an operator can tell the event loop from the copy and sealing threads."""

from __future__ import annotations

import time
from pathlib import Path

from conftest import wait_until
from kvcache import attach_worker, prompt_keys


def _thread_names(pid: int) -> set[str]:
    names = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.add((task / "comm").read_text().strip())
        except OSError:
            pass
    return names


def test_the_daemons_threads_are_named_for_the_kernel(start_daemon, client_factory):
    daemon = start_daemon()
    client = client_factory(daemon)
    worker, _, _ = attach_worker(client, seed=3)
    # A job larger than what the event loop copies itself takes a copy thread.
    job = client.submit_store(worker, 1, prompt_keys(96, prompt=5), list(range(96)))
    assert client.wait([job], 30)[job].ok
    deadline = time.monotonic() + 10
    wanted = {"kvdepot-shm-0", "kvdepot-shm-1", "kvdepot-seal"}

    def named() -> set[str]:
        # The Python lane's sealer is a pool's thread: kvdepot-seal_0.
        return {name.removesuffix("_0") for name in _thread_names(daemon.proc.pid)}

    while not wanted <= named() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert wanted <= named()


def test_the_pools_bring_up_threads_are_named_for_the_kernel(start_daemon, client_factory, tmp_path):
    """The thread that brings the pool up behind the daemon's start, and those
    that fault its pages in, show by name while they work (a large pool takes
    seconds): held here after the first chunk (tests/daemon_with_held_bring_up.py)."""
    gate = tmp_path / "bring-up-gate"
    gate.touch()
    daemon = start_daemon(pool_size="1MiB", pin_chunk_bytes="64KiB",
                          launcher=str(Path(__file__).with_name("daemon_with_held_bring_up.py")),
                          env={"KVDEPOT_TEST_BRING_UP_GATE": str(gate)})
    client = client_factory(daemon)
    assert client.stats().pool.online_slots < client.stats().pool.num_slots  # still coming up
    wait_until(lambda: "kvdepot-bringup" in _thread_names(daemon.proc.pid), what="the bring-up thread named")
    wait_until(lambda: any(name.startswith("kvdepot-fault") for name in _thread_names(daemon.proc.pid)),
               what="the threads that fault the pool in named")
    gate.unlink()
    wait_until(lambda: client.stats().pool.online_slots == client.stats().pool.num_slots, what="the pool up")
