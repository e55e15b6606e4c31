"""A client that tries to make the daemon hold, compute or count more than it
should: oversized registrations, floods of engines and namespaces, stores it
never completes, counts past 2^64. It talks raw gRPC, without the client
library's own checks, and prints what the daemon answered as JSON lines.
Run by tests/test_limits_registration.py as a second process.

    hostile_client.py SOCKET registrations
    hostile_client.py SOCKET flood engines|workers|jobs|namespaces COUNT
                                               (then waits for a line on stdin)
    hostile_client.py SOCKET stall BLOCKS [store|load]   (then waits for a line on stdin)
    hostile_client.py SOCKET counters
    hostile_client.py SOCKET namespaces COUNT
"""

from __future__ import annotations

import json
import os
import sys
import time

import grpc

from kvdepot.defaults import PROTOCOL_VERSION
from kvdepot.keys import KEY_VERSION
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from raw_client import prove  # noqa: E402

SHM = pb.TensorHandle(shared_memory=pb.SharedMemoryWorker())


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def spec(**changes) -> pb.NamespaceSpec:
    fields = {"model": "hostile", "kv_dtype": "bfloat16", "block_size": 16, "layout": "x", "tp_size": 1,
              "key_version": KEY_VERSION}
    fields.update(changes)
    return pb.NamespaceSpec(**fields)


def tensor(shape, strides, block_dim, dtype="uint8", name="t", storage_bytes=None, page_bytes=1, byte_offset=0):
    if storage_bytes is None:
        storage_bytes = 1 << 40
    return pb.TensorSpec(name=name, dtype=dtype, shape=shape, strides=strides, block_dim=block_dim,
                         storage_bytes=storage_bytes, page_bytes=page_bytes, byte_offset=byte_offset)


class Hostile:
    def __init__(self, socket_path: str):
        self.channel = grpc.insecure_channel("unix:" + socket_path)
        self.stub = pb_grpc.KVDepotStub(self.channel)

    def attach(self, name: str = "hostile"):
        """A session, proven with a hello on the job socket (which may close
        again: the session keeps its identity)."""
        stream = self.stub.Attach(pb.AttachRequest(client_name=name, pid=os.getpid(),
                                                   protocol_version=PROTOCOL_VERSION))
        started = next(stream).started
        prove(started)
        return stream, started

    def call(self, case: str, method: str, request) -> bool:
        """Calls, and prints the answer's status; True when the call succeeded."""
        started = time.monotonic()
        try:
            getattr(self.stub, method)(request, timeout=120)
        except grpc.RpcError as e:
            emit(case=case, code=e.code().name, details=e.details(), seconds=time.monotonic() - started)
            return False
        emit(case=case, code="OK", details="", seconds=time.monotonic() - started)
        return True


def worker(session_id: str, tensors, namespace=None, rank=0, device="cpu") -> pb.RegisterWorkerRequest:
    return pb.RegisterWorkerRequest(session_id=session_id, namespace=namespace or spec(), rank=rank, device=device,
                                    tensors=tensors, handles=[SHM] * len(tensors))


def registrations(h: Hostile) -> None:
    stream, started = h.attach()
    sid = started.session_id
    big = "x" * (1 << 20)

    def register(case: str, tensors, **changes):
        h.call(case, "RegisterWorker", worker(sid, tensors, spec(model=case), **changes))

    h.call("tp_size", "RegisterEngine", pb.RegisterEngineRequest(session_id=sid, namespace=spec(tp_size=2**32 - 1)))
    h.call("tp_size_worker", "RegisterWorker", worker(sid, [tensor([2, 4], [4, 1], 1)], spec(tp_size=1 << 20)))
    register("rank", [tensor([2, 4], [4, 1], 1)], rank=2**32 - 1)
    h.call("long_model", "RegisterEngine", pb.RegisterEngineRequest(session_id=sid, namespace=spec(model=big)))
    h.call("newline_model", "RegisterEngine",
           pb.RegisterEngineRequest(session_id=sid, namespace=spec(model="m\n2026 ERROR forged log line")))
    h.call("long_extra", "RegisterEngine", pb.RegisterEngineRequest(session_id=sid, namespace=spec(extra=big)))
    register("long_device", [tensor([2, 4], [4, 1], 1)], device=big)
    register("long_tensor_name", [tensor([2, 4], [4, 1], 1, name=big)])
    register("long_dtype", [tensor([2, 4], [4, 1], 1, dtype=big)])
    register("many_tensors", [tensor([4, 1], [1, 1], 0)] * 4096)
    register("many_dims", [tensor([1] * 64, [1] * 64, 0)])
    # Sizes whose products pass 2^64: their offsets would not fit an int64.
    register("huge_dims", [tensor([2**62, 2**62, 1], [2**62, 1, 1], 1, storage_bytes=2**64 - 1)])
    register("huge_stride", [tensor([2, 4, 1], [2**60, 1, 1], 1, storage_bytes=2**64 - 1)])
    register("huge_offset", [tensor([4, 1], [1, 1], 0, byte_offset=2**63 - 1, storage_bytes=2**64 - 1)])
    register("far_end", [tensor([2**40, 2], [2**30, 1], 0, page_bytes=2, storage_bytes=2**62)])
    h.call("clear_unknown", "Clear", pb.ClearRequest(session_id=sid, namespace_name=big))
    h.call("unknown_session", "Lookup", pb.LookupRequest(session_id=big, engine_id=1))
    # Pages of 1 byte, as many as fit a slot, each tensor with 3 outer
    # dimensions; the last tensor's negative size cancels the others' page
    # count, so a check that sums them first lets every tensor be enumerated.
    outer, n = [16, 16, 16], 511
    strides = [1 << 20, 1 << 10, 1, 1 << 30]
    cube = tensor(outer + [2], strides, 3)
    sneaky = tensor([-(4096 * n) + 1, 2], [1, 1 << 20], 1)
    for attempt in range(3):
        register(f"negative_dims_{attempt}", [cube] * n + [sneaky])
    # The most page offsets a worker may make the daemon compute: accepted.
    register("most_pages", [cube] * 16)
    stream.cancel()


