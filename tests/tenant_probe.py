"""Another tenant's client, run by the trust tests as a second uid: it tries to
read, probe, poison and clear the first tenant's cache through the real
daemon, speaking the protocol directly, and prints what it got as JSON.

argv: socket path, the victim's prompt number (its stored blocks), the prompt
number of blocks the victim has not stored yet (to poison), and a namespace
name of the victim's as stats showed it to an admin.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcache import make_kv_cache, namespace, prompt_keys  # noqa: E402
from raw_client import RawSession  # noqa: E402

from kvdepot.proto import kvdepot_pb2 as pb  # noqa: E402


def code_of(call) -> str:
    try:
        call()
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def main() -> int:
    socket_path, stored, unstored, victim_ns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    session = RawSession(socket_path, name="probe")
    stub, sid = session.stub, session.id
    ns = pb.NamespaceSpec(**namespace("per_layer"))
    engine = stub.RegisterEngine(pb.RegisterEngineRequest(session_id=sid, namespace=ns))
    seen = stub.Lookup(pb.LookupRequest(session_id=sid, engine_id=engine.engine_id, keys=prompt_keys(4, stored)))
    # Poison: publish the victim's next prompt first, from a CPU worker of its own.
    tensors, block_dim = make_kv_cache("per_layer", seed=5)
    try:
        worker, _staging = session.register_cpu_worker(namespace("per_layer"), tensors, block_dim)
        worker_code = "OK"
    except grpc.RpcError as e:
        worker_code = e.code().name
    if worker_code == "OK":
        poison = prompt_keys(4, unstored)
        stub.SubmitStore(pb.SubmitStoreRequest(session_id=sid, worker_id=worker.worker_id, job_id=1,
                                               keys=poison, block_ids=[0, 1, 2, 3]))
        assert session.jobs.reply().job_done.ok
    stats = stub.GetStats(pb.GetStatsRequest(session_id=sid))
    anonymous = stub.GetStats(pb.GetStatsRequest())
    print(json.dumps({
        "uid": os.getuid(),
        "tenant": session.ready.tenant,
        "admin": session.ready.admin,
        "namespace_name": engine.namespace_name,
        "victim_blocks_seen": seen.ready_blocks,
        "register_shared_memory_worker": worker_code,
        "stats_namespaces": [n.name for n in stats.namespaces],
        "stats_clients": [c.client_name for c in stats.clients],
        "anonymous_stats": [len(anonymous.namespaces), len(anonymous.clients), anonymous.totals.lookups],
        # What the pool's DRAM holds, as this tenant may see it: its own blocks' bytes alone.
        "kv_bytes": stats.kv_bytes,
        "block_sizes": [[b.block_bytes, b.namespaces, b.used_slots] for b in stats.block_sizes],
        "anonymous_kv": [anonymous.kv_bytes, len(anonymous.block_sizes)],
        "clear_victim_namespace": code_of(
            lambda: stub.Clear(pb.ClearRequest(session_id=sid, namespace_name=victim_ns))),
        "clear_all": code_of(lambda: stub.Clear(pb.ClearRequest(session_id=sid))),
        "clear_all_without_session": code_of(lambda: stub.Clear(pb.ClearRequest())),
    }), flush=True)
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
