"""A worker's KV-cache tensors as the daemon sees them, and byte views of them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdepot.layout import TensorLayout, describe
from kvdepot.proto import kvdepot_pb2 as pb


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_layout(tensor: torch.Tensor, block_dim: int, name: str) -> TensorLayout:
    """Validates the tensor as the daemon will, so bad layouts fail in the caller."""
    return describe(
        name=name,
        dtype=dtype_name(tensor.dtype),
        shape=tuple(tensor.shape),
        strides=tuple(tensor.stride()),
        byte_offset=tensor.storage_offset() * tensor.element_size(),
        storage_bytes=tensor.untyped_storage().nbytes(),
        block_dim=block_dim,
    )


def tensor_spec(layout: TensorLayout) -> pb.TensorSpec:
    return pb.TensorSpec(
        name=layout.name,
        dtype=layout.dtype,
        shape=layout.shape,
        strides=layout.strides,
        byte_offset=layout.byte_offset,
        storage_bytes=layout.storage_bytes,
        block_dim=layout.block_dim,
        page_bytes=layout.page_bytes,
    )


def block_view(tensor: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """A uint8 view [num_blocks, *outer_dims, page_bytes] of the tensor's storage.

    Indexing its first dimension with block ids gathers (or, assigned to,
    scatters) whole blocks in one operation, whatever the dtype and strides.
    """
    storage = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    storage.set_(tensor.untyped_storage())
    return storage.as_strided(
        (layout.num_blocks, *layout.outer_shape, layout.page_bytes),
        (layout.block_stride_bytes, *layout.outer_strides_bytes, 1),
        layout.byte_offset,
    )


def normalize_block_dims(tensors: Sequence[torch.Tensor], block_dim: int | Sequence[int]) -> list[int]:
    if isinstance(block_dim, int):
        return [block_dim] * len(tensors)
    dims = list(block_dim)
    if len(dims) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors but {len(dims)} block_dim values")
    return dims
