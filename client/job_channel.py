"""How a session's jobs reach the daemon: one interface, two ways.

`submit` sends a store or load nobody waits for: its refusal, a store's
counts and its end come back through the session's JobBook; `hand_over` gives the daemon
a worker's staging memory, which only the job socket can carry. The job socket (the daemon's
`PATH.jobs`, proto: "job socket") is the fast way, where the daemon offers it;
the gRPC calls of the same names are the other, on TCP or where the socket
cannot be opened. JobDone arrive on the job socket once a session has one,
else on the Attach stream (session.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import grpc

from kvdepot import jobtrace
from kvdepot.client.job_socket import JobSocket, JobSocketRefused, hand_over
from kvdepot.client.jobs import JobBook, Lead
from kvdepot.client.rpc import typed_error
from kvdepot.errors import FailedPrecondition, KVDepotError, Unavailable, from_status, status_code
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc

log = logging.getLogger("kvdepot.client")

# The gRPC call that does what a job socket request does.
_METHODS = {"submit_store": "SubmitStore", "submit_load": "SubmitLoad"}
# A submit's kind ("store" or "load") is the request "submit_" + kind.


def submit_failed(book: JobBook, kind: str, job_id: int, error: KVDepotError) -> None:
    """A submit nobody waited for failed: the daemon is gone (quietly), or it
    refused the request (a bug in the caller: logged)."""
    if isinstance(error, Unavailable):
        message = str(error)
    else:
        message = f"kvdepotd refused the {kind} job: {error}"
        log.warning("job %d: %s", job_id, message)
    book.finish(job_id, False, message)


class JobChannel(ABC):
    kind: str = ""

    @abstractmethod
    def submit(self, kind: str, job_id: int, request) -> None:
        """Sends a store or load ("store", "load") nobody waits for; its outcome goes to the JobBook."""

    def hand_over(self, fd: int) -> int:
        """Gives the daemon a worker's staging memory; returns its staging id."""
        raise FailedPrecondition(
            "a worker in host memory (the shared-memory transport) needs the daemon's job socket, "
            "which a unix-socket daemon has: over TCP only GPU workers can register"
        )

    def close(self) -> None:
        pass

    # The job socket's way for a waiting thread to read its jobs' ends itself
    # (JobSocket.lead); None where they come another way.
    lead: Lead | None = None


class GrpcJobChannel(JobChannel):
    kind = "grpc"

    def __init__(self, stub: pb_grpc.KVDepotStub, book: JobBook, timeout: float, metadata):
        self._stub = stub
        self._book = book
        self._timeout = timeout
        self._metadata = metadata

    def submit(self, kind: str, job_id: int, request) -> None:
        method = getattr(self._stub, _METHODS["submit_" + kind])
        try:
            future = method.future(request, timeout=self._timeout, metadata=self._metadata)
        except ValueError:  # the channel closed under us: the daemon went away
            self._book.finish(job_id, False, "the connection to kvdepotd is closed; reconnecting")
            return

        def answered(future) -> None:
            try:
                response = future.result()
            except grpc.RpcError as e:
                submit_failed(self._book, kind, job_id, typed_error(e.code(), e.details()))
                return
            if kind == "store":
                self._book.store_counts(job_id, response.already_stored, response.not_stored)

        future.add_done_callback(answered)


class SocketJobChannel(JobChannel):
    """The job socket. Its reader thread files JobDone and the outcomes of
    submits in the JobBook. Where the daemon answers submits quietly
    (proto: JobSocketHello.quiet_submits), a job costs one message each way:
    its JobDone says a store's counts, and a refusal names the job by its
    request id, which is the job's id. Everything here is under this channel's
    own lock, and nothing is called while holding it."""

    kind = "socket"

    def __init__(
        self, path: str, session_id: str, book: JobBook, timeout: float, on_lost: Callable[[JobChannel, str], None],
        trusted: frozenset[int],
    ):
        self._book = book
        self._timeout = timeout
        self._on_lost = on_lost
        self._changed = threading.Condition()
        self._request_ids = itertools.count(1)
        # Submits not answered yet, by request id: (kind, job id); quietly
        # answered ones until their JobDone (or refusal) comes.
        self._unanswered: dict[int, tuple[str, int]] = {}
        self._closed = False
        self._path, self._session_id, self._trusted = path, session_id, trusted
        # Raises OSError when the daemon cannot be reached or refuses the hello.
        self.socket = JobSocket(path, session_id, self._on_reply, self._lost, timeout, trusted)
        self.quiet = self.socket.quiet
        self.lead = self.socket.lead

    def hand_over(self, fd: int) -> int:
        try:
            return hand_over(self._path, self._session_id, fd, self._timeout, self._trusted)
        except JobSocketRefused as e:
            # The daemon's own code where it gave one (INVALID_ARGUMENT for memory past --max-shm-worker-bytes).
            if e.code:
                raise from_status(status_code(e.code), str(e)) from None
            raise FailedPrecondition(str(e)) from None
        except OSError as e:
            raise Unavailable(f"kvdepotd is not available: {e}") from None

    def submit(self, kind: str, job_id: int, request) -> None:
        request_id = job_id if self.quiet else next(self._request_ids)
        with self._changed:
            self._unanswered[request_id] = (kind, job_id)
        try:
            self.socket.send(pb.JobFrame(request_id=request_id, **{"submit_" + kind: request}))
        except OSError as e:
            with self._changed:
                self._unanswered.pop(request_id, None)
            self._book.finish(job_id, False, f"kvdepotd is not available: {e}")
            self._lost(str(e))

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._unanswered.clear()
            self._changed.notify_all()
        self.socket.close()

    def _lost(self, reason: str) -> None:
        with self._changed:
            if self._closed:
                return
        self._on_lost(self, reason)

    def _on_reply(self, reply: pb.JobReply) -> None:
        kind = reply.WhichOneof("kind")
        with self._changed:
            if self._closed:
                # Its jobs failed with the session, and their ids may be in use again.
                return
            if kind != "job_done":
                unanswered = self._unanswered.pop(reply.request_id, None)
            elif self.quiet:
                unanswered = self._unanswered.pop(reply.job_done.job_id, None)
        if kind == "job_done":
            done = reply.job_done
            if jobtrace.ON:
                jobtrace.client_stamp(self._session_id, done.job_id, "done_read")
            if self.quiet and unanswered is not None and unanswered[0] == "store":
                self._book.store_counts(done.job_id, done.already_stored, done.not_stored)
            self._book.finish(done.job_id, done.ok, done.error)
        elif unanswered is None:
            return  # its session is gone, and the job failed with it
        elif kind == "refused":
            submit_failed(self._book, unanswered[0], unanswered[1], _refusal(reply.refused))
        elif kind == "store_submitted":
            submitted = reply.store_submitted
            self._book.store_counts(unanswered[1], submitted.already_stored, submitted.not_stored)


def _refusal(refused: pb.JobRefused) -> KVDepotError:
    return typed_error(status_code(refused.code), refused.message)
