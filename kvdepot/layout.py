"""Where a block's bytes live in a KV-cache tensor, and where they go in a slot.

The daemon and the worker compute this from the same TensorSpec so that they
agree on every byte: the daemon to bounds-check requests (and, with the CUDA
transport, to address its copies), the worker to copy with the shared-memory
transport.

A tensor's block b is the sub-tensor at index b of `block_dim`. The dimensions
after `block_dim` must form one dense region (a *page*, possibly with permuted
strides); each combination of indices of the dimensions before it is one more
page of the block (K and V of a [2, num_blocks, ...] tensor are two pages).
In a slot, a worker's tensors follow each other in registration order, each
with its pages in row-major order of those outer indices.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.errors import InvalidArgument

DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}

# Limits far above any real KV cache, so that one request cannot make the
# daemon enumerate (and keep) millions of page offsets.
MAX_DIMS = 8
MAX_PAGES_PER_BLOCK = 4096
MAX_TENSORS_PER_WORKER = 4096
MAX_PAGES_PER_WORKER = 65536
# Sizes and strides (elements) and byte offsets a client may claim, checked
# before any of them is multiplied: with them every byte offset of a page,
# plus a slot offset, fits a signed 64-bit integer, as the copy kernels and
# the pool's arithmetic need.
MAX_DIM_ELEMENTS = 1 << 48
MAX_BYTE_OFFSET = 1 << 62


def check_tensor_bounds(
    where: str, shape: Sequence[int], strides: Sequence[int], block_dim: int, byte_offset: int, storage_bytes: int
) -> None:
    """The checks on a tensor description that need no arithmetic on its numbers."""
    if not shape or len(shape) > MAX_DIMS:
        raise InvalidArgument(f"{where}: a KV-cache tensor has 1 to {MAX_DIMS} dimensions, not {len(shape)}")
    if len(strides) != len(shape):
        raise InvalidArgument(f"{where}: {len(shape)} dimensions in shape but {len(strides)} strides")
    if any(s <= 0 for s in shape):
        raise InvalidArgument(f"{where}: every dimension must be at least 1, got {tuple(shape)}")
    if any(s < 0 for s in strides):
        raise InvalidArgument(f"{where}: negative strides are not supported, got {tuple(strides)}")
    if any(s > MAX_DIM_ELEMENTS for s in shape) or any(s > MAX_DIM_ELEMENTS for s in strides):
        raise InvalidArgument(
            f"{where}: sizes and strides are at most {MAX_DIM_ELEMENTS} (2^48) elements, got shape "
            f"{tuple(shape)}, strides {tuple(strides)}"
        )
    if not 0 <= block_dim < len(shape):
        raise InvalidArgument(f"{where}: block_dim {block_dim} is not a dimension of shape {tuple(shape)}")
    if not 0 <= byte_offset <= MAX_BYTE_OFFSET:
        raise InvalidArgument(f"{where}: byte_offset {byte_offset} is outside 0 to 2^62")
    if storage_bytes > MAX_BYTE_OFFSET:
        raise InvalidArgument(f"{where}: storage_bytes {storage_bytes} is more than 2^62")


def _shown(text: str, limit: int = 80) -> str:
    """A client's string in an error: escaped, and cut short."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


@dataclass(frozen=True)
class TensorLayout:
    name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    byte_offset: int
    storage_bytes: int
    block_dim: int
    elem_bytes: int
    num_blocks: int
    page_bytes: int
    # Byte distance between block b and block b + 1.
    block_stride_bytes: int
    # Byte offset of each page of a block from the start of that block.
    page_offsets: tuple[int, ...]

    @property
    def pages_per_block(self) -> int:
        return len(self.page_offsets)

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * self.pages_per_block

    @property
    def outer_shape(self) -> tuple[int, ...]:
        return self.shape[: self.block_dim]

    @property
    def outer_strides_bytes(self) -> tuple[int, ...]:
        return tuple(s * self.elem_bytes for s in self.strides[: self.block_dim])

    def signature(self) -> tuple:
        """What must match between workers that share a namespace's blocks: the
        bytes of a page mean the same only with the same element order."""
        inner = range(self.block_dim + 1, len(self.shape))
        return (
            self.dtype,
            self.outer_shape,
            tuple(self.shape[d] for d in inner),
            tuple(self.strides[d] for d in inner),
        )


