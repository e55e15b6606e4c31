"""What clients ask of the core, as plain values.

The API wing (server/api) reads the wire's messages into these and the core
never sees a protobuf. A job crosses as one value whatever its size: its keys
and block ids are sequences the core checks and reserves in bulk.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.defaults import KEY_BYTES
from kvdepot.errors import InvalidArgument, ResourceExhausted


class JobKind(enum.Enum):
    STORE = "store"
    LOAD = "load"


class LookupStatus(enum.Enum):
    # The ready count is the final answer for these keys.
    READY = 1
    # Blocks right after the ready ones are being stored or promoted: ask again.
    NOT_YET = 2


@dataclass(frozen=True)
class NamespaceSpec:
    """Everything that makes KV content incompatible (proto: NamespaceSpec)."""

    model: str
    revision: str = ""
    kv_dtype: str = ""
    block_size: int = 0
    layout: str = ""
    tp_size: int = 0
    kv_group: int = 0
    extra: str = ""
    key_version: int = 0


@dataclass(frozen=True)
class TensorSpec:
    """One KV-cache tensor of a worker (proto: TensorSpec)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    byte_offset: int
    storage_bytes: int
    block_dim: int
    page_bytes: int


@dataclass(frozen=True)
class CudaIpcHandle:
    """A GPU allocation another process shares (proto: CudaIpcHandle)."""

    mem_handle: bytes
    device_uuid: str
    storage_offset: int


@dataclass(frozen=True)
class WorkerSpec:
    """A worker's registration. `transport` names the kind of its handles
    (None when they are of several kinds); `handles` hold one value per tensor
    that only that transport reads."""

    namespace: NamespaceSpec
    rank: int
    device: str
    tensors: tuple[TensorSpec, ...]
    transport: str | None
    handles: tuple
    # The shared-memory transport's staging memory (Depot.take_staging's id).
    staging_id: int = 0
    # The CUDA transport's fence: where the worker's stream writes a sequence
    # number after the compute of each store.
    fence: CudaIpcHandle | None = None


@dataclass(frozen=True)
class JobRequest:
    """One store or load of one worker: keys[i] goes to or from block_ids[i]."""

    kind: JobKind
    worker_id: int
    job_id: int
    keys: Sequence[bytes]
    block_ids: Sequence[int]
    # A store's wait for the worker's compute (the CUDA transport's
    # interprocess event and fence number); empty where the transport needs none.
    compute_event: bytes = b""
    compute_seq: int = 0

    def checked_keys(self, pool_slots: int, worker_blocks: int) -> list[bytes]:
        """The job's keys, once its shape is checked against a pool of
        `pool_slots` slots and a worker of `worker_blocks` blocks."""
        if len(self.keys) != len(self.block_ids):
            raise InvalidArgument(
                f"{len(self.keys)} keys but {len(self.block_ids)} block ids: give one block id for each key"
            )
        if not self.keys:
            raise InvalidArgument("a job needs at least one block")
        if len(self.keys) > pool_slots:
            raise ResourceExhausted(
                f"the job has {len(self.keys)} blocks but the whole pool holds "
                f"{pool_slots}: split it or start kvdepotd with a larger --pool-size"
            )
        keys = check_keys(self.keys)
        if max(self.block_ids) >= worker_blocks:
            position, block_id = next((p, b) for p, b in enumerate(self.block_ids) if b >= worker_blocks)
            raise InvalidArgument(
                f"block id {block_id} at position {position} is outside the worker's "
                f"registered tensors ({worker_blocks} blocks)"
            )
        return keys


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    keys = list(keys)
    if any(len(key) != KEY_BYTES for key in keys):
        position, key = next((p, k) for p, k in enumerate(keys) if len(k) != KEY_BYTES)
        raise InvalidArgument(f"key {position} has {len(key)} bytes; keys are {KEY_BYTES}-byte hashes")
    return keys
