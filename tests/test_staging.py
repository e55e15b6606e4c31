"""A CPU worker's staging memory reaches the daemon as a descriptor on the job
socket. Everything a hostile client can send there is refused with a reason,
leaks no descriptor or mapping in the daemon, and never lets a later copy
fault (a memfd that could shrink under the daemon's mapping would)."""

from __future__ import annotations

import array
import fcntl
import os
import socket

import grpc
import pytest
from conftest import wait_until
from kvcache import attach_worker, make_kv_cache, namespace, prompt_keys
from raw_client import RawJobSocket, RawSession

from kvdepot.client.shm_copy import StagingMemory
from kvdepot.client.tensors import tensor_layout, tensor_spec
from kvdepot.layout import WorkerLayout
from kvdepot.proto import kvdepot_pb2 as pb


def offer(session: RawSession, descriptors: list[int], session_id: str | None = None) -> pb.JobReply:
    """A staging offer, then one byte carrying `descriptors`; the daemon's last answer."""
    raw = RawJobSocket(session.started.job_socket)
    try:
        raw.send(pb.JobFrame(request_id=1, staging=pb.StagingOffer(session_id=session_id or session.id)))
        answer = raw.reply()
        if not answer.HasField("staging_ready"):
            return answer
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", descriptors))] if descriptors else []
        raw.sock.sendmsg([b"\0"], ancillary)
        return raw.reply()
    finally:
        raw.close()


def refused(answer: pb.JobReply, code: grpc.StatusCode, text: str) -> None:
    assert answer.HasField("refused"), answer
    assert answer.refused.code == code.value[0] and text in answer.refused.message, answer.refused


def memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("attack", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def daemon_fds(daemon) -> int:
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def daemon_staging_maps(daemon) -> int:
    with open(f"/proc/{daemon.proc.pid}/maps") as f:
        return sum("memfd:" in line for line in f)


def test_every_bad_staging_descriptor_is_refused_and_nothing_leaks(start_daemon, tmp_path):
    daemon = start_daemon(max_shm_worker_bytes="1GiB")
    session = RawSession(daemon.socket, name="staging-attacker")
    before = daemon_fds(daemon)
    shrinkable = memfd(1 << 20, 0)
    sealed = memfd(1 << 20, fcntl.F_SEAL_SHRINK)
    plain_file = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain_file, 1 << 20)
    read_only = os.open(f"/proc/self/fd/{sealed}", os.O_RDONLY)
    try:
        # A memfd that may shrink would fault the daemon's next copy (SIGBUS).
        refused(offer(session, [shrinkable]), grpc.StatusCode.INVALID_ARGUMENT, "sealed against shrinking")
        refused(offer(session, [plain_file]), grpc.StatusCode.INVALID_ARGUMENT, "")
        refused(offer(session, [read_only]), grpc.StatusCode.INVALID_ARGUMENT, "reading and writing")
        refused(offer(session, []), grpc.StatusCode.INVALID_ARGUMENT, "exactly one descriptor")
        refused(offer(session, [sealed, sealed]), grpc.StatusCode.INVALID_ARGUMENT, "exactly one descriptor")
        refused(offer(session, [sealed], session_id="not-a-session"), grpc.StatusCode.NOT_FOUND, "unknown session")
        unproven = RawSession(daemon.socket, name="unproven", hello=False)
        refused(offer(unproven, [sealed]), grpc.StatusCode.FAILED_PRECONDITION, "has not said hello")
        too_big = memfd(2 << 30, fcntl.F_SEAL_SHRINK)
        try:
            refused(offer(session, [too_big]), grpc.StatusCode.INVALID_ARGUMENT, "--max-shm-worker-bytes")
        finally:
            os.close(too_big)
        # A staging offer on a connection that said hello is out of order.
        session.jobs.send(pb.JobFrame(request_id=9, staging=pb.StagingOffer(session_id=session.id)))
        refused(session.jobs.reply(), grpc.StatusCode.FAILED_PRECONDITION, "must be the first frame")
    finally:
        for fd in (shrinkable, sealed, plain_file, read_only):
            os.close(fd)
    # Every descriptor it was sent was closed, none mapped.
    wait_until(lambda: daemon_fds(daemon) <= before, what="the daemon's descriptors back to where they were")
    assert daemon_staging_maps(daemon) == 0
    assert daemon.running


def test_staging_memory_must_hold_the_worker_and_serves_one_worker_of_its_own_session(daemon):
    session = RawSession(daemon.socket, name="owner")
    other = RawSession(daemon.socket, name="other")
    tensors, block_dim = make_kv_cache("per_layer", seed=31)
    layouts = [tensor_layout(t, block_dim, f"l{i}") for i, t in enumerate(tensors)]
    layout = WorkerLayout.of(layouts)
    small = StagingMemory(layout.num_blocks - 1, layout.block_bytes)
    taken = offer(session, [small.fd])
    assert taken.HasField("staging_taken")

    def register(on: RawSession, staging_id: int):
        request = pb.RegisterWorkerRequest(
            session_id=on.id, namespace=pb.NamespaceSpec(**namespace("per_layer")), rank=0, device="cpu",
            tensors=[tensor_spec(t) for t in layouts],
            staging_id=staging_id, handles=[pb.TensorHandle(shared_memory=pb.SharedMemoryWorker()) for _ in tensors])
        with pytest.raises(grpc.RpcError) as info:
            on.stub.RegisterWorker(request)
        return info.value

    error = register(session, taken.staging_taken.staging_id)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "need" in error.details()
    # Another session cannot use this one's (the id names nothing there), and
    # a refused memory is gone: it cannot be tried again.
    enough = StagingMemory(layout.num_blocks, layout.block_bytes)
    second = offer(session, [enough.fd]).staging_taken.staging_id
    error = register(other, second)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "no staging memory" in error.details()
    error = register(session, taken.staging_taken.staging_id)
    assert "no staging memory" in error.details()


def test_a_session_that_ends_leaves_no_staging_mapped_in_the_daemon(daemon, client_factory):
    client = client_factory(daemon, name="cpu-engine")
    worker, engine, tensors = attach_worker(client, seed=32)
    keys = prompt_keys(8, prompt=320)
    job = client.submit_store(worker, 1, keys, list(range(8)))
    assert client.wait([job], 10)[job].ok
    assert daemon_staging_maps(daemon) == 1
    client.close()
    wait_until(lambda: daemon_staging_maps(daemon) == 0, what="the worker's staging unmapped")


def test_a_cpu_worker_past_the_memory_limit_gets_the_daemons_invalid_argument(start_daemon, client_factory):
    """The client used to turn every refused hand-over into FailedPrecondition,
    whatever the daemon said; the docs promise INVALID_ARGUMENT naming the option."""
    from kvdepot.errors import InvalidArgument

    client = client_factory(start_daemon(max_shm_worker_bytes="1MiB"))  # the cache is 2 MiB
    tensors, block_dim = make_kv_cache("per_layer", seed=3)
    with pytest.raises(InvalidArgument, match="--max-shm-worker-bytes"):
        client.register_worker(namespace("per_layer"), rank=0, tensors=tensors, block_dim=block_dim)
