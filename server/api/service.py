"""The gRPC face of the depot: requests in, typed errors out as status codes."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from kvdepot.defaults import PROTOCOL_VERSION
from kvdepot.errors import FailedPrecondition, InvalidArgument, KVDepotError, PermissionDenied, Unauthenticated
from kvdepot.logsafe import RateLimitedLog, one_line
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc
from kvdepot.server.api import answers, parse
from kvdepot.server.api.auth_throttle import WrongCredentialThrottle
from kvdepot.server.core.depot import Depot
from kvdepot.server.core.tenants import Identity, Tenants

log = logging.getLogger("kvdepot.service")


SERVICE = pb.DESCRIPTOR.services_by_name["KVDepot"]


class Undecodable:
    """A request whose bytes are not its message. gRPC's own deserializer would
    answer UNKNOWN and log a traceback for each: any client could flood the log."""

    def __init__(self, type_name: str):
        self.error = InvalidArgument(f"the request is not a {type_name}: its bytes do not parse")


def _parser(message_class):
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError:
            return Undecodable(message_class.DESCRIPTOR.name)

    return parse


def add_to_server(servicer: KVDepotService, server) -> None:
    """The generated add_KVDepotServicer_to_server, with requests that do not
    parse refused as INVALID_ARGUMENT by the methods themselves."""
    handlers = {}
    for method in SERVICE.methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_parser(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _unary(method):
    """Checks who calls (on TCP), turns a typed error into its gRPC status;
    anything else is a bug, logged."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            # Who calls comes first: on TCP a caller without credentials learns nothing.
            self._check_caller(request, context)
            if isinstance(request, Undecodable):
                raise request.error
            answer = method(self, request, context)
            return await answer if inspect.isawaitable(answer) else answer
        except KVDepotError as e:
            await self._refuse(e, context)
        except Exception:
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed: see the daemon's log")

    return wrapper


def _token(context) -> str:
    given = dict(context.invocation_metadata() or ()).get("authorization", "")
    return given[len("Bearer "):] if given.startswith("Bearer ") else ""


def _certificate_names(context) -> list[str]:
    """The verified client certificate's common name and alternative names (TLS with client CAs)."""
    auth = context.auth_context() or {}
    names = [*auth.get("x509_common_name", []), *auth.get("x509_subject_alternative_name", [])]
    return [n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names]


