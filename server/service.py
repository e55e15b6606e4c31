"""The gRPC face of the depot: requests in, typed errors out as status codes."""

from __future__ import annotations

import functools
import hmac
import logging

import grpc

from kvdepot.errors import KVDepotError
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc
from kvdepot.server.depot import Depot
from kvdepot.server.logsafe import shown

log = logging.getLogger("kvdepot.service")


def _unary(method):
    """Turns a typed error into its gRPC status; anything else is a bug, logged."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except KVDepotError as e:
            await context.abort(e.code, str(e))
        except Exception:
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed: see the daemon's log")

    return wrapper


class KVDepotService(pb_grpc.KVDepotServicer):
    def __init__(self, depot: Depot, job_socket: str = "", max_queued_keys: int | None = None):
        self.depot = depot
        # Told to every session; empty when the daemon has no job socket.
        self.job_socket = job_socket
        # Keys of notifications that may wait for one session's Attach stream.
        self.max_queued_keys = max_queued_keys

    async def Attach(self, request, context):
        try:
            session = self.depot.attach(request.client_name, request.pid, request.protocol_version)
        except KVDepotError as e:
            await context.abort(e.code, str(e))
        if self.max_queued_keys is not None:
            session.outbox.bound(self.max_queued_keys, lambda reason: self._fell_behind(session, reason))
        try:
            yield pb.Notification(
                started=pb.SessionStarted(
                    session_id=session.id,
                    daemon_instance=self.depot.instance,
                    pool=self.depot.pool_info(),
                    daemon_version=self.depot.version,
                    job_socket=self.job_socket,
                )
            )
            while (notification := await session.outbox.next()) is not None:
                yield notification
            why = f"kvdepotd ended this session: {session.outbox.overflowed}"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        finally:
            # Reached when the client closes the stream or its connection drops
            # (exit, crash, kill -9), and when the server stops.
            self.depot.end_session(session)

    def _fell_behind(self, session, reason: str) -> None:
        # Ended now, not once the stream gets to its end: a client that reads
        # nothing may never let it, and its jobs and pins must go.
        log.warning(
            "ending session %s (%s, pid %d): %s", session.id, shown(session.client_name), session.pid, reason
        )
        self.depot.end_session(session)

    @_unary
    def RegisterEngine(self, request, context):
        engine_id, ns = self.depot.register_engine(request.session_id, request.namespace)
        return pb.RegisterEngineResponse(engine_id=engine_id, namespace_name=ns.name)

    @_unary
    def RegisterWorker(self, request, context):
        worker = self.depot.register_worker(request)
        return pb.RegisterWorkerResponse(
            worker_id=worker.id,
            namespace_name=worker.ns.name,
            block_bytes=worker.layout.block_bytes,
            slot_offsets=worker.layout.slot_offsets,
        )

    @_unary
    def Lookup(self, request, context):
        return self.depot.lookup(request.session_id, request.engine_id, request.keys)

    @_unary
    def ReportLookups(self, request, context):
        self.depot.report_lookups(request)
        return pb.ReportLookupsResponse()

    @_unary
    def SubmitStore(self, request, context):
        return self.depot.submit_store(request)

    @_unary
    def SubmitLoad(self, request, context):
        return self.depot.submit_load(request)

    @_unary
    def CompleteJob(self, request, context):
        self.depot.complete_job(request)
        return pb.CompleteJobResponse()

    @_unary
    def GetStats(self, request, context):
        return self.depot.stats()

    @_unary
    def Clear(self, request, context):
        return self.depot.clear(request.namespace_name)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (TCP listeners only)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        # Health checks reveal nothing and probes carry no token.
        if handler_call_details.method.startswith("/grpc.health.v1.Health/") or hmac.compare_digest(
            given.encode(), self._expected.encode()
        ):
            return await continuation(handler_call_details)
        if handler_call_details.method.endswith("/Attach"):
            return self._deny_stream
        return self._deny_unary
