"""Chaos: client processes (tests/chaos_client.py) and the daemon killed with
SIGKILL at random points, seeded, the daemon restarted each time. Run by
tests/test_chaos.py for a few rounds and by bench/chaos.py for many.

What must hold at the end, whatever was killed when:
- no load ever gave a byte other than what its key's block holds;
- every client still alive is attached to the last daemon and storing again,
  without being told (the client library reconnects by itself);
- once they idle, no slot is pinned: the killed clients' jobs ended with the
  daemon's own copies, and the daemon holds no session of theirs;
- no daemon logged a traceback, and the last one exits 0 on SIGTERM.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import Daemon, subprocess_env

from kvdepot.client import KVDepotClient

CLIENT = str(Path(__file__).resolve().parent / "chaos_client.py")
# A killed client's session ends once its stream breaks, and its jobs with the
# daemon's copies (microseconds); the rest is slack for a loaded machine.
SETTLE_SECONDS = 10.0
# Refusals a well-behaved client can meet while the daemon restarts or evicts.
EXPECTED_REFUSALS = {"FailedPrecondition", "NotFound", "Unavailable"}


class ChaosClient:
    def __init__(self, daemon: Daemon, folder: Path, seed: int):
        self.status_path = folder / f"client-{seed}.json"
        self.stderr_path = folder / f"client-{seed}.err"
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, CLIENT, daemon.socket, "--seed", str(seed), "--status", str(self.status_path)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=subprocess_env(),
            )
        self.killed = False

    def status(self) -> dict:
        try:
            return json.loads(self.status_path.read_text())
        except FileNotFoundError:
            return {}

    def tell(self, command: str) -> None:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it has exited: the checks say how

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.killed = True


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def _stats(daemon: Daemon):
    import grpc

    from kvdepot.proto import kvdepot_pb2 as pb
    from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc

    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        return pb_grpc.KVDepotStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


def run_chaos(folder: Path, rounds: int, clients: int = 3, seed: int = 0, log=lambda line: None) -> dict:
    """Runs the rounds and checks the end state; the summary's `problems` says what failed."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    daemon = Daemon(folder, pool_size="1MiB")  # 64 slots: the clients' blocks evict each other
    daemon.start()
    started: list[ChaosClient] = []
    summary = {"rounds": rounds, "daemon_kills": 0, "client_kills": 0, "problems": []}
    problems = summary["problems"]
    try:
        for round_number in range(rounds):
            if not daemon.running:
                daemon.start()
            while sum(not c.killed for c in started) < clients:
                started.append(ChaosClient(daemon, folder, seed * 1000 + len(started)))
            time.sleep(rng.uniform(0.2, 1.2))
            victim = rng.choice(["client", "client", "daemon", "both"])
            if victim in ("client", "both"):
                rng.choice([c for c in started if not c.killed]).kill()
                summary["client_kills"] += 1
            if victim in ("daemon", "both"):
                daemon.kill()
                summary["daemon_kills"] += 1
                time.sleep(rng.uniform(0.0, 0.5))
                daemon.start()
            log(f"round {round_number + 1}/{rounds}: killed {victim}")
        if not daemon.running:
            daemon.start()
        # The last clients killed under the daemon that stays, once all are
        # working with it (all but one): their pins are what the end state shows.
        while sum(not c.killed for c in started) < clients:
            started.append(ChaosClient(daemon, folder, seed * 1000 + len(started)))
        alive = [c for c in started if not c.killed]
        _wait_storing(daemon, alive, problems)
        for victim in rng.sample(alive, max(1, len(alive) - 1)):
            time.sleep(rng.uniform(0.05, 0.3))
            victim.kill()
            summary["client_kills"] += 1
        _settle(daemon, [c for c in alive if not c.killed], problems)
        try:
            code = daemon.stop()
            if code != 0:
                problems.append(f"the last daemon exited {code} on SIGTERM")
        except subprocess.TimeoutExpired:
            problems.append("the last daemon did not exit within 30 s of SIGTERM")
    finally:
        for client in started:
            if client.proc.poll() is None:
                client.proc.kill()
                client.proc.wait(10)
        if daemon.running:
            daemon.kill()
    _summarise(daemon, started, summary)
    return summary


