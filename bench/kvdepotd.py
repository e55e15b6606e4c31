"""A real kvdepotd for a benchmark: started in a folder of its own in /dev/shm,
waited for when the benchmark needs it (it pins its pool meanwhile), its log
shown if the benchmark fails, stopped and cleaned up at the end.

    with BenchDaemon("24GiB", slot_bytes) as daemon:
        daemon.wait_ready()
        daemon.wait_pool()  # before measuring, where the pool's bring-up would be in the figures
        client = KVDepotClient(daemon.socket, ...)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class BenchDaemon:
    def __init__(self, pool_size: str, slot_bytes: int | None, *, pin: str = "on", pool_dir: str | None = None,
                 extra=(), repo: Path | None = None):
        """extra: more daemon options (e.g. --staging-bytes); slot_bytes None:
        the daemon's default; repo: the source tree whose daemon runs (this
        one's by default). The daemon inherits this process's environment
        (KVDEPOT_* settings, KVDEPOT_TRACE_JOBS)."""
        self.folder = tempfile.mkdtemp(dir="/dev/shm")
        self.socket = f"{self.folder}/kvdepot.sock"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo or REPO), env.get("PYTHONPATH")]))
        self.log_path = os.environ.get("KVDEPOT_BENCH_LOG") or f"{self.folder}/kvdepotd.log"
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvdepot.server", "--listen", self.socket, "--pool-size", pool_size,
                 *(["--slot-size", str(slot_bytes)] if slot_bytes else []),
                 "--pool-dir", pool_dir or self.folder, "--pin", pin,
                 # No metrics port: another daemon on the machine may hold the default one.
                 "--metrics-listen", "none", *extra],
                # From the tree's own folder: `-m` puts the working folder first on the path.
                stderr=log_file, text=True, env=env, cwd=str(repo or REPO))
        self.pid = self.proc.pid

    def log(self) -> str:
        return open(self.log_path).read()

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while "ready on" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("kvdepotd did not start:\n" + self.log())
            time.sleep(0.1)

    def wait_pool(self, timeout: float = 600) -> None:
        """Until the whole pool is up: the daemon serves once its first chunks
        are, and brings up the rest on its own threads meanwhile, which would
        take CPU (and slots) from whatever is measured first."""
        from kvdepot.client import KVDepotClient

        client = KVDepotClient(self.socket, name="bench-wait").connect(60)
        try:
            deadline = time.monotonic() + timeout
            while True:
                pool = client.stats().pool
                if pool.online_slots >= pool.num_slots or pool.bring_up_error:
                    return
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"kvdepotd's pool did not come up ({pool.online_slots} of {pool.num_slots} "
                                     "slots):\n" + self.log())
                time.sleep(0.1)
        finally:
            client.close()

    def __enter__(self) -> BenchDaemon:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            print("kvdepotd's log:\n" + self.log()[-6000:])
        self.proc.terminate()
        self.proc.wait(60)
        shutil.rmtree(self.folder, ignore_errors=True)