def staged(started, request: pb.RegisterWorkerRequest, blocks: int, block_bytes: int) -> pb.RegisterWorkerRequest:
    """The request, with a staging memory of `blocks` rows handed over for it."""
    from kvdepot.client.job_socket import hand_over
    from kvdepot.client.shm_copy import StagingMemory

    staging = StagingMemory(blocks, block_bytes)
    request.staging_id = hand_over(started.job_socket, started.session_id, staging.fd, 10)
    staging.close()  # the daemon has its own descriptor; this client never copies
    return request


def flood(h: Hostile, what: str, count: int) -> None:
    """Registers engines, workers, namespaces (an engine in each of its own)
    or submits stores (the test holds their copies), until one is refused or
    `count` are in."""
    # The session lasts while its stream is referenced.
    _stream, started = h.attach()
    sid = started.session_id
    small = [tensor([count, 64], [64, 1], 0, storage_bytes=count * 64, page_bytes=64)]
    worker_id = 0
    if what == "jobs":
        worker_id = h.stub.RegisterWorker(staged(started, worker(sid, small, spec(model="flood")), count, 64)).worker_id
    done = 0
    for i in range(count):
        if what == "engines":
            request = pb.RegisterEngineRequest(session_id=sid, namespace=spec())
        elif what == "namespaces":
            request = pb.RegisterEngineRequest(session_id=sid, namespace=spec(model=f"flood-{i}"))
        elif what == "workers":
            request = staged(started, worker(sid, small), count, 64)
        else:
            request = pb.SubmitStoreRequest(session_id=sid, worker_id=worker_id, job_id=i + 1,
                                            keys=[(i + 1).to_bytes(32, "little")], block_ids=[i])
        method = {"engines": "RegisterEngine", "namespaces": "RegisterEngine", "workers": "RegisterWorker",
                  "jobs": "SubmitStore"}[what]
        if not h.call(what, method, request):
            break
        done += 1
    emit(case="flood", done=done)
    sys.stdin.readline()


def stall(h: Hostile, blocks: int, kind: str) -> None:
    """Stores a pool's worth of blocks, or stores them and loads them back, and
    then does nothing: it reads no reply, and completes nothing."""
    stream, started = h.attach()
    sid = started.session_id
    request = staged(started, worker(sid, [tensor([blocks, 64], [64, 1], 0, storage_bytes=blocks * 64, page_bytes=64)],
                                     spec(model="stall")), blocks, 64)
    response = h.stub.RegisterWorker(request)
    keys = [i.to_bytes(32, "little") for i in range(1, blocks + 1)]
    h.stub.SubmitStore(pb.SubmitStoreRequest(session_id=sid, worker_id=response.worker_id, job_id=1,
                                             keys=keys, block_ids=list(range(blocks))))
    if kind == "load":
        next(n for n in stream if n.HasField("job_done"))
        h.stub.SubmitLoad(pb.SubmitLoadRequest(session_id=sid, worker_id=response.worker_id, job_id=2,
                                               keys=keys, block_ids=list(range(blocks))))
    emit(case="stall", blocks=blocks)
    sys.stdin.readline()


def counters(h: Hostile) -> None:
    stream, started = h.attach()
    sid = started.session_id
    engine = h.stub.RegisterEngine(pb.RegisterEngineRequest(session_id=sid, namespace=spec(model="counters")))
    top = 2**64 - 1
    for _attempt in range(3):
        h.call("huge_counts", "ReportLookups",
               pb.ReportLookupsRequest(session_id=sid, engine_id=engine.engine_id, lookups=top, hit_blocks=top,
                                       miss_blocks=top))
    # Allowed counts, added until they would pass 2^64 without saturation.
    for attempt in range(5000):
        if not h.call("many_counts", "ReportLookups",
                      pb.ReportLookupsRequest(session_id=sid, engine_id=engine.engine_id, lookups=1 << 32,
                                              hit_blocks=1 << 52, miss_blocks=0)) and attempt == 0:
            break
    stream.cancel()


def namespaces(h: Hostile, count: int) -> None:
    """Sessions that each register an engine and a worker in a namespace of their own, then end."""
    for i in range(count):
        stream, started = h.attach()
        sid = started.session_id
        ns = spec(model=f"ns-{i}-" + "n" * 400)
        h.stub.RegisterEngine(pb.RegisterEngineRequest(session_id=sid, namespace=ns))
        h.stub.RegisterWorker(staged(started, worker(sid, [tensor([2, 4], [4, 1], 1, storage_bytes=8)], ns), 4, 2))
        stream.cancel()
    emit(case="namespaces", done=count)


def main() -> int:
    socket_path, what, *args = sys.argv[1:]
    h = Hostile(socket_path)
    if what == "registrations":
        registrations(h)
    elif what == "flood":
        flood(h, args[0], int(args[1]))
    elif what == "stall":
        stall(h, int(args[0]), args[1] if len(args) > 1 else "store")
    elif what == "counters":
        counters(h)
    elif what == "namespaces":
        namespaces(h, int(args[0]))
    else:
        raise SystemExit(f"unknown attack {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
