"""A worker's staging memory, handed to the daemon on the job socket before the
worker registers (the shared-memory transport's way: no client maps the pool).

It is kept per session until a RegisterWorker takes it: at most as many as the
session may register workers, each charged to its user's staging budget by the
transport that maps it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kvdepot.errors import FailedPrecondition, PermissionDenied, ResourceExhausted
from kvdepot.server.core.tenants import Identity

if TYPE_CHECKING:
    from kvdepot.server.core.depot import Depot


def take(depot: Depot, session_id: str, identity: Identity, fd: int) -> int:
    """Keeps the memory of descriptor `fd` (closed here whatever happens) for
    the session's next RegisterWorker; returns its staging id."""
    try:
        session = depot.session(session_id)
        if (identity.uid, identity.tenant) != (session.identity.uid, session.identity.tenant):
            raise PermissionDenied(f"session {session.number} belongs to another user")
        limit = depot.limits.max_workers_per_session
        if len(session.staging) >= limit:
            raise ResourceExhausted(
                f"session {session.number} holds {len(session.staging)} staging memories no worker has "
                f"taken, the most it may (--max-workers-per-session {limit})"
            )
        transport = next((t for t in depot.transports.values() if t.takes_memory), None)
        if transport is None:
            raise FailedPrecondition("no transport of this daemon takes memory from clients")
    except BaseException:
        os.close(fd)
        raise
    memory = transport.take_memory(
        fd, depot.limits.max_shm_worker_bytes, lambda nbytes: depot.staging_budget.charge(identity, nbytes)
    )
    staging_id = depot.new_id()
    session.staging[staging_id] = memory
    return staging_id
