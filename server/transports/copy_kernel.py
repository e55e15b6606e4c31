"""One Triton kernel moves every page of a job between GPU KV caches and the
pinned host pool, whatever the layout: a job is one launch, never a call per
page.

A worker's layout becomes a page table, uploaded once: for each of the K pages
of a block, the GPU address of that page in block 0, the distance between
blocks, and where the page goes in a slot. Program (i, k, c) copies chunk c of
page k of the job's i-th block. The host side is addressed through UVA: the
pool is registered with CUDA as mapped memory, so its host pointers are valid
on every GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvdepot import cuda
from kvdepot.layout import WorkerLayout
from kvdepot.server.transports import cuda_calls


@functools.cache
def pcie_programs(device: int) -> int:
    """Programs of a copy that reads or writes the pinned pool over PCIe ("kernel"
    mode): one per SM keeps enough bytes in flight to fill PCIe; more only
    block the other direction (docs/benchmarks.md)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def staging_programs(device: int) -> int:
    """Programs of a gather into (or scatter from) a GPU staging buffer: memory on
    both sides is HBM, so more bytes in flight pay, up to two per SM
    (docs/benchmarks.md)."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


# Pages and their addresses must be aligned to this for 16-byte accesses.
ALIGNMENT = 16


# Integer arguments that vary from job to job (and the slices of block ids and
# slots a chunk takes) are not specialised on: every job of one direction then
# runs the one compiled kernel, which `launch` calls without Triton's per-call
# argument binding (tens of microseconds a launch, on the path of every job).
_VARYING = ["block_ids", "slots", "pool_base", "slot_bytes", "pages_per_block", "chunks_per_page", "work_items"]


@triton.jit(do_not_specialize=_VARYING[2:], do_not_specialize_on_alignment=_VARYING[:2])
def _copy_pages(
    block_ids,  # int64[n]: the worker's block of the job's i-th block
    slots,  # int64[n]: the pool slot of the job's i-th block
    page_gpu,  # int64[K]: GPU address of page k of block 0
    page_stride,  # int64[K]: bytes between the same page of consecutive blocks
    page_slot_offset,  # int64[K]: where page k starts in a slot
    page_bytes,  # int64[K]
    pool_base,  # int64: host (UVA) address of the pool
    slot_bytes,  # int64
    pages_per_block,  # K
    chunks_per_page,  # C
    work_items,  # n * K * C
    TO_HOST: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # A fixed number of programs walk the job's (block, page, chunk) items, so
    # that a store and a load (and the engine's kernels) can run side by side
    # instead of one huge grid taking every SM until it drains.
    for item in range(tl.program_id(0), work_items, tl.num_programs(0)):
        c = item % chunks_per_page
        k = (item // chunks_per_page) % pages_per_block
        i = item // (chunks_per_page * pages_per_block)
        start = c.to(tl.int64) * CHUNK
        length = tl.load(page_bytes + k)
        if start < length:
            block = tl.load(block_ids + i)
            slot = tl.load(slots + i)
            gpu = tl.load(page_gpu + k) + block * tl.load(page_stride + k) + start
            host = pool_base + slot * slot_bytes + tl.load(page_slot_offset + k) + start
            if TO_HOST:
                src_addr = gpu
                dst_addr = host
            else:
                src_addr = host
                dst_addr = gpu
            # Four int32 lanes a thread: 16-byte accesses (addresses are 16-aligned).
            words = tl.minimum(length - start, CHUNK) // 16
            src = tl.multiple_of(src_addr, 16).to(tl.pointer_type(tl.int32))
            dst = tl.multiple_of(dst_addr, 16).to(tl.pointer_type(tl.int32))
            rows = tl.arange(0, CHUNK // 16)
            lanes = tl.arange(0, 4)
            offsets = rows[:, None] * 4 + lanes[None, :]
            mask = rows[:, None] < words
            values = tl.load(src + offsets, mask=mask)
            tl.store(dst + offsets, values, mask=mask)


@dataclass
class PageTable:
    """A worker's pages, on its GPU, ready for every job."""

    page_gpu: torch.Tensor
    page_stride: torch.Tensor
    page_slot_offset: torch.Tensor
    page_bytes: torch.Tensor
    max_page_bytes: int

    @functools.cached_property
    def pointers(self) -> tuple[int, int, int, int]:
        """The four tensors' addresses, for launches by handle."""
        return (self.page_gpu.data_ptr(), self.page_stride.data_ptr(), self.page_slot_offset.data_ptr(),
                self.page_bytes.data_ptr())

    @property
    def pages_per_block(self) -> int:
        return self.page_gpu.numel()

    @classmethod
    def build(cls, layout: WorkerLayout, tensor_addresses: list[int], device: torch.device) -> PageTable:
        """tensor_addresses[t]: GPU address of element 0 of tensor t (byte_offset applied)."""
        gpu, stride, slot_offset, nbytes = [], [], [], []
        for tensor, address, base_in_slot in zip(layout.tensors, tensor_addresses, layout.slot_offsets):
            for p, page_offset in enumerate(tensor.page_offsets):
                gpu.append(address + page_offset)
                stride.append(tensor.block_stride_bytes)
                slot_offset.append(base_in_slot + p * tensor.page_bytes)
                nbytes.append(tensor.page_bytes)

        def upload(values):
            return torch.tensor(values, dtype=torch.int64).to(device)

        return cls(upload(gpu), upload(stride), upload(slot_offset), upload(nbytes), max(nbytes))


