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


class BlockCopier:
    """Copies one worker's blocks in and out of pool slots."""

    def __init__(self, tensors: Sequence[torch.Tensor], layout: WorkerLayout):
        self.layout = layout
        self._views = [block_view(t, tl) for t, tl in zip(tensors, layout.tensors)]

    def to_slots(self, pool: MappedPool, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        if not block_ids:
            return
        blocks = torch.as_tensor(block_ids, dtype=torch.long)
        slot_index = torch.as_tensor(slots, dtype=torch.long)
        for view, tl, offset in zip(self._views, self.layout.tensors, self.layout.slot_offsets):
            gathered = view[blocks].reshape(len(block_ids), tl.block_bytes)
            pool.slots[slot_index, offset : offset + tl.block_bytes] = gathered

    def from_slots(self, pool: MappedPool, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        blocks = torch.as_tensor(block_ids, dtype=torch.long)
        slot_index = torch.as_tensor(slots, dtype=torch.long)
        for view, tl, offset in zip(self._views, self.layout.tensors, self.layout.slot_offsets):
            data = pool.slots[slot_index, offset : offset + tl.block_bytes]
            view[blocks] = data.view(len(block_ids), *tl.outer_shape, tl.page_bytes)