def _wait_storing(daemon: Daemon, alive: list[ChaosClient], problems: list) -> None:
    """Until every client still alive is attached to the daemon and has stored again."""
    instance = _stats(daemon).daemon_instance

    def storing_again(client: ChaosClient) -> bool:
        status = client.status()
        return status.get("instance") == instance and status.get("stored_here", 0) >= 2

    if not _wait(lambda: all(storing_again(c) or c.proc.poll() is not None for c in alive), 60):
        stuck = [c.status().get("pid", c.proc.pid) for c in alive if not storing_again(c)]
        problems.append(f"clients {stuck} did not reconnect and store again within 60 s")


def _settle(daemon: Daemon, alive: list[ChaosClient], problems: list) -> None:
    _wait_storing(daemon, alive, problems)
    for client in alive:
        client.tell("stop")
    if not _wait(lambda: all(c.status().get("idle") or c.proc.poll() is not None for c in alive), 60):
        problems.append("clients did not finish their round within 60 s of `stop`")
    for client in alive:
        if client.proc.poll() is not None:
            problems.append(f"client {client.proc.pid} exited {client.proc.returncode} during the run")
    alive = [c for c in alive if c.proc.poll() is None]

    # Pins and sessions are told to a session of an admin (this uid).
    observer = KVDepotClient(daemon.socket, name="chaos-observer").connect(30)

    def released() -> bool:
        stats = observer.stats()
        return (stats.pinned_slots == 0 and len(stats.clients) == len(alive)
                and all(c.jobs_in_flight == 0 for c in stats.clients))

    settled = _wait(released, SETTLE_SECONDS)
    stats = observer.stats()
    observer.close()
    if not settled:
        problems.append(
            f"{SETTLE_SECONDS:.0f} s after the clients went idle: {stats.pinned_slots} pinned slots, "
            f"{len(stats.clients)} sessions for {len(alive)} clients, "
            f"{sum(c.jobs_in_flight for c in stats.clients)} jobs in flight"
        )
    for client in alive:
        client.tell("exit")
    for client in alive:
        try:
            if client.proc.wait(30) != 0:
                problems.append(f"client {client.proc.pid} exited {client.proc.returncode} on `exit`")
        except subprocess.TimeoutExpired:
            problems.append(f"client {client.proc.pid} did not exit within 30 s of `exit`")


def _summarise(daemon: Daemon, started: list[ChaosClient], summary: dict) -> None:
    problems = summary["problems"]
    counts: dict[str, int] = {}
    for client in started:
        status = client.status()
        for what, n in status.get("counts", {}).items():
            counts[what] = counts.get(what, 0) + n
        for wrong in status.get("wrong", []):
            problems.append(f"client {status['pid']} loaded wrong bytes: {wrong}")
        if client.proc.returncode not in (0, -signal.SIGKILL):
            err = client.stderr_path.read_text(errors="replace")[-3000:]
            problems.append(f"client {client.proc.pid} exited {client.proc.returncode}:\n{err}")
    refused = {what.split()[-1] for what in counts if " refused " in what}
    if refused - EXPECTED_REFUSALS:
        problems.append(f"refusals a well-behaved client must never get: {sorted(refused - EXPECTED_REFUSALS)}")
    for log_path in sorted(daemon.folder.glob("kvdepotd-*.log")):
        if "Traceback" in log_path.read_text(errors="replace"):
            problems.append(f"{log_path.name} has a traceback:\n{log_path.read_text(errors='replace')[-3000:]}")
    summary.update(clients_started=len(started), daemon_starts=daemon.starts, counts=dict(sorted(counts.items())))
