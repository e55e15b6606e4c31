"""A session (one client), its workers and its jobs.

Plain data: the depot (depot.py) changes them, on the event loop's thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvdepot.layout import WorkerLayout
from kvdepot.server.core.blocks import Block
from kvdepot.server.core.counters import Counters
from kvdepot.server.core.namespaces import Namespace
from kvdepot.server.core.outbox import Outbox
from kvdepot.server.core.requests import JobKind
from kvdepot.server.core.tenants import Identity
from kvdepot.server.core.transport import Transport

# Job ids a session finished recently, still refused as duplicates: a client
# that reuses one that fast has lost track of its jobs.
RECENT_JOB_IDS = 4096


@dataclass(eq=False)
class Worker:
    id: int
    session: Session
    ns: Namespace
    rank: int
    device: str
    layout: WorkerLayout
    transport: Transport
    # The NUMA node its stores take pool slots on (its GPU's, set by the
    # transport); None: no preference.
    node: int | None = None


@dataclass(eq=False)
class Job:
    id: int
    kind: JobKind
    session: Session
    worker: Worker
    # The blocks the job writes (store) or reads (load), their block ids in the
    # worker's memory and their slots in the pool.
    blocks: list[Block]
    block_ids: list[int]
    slots: list[int]
    # The transport's own state for the job (its prepare_job's answer).
    transport_state: object = None
    # time.monotonic() when the depot took the job.
    submitted: float = 0.0
    # {stage: ns} when jobs are traced (kvdepot.jobtrace), else None.
    trace: dict | None = None
    # A store's keys left out (already stored) and not stored (every slot pinned), for its JobDone.
    already_stored: int = 0
    not_stored: int = 0


@dataclass(eq=False)
class Session:
    # A secret: whoever knows it acts as the session, so it is told to the
    # attaching client alone; logs and stats name the session by `number`.
    id: str
    number: int
    client_name: str
    # Who the session acts for, from the kernel or a token; None until proven
    # (a unix-socket session proves it with its job socket's hello).
    identity: Identity | None = None
    attached_at: float = field(default_factory=time.monotonic)
    outbox: Outbox = field(default_factory=Outbox)
    engines: dict[int, Namespace] = field(default_factory=dict)
    workers: dict[int, Worker] = field(default_factory=dict)
    jobs: dict[int, Job] = field(default_factory=dict)
    recent_job_ids: deque = field(default_factory=lambda: deque(maxlen=RECENT_JOB_IDS))
    recent_job_id_set: set = field(default_factory=set)
    counters: Counters = field(default_factory=Counters)
    # Staging memories handed over on the job socket that no worker took yet
    # (transports/shared_memory.py), by their ids.
    staging: dict = field(default_factory=dict)
    # The client is gone; jobs still in flight are abandoned.
    ended: bool = False
