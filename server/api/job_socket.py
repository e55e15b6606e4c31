"""The job socket: a session's jobs as length-prefixed protobuf frames on a unix
stream socket, handled on the event loop without gRPC (the framing and the
rules are in proto/kvdepot.proto, "job socket").

Jobs are what an engine does every step, and a gRPC call wakes gRPC's threads
on both sides twice (the request in, JobDone out), a large part of a small
job's time (docs/benchmarks.md). Here a request is read by the event loop
itself and its answer, and later its JobDone, are written from the loop
straight into the socket.

Anyone who can reach the socket can open connections, so what they can make
the daemon hold is bounded: connections in all and per user id (from the
kernel, SO_PEERCRED), a deadline and a small frame size until a connection
says hello, and the replies it leaves unread (past a high-water mark the
daemon stops reading its requests until it reads; past a cap it is closed).
What any client can make happen again and again is logged once in a while.

A connection of its own, whose first frame is a staging offer instead of a
hello, hands the daemon a worker's staging memory as a file descriptor
(api/staging_offer.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat

from google.protobuf.message import DecodeError

from kvdepot import jobtrace
from kvdepot.defaults import JOB_FRAME_HEADER, MAX_HELLO_FRAME_BYTES, MAX_JOB_FRAME_BYTES
from kvdepot.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVDepotError,
    PermissionDenied,
    ResourceExhausted,
)
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.server.api import answers, parse
from kvdepot.server.api.answers import job_frame, job_refused
from kvdepot.server.api.job_gate import Gate, JobSocketLimits, fit_fd_limit
from kvdepot.server.api.staging_offer import StagingOffer
from kvdepot.server.host.peer import peer_of

log = logging.getLogger("kvdepot.jobs")

# Unread replies past which the daemon stops reading a connection's requests,
# and below which it reads them again: a few thousand replies in flight.
PAUSE_AT_BYTES = 256 << 10
RESUME_AT_BYTES = 64 << 10
# Frames up to a read's size (asyncio's, and the native lane's) are bounded by
# the connection count; longer ones count against their user's budget
# (--max-job-frame-bytes-per-uid) until they are whole.
UNCOUNTED_FRAME_BYTES = 256 << 10


def job_socket_path(grpc_socket_path: str) -> str:
    return grpc_socket_path + ".jobs"


class JobConnection(asyncio.Protocol):
    """One client's job socket. Belongs to a session after its hello."""

    def __init__(self, depot, tenants, gate: Gate):
        self._depot = depot
        self._tenants = tenants
        self._gate = gate
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self.session = None
        # JobDone of jobs that ended while a request was being handled: they go
        # out after its answer (a job can end inside its own submit).
        self._held_dones: list | None = None
        # The peer's uid (None: unknown), and whether the gate counts this connection.
        self._uid: int | None = None
        self._peer = "an unknown peer"
        # Who the kernel says connected; the hello gives its session this identity.
        self._credentials = None
        self._admitted = False
        self._hello_timer: asyncio.TimerHandle | None = None
        # The client is not reading its replies: requests wait in the buffer.
        self._paused = False
        # The staging offer this connection made instead of a hello.
        self._offer: StagingOffer | None = None
        # Replies held to go out in one write (hold_writes), else None.
        self._held_writes: list[bytes] | None = None
        self._held_bytes = 0
        # The answer to hello, once the depot takes the connection (the native
        # lane): handed over with what was read after the hello.
        self._handover: bytes | None = None
        self._handed_over = False
        # The hello asked for quiet submits (proto: JobSocketHello.quiet_submits).
        self._quiet = False
        # The length of the frame not yet whole that the gate counts for this connection.
        self._frame_held = 0

    @property
    def open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def connection_made(self, transport) -> None:
        self._transport = transport
        peer = self._credentials = peer_of(transport.get_extra_info("socket"))
        if peer is not None:
            self._uid, self._peer = peer.uid, f"pid {peer.pid}, uid {peer.uid}"
        refusal = self._gate.admit(self._uid)
        if refusal is not None:
            self._turn_away("refused", ResourceExhausted(refusal), "refused a job socket connection of %s: %s")
            return
        self._admitted = True
        transport.set_write_buffer_limits(high=PAUSE_AT_BYTES, low=RESUME_AT_BYTES)
        timeout = self._gate.limits.hello_timeout
        self._hello_timer = asyncio.get_running_loop().call_later(timeout, self._no_hello, timeout)

    def connection_lost(self, exc) -> None:
        if self._handed_over:  # the depot's now, and its gate slot with it
            self._transport = None
            return
        if self.session is not None and self.session.outbox.job_channel is self:
            # Later JobDone go back to the Attach stream, which still ends the session.
            self.session.outbox.job_channel = None
        if self._admitted:
            self._gate.release(self._uid)
            self._admitted = False
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        if self._offer is not None:
            self._offer.stop()
        self._gate.drop_frame(self._uid, self._frame_held)
        self._frame_held = 0
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._serve()

    def pause_writing(self) -> None:
        # Its replies pile up unread: take no more requests until they go out.
        self._paused = True
        self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        self._serve()
        if self.open and not self._paused:
            self._transport.resume_reading()

    def _serve(self) -> None:
        """Handles the whole frames in the buffer, until writing is paused."""
        more = True
        while more and self.open and not self._paused:
            self.hold_writes()  # the answers to the frames read go out in one write
            try:
                more = self._handle_frames(self._buffer)
            finally:
                self.write_held()

    def _handle_frames(self, buffer: bytearray) -> bool:
        """Handles frames until the answers held reach PAUSE_AT_BYTES (then
        True: a read's worth of small frames would otherwise make ten times
        their size in answers, held before the client reads any)."""
        start = 0
        while self.open and not self._paused and self._offer is None and len(buffer) - start >= JOB_FRAME_HEADER.size:
            if self._held_bytes > PAUSE_AT_BYTES:
                del buffer[:start]
                return True
            (length,) = JOB_FRAME_HEADER.unpack_from(buffer, start)
            limit = MAX_JOB_FRAME_BYTES if self.session is not None else MAX_HELLO_FRAME_BYTES
            if length > limit:
                before_hello = "" if self.session is not None else " before hello"
                self._drop("too large", f"a frame of {length} bytes (the limit is {limit}{before_hello})")
                return False
            end = start + JOB_FRAME_HEADER.size + length
            if len(buffer) < end:
                if self.session is not None and length > UNCOUNTED_FRAME_BYTES and not self._frame_held:
                    # Its bytes wait in the buffer: counted against its user's budget.
                    refusal = self._gate.hold_frame(self._uid, length)
                    if refusal is not None:
                        self.write_held()
                        self._turn_away("frame budget", ResourceExhausted(refusal))
                        return False
                    self._frame_held = length
                break
            if self._frame_held:
                self._gate.drop_frame(self._uid, self._frame_held)
                self._frame_held = 0
            received = jobtrace.now() if jobtrace.ON else 0
            request = pb.JobFrame()
            try:
                request.ParseFromString(bytes(buffer[start + JOB_FRAME_HEADER.size : end]))
            except DecodeError:
                self._drop("undecodable", "a frame that is not a JobFrame")
                return False
            start = end
            self._handle(request, received)
            if self._handover is not None:
                self._hand_over(bytes(buffer[start:]))
                buffer.clear()
                return False
        del buffer[:start]
        return False

    def _turn_away(self, kind: str, error: KVDepotError, message="closing the job socket connection of %s: %s") -> None:
        """Says why (a JobRefused of request 0) and closes, with a warning now and then."""
        self._gate.events.warning(kind, message, self._peer, error)
        self._transport.write(job_refused(0, error))
        self._transport.close()

    def send_done(self, done) -> None:
        message = job_frame(pb.JobReply(job_done=answers.job_done(done)))
        if self._held_dones is not None:
            self._held_dones.append(message)
        else:
            self._write(message)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def hold_writes(self) -> None:
        """Holds the replies written from now on, until write_held."""
        if self._held_writes is None:
            self._held_writes = []
            self._held_bytes = 0

    def write_held(self) -> None:
        """Writes the held replies, in order, with one system call."""
        held, self._held_writes = self._held_writes, None
        if held and self.open:
            self._write_now(held[0] if len(held) == 1 else b"".join(held))

    def _write(self, message: bytes) -> None:
        if self._held_writes is not None:
            self._held_writes.append(message)
            self._held_bytes += len(message)
        else:
            self._write_now(message)

    def _write_now(self, message: bytes) -> None:
        self._transport.write(message)
        unread = self._transport.get_write_buffer_size()
        cap = self._gate.limits.max_unread_replies
        if unread > cap:
            self._gate.events.warning(
                "unread",
                "closing the job socket connection of %s: it left %d bytes of replies unread "
                "(the limit is %d, --max-unread-job-replies)",
                self._peer,
                unread,
                cap,
            )
            self._transport.abort()  # what it did not read goes with it

    def _drop(self, kind: str, what: str) -> None:
        self.write_held()  # the answers to the frames before this one
        self._gate.events.warning(kind, "closing a job socket connection that sent %s (%s)", what, self._peer)
        self._transport.close()

    def _no_hello(self, timeout: float) -> None:
        self._hello_timer = None
        if self.session is None and self.open:
            what = "no staging descriptor" if self._offer is not None else "no hello"
            if self._offer is not None:
                self._offer.stop()  # no descriptor is taken once it has been refused
            error = FailedPrecondition(f"{what} within {timeout:g} s (--job-hello-timeout)")
            self._turn_away("no hello", error)

    def _handle(self, request: pb.JobFrame, received: int = 0) -> None:
        kind = request.WhichOneof("kind")
        if self.session is None:
            self._bind(request, kind)
            return
        self._held_dones = []
        try:
            answer = self._answer(request, kind, received)
            if answer is not None:
                self._write(answer)
            for message in self._held_dones:
                if self.open:
                    self._write(message)
        finally:
            self._held_dones = None

    def _answer(self, request: pb.JobFrame, kind: str, received: int) -> bytes | None:
        """The answer to a request; None for a submit taken quietly."""
        reply = pb.JobReply(request_id=request.request_id)
        try:
            if kind == "submit_store":
                self._check_session(request.submit_store.session_id)
                job = parse.store_job(request.submit_store)
                submitted = self._depot.submit(self.session.id, job, received)
                if self._quiet:
                    return None
                reply.store_submitted.CopyFrom(answers.store_submitted(submitted))
            elif kind == "submit_load":
                self._check_session(request.submit_load.session_id)
                self._depot.submit(self.session.id, parse.load_job(request.submit_load), received)
                if self._quiet:
                    return None
                reply.load_submitted.SetInParent()
            elif kind in ("hello", "staging"):
                raise FailedPrecondition(f"{kind} must be the first frame of a job socket connection")
            else:
                raise InvalidArgument("an empty JobFrame: set one of its requests")
        except KVDepotError as e:
            return job_refused(request.request_id, e)
        except Exception as e:
            # A bug of the daemon's, but one a client may trigger at will.
            self._gate.events.warning(f"failed {kind}", "job socket %s failed", kind, exc_info=True)
            return job_refused(request.request_id, RuntimeError(f"{kind} failed: see the daemon's log ({e})"))
        return job_frame(reply)

    def _bind(self, request: pb.JobFrame, kind: str) -> None:
        """The hello: the connection joins its session, and the session takes
        the identity the kernel gives for the connection's peer."""
        try:
            if kind not in ("hello", "staging"):
                raise FailedPrecondition("the first frame on a job socket must be hello (or a staging offer)")
            peer = self._credentials
            if peer is None:
                raise PermissionDenied("the daemon cannot tell who this connection's peer is (no SO_PEERCRED)")
            identity = self._tenants.for_peer(peer)
            if kind == "staging":
                session_id = request.staging.session_id
                self._depot.session(session_id)  # known, and proven
                self._offer = StagingOffer(self._transport, request.request_id,
                                           lambda fd: self._depot.take_staging(session_id, identity, fd),
                                           self._gate.events, lambda what: self._drop("broken", what))
                return
            session = self._depot.prove(request.hello.session_id, identity)
            if session.outbox.has_job_channel():
                raise FailedPrecondition(f"session {session.number} has a job socket connection already")
        except KVDepotError as e:
            self._transport.write(job_refused(request.request_id, e))
            self._transport.close()
            return
        self.session = session
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self._quiet = request.hello.quiet_submits
        ready = pb.JobSocketReady(tenant=session.identity.tenant, admin=session.identity.admin,
                                  quiet_submits=self._quiet)
        answer = job_frame(pb.JobReply(request_id=request.request_id, ready=ready))
        if self._depot.takes_job_connections:
            self._handover = answer  # once the hello is taken off the buffer
            return
        session.outbox.job_channel = self
        self._transport.write(answer)

    def _hand_over(self, leftover: bytes) -> None:
        """The connection's socket goes to the depot (a duplicate of it: the
        peer sees nothing), with the answer to hello and what was read after
        it; this protocol lets go of it without closing the peer's end."""
        self.write_held()
        sock = self._transport.get_extra_info("socket")
        fd = os.dup(sock.fileno())
        os.set_blocking(fd, False)
        uid, gate = self._uid, self._gate
        self._handed_over = True
        self._admitted = False
        self._transport.pause_reading()
        try:
            self._depot.adopt_job_connection(self.session, fd, self._peer, uid, self._handover, leftover, self._quiet,
                                             lambda: gate.release(uid))
        finally:
            self._transport.abort()

    def _check_session(self, session_id: str) -> None:
        if session_id != self.session.id:
            raise InvalidArgument(
                f"this job socket connection belongs to session {self.session.number}, not to the one named"
            )


async def listen(depot, tenants, path: str, limits: JobSocketLimits | None = None) -> asyncio.AbstractServer:
    """Serves the job socket at `path` (a stale socket there is removed: the
    daemon holds its address lock; anything else there is left alone)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; it is left as it is")
        os.unlink(path)
    except FileNotFoundError:
        pass
    gate = Gate(fit_fd_limit(limits or JobSocketLimits()))
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: JobConnection(depot, tenants, gate), path)
    try:
        os.chmod(path, 0o660)
    except OSError:
        server.close()
        raise
    return server
