"""What gRPC connections may hold: the server's options that bound each one
(handshake, idle time, streams), and a cap on the connections one user id
holds on the unix socket.

grpcio accepts connections itself: it offers no hook between accept and the
handshake, and takes no listening socket or accepted descriptor from the
application. So the cap is kept by a sweep of the daemon's own descriptors:
each connection to the gRPC socket is named by the kernel (SO_PEERCRED), and
those of a uid past the cap, newest first, are shut down; gRPC sees them end
and closes them. Between two sweeps a uid may hold more, by what it opens in
that time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections import defaultdict

from kvdepot.logsafe import RateLimitedLog

log = logging.getLogger("kvdepot.grpc")

_PEERCRED = struct.Struct("3i")

# Streams one gRPC connection may have open at once. A process's sessions share
# its connection: each holds an Attach stream, and --max-sessions-per-uid is 256.
MAX_STREAMS_PER_CONNECTION = 1024


def server_options(limits) -> list[tuple[str, int | str]]:
    """The gRPC server's options, with `limits` (core/limits.py Limits)."""
    return [
        # Without this a second daemon could bind the same TCP port.
        ("grpc.so_reuseport", 0),
        # Notice dead TCP peers; unix sockets report them at once anyway.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Small messages that engine steps wait on (see the client's channel).
        ("grpc.optimization_target", "latency"),
        # A connection costs a descriptor before any call proves anything:
        # one that never finishes its handshake, or holds no call, is
        # closed (an engine's Attach stream keeps its own busy).
        ("grpc.server_handshake_timeout_ms", int(limits.grpc_handshake_timeout * 1000)),
        ("grpc.max_connection_idle_ms", int(limits.grpc_idle_timeout * 1000)),
        # Every open stream holds memory (about 20 KB with its headers) and no
        # session or token is needed to open one (reflection, health): a bound
        # per connection, well above what one process's sessions use, since
        # grpcio clients share one connection between a process's channels.
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ]


def _duplicate(fd: int) -> socket.socket | None:
    """A socket object of our own on the socket at `fd`; None if it is none."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _connection(fd: int, path: str) -> tuple[int, int] | None:
    """(socket inode, peer uid) of a connection to the socket at `path`, else None.

    Looked at through a duplicate, so that a descriptor gRPC closes and reuses
    meanwhile is never mistaken for another.
    """
    sock = _duplicate(fd)
    if sock is None:
        return None
    with sock:
        try:
            if sock.family != socket.AF_UNIX or sock.getsockname() != path:
                return None
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return None
            _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            return os.fstat(sock.fileno()).st_ino, uid
        except OSError:
            return None


def _shut_down(fd: int, inode: int) -> bool:
    sock = _duplicate(fd)
    if sock is None:
        return False
    with sock:
        try:
            if os.fstat(sock.fileno()).st_ino != inode:
                return False
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False


class ConnectionCap:
    """Sweeps of the daemon's descriptors. Each socket is looked at once: its
    inode (in its /proc link) says whether it was seen before, and whose it is."""

    def __init__(self, path: str, per_uid: int):
        self.path = path
        self.per_uid = per_uid
        # socket inode -> the peer uid of a gRPC connection, or None for any other socket
        self._known: dict[int, int | None] = {}

    def sweep(self) -> dict[int, tuple[int, int]]:
        """Shuts down each uid's connections past the cap, newest first: uid ->
        (connections it held, connections shut down), for the uids past it."""
        by_uid: dict[int, list[tuple[int, int]]] = defaultdict(list)
        known: dict[int, int | None] = {}
        for name in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if not link.startswith("socket:["):
                continue
            inode, fd = int(link[8:-1]), int(name)
            if inode in self._known:
                uid = self._known[inode]
            else:
                found = _connection(fd, self.path)
                uid = None if found is None or found[0] != inode else found[1]
            known[inode] = uid
            if uid is not None:
                by_uid[uid].append((inode, fd))
        self._known = known
        over = {}
        for uid, connections in by_uid.items():
            if len(connections) <= self.per_uid:
                continue
            # Socket inodes are handed out in (roughly) increasing order: the highest are the newest.
            connections.sort()
            closed = sum(_shut_down(fd, inode) for inode, fd in connections[self.per_uid:])
            over[uid] = (len(connections), closed)
        return over


async def keep_cap(path: str, per_uid: int, interval: float = 0.25) -> None:
    """Sweeps every `interval` seconds, on a thread (thousands of descriptors
    take a while), and logs a uid past the cap at most once per 10 s."""
    cap = ConnectionCap(path, per_uid)
    events = RateLimitedLog(log)
    while True:
        try:
            over = await asyncio.to_thread(cap.sweep)
        except Exception:  # a sweep that fails must not end the ones after it
            events.warning("failed", "a sweep of the gRPC connections failed", exc_info=True)
            over = {}
        for uid, (held, closed) in over.items():
            events.warning(
                f"uid {uid}",
                "uid %d held %d gRPC connections, more than --max-grpc-connections-per-uid (%d): %d closed",
                uid, held, per_uid, closed,
            )
        await asyncio.sleep(interval)
