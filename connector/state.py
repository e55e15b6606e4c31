"""The scheduler side's records: one per request it follows, one per transfer job in flight.

Rules:
- A request's record is made when the request arrives (or at its first lookup)
  and dropped once the request finished and none of its jobs is in flight
  (scheduler.py): a finished request keeps its record while a store still
  reads its blocks.
- A job's record lives until every worker reported the job: `pending` counts
  the workers that have not.
- `block_ids` is written by block_ids.py only; `limit_blocks` and
  `stored_upto` by store_plan.py only; `deferred_since` and `looked_up` by
  lookup.py only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot.connector.config import StorePolicy
from kvdepot.connector.engine_keys import RequestKeys
from kvdepot.connector.kv_events import StoredRun
from kvdepot.connector.metadata import TransferJob


@dataclass(eq=False)
class RequestState:
    request: object
    keys: RequestKeys
    policy: StorePolicy
    # GPU block ids of each offloaded group, kept only where the KV-cache
    # manager cannot tell them later (block_ids.py).
    block_ids: list[list[int]]
    # Whole blocks the policy lets this request store; None: no limit (store_plan.py).
    limit_blocks: int | None = None
    # Blocks [0, stored_upto) are in the daemon already, or in a load or store job.
    stored_upto: int = 0
    # Tokens whose KV exists once the last scheduled step has run (lazy mode).
    num_computed: int = 0
    # Tokens the GPU prefix cache had at the last lookup.
    num_local: int = 0
    jobs: set[int] = field(default_factory=set)
    deferred_since: float | None = None
    # Blocks past the GPU prefix hit that the last lookup asked about, until
    # vLLM schedules the request and the lookup counts (lookup.py).
    looked_up: int | None = None
    # Its blocks below DRAM were asked for (lookup.py).
    asked_below: bool = False
    finished: bool = False


@dataclass(eq=False)
class JobState:
    job: TransferJob
    req_ids: list[str]
    # Workers that have not reported the job yet.
    pending: int
    failed: bool = False
    # A load's keys: this engine is loading them until the job is done.
    loading_keys: list[bytes] = field(default_factory=list)
    # A store's runs of blocks, for the KV events (only when events are on).
    runs: list[StoredRun] = field(default_factory=list)
    # GPU blocks a store reads, fenced until it is done (sliding windows only).
    fenced_blocks: list[int] = field(default_factory=list)
