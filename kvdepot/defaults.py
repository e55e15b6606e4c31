"""Defaults that the daemon and its clients must agree on."""

from __future__ import annotations

import os
import struct

# Length of a block key: a 256-bit content hash.
KEY_BYTES = 32

# The wire protocol version that proto/kvdepot.proto defines: a client and a
# daemon of different versions refuse each other instead of misreading.
PROTOCOL_VERSION = 1

SOCKET_ENV = "KVDEPOT_SOCKET"

# The job socket's framing (proto: "job socket"): a 4-byte little-endian length
# before each message, and the longest message either side accepts.
JOB_FRAME_HEADER = struct.Struct("<I")
MAX_JOB_FRAME_BYTES = 64 << 20
# The longest first frame (a hello, a few dozen bytes) the daemon reads from a
# connection that has not said hello: a stranger's bytes are not buffered.
MAX_HELLO_FRAME_BYTES = 4096


def read_token(path: str) -> str:
    """The auth token in a file; ValueError saying why it cannot be used."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read the auth token file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the auth token file {path} is not UTF-8 text") from None
    if not token:
        raise ValueError(f"the auth token file {path} is empty")
    return token


def default_socket_path() -> str:
    """Where kvdepotd listens unless told otherwise, for any user without set-up.

    $KVDEPOT_SOCKET wins; then the user's runtime directory ($XDG_RUNTIME_DIR,
    set by systemd-logind for login sessions); root gets /run/kvdepot (what the
    systemd unit's RuntimeDirectory creates); anyone else a private folder in
    /tmp named after their uid.
    """
    explicit = os.environ.get(SOCKET_ENV)
    if explicit:
        return explicit
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.path.isdir(runtime_dir):
        return os.path.join(runtime_dir, "kvdepot", "kvdepot.sock")
    if os.geteuid() == 0:
        return "/run/kvdepot/kvdepot.sock"
    return f"/tmp/kvdepot-{os.geteuid()}/kvdepot.sock"


def grpc_target(listen: str) -> str:
    """The gRPC target for a --listen value: a socket path, unix:PATH or HOST:PORT."""
    if listen.startswith("unix:"):
        return listen
    if listen.startswith("tcp:"):
        return listen[len("tcp:"):]
    if "/" in listen or listen.endswith(".sock"):
        return "unix:" + os.path.abspath(listen)
    return listen
