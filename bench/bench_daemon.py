"""Starts a real kvdepotd for a CPU benchmark: unpinned pool in a temp folder, log to a file."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class Daemon:
    def __init__(self, folder: Path, pool_size: str, slot_size: str, pool_parent: str | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.folder = folder
        self.socket = str(folder / "kvdepot.sock")
        self.log_path = folder / "kvdepotd.log"
        # The pool file belongs on a tmpfs, as in production: on a disk-backed
        # folder every write to the mapping dirties page cache and the copies crawl.
        self.pool_dir = Path(tempfile.mkdtemp(prefix="kvdepot-bench-pool-", dir=pool_parent or str(folder)))
        pool = self.pool_dir
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        args = [sys.executable, "-m", "kvdepot.server", "--listen", self.socket, "--pool-dir", str(pool),
                "--pool-size", pool_size, "--slot-size", slot_size, "--pin", "off", *extra_args]  # fmt: skip
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if b"ready on" in self.log_path.read_bytes():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise SystemExit(f"kvdepotd did not start:\n{self.log_path.read_text(errors='replace')}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.pool_dir, ignore_errors=True)
        return self.proc.returncode
