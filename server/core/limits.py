"""Bounds on what one client can make the daemon hold or compute.

Every number a client sends is checked against a bound before the daemon does
arithmetic with it or keeps anything for it: how many engines, workers and
jobs a session has, how long its strings are, how large its tensors claim to
be, and what it adds to the counters everyone's stats show. A refusal names
the option that raises the bound (server/daemon/options.py; docs/configuration.md, "Limits").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.errors import ComingUp, InvalidArgument, ResourceExhausted
from kvdepot.layout import check_tensor_bounds

# What one ReportLookups may add: far more than an engine answers between two
# reports (it reports every few seconds), far less than a counter holds.
MAX_REPORTED_LOOKUPS = 1 << 32
# Blocks one lookup covers at most (16M tokens at 16 tokens a block).
MAX_BLOCKS_PER_LOOKUP = 1 << 20

# Characters of a client's string that an error message or a stats entry repeats.
SHOWN_CHARS = 80


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """A client-given string for an error or a log line: quoted and escaped
    (a newline cannot forge a log line) and cut short (an error's size stays
    within what gRPC carries)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


@dataclass(frozen=True)
class Limits:
    """What one client can make the daemon hold: the daemon's `limits` options
    (server/daemon/options.py), whose defaults these are."""

    max_engines_per_session: int = 64
    max_workers_per_session: int = 64
    max_jobs_per_session: int = 4096
    max_tp_size: int = 64
    max_tensors_per_worker: int = 1024
    max_name_length: int = 512
    max_namespaces: int = 1024
    max_namespaces_per_tenant: int = 128
    max_sessions_per_uid: int = 256
    max_unproven_sessions: int = 256
    # Worker registrations of one user id waiting at once for a transport still
    # coming up (CUDA's, after the daemon serves): each holds its request.
    max_waiting_registrations_per_uid: int = 64
    # The largest staging memory a shared-memory worker may hand over (its KV
    # cache's size): the daemon maps it, so it is bounded like any mapping.
    max_shm_worker_bytes: int = 256 << 30
    # Staging memory the daemon maps at once, for one user id and in all: the
    # daemon's address space is finite (128 TiB on x86-64), and sparse memfds
    # cost a client nothing.
    max_staging_bytes_per_uid: int = 1 << 40
    max_staging_bytes: int = 16 << 40
    stats_max_entries: int = 256
    # A session must prove who it is (its job socket's hello) this soon.
    job_hello_timeout: float = 10.0
    # Notification keys queued for one session's Attach stream; 0: sized from
    # the pool when the daemon starts.
    max_queued_notification_keys: int = 0
    # Job socket connections (server/api/job_socket.py): at once, at once per
    # user id, and bytes of replies one connection may leave unread.
    max_job_connections: int = 1024
    max_job_connections_per_uid: int = 512
    max_unread_job_replies: int = 16 << 20
    # Bytes of job socket frames not yet whole (announced by their length) that
    # the connections of one user id may hold at once: a frame may be 64 MiB,
    # and a user may open hundreds of connections.
    max_job_frame_bytes_per_uid: int = 256 << 20
    # gRPC connections (server/daemon/startup.py): seconds to finish the
    # handshake, and seconds a connection with no call in flight stays open.
    grpc_handshake_timeout: float = 10.0
    grpc_idle_timeout: float = 300.0
    # gRPC connections one user id may hold on the unix socket (an engine holds one to three).
    max_grpc_connections_per_uid: int = 256

    # ------------------------------------------------------------ sessions

    def room_for_engine(self, session) -> None:
        if len(session.engines) >= self.max_engines_per_session:
            raise ResourceExhausted(
                f"this session has registered {len(session.engines)} engines, the most one session may "
                f"(--max-engines-per-session {self.max_engines_per_session})"
            )

    def room_for_worker(self, session) -> None:
        if len(session.workers) >= self.max_workers_per_session:
            raise ResourceExhausted(
                f"this session has registered {len(session.workers)} workers, the most one session may "
                f"(--max-workers-per-session {self.max_workers_per_session})"
            )

    def room_for_job(self, session) -> None:
        if len(session.jobs) >= self.max_jobs_per_session:
            raise ResourceExhausted(
                f"this session has {len(session.jobs)} jobs in flight, the most one session may "
                f"(--max-jobs-per-session {self.max_jobs_per_session}): wait for some to finish"
            )

    # ------------------------------------------------------------ strings

    def check_text(self, field: str, value: str, printable: bool = True) -> None:
        """A client's string that the daemon keeps, shows in stats or logs."""
        if len(value) > self.max_name_length:
            raise InvalidArgument(
                f"{field} has {len(value)} characters, more than --max-name-length ({self.max_name_length}): "
                f"{shown(value)}"
            )
        if printable and not value.isprintable():
            raise InvalidArgument(f"{field} has control characters: {shown(value)}")

    def check_namespace(self, spec) -> None:
        for name in ("model", "revision", "kv_dtype", "layout"):
            self.check_text(f"namespace.{name}", getattr(spec, name))
        # Hashed into the name, never shown: any characters, bounded length.
        self.check_text("namespace.extra", spec.extra, printable=False)
        if spec.tp_size > self.max_tp_size:
            raise InvalidArgument(
                f"namespace.tp_size {spec.tp_size} is more than --max-tp-size ({self.max_tp_size})"
            )

    def unproven_over(self, sessions) -> list:
        """Before a session not proven yet is made: the oldest of those waiting
        for their hello that must go to make room for it. No identity is known
        before the hello, so refusing the new one would let one user who keeps
        the daemon full lock every other out; a real client says hello within
        milliseconds of its Attach, so only sessions that stall are ended."""
        unproven = [s for s in sessions if s.identity is None]
        return unproven[: max(0, len(unproven) - self.max_unproven_sessions + 1)]

    def room_for_session(self, sessions, identity) -> None:
        """Before a session is proven, or made with its identity known (TCP)."""
        mine = sum(
            1 for s in sessions
            if s.identity is not None and (s.identity.uid, s.identity.tenant) == (identity.uid, identity.tenant)
        )
        if mine >= self.max_sessions_per_uid:
            raise ResourceExhausted(
                f"{identity.describe()} has {mine} sessions, the most one user may "
                f"(--max-sessions-per-uid {self.max_sessions_per_uid})"
            )

    # ------------------------------------------------------------ workers

    def room_to_wait(self, waiting: int, identity, kind: str) -> None:
        """Before a registration waits for the `kind` transport to come up;
        `waiting`: those of the same user waiting already. Past the limit the
        call is answered at once, as one whose deadline would come first is
        (ComingUp: the client asks again), so that it holds nothing meanwhile."""
        if waiting >= self.max_waiting_registrations_per_uid:
            raise ComingUp(
                f"the daemon's {kind} transport is still starting, and {identity.describe()} has {waiting} "
                f"worker registrations waiting for it, the most one user may (--max-waiting-registrations-per-uid "
                f"{self.max_waiting_registrations_per_uid}); ask again"
            )

    def check_worker_counts(self, tensors: int, handles: int) -> None:
        """A registration's sizes, before any of its tensors is read."""
        if tensors > self.max_tensors_per_worker:
            raise InvalidArgument(
                f"{tensors} tensors; a worker registers at most "
                f"{self.max_tensors_per_worker} (--max-tensors-per-worker)"
            )
        if handles != tensors:
            raise InvalidArgument(f"{tensors} tensors but {handles} handles: give one handle for each tensor")

    def check_worker(self, request) -> None:
        """Everything about a RegisterWorker request that needs no namespace,
        checked before its tensors' sizes are multiplied or summed."""
        self.check_text("device", request.device)
        self.check_worker_counts(len(request.tensors), len(request.handles))
        for position, t in enumerate(request.tensors):
            self.check_text(f"tensor {position} name", t.name)
            where = f"tensor {position} ({shown(t.name, 40)})"
            check_tensor_bounds(where, t.shape, t.strides, t.block_dim, t.byte_offset, t.storage_bytes)

    # ------------------------------------------------------------ counters

    @staticmethod
    def check_lookup_report(lookups: int, hit_blocks: int, miss_blocks: int) -> None:
        if lookups > MAX_REPORTED_LOOKUPS:
            raise InvalidArgument(
                f"ReportLookups counts {lookups} lookups; one report counts at most "
                f"{MAX_REPORTED_LOOKUPS} (report more often)"
            )
        if hit_blocks + miss_blocks > lookups * MAX_BLOCKS_PER_LOOKUP:
            raise InvalidArgument(
                f"ReportLookups counts {hit_blocks} hit and {miss_blocks} missed blocks for "
                f"{lookups} lookups; a lookup covers at most {MAX_BLOCKS_PER_LOOKUP} blocks"
            )


