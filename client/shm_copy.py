"""The worker's half of the shared-memory transport: its staging memory, and
the copies between its KV-cache tensors and the staging rows.

The daemon's pool is the daemon's alone. Each worker makes a memfd with one
row per block of its tensors (laid out like a pool slot), hands it to the
daemon (job_socket.hand_over), and the daemon copies between these rows and
its pool. A store fills the rows before it is submitted; a load reads them
once the daemon says it is done. Each copy here is one copy per tensor and
run of consecutive blocks where those are large, else one gather (or
scatter) per tensor: never a call per block and tensor where calls cost
more than the bytes.

Rows stay in memory after their job (up to `RESIDENT_BYTES` of them, the
least recently used given back first): a row given back costs the next job
that uses it a page fault per page on each side (measured on a 2-core VM: a
load of 19 blocks of 256 KiB took 5.4 ms into given-back rows against 0.5 ms
into resident ones, and giving them back 1.3 ms more).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvdepot.client.tensors import block_view
from kvdepot.layout import WorkerLayout

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_PAGE = mmap.PAGESIZE
# Staging rows of ended jobs kept in memory, per worker, at most.
RESIDENT_BYTES = 256 << 20
# Copies by runs of consecutive blocks when they move at least this much each on average; else
# a gather (or scatter) per tensor, which costs about 3x the bytes but no call per run (a call
# costs about 7 us, as much as 32 KiB on a 2-core VM).
MIN_RUN_COPY_BYTES = 32 << 10


class StagingMemory:
    """A worker's staging rows, [num_blocks, block_bytes], in a sealed memfd.

    Sealed against shrinking, so that the daemon, which maps it too, can never
    fault on it. The rows of jobs in flight hold memory, and those of ended
    jobs up to `resident_bytes` (the least recently used beyond it are given
    back, a hole punched): a job takes its rows (`take`) before the daemon
    touches them and gives them back (`release`) once it ended.
    """

    def __init__(self, num_blocks: int, row_bytes: int, resident_bytes: int = RESIDENT_BYTES):
        self.row_bytes = row_bytes
        self.max_idle_rows = resident_bytes // max(1, row_bytes)
        # Rows of ended jobs still in memory, least recently used first; rows
        # taken by a job in flight are never in it (so never punched).
        self._idle: OrderedDict[int, None] = OrderedDict()
        # Rows a cancelled job left to the daemon, which may still copy into
        # them (KVDepotClient.cancel): no job uses them until its end comes.
        self._quarantined: set[int] = set()
        self._lock = threading.Lock()
        size = max(1, num_blocks * row_bytes)
        self.fd = os.memfd_create("kvdepot-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._mmap = mmap.mmap(self.fd, size, mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        raw = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.rows = raw[: num_blocks * row_bytes].view(num_blocks, row_bytes)

    def take(self, block_ids: Sequence[int]) -> None:
        """A job uses these rows from now until it releases them."""
        idle = self._idle
        with self._lock:
            for b in block_ids:
                idle.pop(b, None)

    def quarantine(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._quarantined.update(block_ids)

    def lift_quarantine(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._quarantined.difference_update(block_ids)
        self.release(block_ids)

    def quarantined(self, block_ids: Sequence[int]) -> bool:
        """Whether a cancelled job's daemon may still write one of these rows."""
        with self._lock:
            return bool(self._quarantined) and not self._quarantined.isdisjoint(block_ids)

    def release(self, block_ids: Sequence[int]) -> None:
        """A job ended with these rows: they stay in memory, and the least
        recently used rows beyond the budget are given back."""
        idle = self._idle
        with self._lock:
            for b in block_ids:
                if b in self._quarantined:
                    continue
                idle[b] = None
                idle.move_to_end(b)
            over = len(idle) - self.max_idle_rows
            dropped = [idle.popitem(last=False)[0] for _ in range(max(0, over))]
        if dropped:
            self.punch(dropped)

    def punch(self, block_ids: Sequence[int]) -> None:
        """Gives back the memory of the pages inside the rows (they read as
        zeros until written again). A page shared with a row outside them is
        kept whole: that row may belong to a job in flight."""
        for start, count in _runs(sorted(set(block_ids))):
            first = -(-start * self.row_bytes // _PAGE) * _PAGE
            end = (start + count) * self.row_bytes // _PAGE * _PAGE
            if end > first:
                _LIBC.fallocate(self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, first, end - first)

    def close(self) -> None:
        os.close(self.fd)


def _runs(block_ids: Sequence[int]):
    """(first, count) of each run of consecutive ids."""
    start = previous = None
    for b in block_ids:
        if previous is not None and b == previous + 1:
            previous = b
            continue
        if start is not None:
            yield start, previous - start + 1
        start = previous = b
    if start is not None:
        yield start, previous - start + 1


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
    """Copies one worker's blocks in and out of its staging rows."""

    def __init__(self, tensors: Sequence[torch.Tensor], layout: WorkerLayout):
        self.layout = layout
        self.staging = StagingMemory(layout.num_blocks, layout.block_bytes)
        self._views = []
        for tensor, tl, offset in zip(tensors, layout.tensors, layout.slot_offsets):
            unit, dtype = _copy_unit(tensor, tl, offset, layout.block_bytes)
            rows = self.staging.rows.view(dtype)
            view = _typed_block_view(tensor, tl, unit, dtype)
            self._views.append((view, rows, offset // unit, tl.block_bytes // unit))

    def _runs(self, block_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """The runs of consecutive blocks, where copying by runs is the cheaper way; else None."""
        runs = list(_runs(sorted(set(block_ids))))
        if len(runs) * len(self._views) * MIN_RUN_COPY_BYTES <= len(block_ids) * self.layout.block_bytes:
            return runs
        return None

    # Copies run in inference mode whichever mode the caller is in: vLLM runs
    # its steps in inference mode, so views made there are inference tensors,
    # which an in-place copy outside it refuses (a flush at shutdown, say).
    @torch.inference_mode()
    def to_staging(self, block_ids: Sequence[int]) -> None:
        runs = self._runs(block_ids)
        if runs is not None:
            for view, rows, offset, width in self._views:
                for start, count in runs:
                    end = start + count
                    rows[start:end, offset : offset + width].view(count, *view.shape[1:]).copy_(view[start:end])
            return
        blocks = torch.as_tensor(block_ids, dtype=torch.long)
        for view, rows, offset, width in self._views:
            rows[blocks, offset : offset + width] = view[blocks].reshape(len(block_ids), width)

    @torch.inference_mode()
    def from_staging(self, block_ids: Sequence[int]) -> None:
        runs = self._runs(block_ids)
        if runs is not None:
            for view, rows, offset, width in self._views:
                for start, count in runs:
                    end = start + count
                    view[start:end].copy_(rows[start:end, offset : offset + width].view(count, *view.shape[1:]))
            return
        blocks = torch.as_tensor(block_ids, dtype=torch.long)
        for view, rows, offset, width in self._views:
            view[blocks] = rows[blocks, offset : offset + width].view(len(block_ids), *view.shape[1:])
