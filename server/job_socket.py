"""The job socket: a session's jobs as length-prefixed protobuf frames on a unix
stream socket, handled on the event loop without gRPC (the framing and the
rules are in proto/kvdepot.proto, "job socket").

Jobs are what an engine does every step, and a gRPC call wakes gRPC's threads
on both sides twice (the request in, JobDone out), a large part of a small
job's time (docs/benchmarks.md). Here a request is read by the event loop
itself and its answer, and later its JobDone, are written from the loop
straight into the socket.
"""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
from google.protobuf.message import DecodeError

from kvdepot.defaults import JOB_FRAME_HEADER, MAX_JOB_FRAME_BYTES
from kvdepot.errors import FailedPrecondition, InvalidArgument, KVDepotError, NotFound, PermissionDenied
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.server.peer import peer_of

log = logging.getLogger("kvdepot.jobs")


def job_socket_path(grpc_socket_path: str) -> str:
    return grpc_socket_path + ".jobs"


def frame(message) -> bytes:
    data = message.SerializeToString()
    return JOB_FRAME_HEADER.pack(len(data)) + data


class JobConnection(asyncio.Protocol):
    """One client's job socket. Belongs to a session after its hello."""

    def __init__(self, depot, tenants):
        self._depot = depot
        self._tenants = tenants
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self.session = None
        # JobDone of jobs that ended while a request was being handled: they go
        # out after its answer (a job can end inside its own submit).
        self._held_dones: list | None = None

    @property
    def open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, exc) -> None:
        if self.session is not None and self.session.outbox.job_channel is self:
            # Later JobDone go back to the Attach stream, which still ends the session.
            self.session.outbox.job_channel = None
        self._transport = None

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while self.open and len(buffer) - start >= JOB_FRAME_HEADER.size:
            (length,) = JOB_FRAME_HEADER.unpack_from(buffer, start)
            if length > MAX_JOB_FRAME_BYTES:
                self._drop(f"a frame of {length} bytes (the limit is {MAX_JOB_FRAME_BYTES})")
                return
            end = start + JOB_FRAME_HEADER.size + length
            if len(buffer) < end:
                break
            request = pb.JobFrame()
            try:
                request.ParseFromString(bytes(buffer[start + JOB_FRAME_HEADER.size : end]))
            except DecodeError:
                self._drop("a frame that is not a JobFrame")
                return
            start = end
            self._handle(request)
        del buffer[:start]

    def send_done(self, done: pb.JobDone) -> None:
        message = frame(pb.JobReply(job_done=done))
        if self._held_dones is not None:
            self._held_dones.append(message)
        else:
            self._transport.write(message)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _drop(self, what: str) -> None:
        log.warning("closing a job socket connection that sent %s", what)
        self._transport.close()

    @staticmethod
    def _refusal(request_id: int, error: Exception) -> bytes:
        # An error that is not a KVDepotError is a bug in the daemon: INTERNAL.
        status = error.code if isinstance(error, KVDepotError) else grpc.StatusCode.INTERNAL
        code = status.value[0]
        refused = pb.JobRefused(code=code, message=str(error))
        return frame(pb.JobReply(request_id=request_id, refused=refused))

    def _handle(self, request: pb.JobFrame) -> None:
        kind = request.WhichOneof("kind")
        if self.session is None:
            self._bind(request, kind)
            return
        self._held_dones = []
        try:
            self._transport.write(self._answer(request, kind))
            for message in self._held_dones:
                self._transport.write(message)
        finally:
            self._held_dones = None

    def _answer(self, request: pb.JobFrame, kind: str) -> bytes:
        reply = pb.JobReply(request_id=request.request_id)
        try:
            if kind == "submit_store":
                self._check_session(request.submit_store.session_id)
                reply.store_submitted.CopyFrom(self._depot.submit_store(request.submit_store))
            elif kind == "submit_load":
                self._check_session(request.submit_load.session_id)
                reply.load_submitted.CopyFrom(self._depot.submit_load(request.submit_load))
            elif kind == "complete_job":
                self._check_session(request.complete_job.session_id)
                self._depot.complete_job(request.complete_job)
                reply.job_completed.SetInParent()
            elif kind == "hello":
                raise FailedPrecondition("this job socket connection has said hello already")
            else:
                raise InvalidArgument("an empty JobFrame: set one of its requests")
        except KVDepotError as e:
            return self._refusal(request.request_id, e)
        except Exception as e:
            log.exception("job socket %s failed", kind)
            return self._refusal(request.request_id, RuntimeError(f"{kind} failed: see the daemon's log ({e})"))
        return frame(reply)

    def _bind(self, request: pb.JobFrame, kind: str) -> None:
        """The hello: the connection joins its session, and the session takes
        the identity the kernel gives for the connection's peer."""
        try:
            if kind != "hello":
                raise FailedPrecondition("the first frame on a job socket must be hello")
            peer = peer_of(self._transport.get_extra_info("socket"))
            if peer is None:
                raise PermissionDenied("the daemon cannot tell who this connection's peer is (no SO_PEERCRED)")
            identity = self._tenants.for_peer(peer)
            session = self._depot.prove(request.hello.session_id, identity)
            if session.outbox.has_job_channel():
                raise FailedPrecondition(f"session {session.number} has a job socket connection already")
        except (FailedPrecondition, NotFound, PermissionDenied) as e:
            self._transport.write(self._refusal(request.request_id, e))
            self._transport.close()
            return
        session.outbox.job_channel = self
        self.session = session
        ready = pb.JobSocketReady(tenant=session.identity.tenant, admin=session.identity.admin)
        self._transport.write(frame(pb.JobReply(request_id=request.request_id, ready=ready)))

    def _check_session(self, session_id: str) -> None:
        if session_id != self.session.id:
            raise InvalidArgument(
                f"this job socket connection belongs to session {self.session.number}, not to the one named"
            )


async def listen(depot, tenants, path: str) -> asyncio.AbstractServer:
    """Serves the job socket at `path` (a stale file there is removed: the
    daemon holds its address lock)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: JobConnection(depot, tenants), path)
    try:
        os.chmod(path, 0o660)
    except OSError:
        server.close()
        raise
    return server
