"""A client that loses its session mid-store but lives on, and keeps writing
all the memory it can reach: what a buggy client, or one whose stream broke,
does. It talks raw gRPC, without the client library's own care. Run by the
tests, which hold its store's copy in the daemon (start_held_daemon).
"""

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
    session = RawSession(socket_path, name="rogue")
    tensors, block_dim = make_kv_cache("per_layer", seed=99)
    worker, staging = session.register_cpu_worker(namespace("per_layer"), tensors, block_dim)
    session.stub.SubmitStore(pb.SubmitStoreRequest(
        session_id=session.id, worker_id=worker.worker_id, job_id=1,
        keys=prompt_keys(blocks, prompt=77), block_ids=list(range(blocks))))
    session.stream.cancel()  # the session ends; this process does not
    print(json.dumps({"submitted": blocks}), flush=True)
    while True:
        staging.rows.fill_(0xAB)
        staging.rows.fill_(0x00)


if __name__ == "__main__":
    sys.exit(main())
