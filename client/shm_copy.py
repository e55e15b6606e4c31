"""The worker's half of the shared-memory transport: it maps the daemon's pool
and copies blocks between its KV-cache tensors and the slots the daemon chose.

Each job is one gather (or scatter) per tensor, never a Python call per block.
"""

from __future__ import annotations

import mmap
import os
from typing import Sequence

import torch

from kvdepot.layout import WorkerLayout
from kvdepot.client.tensors import block_view


class MappedPool:
    """The daemon's pool file mapped into this process, as [num_slots, slot_bytes]."""

    def __init__(self, path: str, slot_bytes: int, num_slots: int):
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, slot_bytes * num_slots, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.slots = torch.frombuffer(self._mmap, dtype=torch.uint8).view(num_slots, slot_bytes)


# Copy in the widest element that divides every offset and size: indexing a
# uint8 view copies byte by byte, far slower than wider elements.
_UNITS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _copy_unit(tensor: torch.Tensor, tl, slot_offset: int, slot_bytes: int) -> tuple[int, torch.dtype]:
    sizes = (tl.block_stride_bytes, *tl.outer_strides_bytes, tl.byte_offset, tl.page_bytes, slot_offset, slot_bytes)
    for unit, dtype in _UNITS:
        if all(x % unit == 0 for x in sizes) and tensor.untyped_storage().nbytes() % unit == 0:
            return unit, dtype
    return 1, torch.uint8


def _typed_block_view(tensor: torch.Tensor, tl, unit: int, dtype: torch.dtype) -> torch.Tensor:
    """block_view in elements of `unit` bytes: [num_blocks, *outer_dims, page_bytes / unit]."""
    if unit == 1:
        return block_view(tensor, tl)
    storage = torch.empty(0, dtype=dtype, device=tensor.device)
    storage.set_(tensor.untyped_storage())
    return storage.as_strided(
        (tl.num_blocks, *tl.outer_shape, tl.page_bytes // unit),
        (tl.block_stride_bytes // unit, *(s // unit for s in tl.outer_strides_bytes), 1),
        tl.byte_offset // unit,
    )


class BlockCopier:
    """Copies one worker's blocks in and out of pool slots."""

    def __init__(self, tensors: Sequence[torch.Tensor], layout: WorkerLayout):
        self.layout = layout
        self._tensors = list(tensors)
        self._plan_pool: MappedPool | None = None
        self._plan_views: list = []

    def _plan(self, pool: MappedPool) -> list:
        """Per tensor: (block view, pool view, offset, width), in a common element type."""
        # Compared by identity, never by id(): a new daemon's pool mapped after
        # a reconnect can reuse the old object's id, and its views would still
        # point into the old (deleted) pool file.
        if self._plan_pool is not pool:
            plan = []
            slot_bytes = pool.slots.shape[1]
            for tensor, tl, offset in zip(self._tensors, self.layout.tensors, self.layout.slot_offsets):
                unit, dtype = _copy_unit(tensor, tl, offset, slot_bytes)
                plan.append((_typed_block_view(tensor, tl, unit, dtype), pool.slots.view(dtype), offset // unit, tl.block_bytes // unit))
            self._plan_pool, self._plan_views = pool, plan
        return self._plan_views

    def forget_pool(self) -> None:
        """Drops the views into the pool last copied with, so that a gone
        daemon's pool is unmapped once nothing else holds it."""
        self._plan_pool, self._plan_views = None, []

    # Copies run in inference mode whichever mode the caller is in: vLLM runs
    # its steps in inference mode, so views made there are inference tensors,
    # which an in-place copy outside it refuses (a flush at shutdown, say).
    @torch.inference_mode()
    def to_slots(self, pool: MappedPool, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        if not block_ids:
            return
        blocks = torch.as_tensor(block_ids, dtype=torch.long)
        slot_index = torch.as_tensor(slots, dtype=torch.long)
        for view, pool_view, offset, width in self._plan(pool):
            pool_view[slot_index, offset : offset + width] = view[blocks].reshape(len(block_ids), width)

    @torch.inference_mode()
    def from_slots(self, pool: MappedPool, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        blocks = torch.as_tensor(block_ids, dtype=torch.long)
        slot_index = torch.as_tensor(slots, dtype=torch.long)
        for view, pool_view, offset, width in self._plan(pool):
            data = pool_view[slot_index, offset : offset + width]
            view[blocks] = data.view(len(block_ids), *view.shape[1:])
