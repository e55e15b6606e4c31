"""`kvdepot stats --watch`: rates from consecutive stats, a clean Ctrl-C, and a
daemon that dies and comes back, with the CLI as a real process."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

from conftest import subprocess_env
from kvcache import attach_worker, prompt_keys

from kvdepot.client.watch import LEAVE_SCREEN, block_size, byte_rate, counter_rates, interval_seconds
from kvdepot.proto import kvdepot_pb2 as pb

BLOCK_BYTES = 16 * 1024
STORE_RATE = re.compile(r"^store +([0-9.]+) ([kMG]?B)/s", re.MULTILINE)


class Watch:
    """`kvdepot stats --watch` as a process; its output collected as it comes."""

    def __init__(self, daemon, interval: float = 0.3, stdout=subprocess.PIPE, stdin=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvdepot.client.cli", "--socket", daemon.socket, "stats", "--watch", str(interval)],
            stdout=stdout, stdin=stdin, stderr=subprocess.PIPE, env=subprocess_env(),
            # Ctrl-C as at a terminal, even where these tests run with SIGINT
            # ignored (a background job, nohup), which the child would inherit.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self._read_from = self.proc.stdout.fileno() if stdout == subprocess.PIPE else None
        self._chunks: list[bytes] = []
        self._reader = None
        self._exited = threading.Event()

    def read_from(self, fd: int) -> Watch:
        self._read_from = fd
        return self

    def start(self) -> Watch:
        def read():
            # A pty's master gives no end of file while this process holds the
            # terminal open: once the watch has exited, what is left is read,
            # and reading stops when nothing more comes.
            while True:
                ready, _, _ = select.select([self._read_from], [], [], 0.2)
                if not ready:
                    if self._exited.is_set():
                        return
                    continue
                try:
                    data = os.read(self._read_from, 65536)
                except OSError:
                    return
                if not data:
                    return
                self._chunks.append(data)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        return self

    @property
    def output(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def wait_for(self, pattern: str | re.Pattern, start: int = 0, timeout: float = 30.0,
                 check=lambda match: True) -> re.Match:
        """The first match at or after `start` for which `check` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            regex = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, re.MULTILINE)
            for match in regex.finditer(self.output, start):
                if check(match):
                    return match
            assert self.proc.poll() is None, f"the watch exited {self.proc.returncode}:\n{self.output}"
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not shown within {timeout} s:\n{self.output[start:][-3000:]}")

    def interrupt(self) -> tuple[int, str]:
        """Ctrl-C: the exit code and stderr."""
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(30)
        self._exited.set()
        self._reader.join(10)
        return code, self.proc.stderr.read().decode(errors="replace")


def store(client, worker, blocks: int, prompt: int, job_id: int) -> None:
    job = client.submit_store(worker, job_id, prompt_keys(blocks, prompt=prompt), list(range(blocks)))
    assert client.wait([job], 10)[job].ok


def test_rates_come_from_two_answers_of_one_daemon():
    before = pb.GetStatsResponse(daemon_instance="a", uptime_seconds=10.0)
    before.totals.stored_bytes, before.totals.hit_blocks = 1_000, 50
    after = pb.GetStatsResponse(daemon_instance="a", uptime_seconds=12.0)
    after.totals.stored_bytes, after.totals.hit_blocks = 4_001_000, 30  # a namespace went, with its hits
    seconds = interval_seconds(before, after)
    assert seconds == 2.0
    rates = counter_rates(before.totals, after.totals, seconds)
    assert rates["stored_bytes"] == 2e6 and rates["hit_blocks"] == 0 and rates["loaded_bytes"] == 0
    assert interval_seconds(None, after) is None
    assert interval_seconds(before, pb.GetStatsResponse(daemon_instance="b", uptime_seconds=20.0)) is None
    assert [byte_rate(r) for r in (2.5e9, 2e6, 1500, 12)] == ["2.50 GB/s", "2.00 MB/s", "1.50 kB/s", "12 B/s"]


