"""Whichever start-up step fails, the daemon leaves nothing taken: its address
(a second daemon can serve it), the metrics port, the disk tier's folder, the
pool's mapping and file, its threads, files and signal handlers. The daemon
runs in this process (serve()), with a real configuration in the test's
folder; each case makes one step raise, as a full disk or a refused bind would.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import os
import signal
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot.server.daemon import main, startup
from kvdepot.server.daemon.config import load_config
from kvdepot.server.daemon.startup import StartupError
from kvdepot.server.host import pidlock
from kvdepot.server.tiers.disk_store import DiskTier

# In the order serve() takes them; each raises in its turn.
STEPS = [
    (startup, "take_address"),
    (main, "choose_pool_dir"),
    (main, "pick_pool_file"),
    (startup, "open_metrics"),
    (startup, "open_pool"),
    (main, "scope_quotas"),
    (main, "wire_depot"),
    (main, "open_tiers"),
    (main, "open_disk_tier"),
    (main, "add_transports"),
    (startup, "open_job_socket"),
    (startup, "open_grpc_server"),
    (startup, "start_housekeeping"),
    # The last thing start-up does: everything before it is taken.
    (main, "notify_systemd"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def setup(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    port = free_port()
    config = load_config(
        ["--listen", str(folder / "kvdepot.sock"), "--pool-size", "4MiB", "--slot-size", "16KiB", "--pin", "off",
         "--pool-dir", str(folder), "--metrics-listen", f"127.0.0.1:{port}", "--disk-dir", str(tmp_path / "disk"),
         "--disk-size", "16MiB", "--drain-timeout", "1"],
        environ={},
    )
    # As under nohup or in a background job: a failed start must leave the
    # handler it found, not Python's default.
    was = signal.signal(signal.SIGINT, signal.SIG_IGN)
    before = Taken.now(tmp_path)
    yield config, port, tmp_path, before
    signal.signal(signal.SIGINT, was)


class Taken:
    """What this process holds that a daemon's start could leave behind."""

    def __init__(self, threads, fds, handlers):
        self.threads, self.fds, self.handlers = threads, fds, handlers

    @classmethod
    def now(cls, folder) -> Taken:
        fds = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except FileNotFoundError:
                continue
            if target.startswith(str(folder)):
                fds.add(target)
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        return cls({t.ident for t in threading.enumerate()}, fds, handlers)


def assert_nothing_left(config, port, folder, before: Taken, pool_kept: bool):
    sock = config.network.listen
    # The address: a second daemon could take its lock, and no socket is left.
    fd, holder = pidlock.take(sock + ".lock")
    assert fd >= 0, f"the address lock is still held (by pid {holder})"
    os.close(fd)
    assert not os.path.exists(sock) and not os.path.exists(sock + ".jobs")
    # The metrics port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    # The disk tier's folder.
    if os.path.isdir(config.tiers.disk_dir):
        DiskTier(config.tiers.disk_dir, config.tiers.disk_size, segment_bytes=1 << 20).close()
    # The pool: unmapped; its file kept only for a daemon that served.
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if config.pool.dir in line]
    assert not mapped, mapped
    pools = list((folder / "run").glob("*.pool"))
    assert len(pools) == (1 if pool_kept else 0), pools
    catalogs = list((folder / "run").glob("*.namespaces.json"))
    assert len(catalogs) == (1 if pool_kept else 0), catalogs
    # Threads end a little after they are told to.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t.ident not in before.threads]
        if not extra:
            break
        time.sleep(0.05)
    assert not extra, f"threads left: {[t.name for t in extra]}"
    after = Taken.now(folder)
    assert after.fds <= before.fds, f"files left open: {sorted(after.fds - before.fds)}"
    assert after.handlers == before.handlers


def failing(module, name):
    original = getattr(module, name)
    error = OSError(errno.ENOSPC, f"injected failure of {name}")
    if inspect.iscoroutinefunction(original):
        async def fail(*args, **kwargs):
            raise error
    else:
        def fail(*args, **kwargs):
            raise error
    return fail


@pytest.mark.parametrize("module, name", STEPS, ids=[name for _, name in STEPS])
def test_a_failed_start_leaves_nothing_taken(setup, monkeypatch, module, name):
    config, port, folder, before = setup
    monkeypatch.setattr(module, name, failing(module, name))
    with pytest.raises(StartupError, match=f"injected failure of {name}") as info:
        asyncio.run(main.serve(config))
    assert info.value.exit_code == 1
    assert_nothing_left(config, port, folder, before, pool_kept=False)


def test_every_step_is_injected_above():
    source = inspect.getsource(main.start) + inspect.getsource(main.wire_depot) + inspect.getsource(main.open_tiers)
    for _module, name in STEPS:
        assert f"{name}(" in source, f"start-up no longer calls {name}: update STEPS"


def test_a_daemon_that_served_and_stopped_leaves_only_its_pool(setup):
    config, port, folder, before = setup

    async def serve_then_stop():
        stop = asyncio.Event()
        served = asyncio.create_task(main.serve(config, stop))
        async with grpc.aio.insecure_channel("unix:" + config.network.listen) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=startup.SERVICE_NAME), timeout=30, wait_for_ready=True
            )
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        stop.set()
        return await served

    assert asyncio.run(serve_then_stop()) == 0
    # The pool stays for the next daemon on this address to adopt.
    assert_nothing_left(config, port, folder, before, pool_kept=True)


def test_a_taken_metrics_port_is_a_startup_error_of_exit_code_2(setup):
    config, port, folder, before = setup
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(StartupError, match="give --metrics-listen a free HOST:PORT") as info:
            asyncio.run(main.serve(config))
    assert info.value.exit_code == 2
    assert_nothing_left(config, port, folder, before, pool_kept=False)
