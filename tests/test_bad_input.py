"""Bad requests get a clear status; the daemon keeps serving and loses nothing."""

from __future__ import annotations

import os
import socket

import grpc
import pytest
import torch
from kvcache import NUM_BLOCKS, attach_worker, block_of, namespace, prompt_keys

from kvdepot import errors
from kvdepot.client.tensors import tensor_layout, tensor_spec
from kvdepot.proto import kvdepot_pb2 as pb


@pytest.fixture
def setup(daemon, client_factory):
    client = client_factory(daemon, name="bad-input")
    worker, engine, tensors = attach_worker(client, seed=8)
    keys = prompt_keys(16, prompt=40)
    job = client.submit_store(worker, 1, keys, list(range(16)))
    assert client.wait([job], 10)[job].ok
    return client, engine, worker, tensors, keys


def raw_call(client, method: str, request):
    """Calls the daemon directly, without the client library's own checks."""
    connection = client._connection
    return getattr(connection.stub, method)(request, timeout=5)


def expect(code, call, *args, match: str):
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()


def assert_still_intact(client, engine, worker, tensors, keys, job_id=900):
    assert client.lookup(engine, keys).ready_blocks == len(keys)
    job = client.submit_load(worker, job_id, keys, list(range(64, 64 + len(keys))))
    assert client.wait([job], 10)[job].ok
    for i in range(len(keys)):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 64 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16))


def refusal(client, worker, kind: str, job_id: int, keys, block_ids) -> str:
    """The daemon's refusal of a job, as the job's result tells it (a submit
    never waits for the daemon's answer)."""
    submit = client.submit_store if kind == "store" else client.submit_load
    submit(worker, job_id, keys, block_ids)
    result = client.wait([job_id], 10)[job_id]
    assert not result.ok
    return result.error


def test_bad_job_requests_get_clear_errors(setup):
    client, engine, worker, tensors, keys = setup
    new = prompt_keys(2, prompt=41)
    assert f"block id {NUM_BLOCKS} at position 1 is outside" in refusal(
        client, worker, "store", 2, new, [0, NUM_BLOCKS]
    )
    assert "key 1 has 31 bytes; keys are 32-byte" in refusal(client, worker, "store", 3, [new[0], new[1][:31]], [0, 1])
    assert "2 keys but 1 block ids" in refusal(client, worker, "load", 4, keys[:2], [0])
    assert "at least one block" in refusal(client, worker, "store", 5, [], [])
    assert "each block id once" in refusal(client, worker, "load", 6, keys[:2], [7, 7])
    assert "is not stored" in refusal(client, worker, "load", 7, [keys[0], new[0]], [70, 71])
    many = prompt_keys(257, prompt=42)
    assert "whole pool holds 256" in refusal(client, worker, "store", 8, many, [i % NUM_BLOCKS for i in range(257)])
    assert "job id 1 is already used" in refusal(client, worker, "store", 1, new, [2, 3])
    # The statuses, as a call gets them.
    session_id = client._connection.session_id
    expect(grpc.StatusCode.INVALID_ARGUMENT, raw_call, client, "SubmitStore",
           pb.SubmitStoreRequest(session_id=session_id, worker_id=worker.worker_id, job_id=20, keys=new,
                                 block_ids=[0, NUM_BLOCKS]), match="is outside")
    expect(grpc.StatusCode.FAILED_PRECONDITION, raw_call, client, "SubmitLoad",
           pb.SubmitLoadRequest(session_id=session_id, worker_id=worker.worker_id, job_id=21, keys=new,
                                block_ids=[0, 1]), match="is not stored")
    # None of the refused jobs changed anything, and the daemon has none in flight.
    stats = client.stats()
    assert stats.pinned_slots == 0 and stats.totals.failed_jobs == 0
    assert_still_intact(client, engine, worker, tensors, keys)


def test_unknown_session_engine_and_worker(setup):
    client, engine, worker, tensors, keys = setup
    session_id = client._connection.session_id
    expect(grpc.StatusCode.NOT_FOUND, raw_call, client, "Lookup",
           pb.LookupRequest(session_id="nope", engine_id=engine.engine_id, keys=keys[:1]), match="unknown session")
    expect(grpc.StatusCode.NOT_FOUND, raw_call, client, "Lookup",
           pb.LookupRequest(session_id=session_id, engine_id=12345, keys=keys[:1]), match="unknown engine 12345")
    expect(grpc.StatusCode.NOT_FOUND, raw_call, client, "SubmitStore",
           pb.SubmitStoreRequest(session_id=session_id, worker_id=12345, job_id=50, keys=keys[:1], block_ids=[0]),
           match="unknown worker 12345")
    expect(grpc.StatusCode.INVALID_ARGUMENT, raw_call, client, "RegisterEngine",
           pb.RegisterEngineRequest(session_id=session_id, namespace=pb.NamespaceSpec(model="m", block_size=16)),
           match="tp_size must be at least 1")
    expect(grpc.StatusCode.INVALID_ARGUMENT, raw_call, client, "RegisterEngine",
           pb.RegisterEngineRequest(session_id=session_id,
                                    namespace=pb.NamespaceSpec(model="m", block_size=16, tp_size=1)),
           match="namespace.key_version is required")
    assert_still_intact(client, engine, worker, tensors, keys)


