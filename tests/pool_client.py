"""A CPU client (shared-memory worker) that lives across daemon restarts: run by
the tests. Prints one JSON line per command read from stdin:

  store N          store blocks under prompt N (once attached)
  attached OLD     wait until attached to a daemon instance other than OLD
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcache import attach_worker, prompt_keys  # noqa: E402

from kvdepot.client import KVDepotClient  # noqa: E402


def main() -> int:
    client = KVDepotClient(sys.argv[1], name="pool-client", backoff_max=0.5).connect(10)
    worker, engine, tensors = attach_worker(client, seed=61)
    print(json.dumps({"pid": os.getpid(), "instance": client.daemon_instance}), flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "store":
            client.wait_connected(30)
            job = client.submit_store(worker, int(args[0]), prompt_keys(4, prompt=int(args[0])), [0, 1, 2, 3])
            ok = client.wait([job], 30)[job].ok
            print(json.dumps({"ok": ok, "instance": client.daemon_instance}), flush=True)
        elif command == "attached":
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and client.daemon_instance in (None, args[0]):
                time.sleep(0.05)
            client.wait_connected(30)
            print(json.dumps({"instance": client.daemon_instance}), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
