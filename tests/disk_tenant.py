"""A tenant's client driven line by line on stdin, run by the disk share tests
as a second uid: `store PROMPT` stores a round of NUM_BLOCKS new blocks,
`lookup PROMPT` looks up a round's keys (which starts promotions from disk);
each prints one JSON line when done."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcache import NUM_BLOCKS, attach_worker, prompt_keys  # noqa: E402

from kvdepot.client import KVDepotClient  # noqa: E402


def main() -> int:
    client = KVDepotClient(sys.argv[1], name="disk-tenant").connect(10)
    worker, engine, _ = attach_worker(client, seed=77)
    print(json.dumps({"ready": True}), flush=True)
    job_id = 0
    for line in sys.stdin:
        command, prompt = line.split()
        keys = prompt_keys(NUM_BLOCKS, prompt=int(prompt))
        if command == "store":
            job_id += 1
            job = client.submit_store(worker, job_id, keys, list(range(NUM_BLOCKS)))
            result = client.wait([job], 10)[job]
            print(json.dumps({"ok": result.ok}), flush=True)
        elif command == "lookup":
            answer = client.lookup(engine, keys)
            print(json.dumps({"ready": answer.ready_blocks, "not_yet": answer.not_yet}), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