def worker_request(client, tensor, **changes) -> pb.RegisterWorkerRequest:
    spec = tensor_spec(tensor_layout(tensor, 1, "layer0"))
    for name, value in changes.items():
        if isinstance(value, list):
            del getattr(spec, name)[:]
            getattr(spec, name).extend(value)
        else:
            setattr(spec, name, value)
    return pb.RegisterWorkerRequest(
        session_id=client._connection.session_id,
        namespace=pb.NamespaceSpec(**namespace("per_layer", model="layout-checks")),
        rank=0,
        device="cpu",
        tensors=[spec],
        handles=[pb.TensorHandle(shared_memory=pb.SharedMemoryWorker())],
    )


def test_layout_descriptors_that_do_not_match_the_tensor_are_refused(setup):
    client, engine, worker, tensors, keys = setup
    t = tensors[0]
    bad = [
        (dict(page_bytes=4096), "page_bytes 4096 does not match"),
        (dict(storage_bytes=t.untyped_storage().nbytes() // 2), "does not match the tensor"),
        (dict(dtype="float32"), "holds only 524288 bytes"),
        (dict(dtype="complex32"), "unknown dtype 'complex32'"),
        (dict(block_dim=7), "block_dim 7 is not a dimension"),
        (dict(strides=[1, 2, 3, 4, 5]), "not one dense region"),
        (dict(shape=[2, 128, 16, 2]), "4 dimensions in shape but 5 strides"),
    ]
    for changes, message in bad:
        expect(grpc.StatusCode.INVALID_ARGUMENT, raw_call, client, "RegisterWorker",
               worker_request(client, t, **changes), match=message)
    # A rank's layout must match the namespace's other workers of that rank.
    # (Same bytes per block, but one page instead of eight.)
    other = torch.zeros(NUM_BLOCKS, 8, 16, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(errors.InvalidArgument, match="registered with another layout"):
        client.register_worker(namespace("per_layer"), rank=0, tensors=[other], block_dim=0)
    # A block larger than the pool can hold in one run (512 KiB; a sixteenth of the 4 MiB pool).
    huge = torch.zeros(2, 4, 16, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(errors.InvalidArgument, match="more than the pool holds in one run"):
        client.register_worker(namespace("per_layer", model="huge"), rank=0, tensors=[huge] * 8, block_dim=1)
    with pytest.raises(errors.InvalidArgument, match="rank 2 is outside tp_size 2"):
        client.register_worker(namespace("per_layer", tp_size=2), rank=2, tensors=tensors, block_dim=1)
    assert_still_intact(client, engine, worker, tensors, keys)


def test_garbage_bytes_on_the_socket_do_not_hurt(setup, daemon):
    client, engine, worker, tensors, keys = setup
    for payload in (os.urandom(4096), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(512), b"GET / HTTP/1.1\r\n\r\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(daemon.socket)
            s.sendall(payload)
            s.settimeout(2)
            try:
                s.recv(1024)
            except (TimeoutError, ConnectionResetError):
                pass
    assert daemon.running
    assert_still_intact(client, engine, worker, tensors, keys)


def test_a_huge_registration_is_refused_before_any_work(setup):
    client, engine, worker, tensors, keys = setup
    spec = pb.TensorSpec(name="t", dtype="uint8", shape=[4096, 1, 1], strides=[1, 4096, 1],
                         storage_bytes=1 << 40, block_dim=1, page_bytes=1)
    request = pb.RegisterWorkerRequest(
        session_id=client._connection.session_id,
        namespace=pb.NamespaceSpec(**namespace("per_layer", model="huge-registration")),
        rank=0, device="cpu", tensors=[spec] * 100,
        handles=[pb.TensorHandle(shared_memory=pb.SharedMemoryWorker())] * 100,
    )
    expect(grpc.StatusCode.INVALID_ARGUMENT, raw_call, client, "RegisterWorker", request,
           match="409600 pages per block over all tensors")
    assert_still_intact(client, engine, worker, tensors, keys)


def test_a_registration_of_many_handles_is_refused_by_its_counts(setup):
    """A RegisterWorker of hundreds of thousands of handles, from any process
    that can connect, is refused by its session and its counts before a single
    tensor or handle is read into the daemon's values (reading them took the
    event loop seconds, every client waiting)."""
    client, engine, worker, tensors, keys = setup
    flood = pb.RegisterWorkerRequest(session_id="no-such-session", namespace=pb.NamespaceSpec(model="m"))
    flood.handles.extend([pb.TensorHandle(shared_memory=pb.SharedMemoryWorker())] * 300_000)
    expect(grpc.StatusCode.NOT_FOUND, raw_call, client, "RegisterWorker", flood, match="unknown session")
    flood.session_id = client._connection.session_id
    expect(grpc.StatusCode.INVALID_ARGUMENT, raw_call, client, "RegisterWorker", flood, match="0 tensors but 300000")
    del flood.handles[:]
    flood.tensors.extend([pb.TensorSpec(name="t")] * 100_000)
    expect(grpc.StatusCode.INVALID_ARGUMENT, raw_call, client, "RegisterWorker", flood,
           match="--max-tensors-per-worker")
    assert_still_intact(client, engine, worker, tensors, keys)
