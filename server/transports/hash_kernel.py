"""The GPU's half of a stored shard's record: host/shard_hash.py's hash of each
row of a staging buffer, computed where the rows are (HBM), so that no CPU
reads a stored byte to seal its record.

Two kernels: `_hash_blocks` gives each (row, 4 KiB block) program one
block's mixed sums; `_hash_rows` sums a row's blocks and writes its hash to
`dest` (pinned host memory, which the GPU writes through UVA). The native
lane launches both by their handles after a store's gather (server/native/
src/cuda_staging.cpp), with the block ids' ring holding the hashes after the fence.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from kvdepot.server.host import shard_hash
from kvdepot.server.transports import cuda_calls

BLOCK_WORDS = shard_hash.BLOCK_WORDS
# Blocks of a row that _hash_rows sums at a time.
ROW_STEP = 1024


@triton.jit
def _mix(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit(do_not_specialize=["buffer", "slot_bytes", "length", "blocks_per_row"])
def _hash_blocks(buffer, slot_bytes, length, keys, out, blocks_per_row, WORDS: tl.constexpr):
    # Program (j, r): block j of row r of the buffer.
    j = tl.program_id(0)
    r = tl.program_id(1)
    i = tl.arange(0, WORDS)
    word = j.to(tl.int64) * WORDS + i
    live = word < length // 8
    row = buffer + r.to(tl.int64) * slot_bytes
    w = tl.load((row + word * 8).to(tl.pointer_type(tl.uint64)), mask=live, other=0)
    lo = w & 0xFFFFFFFF
    hi = w >> 32
    ka_lo = tl.load(keys + i).to(tl.uint64)
    ka_hi = tl.load(keys + WORDS + i).to(tl.uint64)
    kb_lo = tl.load(keys + 2 * WORDS + i).to(tl.uint64)
    kb_hi = tl.load(keys + 3 * WORDS + i).to(tl.uint64)
    zero = tl.zeros_like(w)
    a = tl.where(live, ((lo + ka_lo) & 0xFFFFFFFF) * ((hi + ka_hi) & 0xFFFFFFFF), zero)
    b = tl.where(live, ((lo + kb_lo) & 0xFFFFFFFF) * ((hi + kb_hi) & 0xFFFFFFFF), zero)
    sum_a = tl.sum(a, axis=0)
    sum_b = tl.sum(b, axis=0)
    mixed = _mix(sum_a ^ _mix(sum_b + (j + 1).to(tl.uint64)))
    tl.store(out + r.to(tl.int64) * blocks_per_row + j, mixed)


@triton.jit(do_not_specialize=["length", "blocks_per_row", "dest"])
def _hash_rows(out, length, blocks_per_row, dest, STEP: tl.constexpr):
    # Program r: row r's hash, from its blocks', to dest[r].
    r = tl.program_id(0)
    total = tl.zeros((), dtype=tl.uint64)
    for start in range(0, blocks_per_row, STEP):
        j = start + tl.arange(0, STEP)
        values = tl.load(out + r.to(tl.int64) * blocks_per_row + j, mask=j < blocks_per_row, other=0)
        total += tl.sum(values, axis=0)
    h = _mix(total + length.to(tl.uint64))
    tl.store((dest + r.to(tl.int64) * 8).to(tl.pointer_type(tl.uint64)), h)


def keys_on(device: torch.device) -> torch.Tensor:
    """The hash's keys (uint32[4 * BLOCK_WORDS], as int32) on `device`."""
    return torch.from_numpy(shard_hash.keys().reshape(-1).view(np.int32).copy()).to(device)


def blocks_per_row(length: int) -> int:
    return -(-length // (8 * BLOCK_WORDS))


def hash_rows(buffer: torch.Tensor, rows: int, slot_bytes: int, length: int, keys: torch.Tensor,
              scratch: torch.Tensor, dest: torch.Tensor) -> None:
    """Hashes rows [0, rows) of `buffer` (uint8, rows of `slot_bytes`), the
    first `length` bytes of each, into dest[0:rows] (uint64 as int64), through
    Triton's launcher (the tests' way; the lane launches by handle)."""
    per_row = blocks_per_row(length)
    _hash_blocks[(per_row, rows)](buffer.data_ptr(), slot_bytes, length, keys, scratch, per_row, WORDS=BLOCK_WORDS)
    _hash_rows[(rows,)](scratch, length, per_row, dest.data_ptr(), STEP=ROW_STEP)


@functools.cache
def _compiled(device: int) -> tuple:
    """Both kernels compiled for `device` (a launch that hashes one short row)."""
    with torch.cuda.device(device):
        buffer = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        scratch = torch.zeros(1, dtype=torch.int64, device="cuda")
        dest = torch.zeros(1, dtype=torch.int64, device="cuda")
        keys = keys_on(buffer.device)
        blocks = _hash_blocks[(1, 1)](buffer.data_ptr(), 4096, 4096, keys, scratch, 1, WORDS=BLOCK_WORDS)
        rows = _hash_rows[(1,)](scratch, 4096, 1, dest.data_ptr(), STEP=ROW_STEP)
        torch.cuda.synchronize(device)
    return blocks, rows, keys


def prepared(device: int) -> tuple[cuda_calls.KernelLaunch, cuda_calls.KernelLaunch, torch.Tensor] | None:
    """(blocks kernel, rows kernel, keys on the GPU) for launches by handle on
    `device`; None where this Triton's kernels cannot be launched so."""
    blocks, rows, keys = _compiled(device)
    launches = (cuda_calls.KernelLaunch.of(blocks, 6), cuda_calls.KernelLaunch.of(rows, 4))
    return None if None in launches else (*launches, keys)
