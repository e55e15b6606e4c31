"""A chaos test's client process (tests/chaos.py starts several and kills
them): the real client library, storing blocks whose content follows from
their keys and loading back whatever is ready, its own or another client's,
checking every byte. It keeps going through daemon restarts (the library
reconnects by itself) until told on stdin: `stop` (finish the round, then
idle, attached) and `exit` (close and exit 0).

After every round it rewrites its status file (JSON): the daemon instance it
is attached to, rounds with a stored block since then, its counts, and any
load that gave wrong bytes (it exits 3 at once on one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from keyed_blocks import KeyedEngine  # noqa: E402
from kvcache import prompt_keys  # noqa: E402

from kvdepot.client import KVDepotClient  # noqa: E402


def write_status(path: Path, status: dict) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(status))
    os.replace(partial, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--status", required=True)
    parser.add_argument("--prompts", type=int, default=100, help="how many prompts the clients share")
    args = parser.parse_args()

    status_path = Path(args.status)
    stop, leave = threading.Event(), threading.Event()

    def read_commands():
        for line in sys.stdin:
            (stop if line.strip() == "stop" else leave).set()
        leave.set()

    threading.Thread(target=read_commands, daemon=True).start()
    client = KVDepotClient(args.socket, name=f"chaos-{args.seed}", backoff_max=0.3).connect(30)
    engine = KeyedEngine(client, model="chaos-model", seed=args.seed)
    rng = random.Random(args.seed)
    instance, stored_here = None, 0

    def status(**extra) -> dict:
        return dict(pid=os.getpid(), instance=instance, stored_here=stored_here, reconnects=client.reconnects,
                    counts=engine.counts, wrong=engine.wrong, **extra)

    while not stop.is_set():
        if not client.connected:
            time.sleep(0.05)  # the daemon is away: jobs fail at once, nothing to do
        stores_before = engine.counts.get("store ok", 0)
        engine.round(prompt_keys(rng.randint(1, 8), prompt=rng.randrange(args.prompts)))
        if client.daemon_instance != instance:
            instance, stored_here = client.daemon_instance, 0
        stored_here += engine.counts.get("store ok", 0) > stores_before
        write_status(status_path, status(idle=False))
        if engine.wrong:
            return 3
    write_status(status_path, status(idle=True))
    leave.wait()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
