"""gRPC calls to the daemon, and what their failures mean to a caller."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvdepot.errors import ComingUp, InvalidArgument, KVDepotError, Unavailable, from_status

# Status codes that mean "the daemon is not there (any more)", not "your request is wrong".
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


def typed_error(code: grpc.StatusCode, details: str | None) -> KVDepotError:
    """Unavailable when the daemon is gone or restarted, else the typed error for the status."""
    typed = from_status(code, details or "")
    if isinstance(typed, ComingUp):  # the daemon is there: what the call needs is still starting
        return typed
    if code in GONE:
        return Unavailable(f"kvdepotd is not available: {details}")
    if code == grpc.StatusCode.NOT_FOUND and "unknown session" in (details or ""):
        return Unavailable("the daemon restarted; reconnecting")
    return typed


def unary(method, request, timeout: float, metadata):
    """One unary call; typed errors, and Unavailable when the daemon is gone."""
    try:
        return method(request, timeout=timeout, metadata=metadata)
    except ValueError:
        # grpc raises this for a call on a channel closed after the daemon went away.
        raise Unavailable("the connection to kvdepotd is closed; reconnecting") from None
    except grpc.RpcError as e:
        raise typed_error(e.code(), e.details()) from None


@dataclass(frozen=True)
class Tls:
    """TLS towards a daemon on TCP: the CA that signed its certificate (None:
    the system's), and this client's own certificate where the daemon asks for one."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidArgument("a client certificate needs its key: give both tls_cert_file and tls_key_file")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument(f"cannot read the TLS file {path}: {e.strerror}") from None


def open_channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel to the daemon: plain on a unix socket, TLS where `credentials` are given."""
    options = [
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        # Every call is small and an engine step waits on some (docs/benchmarks.md).
        ("grpc.optimization_target", "latency"),
    ]
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=options)
    return grpc.insecure_channel(target, options=options)