def check_alignment(layout: WorkerLayout, tensor_addresses: list[int], slot_bytes: int) -> str | None:
    """Why this worker cannot use the kernel's 16-byte accesses, or None."""
    if slot_bytes % ALIGNMENT:
        return f"the pool's slot size {slot_bytes} is not a multiple of {ALIGNMENT}"
    for tensor, address, base_in_slot in zip(layout.tensors, tensor_addresses, layout.slot_offsets):
        values = [address, tensor.block_stride_bytes, tensor.page_bytes, base_in_slot, *tensor.page_offsets]
        if any(v % ALIGNMENT for v in values):
            return (
                f"tensor {tensor.name!r}: its address, block stride, page offsets and page size "
                f"({tensor.page_bytes} bytes) must be multiples of {ALIGNMENT} bytes"
            )
    return None


def launch(
    table: PageTable,
    block_ids: torch.Tensor,
    slots: torch.Tensor,
    pool_base: int,
    slot_bytes: int,
    to_host: bool,
    chunk_bytes: int,
    programs: int,
) -> None:
    """Enqueues the copies of one job on the current stream of the table's device.

    chunk_bytes: bytes one program copies at a time (a power of two, >= 64);
    programs: how many programs share the work."""
    chunks, work = _work(table, block_ids.numel(), chunk_bytes)
    args = (block_ids, slots, table.page_gpu, table.page_stride, table.page_slot_offset, table.page_bytes,
            pool_base, slot_bytes, table.pages_per_block, chunks, work)
    grid = (min(work, programs), 1, 1)
    key = _key(block_ids.device.index, to_host, chunk_bytes, pool_base, slot_bytes)
    kernel = _compiled.get(key)
    if kernel is None:
        _compiled[key] = _copy_pages[grid](*args, TO_HOST=to_host, CHUNK=chunk_bytes, num_warps=4)
    else:
        kernel[grid](*args, to_host, chunk_bytes, stream=cuda.current_raw_stream(block_ids.device.index))


def launch_at(
    table: PageTable,
    ids: torch.Tensor,
    at: int,
    count: int,
    positions: torch.Tensor,
    pool_base: int,
    slot_bytes: int,
    to_host: bool,
    chunk_bytes: int,
    programs: int,
    stream: torch.cuda.Stream,
    stream_handle: int,
) -> None:
    """`launch` of `count` blocks whose ids are ids[at:] and whose slots are
    positions[:count], on `stream` (whose CUDA handle is `stream_handle`): by
    the kernel's handle once it is compiled (a foreign call, no tensor made),
    else through Triton."""
    key = _key(ids.device.index, to_host, chunk_bytes, pool_base, slot_bytes)
    fast = _launches.get(key)
    if fast:
        chunks, work = _work(table, count, chunk_bytes)
        fast(min(work, programs), stream_handle, ids.data_ptr() + 8 * at, positions.data_ptr(), *table.pointers,
             pool_base, slot_bytes, table.pages_per_block, chunks, work)
        return
    with torch.cuda.stream(stream):
        launch(table, ids[at : at + count], positions[:count], pool_base, slot_bytes, to_host, chunk_bytes, programs)
    if fast is None and key in _compiled:
        # False: this Triton's kernels are launched through Triton.
        _launches[key] = cuda_calls.KernelLaunch.of(_compiled[key], _ARGS) or False


def prepared(positions: torch.Tensor, buffer: int, slot_bytes: int, to_host: bool,
             chunk_bytes: int) -> cuda_calls.KernelLaunch | None:
    """The kernel `launch_at` runs into (or out of) staging buffers like
    `buffer` of `positions`' GPU, compiled now if it was not (a launch with no
    work), as a KernelLaunch; None where it must be launched through Triton."""
    key = _key(positions.device.index, to_host, chunk_bytes, buffer, slot_bytes)
    if key not in _compiled:
        p = positions
        with torch.cuda.device(positions.device):
            _compiled[key] = _copy_pages[(1, 1, 1)](p, p, p, p, p, p, buffer, slot_bytes, 1, 1, 0, TO_HOST=to_host,
                                                    CHUNK=chunk_bytes, num_warps=4)
    if key not in _launches:
        _launches[key] = cuda_calls.KernelLaunch.of(_compiled[key], _ARGS) or False
    return _launches[key] or None


def _work(table: PageTable, blocks: int, chunk_bytes: int) -> tuple[int, int]:
    chunks = triton.cdiv(table.max_page_bytes, chunk_bytes)
    work = blocks * table.pages_per_block * chunks
    if work >= 2**31 - 2**20:  # the kernel's loop counter is 32-bit
        raise ValueError(f"a job of {work} page chunks is too large for one launch; split it")
    return chunks, work


def _key(device: int, to_host: bool, chunk_bytes: int, pool_base: int, slot_bytes: int) -> tuple:
    # What decides the compiled kernel: Triton types an int by its range, and
    # specialises the page table's pointers (allocated, so always aligned).
    return (device, to_host, chunk_bytes, pool_base >= 2**31, slot_bytes >= 2**31)


# The kernel's parameters that `launch` passes (Triton may add its own after them).
_ARGS = 11

# (device, direction, chunk, int ranges) -> the compiled kernel, after its first launch.
_compiled: dict = {}
# The same keys -> its KernelLaunch (False: launched through Triton).
_launches: dict = {}
