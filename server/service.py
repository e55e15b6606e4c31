"""The gRPC face of the depot: requests in, typed errors out as status codes."""

from __future__ import annotations

import functools
import logging

import grpc

from kvdepot.errors import KVDepotError
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc
from kvdepot.server.depot import Depot
from kvdepot.server.tenants import Identity, Tenants

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


def _token(context) -> str:
    given = dict(context.invocation_metadata() or ()).get("authorization", "")
    return given[len("Bearer "):] if given.startswith("Bearer ") else ""


class KVDepotService(pb_grpc.KVDepotServicer):
    def __init__(self, depot: Depot, tenants: Tenants, job_socket: str = ""):
        self.depot = depot
        self.tenants = tenants
        # Told to every session; empty when the daemon has no job socket, that
        # is on TCP, where the token names the client instead.
        self.job_socket = job_socket

    def _token_identity(self, context) -> Identity | None:
        """On TCP, who the call's token says the caller is (the interceptor has
        refused calls without a known token); None on a unix socket."""
        if self.job_socket:
            return None
        return self.tenants.for_token(_token(context))

    def _operator(self, session_id: str, context) -> Identity | None:
        if session_id:
            return self.depot.session(session_id).identity
        return self._token_identity(context)

    async def Attach(self, request, context):
        try:
            identity = self._token_identity(context)
            session = self.depot.attach(request.client_name, request.protocol_version, identity)
        except KVDepotError as e:
            await context.abort(e.code, str(e))
        try:
            yield pb.Notification(
                started=pb.SessionStarted(
                    session_id=session.id,
                    daemon_instance=self.depot.instance,
                    pool=self.depot.pool_info(),
                    daemon_version=self.depot.version,
                    job_socket=self.job_socket,
                    tenant=identity.tenant if identity else "",
                )
            )
            while True:
                yield await session.outbox.stream.get()
        finally:
            # Reached when the client closes the stream or its connection drops
            # (exit, crash, kill -9), and when the server stops.
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
        # The asking session (the CLI's own) is left out of the clients it lists.
        return self.depot.stats(self._operator(request.session_id, context), request.session_id)

    @_unary
    def Clear(self, request, context):
        return self.depot.clear(self._operator(request.session_id, context), request.namespace_name)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` of a known tenant
    (TCP listeners only)."""

    def __init__(self, tenants: Tenants):
        self._tenants = tenants

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        token = given[len("Bearer "):] if given.startswith("Bearer ") else ""
        # Health checks reveal nothing and probes carry no token.
        if handler_call_details.method.startswith("/grpc.health.v1.Health/") or (
            token and self._tenants.for_token(token) is not None
        ):
            return await continuation(handler_call_details)
        if handler_call_details.method.endswith("/Attach"):
            return self._deny_stream
        return self._deny_unary
