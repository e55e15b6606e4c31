"""A worker registration's tensors, checked before any handle is opened.

The size of a block follows from the shapes alone, so an oversized or absurd
registration is refused before a single page offset is computed; and every
number is bounded (Limits.check_worker) before those sizes are computed.
"""

from __future__ import annotations

import math

from kvdepot.errors import InvalidArgument
from kvdepot.layout import DTYPE_BYTES, MAX_PAGES_PER_WORKER, WorkerLayout, describe
from kvdepot.server.core.limits import Limits
from kvdepot.server.core.namespaces import Namespace
from kvdepot.server.core.requests import TensorSpec, WorkerSpec


def _block_bytes_of(spec: TensorSpec) -> int:
    """Bytes of one block of a tensor, from its shape (bounded by Limits.check_worker)."""
    shape = list(spec.shape)
    return DTYPE_BYTES.get(spec.dtype, 0) * math.prod(shape) // shape[spec.block_dim]


def worker_layout(request: WorkerSpec, ns: Namespace, largest_shard: int, limits: Limits) -> WorkerLayout:
    """The layout the request's tensors describe; InvalidArgument if it is unusable."""
    # Sizes, counts and strings first: what follows multiplies and sums them.
    limits.check_worker(request)
    if request.rank >= ns.tp_size:
        raise InvalidArgument(f"rank {request.rank} is outside tp_size {ns.tp_size}")
    if not request.tensors:
        raise InvalidArgument("a worker must register at least one KV-cache tensor")
    # Every size is at least 1 (checked above), so no tensor's pages can hide another's.
    pages = sum(math.prod(t.shape[: t.block_dim]) for t in request.tensors)
    if pages > MAX_PAGES_PER_WORKER:
        raise InvalidArgument(f"{pages} pages per block over all tensors; a worker has at most {MAX_PAGES_PER_WORKER}")
    block_bytes = sum(_block_bytes_of(t) for t in request.tensors)
    if block_bytes > largest_shard:
        raise InvalidArgument(
            f"one block of this worker is {block_bytes} bytes, more than the pool holds in one run "
            f"({largest_shard} bytes: an extent of the pool, within one --pin-chunk-bytes): give kvdepotd a larger "
            "--pool-size, or a larger --pin-chunk-bytes if that is what bounds it"
        )
    layout = WorkerLayout.of(
        [
            describe(
                name=t.name or f"tensor{i}",
                dtype=t.dtype,
                shape=t.shape,
                strides=t.strides,
                byte_offset=t.byte_offset,
                storage_bytes=t.storage_bytes,
                block_dim=t.block_dim,
                page_bytes=t.page_bytes,
            )
            for i, t in enumerate(request.tensors)
        ]
    )
    ns.check_rank_layout(request.rank, layout)
    return layout