def test_the_view_shows_a_store_as_it_happens_and_ctrl_c_ends_it_cleanly(daemon, client_factory):
    watch = Watch(daemon).start()
    first = watch.wait_for(STORE_RATE)  # rates from the second answer on
    assert float(first.group(1)) == 0  # nothing stored yet

    client = client_factory(daemon, name="watched")
    worker, engine, _ = attach_worker(client, seed=21)
    store(client, worker, 20, prompt=90, job_id=1)
    busy = watch.wait_for(STORE_RATE, first.end(), check=lambda m: float(m.group(1)) > 0)
    rate = float(busy.group(1)) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[busy.group(2)]
    # 20 blocks over the gap between two of the daemon's answers: the view
    # refreshes every 0.3 s from its own clock, and one answer late makes the
    # next gap short, so the bound is loose; what it checks is bytes a second.
    assert 0 < rate <= 20 * BLOCK_BYTES / 0.02
    block = watch.output[busy.start():]
    assert engine.namespace_name[:48] in block and "watched" in block

    code, stderr = watch.interrupt()
    assert code == 0 and stderr == ""


def test_the_view_says_when_the_daemon_goes_and_when_it_is_back(daemon, client_factory):
    watch = Watch(daemon).start()
    seen = watch.wait_for(r"^store ")
    instance = re.search(r"instance (\w+)", watch.output).group(1)

    daemon.kill()
    gone = watch.wait_for(rf"^kvdepotd is not reachable at unix:{re.escape(daemon.socket)} since \d\d:\d\d:\d\d",
                          seen.end())
    daemon.start()
    back = watch.wait_for(r"^kvdepotd restarted at \d\d:\d\d:\d\d \(instance (\w+)\): rates restart", gone.end())
    assert back.group(1) != instance
    # Data again, and rates of the new daemon: a store now shows.
    client = client_factory(daemon, name="after-restart")
    worker, _, _ = attach_worker(client, seed=22)
    store(client, worker, 10, prompt=91, job_id=1)
    watch.wait_for(STORE_RATE, back.end(), check=lambda m: float(m.group(1)) > 0)
    assert "after-restart" in watch.output[back.end():]

    code, stderr = watch.interrupt()
    assert code == 0 and stderr == ""


def test_on_a_terminal_ctrl_c_gives_the_terminal_back_as_it_was(daemon):
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    settings = termios.tcgetattr(terminal)
    try:
        watch = Watch(daemon, stdout=terminal, stdin=terminal).read_from(master).start()
        watch.wait_for(r"^store ")
        assert not termios.tcgetattr(terminal)[3] & termios.ECHO  # keys typed do not write over the view
        code, stderr = watch.interrupt()
        assert code == 0 and stderr == ""
        assert watch.output.startswith("\x1b[?1049h")  # the alternate screen...
        assert watch.output.endswith(LEAVE_SCREEN)  # ...left at the end, the cursor shown
        assert termios.tcgetattr(terminal) == settings
    finally:
        os.close(master)
        os.close(terminal)


def _piped_env() -> dict:
    # Buffered stdout, as in a shell: what is left in the buffer is written at
    # exit, where a closed pipe used to fail too.
    env = subprocess_env()
    del env["PYTHONUNBUFFERED"]
    return env


def test_a_reader_that_stops_ends_the_piped_view_quietly(daemon):
    """`kvdepot stats --watch 1 | head -20`: head exits after its lines, and
    the watch ends there, exit 0 and no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdepot.client.cli", "--socket", daemon.socket, "stats", "--watch", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_piped_env(),
    )
    try:
        for _ in range(20):
            assert proc.stdout.readline(), "the watch ended before its 20th line"
        proc.stdout.close()
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read().decode(errors="replace")
    assert (code, stderr) == (0, "")


def test_a_reader_that_is_gone_ends_stats_quietly(daemon):
    """`kvdepot stats | true`: the pipe is closed before stats writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvdepot.client.cli", "--socket", daemon.socket, "stats"],
            stdout=write_end, stderr=subprocess.PIPE, env=_piped_env(), timeout=60,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr.decode(errors="replace")) == (0, "")


def test_two_block_sizes_never_read_the_same():
    """65,536 and 65,537 bytes are two layouts (the second takes two slots of
    64 KiB): the stats name each exactly."""
    sizes = [0, 4096, 65536, 65537, 2 << 20, (2 << 20) + 1024, (2 << 20) + 1]
    labels = [block_size(n) for n in sizes]
    assert labels == ["unknown", "4 KiB", "64 KiB", "65,537 B", "2 MiB", "2,049 KiB", "2,097,153 B"]
    assert len(set(labels)) == len(labels)
