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
from kvdepot.client.tensors import tensor_layout, tensor_spec  # noqa: E402
from kvdepot.proto import kvdepot_pb2 as pb  # noqa: E402
from raw_client import RawSession  # noqa: E402


def main() -> int:
    socket_path, blocks = sys.argv[1], int(sys.argv[2])
    hold = sys.argv[3:] == ["hold"]
    session = RawSession(socket_path, name="flood")
    stub, sid = session.stub, session.id
    tensors, block_dim = make_kv_cache("per_layer", seed=6)
    worker = stub.RegisterWorker(pb.RegisterWorkerRequest(
        session_id=sid, namespace=pb.NamespaceSpec(**namespace("per_layer")), rank=0, device="cpu",
        tensors=[tensor_spec(tensor_layout(t, block_dim, f"l{i}")) for i, t in enumerate(tensors)],
        handles=[pb.TensorHandle(shared_memory=pb.SharedMemoryWorker()) for _ in tensors]))
    answer = stub.SubmitStore(pb.SubmitStoreRequest(
        session_id=sid, worker_id=worker.worker_id, job_id=1, keys=prompt_keys(blocks, prompt=999),
        block_ids=list(range(blocks))))
    if not hold:
        stub.CompleteJob(pb.CompleteJobRequest(session_id=sid, job_id=1, ok=True))
    print(json.dumps({"stored": len(answer.slots), "not_stored": answer.not_stored}), flush=True)
    if hold:
        sys.stdin.readline()
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
