"""What the scheduler side tells the workers each step, and what they answer.

Both travel between processes with vLLM's own serialization, so they hold
plain lists and ints only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot.connector.vllm_compat import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class GroupTransfer:
    """The blocks of one KV-cache group that a job moves: keys[i] <-> GPU block_ids[i]."""

    group_idx: int
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class TransferJob:
    job_id: int
    is_store: bool
    groups: list[GroupTransfer]
    # The request a load is for (its finished_recving); empty for stores, which
    # batch the blocks of every request computed in one step.
    req_id: str = ""
    # A load vLLM scheduled in the same step (load_kv_async False): the worker
    # finishes it before the forward pass and reports a failure by block ids.
    sync: bool = False


@dataclass
class KVDepotMetadata(KVConnectorMetadata):
    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    # Store jobs to submit and wait for before this step's forward pass: their
    # GPU blocks are about to be given to other requests (preemption, reuse).
    flush: list[int] = field(default_factory=list)
    # Finished requests whose blocks the scheduler holds until this worker
    # reports (finished_sending) that their store jobs are done.
    await_stores: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class KVDepotWorkerMetadata(KVConnectorWorkerMetadata):
    """Per job: how many workers finished it, and how many of those failed it."""

    done: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVDepotWorkerMetadata):
            raise TypeError(f"cannot aggregate KVDepotWorkerMetadata with {type(other).__name__}")
        done, failed = dict(self.done), dict(self.failed)
        for job_id, n in other.done.items():
            done[job_id] = done.get(job_id, 0) + n
        for job_id, n in other.failed.items():
            failed[job_id] = failed.get(job_id, 0) + n
        return KVDepotWorkerMetadata(done, failed)
