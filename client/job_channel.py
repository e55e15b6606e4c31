"""How a session's jobs reach the daemon: one interface, two ways.

`call` sends a job request and returns the daemon's answer (or raises its
typed error); `submit` sends one nobody waits for: its refusal, or a store's
counts, come back through the session's JobBook; `hand_over` gives the daemon
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
from kvdepot.client.jobs import JobBook
from kvdepot.client.rpc import typed_error, unary
from kvdepot.errors import FailedPrecondition, KVDepotError, Unavailable, status_code
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
    def call(self, kind: str, request):
        """The answer to a job request ("submit_store" or "submit_load")."""

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


class GrpcJobChannel(JobChannel):
    kind = "grpc"

    def __init__(self, stub: pb_grpc.KVDepotStub, book: JobBook, timeout: float, metadata):
        self._stub = stub
        self._book = book
        self._timeout = timeout
        self._metadata = metadata

    def call(self, kind: str, request):
        return unary(getattr(self._stub, _METHODS[kind]), request, self._timeout, self._metadata)

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
    """The job socket. Its reader thread files answers for the callers waiting
    on them, JobDone and the outcomes of submits in the JobBook. Everything here
    is under this channel's own lock, and nothing is called while holding it."""

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
        # A caller blocked on an answer is in _wanted until the reader files it
        # in _replies; a request nobody waits for is in _unanswered as (kind, job id).
        self._wanted: set[int] = set()
        self._replies: dict[int, pb.JobReply] = {}
        self._unanswered: dict[int, tuple[str, int]] = {}
        self._closed = False
        self._path, self._session_id, self._trusted = path, session_id, trusted
        # Raises OSError when the daemon cannot be reached or refuses the hello.
        self.socket = JobSocket(path, session_id, self._on_reply, self._lost, timeout, trusted)

    def hand_over(self, fd: int) -> int:
        try:
            return hand_over(self._path, self._session_id, fd, self._timeout, self._trusted)
        except JobSocketRefused as e:
            raise FailedPrecondition(str(e)) from None
        except OSError as e:
            raise Unavailable(f"kvdepotd is not available: {e}") from None

    def call(self, kind: str, request):
        request_id = next(self._request_ids)
        with self._changed:
            self._wanted.add(request_id)
        try:
            try:
                self.socket.send(pb.JobFrame(request_id=request_id, **{kind: request}))
            except OSError as e:
                self._lost(str(e))
                raise Unavailable(f"kvdepotd is not available: {e}") from None
            with self._changed:
                self._changed.wait_for(lambda: request_id in self._replies or self._closed, self._timeout)
                reply = self._replies.pop(request_id, None)
                closed = self._closed
        finally:
            with self._changed:
                self._wanted.discard(request_id)
                self._replies.pop(request_id, None)
        if reply is None:
            if closed:
                raise Unavailable("the connection to kvdepotd was lost; reconnecting")
            raise Unavailable(f"kvdepotd did not answer {kind} within {self._timeout} s")
        if reply.HasField("refused"):
            raise _refusal(reply.refused)
        return getattr(reply, reply.WhichOneof("kind"))

    def submit(self, kind: str, job_id: int, request) -> None:
        request_id = next(self._request_ids)
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
                if reply.request_id in self._wanted:
                    self._replies[reply.request_id] = reply
                    self._changed.notify_all()
                    return
                unanswered = self._unanswered.pop(reply.request_id, None)
        if kind == "job_done":
            done = reply.job_done
            if jobtrace.ON:
                jobtrace.client_stamp(self._session_id, done.job_id, "done_read")
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
