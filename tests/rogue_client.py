"""A client that loses its session but lives on and writes the slots of its
unfinished store anyway: what a buggy client, or one whose stream broke, does.
It talks raw gRPC, without the client library's own care. Run by the tests.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcache import make_kv_cache, namespace, prompt_keys  # noqa: E402
from kvdepot.client.shm_copy import MappedPool  # noqa: E402
from kvdepot.client.tensors import tensor_layout, tensor_spec  # noqa: E402
from kvdepot.proto import kvdepot_pb2 as pb  # noqa: E402
from raw_client import RawSession  # noqa: E402


def main() -> int:
    socket_path, blocks = sys.argv[1], int(sys.argv[2])
    # pid: a lie the daemon must not believe (an unknown pid would free the slots at once).
    session = RawSession(socket_path, name="rogue", pid=int(sys.argv[3]) if len(sys.argv) > 3 else None)
    stub, started = session.stub, session.started
    tensors, block_dim = make_kv_cache("per_layer", seed=99)
    worker = stub.RegisterWorker(pb.RegisterWorkerRequest(
        session_id=started.session_id, namespace=pb.NamespaceSpec(**namespace("per_layer")), rank=0,
        device="cpu", tensors=[tensor_spec(tensor_layout(t, block_dim, f"l{i}")) for i, t in enumerate(tensors)],
        handles=[pb.TensorHandle(shared_memory=pb.SharedMemoryWorker()) for _ in tensors]))
    response = stub.SubmitStore(pb.SubmitStoreRequest(
        session_id=started.session_id, worker_id=worker.worker_id, job_id=1,
        keys=prompt_keys(blocks, prompt=77), block_ids=list(range(blocks))))
    session.stream.cancel()  # the session ends; this process does not
    print(json.dumps({"slots": list(response.slots)}), flush=True)
    sys.stdin.readline()
    pool = MappedPool(started.pool.shm_path, started.pool.slot_bytes, started.pool.num_slots)
    pool.slots[torch.as_tensor(list(response.slots))] = 0xAB
    print("written", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
