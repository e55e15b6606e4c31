"""The client's session with the daemon: attach, reconnect, register again.

One background thread holds the session's Attach stream: it files the stream's
JobDone in the JobBook and its BlocksChanged in the engines' key copies. When
the daemon goes away it fails the jobs in flight, has the process say so once
(announce.py), and reconnects with backoff; once attached again it registers every engine and
worker again by itself, so callers keep their handles across daemon restarts.

Locks (see client.py for the whole client's rule): `_lock` guards the
connection and the lists of handles; `_register_lock` serialises
registrations, so that a handle added during a reconnect is registered
exactly once, by whoever comes second. It is held across the
RegisterEngine/RegisterWorker calls, always taken before `_lock`.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass

import grpc

from kvdepot.client import announce
from kvdepot.client.daemon_identity import check_daemon
from kvdepot.client.job_channel import GrpcJobChannel, JobChannel, SocketJobChannel
from kvdepot.client.jobs import JobBook
from kvdepot.client.key_copy import EngineCopies, EngineHandle
from kvdepot.client.rpc import open_channel, unary
from kvdepot.client.workers import WorkerHandle
from kvdepot.defaults import PROTOCOL_VERSION
from kvdepot.errors import ComingUp, KVDepotError, Unavailable, UntrustedDaemon
from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc

# How long a worker's registration asks again while the daemon says its
# transport is still starting (seconds after a start, on a GPU host): past
# this the daemon is stuck, and the caller hears of it.
COMING_UP_PATIENCE = 120.0

log = logging.getLogger("kvdepot.client")


@dataclass
class Connection:
    """One session with one daemon; replaced as a whole on reconnect."""

    stub: pb_grpc.KVDepotStub
    session_id: str
    instance: str
    pool_info: pb.PoolInfo
    jobs: JobChannel


class Session:
    def __init__(
        self,
        target: str,
        name: str,
        metadata: tuple,
        credentials: grpc.ChannelCredentials | None,
        call_timeout: float,
        backoff: tuple[float, float],
        book: JobBook,
        copies: EngineCopies,
        trusted: frozenset[int],
    ):
        self.target = target
        self.trusted = trusted
        # Why the last attempt did not send anything: the socket is not a trusted daemon's.
        self.refusal: UntrustedDaemon | None = None
        self.name = name
        self.call_timeout = call_timeout
        self.reconnects = 0
        self.closing = threading.Event()
        self._metadata = metadata
        self._credentials = credentials
        self._backoff = backoff
        self._book = book
        self._copies = copies
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._register_lock = threading.Lock()
        self._connection: Connection | None = None
        self._engines: list[EngineHandle] = []
        self._workers: list[WorkerHandle] = []
        self._stream_call = None
        # Why the job socket was lost, when that is why the stream was cancelled.
        self._lost_reason: str | None = None
        self._was_attached = False
        self._thread = threading.Thread(target=self._stream_loop, name="kvdepot-client", daemon=True)
        self._thread.start()

    @property
    def connection(self) -> Connection | None:
        return self._connection

    def wait_connected(self, timeout: float | None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._connection is not None, timeout)

    def wait_connected_or_refused(self, timeout: float | None) -> bool:
        """Like wait_connected, but returns (False) as soon as the socket turns
        out not to be a trusted daemon's: waiting would not change whose it is."""
        with self._changed:
            return self._changed.wait_for(lambda: self._connection is not None or self.refusal is not None, timeout)

    def stop(self) -> None:
        """Ends the session (call after setting `closing`)."""
        self.closing.set()
        call = self._stream_call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=5)

    def call(self, connection: Connection, method: str, request):
        return unary(getattr(connection.stub, method), request, self.call_timeout, self._metadata)

    # ------------------------------------------------------------ handles

    def add(self, handle: EngineHandle | WorkerHandle) -> None:
        """Keeps the handle for every future session, and registers it now if attached."""
        handles = self._engines if isinstance(handle, EngineHandle) else self._workers
        with self._lock:
            handles.append(handle)
        try:
            with self._register_lock:
                connection = self._connection
                if connection is not None and not handle.registered:
                    self._register(connection, handle)
        except Unavailable:
            pass  # registered when the daemon is back
        except BaseException:
            # Refused (or unusable here): it must not fail every later session too.
            with self._lock:
                handles.remove(handle)
            raise

    def _register(self, connection: Connection, handle: EngineHandle | WorkerHandle) -> None:
        if isinstance(handle, EngineHandle):
            request = pb.RegisterEngineRequest(session_id=connection.session_id, namespace=handle.namespace)
            response = self.call(connection, "RegisterEngine", request)
            self._copies.registered(
                handle, connection.session_id, response.engine_id, response.namespace_name, response.remote_tier
            )
            return
        staging_id = 0
        if handle.copier is not None:
            staging_id = connection.jobs.hand_over(handle.copier.staging.fd)
        request = handle.request(connection.session_id, staging_id)
        patience = time.monotonic() + COMING_UP_PATIENCE
        while True:
            try:
                response = self.call(connection, "RegisterWorker", request)
                break
            except ComingUp:  # its transport still starts (a daemon that just started): asked again
                if time.monotonic() > patience or self.closing.is_set():
                    raise
                time.sleep(0.1)
        handle.worker_id = response.worker_id
        handle.namespace_name = response.namespace_name

    # ------------------------------------------------------------ the stream

    def _stream_loop(self) -> None:
        delay = self._backoff[0]
        while not self.closing.is_set():
            channel = None
            reason = "the stream ended"
            try:
                # Before the first byte: the Attach says who this process is.
                target = check_daemon(self.target, self.trusted, self.call_timeout)
                self.refusal = None
                channel = open_channel(target, self._credentials)
                stub = pb_grpc.KVDepotStub(channel)
                call = stub.Attach(
                    pb.AttachRequest(client_name=self.name, pid=os.getpid(), protocol_version=PROTOCOL_VERSION),
                    metadata=self._metadata,
                )
                self._stream_call = call
                first = next(call)
                session_id = first.started.session_id
                self._on_attached(stub, first.started)
                delay = self._backoff[0]
                for notification in call:
                    kind = notification.WhichOneof("kind")
                    if kind == "job_done":
                        done = notification.job_done
                        self._book.finish(done.job_id, done.ok, done.error)
                    elif kind == "blocks_changed":
                        self._copies.note(session_id, notification.blocks_changed)
            except UntrustedDaemon as e:
                reason = str(e)
                if self.refusal is None or str(self.refusal) != reason:
                    log.error("%s", reason)
                with self._changed:
                    self.refusal = e
                    self._changed.notify_all()
            except Unavailable as e:
                reason = str(e)
            except grpc.RpcError as e:
                reason = _why(e)
                if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED):
                    log.error("kvdepotd refused this client: %s", e.details())
            except StopIteration:
                pass
            except Exception:
                log.exception("kvdepot client stream failed")
                reason = "the client's stream thread failed"
            finally:
                self._stream_call = None
                reason, self._lost_reason = self._lost_reason or reason, None
                self._on_detached(reason)
                if channel is not None:
                    channel.close()
            if self.closing.wait(delay * random.uniform(0.5, 1.0)):
                break
            delay = min(delay * 2, self._backoff[1])

    def _job_channel(self, stub: pb_grpc.KVDepotStub, started: pb.SessionStarted) -> JobChannel:
        if not started.job_socket:  # TCP: the token says who the client is
            return GrpcJobChannel(stub, self._book, self.call_timeout, self._metadata)
        try:
            return SocketJobChannel(
                started.job_socket, started.session_id, self._book, self.call_timeout, self._job_socket_lost,
                self.trusted,
            )
        except OSError as e:
            # The daemon learns who a unix-socket client is from this connection:
            # the session cannot be used without it.
            raise Unavailable(f"its job socket {started.job_socket} cannot be used ({e})") from None

    def _on_attached(self, stub: pb_grpc.KVDepotStub, started: pb.SessionStarted) -> None:
        self._copies.attached(started.session_id)
        connection = Connection(
            stub, started.session_id, started.daemon_instance, started.pool, self._job_channel(stub, started)
        )
        try:
            with self._register_lock:
                with self._lock:
                    handles = [*self._engines, *self._workers]
                for handle in handles:
                    try:
                        self._register(connection, handle)
                    except KVDepotError as e:
                        log.error("registering %s again failed: %s", handle.namespace_name or "a handle", e)
                with self._changed:
                    self._connection = connection
                    self._changed.notify_all()
        except BaseException:
            connection.jobs.close()  # its reader must not outlive the attempt
            raise
        if self._was_attached:
            self.reconnects += 1
        self._was_attached = True
        announce.attached(self.target, connection.instance)

    def _on_detached(self, reason: str) -> None:
        with self._changed:
            connection, self._connection = self._connection, None
            for worker in self._workers:
                worker.worker_id = None
            engines = list(self._engines)
            self._changed.notify_all()
        if connection is not None:
            connection.jobs.close()
        self._copies.forget_all(engines)
        closing = self.closing.is_set()
        self._book.fail_all("the client was closed during the job" if closing else "kvdepotd went away during the job")
        if not closing:
            announce.unavailable(self.target, reason)

    def _job_socket_lost(self, channel: JobChannel, reason: str) -> None:
        """The job socket closed (or failed a write) under a live session: start
        over, so that no job waits for an end that cannot come."""
        connection = self._connection
        if connection is not None and connection.jobs is not channel:
            return  # a channel of an earlier session
        call = self._stream_call
        if call is not None and not self.closing.is_set():
            # The outage's warning gives this reason, not the cancellation's.
            self._lost_reason = reason
            call.cancel()


def _why(error: grpc.RpcError) -> str:
    """What a failed stream says about the daemon, in words an operator reads."""
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        if "No such file" in details or "Connection refused" in details:
            return "nothing listens on its socket"
        return f"the connection failed: {details}"
    if code == grpc.StatusCode.CANCELLED:
        return "the connection was closed"
    return f"{code.name}: {details}"