def describe(
    *,
    name: str,
    dtype: str,
    shape: Sequence[int],
    strides: Sequence[int],
    byte_offset: int,
    storage_bytes: int,
    block_dim: int,
    page_bytes: int | None = None,
) -> TensorLayout:
    """Validates a tensor description and computes its pages.

    `page_bytes`, when given, is the sender's own computation; a mismatch
    means the two sides disagree about the tensor and is refused.
    """
    where = f"tensor {_shown(name)}"
    if dtype not in DTYPE_BYTES:
        raise InvalidArgument(
            f"{where}: unknown dtype {_shown(dtype)}; known: {', '.join(sorted(DTYPE_BYTES))}"
        )
    shape = tuple(int(s) for s in shape)
    strides = tuple(int(s) for s in strides)
    check_tensor_bounds(where, shape, strides, block_dim, byte_offset, storage_bytes)
    elem = DTYPE_BYTES[dtype]

    # The dimensions after block_dim must cover a dense run of elements.
    inner = sorted(
        (strides[d], shape[d]) for d in range(block_dim + 1, len(shape)) if shape[d] > 1
    )
    expected_stride = 1
    for stride, size in inner:
        if stride != expected_stride:
            raise InvalidArgument(
                f"{where}: the dimensions after block_dim {block_dim} are not one dense "
                f"region (shape {shape}, strides {strides}); each block's data must be "
                "contiguous apart from the dimensions before block_dim"
            )
        expected_stride *= size
    page_elems = expected_stride
    computed_page_bytes = page_elems * elem

    outer = shape[:block_dim]
    n_pages = math.prod(outer)
    if n_pages > MAX_PAGES_PER_BLOCK:
        raise InvalidArgument(
            f"{where}: {n_pages} pages per block (dimensions {outer} before block_dim); "
            f"at most {MAX_PAGES_PER_BLOCK} are supported"
        )
    page_offsets = tuple(
        sum(i * strides[d] for d, i in enumerate(index)) * elem
        for index in itertools.product(*(range(n) for n in outer))
    )
    num_blocks = shape[block_dim]
    block_stride = strides[block_dim] * elem
    if _pages_overlap(outer, [s * elem for s in strides[:block_dim]], num_blocks, block_stride, computed_page_bytes):
        raise InvalidArgument(
            f"{where}: pages of its blocks overlap (shape {shape}, strides {strides}): a load "
            "into one block would overwrite another"
        )
    end = byte_offset + (num_blocks - 1) * block_stride + max(page_offsets) + computed_page_bytes
    if end > MAX_BYTE_OFFSET:
        raise InvalidArgument(f"{where}: the layout reaches byte {end}, past 2^62 (shape {shape}, strides {strides})")
    if end > storage_bytes:
        raise InvalidArgument(
            f"{where}: the layout reaches byte {end} but its storage holds only "
            f"{storage_bytes} bytes: the layout descriptor does not match the tensor"
        )
    if page_bytes is not None and page_bytes != computed_page_bytes:
        raise InvalidArgument(
            f"{where}: page_bytes {page_bytes} does not match shape {shape}, strides "
            f"{strides} and dtype {dtype}, which give {computed_page_bytes}"
        )
    return TensorLayout(
        name=name,
        dtype=dtype,
        shape=shape,
        strides=strides,
        byte_offset=byte_offset,
        storage_bytes=storage_bytes,
        block_dim=block_dim,
        elem_bytes=elem,
        num_blocks=num_blocks,
        page_bytes=computed_page_bytes,
        block_stride_bytes=block_stride,
        page_offsets=page_offsets,
    )


def _pages_overlap(outer: tuple, outer_strides: list, num_blocks: int, block_stride: int, page: int) -> bool:
    """Whether any two pages of any blocks share a byte.

    Page starts are b * block_stride + sum(i_d * outer_strides[d]). Two of them
    differ by d * block_stride + x, where x is a sum of (i_d - j_d) *
    outer_strides[d]; they overlap when that difference is less than a page
    (and the two are not the same page). Enumerating the differences x, not the
    pairs of pages, keeps this linear in the pages of one block.
    """
    differences = {0: False}  # difference -> reachable with a nonzero index change
    for size, stride in zip(outer, outer_strides):
        grown = {}
        for x, nonzero in differences.items():
            for delta in range(-(size - 1), size):
                key = x + delta * stride
                grown[key] = grown.get(key, False) or nonzero or delta != 0
        differences = grown
        if len(differences) > 4 * MAX_PAGES_PER_BLOCK * MAX_DIMS:
            return True  # no real layout has this many distinct page distances
    for x, nonzero in differences.items():
        if nonzero and abs(x) < page:
            return True  # two pages of one block
        if num_blocks > 1:
            if block_stride == 0:
                return True
            # The block distance d (1 <= d < num_blocks) closest to x.
            nearest = min(max(round(x / block_stride), 1), num_blocks - 1)
            for d in (nearest - 1, nearest, nearest + 1):
                if 1 <= d < num_blocks and abs(d * block_stride - x) < page:
                    return True
    return False


@dataclass(frozen=True)
class WorkerLayout:
    """All KV-cache tensors of one worker, and how one of its blocks fills a slot."""

    tensors: tuple[TensorLayout, ...]
    slot_offsets: tuple[int, ...]
    block_bytes: int
    num_blocks: int

    @classmethod
    def of(cls, tensors: Sequence[TensorLayout]) -> WorkerLayout:
        if not tensors:
            raise InvalidArgument("a worker must register at least one KV-cache tensor")
        if len(tensors) > MAX_TENSORS_PER_WORKER:
            raise InvalidArgument(
                f"{len(tensors)} tensors; a worker registers at most {MAX_TENSORS_PER_WORKER}"
            )
        counts = {t.num_blocks for t in tensors}
        if len(counts) != 1:
            raise InvalidArgument(
                "all tensors of a worker must have the same number of blocks, got "
                + ", ".join(f"{t.name}: {t.num_blocks}" for t in tensors)
                + " (register each KV-cache group as its own namespace)"
            )
        offsets = []
        position = 0
        for t in tensors:
            offsets.append(position)
            position += t.block_bytes
        return cls(tuple(tensors), tuple(offsets), position, counts.pop())

    def signature(self) -> tuple:
        return tuple(t.signature() for t in self.tensors)
