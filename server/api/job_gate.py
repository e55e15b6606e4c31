"""Who may hold a job socket connection: bounds on connections in all and per
user id (from the kernel), and one log line now and then for what any client
can make happen at will."""

from __future__ import annotations

import dataclasses
import logging
import resource
from dataclasses import dataclass

from kvdepot.logsafe import RateLimitedLog

log = logging.getLogger("kvdepot.jobs")


@dataclass
class JobSocketLimits:
    """What one client can make the job socket hold (server/daemon/options.py has the options)."""

    connections: int = 1024
    connections_per_uid: int = 512
    hello_timeout: float = 10.0
    max_unread_replies: int = 16 << 20
    frame_bytes_per_uid: int = 256 << 20


class Gate:
    """Admits connections within the limits and counts them while they are open."""

    def __init__(self, limits: JobSocketLimits):
        self.limits = limits
        self.total = 0
        # By the peer's uid; None for a peer without credentials.
        self.per_uid: dict[int | None, int] = {}
        # Bytes of frames not yet whole that each uid's connections hold, by
        # the length the frames announce (the bytes are on their way).
        self.frame_bytes: dict[int | None, int] = {}
        # One line now and then for what any client can make happen at will.
        self.events = RateLimitedLog(log)

    def admit(self, uid: int | None) -> str | None:
        """None when the connection may stay (it is counted), else why not."""
        if self.total >= self.limits.connections:
            return (
                f"kvdepotd has {self.total} job socket connections open, its limit "
                "(--max-job-connections); the client's session cannot be used until it connects"
            )
        if self.per_uid.get(uid, 0) >= self.limits.connections_per_uid:
            return (
                f"user id {uid} has {self.per_uid[uid]} job socket connections open, the limit per user "
                "(--max-job-connections-per-uid); the client's session cannot be used until it connects"
            )
        self.total += 1
        self.per_uid[uid] = self.per_uid.get(uid, 0) + 1
        return None

    def release(self, uid: int | None) -> None:
        self.total -= 1
        self.per_uid[uid] -= 1
        if not self.per_uid[uid]:
            del self.per_uid[uid]

    def hold_frame(self, uid: int | None, length: int) -> str | None:
        """None when a connection of `uid` may hold a frame of `length` bytes
        until it is whole (counted), else why not."""
        held = self.frame_bytes.get(uid, 0)
        budget = self.limits.frame_bytes_per_uid
        if held + length > budget:
            return (
                f"user id {uid}'s job socket connections hold {held} bytes of frames not yet whole; a frame of "
                f"{length} more would pass the limit per user, {budget} (--max-job-frame-bytes-per-uid)"
            )
        self.frame_bytes[uid] = held + length
        return None

    def drop_frame(self, uid: int | None, length: int) -> None:
        if not length:
            return
        left = self.frame_bytes[uid] - length
        if left:
            self.frame_bytes[uid] = left
        else:
            del self.frame_bytes[uid]


def fit_fd_limit(limits: JobSocketLimits) -> JobSocketLimits:
    """The limits, with the connection limit within half the process's file
    descriptors: the rest serve gRPC clients, the pool and the log. Job socket
    connections must never be what keeps a new client from attaching.

    The soft limit is raised to the hard one first (systemd's default soft
    limit, 1024, would not hold the default connection limit and gRPC's).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or limits.connections <= soft // 2:
        return limits
    fitted = max(1, soft // 2)
    log.warning(
        "the job socket takes at most %d connections, not %d: the daemon may open %d files "
        "(raise LimitNOFILE / ulimit -n for more)",
        fitted,
        limits.connections,
        soft,
    )
    return dataclasses.replace(limits, connections=fitted)
