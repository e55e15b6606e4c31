"""A tenant's client that stores more blocks than the pool has free, as one
big job, and prints how many the daemon did not store. With "hold" it never
completes the store (its slots stay pinned) and waits to be killed. Run by the
trust tests as a second uid."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcache import make_kv_cache, namespace, prompt_keys  # noqa: E402
from raw_client import RawSession  # noqa: E402

from kvdepot.proto import kvdepot_pb2 as pb  # noqa: E402


def main() -> int:
    socket_path, blocks = sys.argv[1], int(sys.argv[2])
    hold = sys.argv[3:] == ["hold"]
    session = RawSession(socket_path, name="flood")
    stub, sid = session.stub, session.id
    tensors, block_dim = make_kv_cache("per_layer", seed=6)
    worker, _staging = session.register_cpu_worker(namespace("per_layer"), tensors, block_dim)
    answer = stub.SubmitStore(pb.SubmitStoreRequest(
        session_id=sid, worker_id=worker.worker_id, job_id=1, keys=prompt_keys(blocks, prompt=999),
        block_ids=list(range(blocks))))
    if not hold:
        assert session.jobs.reply().job_done.ok
    stored = blocks - answer.already_stored - answer.not_stored
    print(json.dumps({"stored": stored, "not_stored": answer.not_stored}), flush=True)
    if hold:
        sys.stdin.readline()
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
