"""Typed errors shared by the daemon and its clients.

The daemon raises them and the gRPC service turns each into its status code;
the client turns a status code back into the same class, so callers on both
sides catch the same names.
"""

from __future__ import annotations

import grpc


class KVDepotError(Exception):
    """Base class; `code` is the gRPC status the daemon answers with."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(KVDepotError):
    """The request is malformed: bad key length, index out of bounds, layout mismatch."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVDepotError):
    """Unknown session, engine, worker, job or namespace."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KVDepotError):
    """A job id that the session already has in flight."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(KVDepotError):
    """The request can never fit, for example a job larger than the whole pool."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KVDepotError):
    """The request does not fit the current state, e.g. loading a block that is not stored."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(KVDepotError):
    """The daemon cannot be reached, or is draining before it exits."""

    code = grpc.StatusCode.UNAVAILABLE


class ComingUp(Unavailable):
    """What the request needs is still starting (a GPU worker's CUDA transport,
    for seconds after the daemon starts serving): the same request succeeds
    later. On the wire: UNAVAILABLE, its details beginning with COMING_UP."""

    def __init__(self, message: str = ""):
        super().__init__(message if message.startswith(COMING_UP) else COMING_UP + message)


COMING_UP = "coming up: "


class Unauthenticated(KVDepotError):
    """A TCP connection without the daemon's auth token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KVDepotError):
    """The caller's identity may not do this: another tenant's data, or a call for admins."""

    code = grpc.StatusCode.PERMISSION_DENIED


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        ResourceExhausted,
        FailedPrecondition,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
    )
}


_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a status number (as a JobRefused carries it)."""
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def from_rpc_error(error: grpc.RpcError) -> KVDepotError:
    """The typed error for a failed call, keeping the daemon's message."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return from_status(code, details)


def from_status(code: grpc.StatusCode, details: str) -> KVDepotError:
    cls = _BY_CODE.get(code, KVDepotError)
    if cls is Unavailable and (details or "").startswith(COMING_UP):
        cls = ComingUp
    exc = cls(details or code.name)
    exc.code = code
    return exc


class UntrustedDaemon(Unavailable):
    """What answers on the daemon's socket is not a daemon this client trusts
    (root, its own user, or a uid its configuration names): nothing is sent to it."""
