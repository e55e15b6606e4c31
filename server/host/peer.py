"""Who is on the other end of a unix socket, from the kernel (SO_PEERCRED).

A client's word about itself (its pid, its name) is a claim; the credentials
the kernel recorded when the peer connected are not.
"""

from __future__ import annotations

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
