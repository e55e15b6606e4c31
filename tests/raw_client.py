"""The daemon's protocol spoken directly, without the client library's care:
what attack scripts and protocol tests use, in the test process or in a
second one."""

from __future__ import annotations

import os
import socket
import struct

import grpc

from kvdepot.defaults import PROTOCOL_VERSION
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc

LENGTH = struct.Struct("<I")


class RawJobSocket:
    """Speaks the job socket's framing directly."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)

    def send(self, frame: pb.JobFrame) -> None:
        data = frame.SerializeToString()
        self.sock.sendall(LENGTH.pack(len(data)) + data)

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return data
            data += chunk
        return data

    def reply(self) -> pb.JobReply | None:
        """The next reply, or None when the daemon closed the connection."""
        header = self._exactly(LENGTH.size)
        if len(header) < LENGTH.size:
            return None
        reply = pb.JobReply()
        reply.ParseFromString(self._exactly(LENGTH.unpack(header)[0]))
        return reply

    def hello(self, session_id: str) -> pb.JobReply | None:
        self.send(pb.JobFrame(hello=pb.JobSocketHello(session_id=session_id)))
        return self.reply()

    def closed_by_daemon(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def ready(reply: pb.JobReply | None) -> pb.JobSocketReady:
    """The hello's answer, or RuntimeError saying why the daemon refused it."""
    if reply is None or not reply.HasField("ready"):
        raise RuntimeError(f"the daemon refused our hello: {reply}")
    return reply.ready


def prove(started: pb.SessionStarted) -> pb.JobSocketReady:
    """Says hello for the session on a job socket connection of its own, then
    closes it: the session keeps the identity it proved."""
    jobs = RawJobSocket(started.job_socket)
    try:
        return ready(jobs.hello(started.session_id))
    finally:
        jobs.close()


class RawSession:
    """A session of our own: Attach, then (unless told not to) the job socket's
    hello that proves who we are. `stub` makes any call; `jobs` is the job
    socket connection."""

    def __init__(self, socket_path: str, name: str = "raw", hello: bool = True, pid: int | None = None):
        self.channel = grpc.insecure_channel(f"unix:{socket_path}")
        self.stub = pb_grpc.KVDepotStub(self.channel)
        request = pb.AttachRequest(
            client_name=name, pid=os.getpid() if pid is None else pid, protocol_version=PROTOCOL_VERSION
        )
        self.stream = self.stub.Attach(request)
        self.started = next(self.stream).started
        self.id = self.started.session_id
        self.jobs = None
        self.ready = None
        if hello:
            self.jobs = RawJobSocket(self.started.job_socket)
            self.ready = ready(self.jobs.hello(self.id))

    def register_cpu_worker(self, ns: dict, tensors, block_dim, rank: int = 0):
        """Registers a shared-memory worker as the client library does, its
        staging memory handed over first: (RegisterWorkerResponse, StagingMemory)."""
        from kvdepot.client.job_socket import hand_over
        from kvdepot.client.shm_copy import StagingMemory
        from kvdepot.layout import WorkerLayout

        request, layouts = cpu_worker_request(self.id, ns, tensors, block_dim, rank=rank)
        layout = WorkerLayout.of(layouts)
        staging = StagingMemory(layout.num_blocks, layout.block_bytes)
        request.staging_id = hand_over(self.started.job_socket, self.id, staging.fd, 10)
        return self.stub.RegisterWorker(request), staging

    def close(self) -> None:
        """Ends the session (the Attach stream closes)."""
        self.stream.cancel()
        if self.jobs is not None:
            self.jobs.close()
        self.channel.close()


def cpu_worker_request(session_id: str, ns: dict, tensors, block_dim: int, staging_id: int = 0, rank: int = 0):
    """A shared-memory worker's RegisterWorkerRequest for `tensors`, as the
    client library makes it, and the tensors' layouts."""
    from kvdepot.client.tensors import tensor_layout, tensor_spec

    layouts = [tensor_layout(t, block_dim, f"l{i}") for i, t in enumerate(tensors)]
    request = pb.RegisterWorkerRequest(
        session_id=session_id, namespace=pb.NamespaceSpec(**ns), rank=rank, device="cpu",
        tensors=[tensor_spec(t) for t in layouts], staging_id=staging_id,
        handles=[pb.TensorHandle(shared_memory=pb.SharedMemoryWorker()) for _ in tensors])
    return request, layouts