class StagingBudget:
    """The bytes of staging memory the daemon maps, per user id and in all:
    each mapping is charged before it is made and released once unmapped."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.total = 0
        self.per_uid: dict[int, int] = {}

    def charge(self, identity, nbytes: int) -> StagingCharge:
        mine = self.per_uid.get(identity.uid, 0)
        if mine + nbytes > self.limits.max_staging_bytes_per_uid:
            raise ResourceExhausted(
                f"{identity.describe()} has {mine} bytes of staging memory mapped in the daemon; {nbytes} more "
                f"would pass --max-staging-bytes-per-uid ({self.limits.max_staging_bytes_per_uid}): end workers "
                "(or sessions) first, or hand over memfds only as large as the workers' KV caches"
            )
        if self.total + nbytes > self.limits.max_staging_bytes:
            raise ResourceExhausted(
                f"the daemon maps {self.total} bytes of staging memory; {nbytes} more would pass "
                f"--max-staging-bytes ({self.limits.max_staging_bytes})"
            )
        self.total += nbytes
        self.per_uid[identity.uid] = mine + nbytes
        return StagingCharge(self, identity.uid, nbytes)

    def _give_back(self, uid: int, nbytes: int) -> None:
        self.total -= nbytes
        left = self.per_uid[uid] - nbytes
        if left:
            self.per_uid[uid] = left
        else:
            del self.per_uid[uid]


class StagingCharge:
    """One mapping's share of the StagingBudget."""

    def __init__(self, budget: StagingBudget, uid: int, nbytes: int):
        self._budget, self._uid, self.nbytes = budget, uid, nbytes

    def shrink(self, nbytes: int) -> None:
        if nbytes < self.nbytes:
            self._budget._give_back(self._uid, self.nbytes - nbytes)
            self.nbytes = nbytes

    def release(self) -> None:
        self.shrink(0)
