"""What the kernel says of the peer of a unix socket: who it is
(SO_PEERCRED), and the descriptors it passes (SCM_RIGHTS).

A client's word about itself (its pid, its name) is a claim; the credentials
the kernel recorded when the peer connected are not.
"""

from __future__ import annotations

import array
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # struct ucred: pid_t pid; uid_t uid; gid_t gid


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(sock: socket.socket) -> Peer | None:
    """The peer's credentials, or None where the socket has none (not AF_UNIX,
    or a platform without SO_PEERCRED)."""
    if sock.family != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    # pid is 0 for a peer in a PID namespace this daemon cannot see (another
    # container): its uid and gid still hold, its pid is unknown.
    return Peer(pid, uid, gid)


# Read with room for this many descriptors, so that a peer that sends more is
# refused (and every one of them closed) rather than truncated unseen.
_MAX_DESCRIPTORS = 4


def receive_descriptors(sock: socket.socket) -> tuple[bytes, list[int], bool]:
    """One byte and the descriptors that came with it (close-on-exec, the
    caller's to close), and whether the kernel cut some off; BlockingIOError
    on a non-blocking socket with nothing to read."""
    data, ancillary, flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(4 * _MAX_DESCRIPTORS), socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), bool(flags & socket.MSG_CTRUNC)
