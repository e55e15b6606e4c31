"""Fixtures that start the real daemon as a subprocess on a real socket."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The vLLM tests make their tiny model locally; nothing may be downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every block index, in process and in the daemons the tests start, recomputes
# its derived counts after each mutation and fails on a difference.
os.environ.setdefault("KVDEPOT_CHECK_INDEX", "1")
# Without it vLLM's CPU build sizes its KV cache from the machine's memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def pytest_runtest_setup(item):
    # A connector test must fail, not skip, where vLLM is missing: CI installs
    # it (make test), and a silent skip would hide a broken install step.
    if item.get_closest_marker("vllm"):
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            pytest.fail(f"vLLM is not importable ({e}); `make test` installs it (scripts/install-vllm-cpu)")


def subprocess_env(**extra: str) -> dict:
    env = dict(os.environ)
    # The checkout under test, installed or not.
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    # Test daemons serve no metrics unless a test asks: many run at once, and
    # the default port would let only one of them start.
    env["KVDEPOT_METRICS_LISTEN"] = "none"
    env.update(extra)
    return env


class Daemon:
    """A kvdepotd process. The pool file goes in the test's folder, never /dev/shm,
    so a daemon killed by a test leaves nothing behind."""

    def __init__(self, folder: Path, env: dict | None = None, launcher: str | None = None, **options):
        self.folder = folder
        self.env = env or {}
        # A script of the tests' that runs the daemon instead of `-m kvdepot.server`.
        self.launcher = launcher
        self.socket = str(folder / "kvdepot.sock")
        self.options = {"pool_size": "4MiB", "slot_size": "16KiB", "pin": "off", "pool_dir": str(folder)}
        self.options.update(options)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def args(self) -> list[str]:
        args = [sys.executable, self.launcher] if self.launcher else [sys.executable, "-m", "kvdepot.server"]
        if "listen" not in self.options:
            args += ["--listen", self.socket]
        for name, value in self.options.items():
            if value is not None:  # None: the daemon's own default
                args += ["--" + name.replace("_", "-"), str(value)]
        return args

    def start(self, wait: bool = True) -> Daemon:
        self.starts += 1
        self.log_path = self.folder / f"kvdepotd-{self.starts}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args(), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=subprocess_env(**self.env))
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvdepotd exited with {self.proc.returncode}:\n{self.log()}")
            if b"ready on" in self.log_path.read_bytes():
                return
            time.sleep(0.05)
        raise TimeoutError(f"kvdepotd not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, and the exit code once it is gone."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._log.close()
        return code

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def start_daemon(tmp_path):
    """Starts daemons; each still running at the end must exit 0 on SIGTERM."""
    daemons: list[Daemon] = []
    shm_folders: list[str] = []

    def start(folder: Path | None = None, wait: bool = True, env: dict | None = None, launcher: str | None = None,
              **options) -> Daemon:
        folder = folder or tmp_path / f"d{len(daemons)}"
        folder.mkdir(exist_ok=True)
        if options.get("pool_dir") == "/dev/shm":
            # A pool that must be pinnable goes in shared memory; pools outlive
            # their daemon (for the next to adopt), so each gets a folder there
            # of its own, removed with what is in it at the end.
            options["pool_dir"] = tempfile.mkdtemp(dir="/dev/shm", prefix="kvdepot-test-")
            shm_folders.append(options["pool_dir"])
        daemon = Daemon(folder, env=env, launcher=launcher, **options)
        daemons.append(daemon)
        return daemon.start(wait=wait)

    try:
        yield start
        for daemon in daemons:
            if daemon.running:
                code = daemon.stop()
                assert code == 0, f"kvdepotd exited {code} on SIGTERM:\n{daemon.log()}"
    finally:
        for folder in shm_folders:
            shutil.rmtree(folder, ignore_errors=True)
        # Pools outlive their daemons; pytest keeps the last runs' folders,
        # where a few hundred test pools would hold a GiB or more.
        for daemon in daemons:
            if not daemon.running:
                for pool in [*daemon.folder.glob("*.pool"), *daemon.folder.glob("*.pool.*")]:
                    pool.unlink(missing_ok=True)


@pytest.fixture
def daemon(start_daemon) -> Daemon:
    return start_daemon()


@pytest.fixture
def start_held_daemon(start_daemon, tmp_path):
    """Starts daemons whose shared-memory copies a test can hold
    (tests/daemon_with_held_copies.py): `daemon.hold(job_id)` keeps that job
    in flight (every job without an id) until `daemon.release(job_id)`.
    Everything is released before the daemons are stopped."""
    gates: list[Path] = []

    def start(env: dict | None = None, **options) -> Daemon:
        gate = tmp_path / f"copy-gate-{len(gates)}"
        gate.mkdir()
        gates.append(gate)
        env = {**(env or {}), "KVDEPOT_TEST_COPY_GATE": str(gate)}
        daemon = start_daemon(env=env, launcher=str(Path(__file__).with_name("daemon_with_held_copies.py")), **options)
        daemon.hold = lambda job_id=None: (gate / f"hold-{job_id or 'all'}").touch()
        daemon.release = lambda job_id=None: (gate / f"hold-{job_id or 'all'}").unlink(missing_ok=True)
        return daemon

    yield start
    for gate in gates:
        for hold in gate.glob("hold-*"):
            hold.unlink()


@pytest.fixture
def client_factory():
    from kvdepot.client import KVDepotClient

    clients = []

    def make(daemon: Daemon, name: str = "test", **kwargs) -> KVDepotClient:
        client = KVDepotClient(daemon.socket, name=name, **kwargs)
        clients.append(client)
        return client.connect(10)

    yield make
    for client in clients:
        client.close()


def lane_env(lane: str) -> dict:
    """The environment of a daemon on `lane` ("python" or "native"); skips
    the test where the native lane is not built."""
    if lane == "native":
        binding = pytest.importorskip("kvdepot.server.native.binding")
        try:
            binding.load()
        except OSError as e:
            pytest.skip(f"the native lane is not built ({e})")
    return {"KVDEPOT_LANE": lane}


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout} s")


def settled(read, quiet: float = 0.5, timeout: float = 20.0, what: str = "a count settling"):
    """`read()` once it has not changed for `quiet` seconds (a background
    writer caught up); a fixed sleep guesses how long that takes."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return value
    raise AssertionError(f"{what}: still changing after {timeout} s")


@pytest.fixture
def open_folder():
    """A daemon folder every uid can reach (pytest's own are root's alone), for
    tests that attack from a second uid. Requested before start_daemon, so it is
    removed after the daemons stop."""
    folder = Path(tempfile.mkdtemp(prefix="kvdepot-open-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