class KVDepotService(pb_grpc.KVDepotServicer):
    def __init__(self, depot: Depot, tenants: Tenants, job_socket: str = "", max_queued_keys: int | None = None):
        self.depot = depot
        self.tenants = tenants
        # Told to every session. Set on a unix socket, where the client's hello
        # there proves who it is; empty on TCP, where each call's token or
        # client certificate does.
        self.job_socket = job_socket
        # Keys of notifications that may wait for one session's Attach stream.
        self.max_queued_keys = max_queued_keys
        self.wrong_credentials = WrongCredentialThrottle()
        self._rate_limited = RateLimitedLog(log)

    async def _refuse(self, error: KVDepotError, context) -> None:
        """Answers `error`; a wrong credential only after its peer's delay (auth_throttle.py)."""
        if isinstance(error, Unauthenticated):
            peer = context.peer() or "an unknown peer"
            wait, failures = self.wrong_credentials.failed(peer)
            self._rate_limited.warning(
                "wrong-credential",
                "refused a TCP call from %s: missing or wrong auth token or client certificate (%d from its host "
                "lately; this one answered after %.2f s)",
                one_line(peer), failures, wait,
            )
            if wait:
                await asyncio.sleep(wait)
        await context.abort(error.code, str(error))

    def _tcp_identity(self, context) -> Identity | None:
        """On TCP, who the call's token or client certificate proves; None on a unix socket."""
        if self.job_socket:
            return None
        token = _token(context)
        identity = self.tenants.for_token(token) if token else None
        if identity is None:
            identity = self.tenants.for_certificate(_certificate_names(context))
        if identity is None:
            raise Unauthenticated(
                "missing or wrong auth token: send 'authorization: Bearer TOKEN' with a tenant's token, "
                "or a client certificate a tenant names"
            )
        return identity

    def _check_caller(self, request, context) -> None:
        """On TCP a session acts only for the identity that opened it."""
        identity = self._tcp_identity(context)
        session = self.depot.sessions.get(getattr(request, "session_id", ""))
        if identity is not None and session is not None and session.identity != identity:
            raise PermissionDenied(f"session {session.number} belongs to another identity")

    def _operator(self, session_id: str, context) -> Identity | None:
        if session_id:
            return self.depot.session(session_id).identity
        return self._tcp_identity(context)

    async def Attach(self, request, context):
        try:
            identity = self._tcp_identity(context)
            if isinstance(request, Undecodable):
                raise request.error
            if request.protocol_version != PROTOCOL_VERSION:
                raise FailedPrecondition(
                    f"this daemon speaks protocol version {PROTOCOL_VERSION}, the client "
                    f"{request.protocol_version}: use a client and a daemon of the same release"
                )
            session = self.depot.attach(request.client_name, identity)
        except KVDepotError as e:
            await self._refuse(e, context)
        if self.max_queued_keys is not None:
            session.outbox.bound(self.max_queued_keys, lambda reason: self.depot.expel(session, reason))
        try:
            yield pb.Notification(
                started=pb.SessionStarted(
                    session_id=session.id,
                    daemon_instance=self.depot.instance,
                    pool=answers.pool_info(self.depot.pool_info()),
                    daemon_version=self.depot.version,
                    job_socket=self.job_socket,
                    tenant=identity.tenant if identity else "",
                )
            )
            while (notice := await session.outbox.next()) is not None:
                yield answers.notification(notice)
            why = f"kvdepotd ended this session: {session.outbox.overflowed}"
            await context.abort(session.outbox.end_error.code, why)
        finally:
            # Reached when the client closes the stream or its connection drops
            # (exit, crash, kill -9), and when the server stops.
            self.depot.end_session(session)

    @_unary
    def RegisterEngine(self, request, context):
        engine_id, ns = self.depot.register_engine(request.session_id, parse.namespace_spec(request.namespace))
        return pb.RegisterEngineResponse(
            engine_id=engine_id, namespace_name=ns.name, remote_tier=self.depot.index.tiers.may_find(ns)
        )

    @_unary
    async def RegisterWorker(self, request, context):
        # Bounded before a single tensor is read: the request may hold a million.
        session = self.depot.session(request.session_id)
        self.depot.limits.check_worker_counts(len(request.tensors), len(request.handles))
        spec = parse.worker_spec(request)
        # CUDA's transport comes up after the daemon serves: waited for, but answered
        # (ComingUp: ask again) before the caller's deadline rather than at it.
        remaining = context.time_remaining()
        within = None if remaining is None else remaining - min(1.0, remaining / 4)
        await self.depot.transport_up(spec.transport, session.identity, within)
        worker = self.depot.register_worker(request.session_id, spec)
        return pb.RegisterWorkerResponse(
            worker_id=worker.id,
            namespace_name=worker.ns.name,
            block_bytes=worker.layout.block_bytes,
            slot_offsets=worker.layout.slot_offsets,
        )

    @_unary
    async def Lookup(self, request, context):
        return answers.lookup(await self.depot.lookup_asking(request.session_id, request.engine_id, request.keys))

    @_unary
    def ReportLookups(self, request, context):
        self.depot.report_lookups(
            request.session_id, request.engine_id, request.lookups, request.hit_blocks, request.miss_blocks
        )
        return pb.ReportLookupsResponse()

    @_unary
    def SubmitStore(self, request, context):
        return answers.store_submitted(self.depot.submit(request.session_id, parse.store_job(request)))

    @_unary
    def SubmitLoad(self, request, context):
        self.depot.submit(request.session_id, parse.load_job(request))
        return pb.SubmitLoadResponse()

    @_unary
    def GetStats(self, request, context):
        # The asking session (the CLI's own) is left out of the clients it lists.
        viewer = self._operator(request.session_id, context)
        return answers.stats(self.depot.report(viewer, request.session_id), viewer is not None)

    @_unary
    def Clear(self, request, context):
        return answers.cleared(self.depot.clear(self._operator(request.session_id, context), request.namespace_name))
