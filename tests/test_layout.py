"""Where a block's bytes are, computed from the descriptor as the daemon does."""

from __future__ import annotations

import pytest
import torch

from kvdepot.client.tensors import block_view, tensor_layout
from kvdepot.errors import InvalidArgument
from kvdepot.layout import WorkerLayout


def test_per_layer_kv_tensor_has_two_pages_per_block():
    t = torch.zeros(2, 10, 16, 8, 128, dtype=torch.bfloat16)
    layout = tensor_layout(t, 1, "l0")
    assert layout.page_bytes == 16 * 8 * 128 * 2 == 32768
    assert layout.page_offsets == (0, 10 * 32768)
    assert layout.block_stride_bytes == 32768
    assert layout.num_blocks == 10 and layout.block_bytes == 65536


def test_block_major_and_mla_tensors_have_one_page():
    cross_layer = torch.zeros(10, 32, 2, 16, 8, 128, dtype=torch.bfloat16)
    assert tensor_layout(cross_layer, 0, "x").page_offsets == (0,)
    assert tensor_layout(cross_layer, 0, "x").page_bytes == 32 * 2 * 16 * 8 * 128 * 2
    mla = torch.zeros(10, 16, 576, dtype=torch.bfloat16)
    assert tensor_layout(mla, 0, "mla").page_bytes == 16 * 576 * 2


def test_permuted_inner_dimensions_still_form_a_page():
    # HND physical order viewed as NHD: dense, with permuted strides.
    physical = torch.zeros(2, 10, 8, 16, 128, dtype=torch.float16)
    logical = physical.permute(0, 1, 3, 2, 4)
    layout = tensor_layout(logical, 1, "hnd")
    assert layout.page_bytes == 8 * 16 * 128 * 2


def test_a_view_into_a_larger_storage_is_addressed_from_its_offset():
    storage = torch.arange(2 * 12 * 4, dtype=torch.float32).view(2, 12, 4)
    view = storage[:, 2:10]
    layout = tensor_layout(view, 1, "v")
    assert layout.byte_offset == 2 * 4 * 4
    bytes_of = block_view(view, layout)
    assert torch.equal(bytes_of[3].view(torch.float32).view(2, 4), view[:, 3])


def test_non_dense_blocks_are_refused():
    t = torch.zeros(10, 16, 64)[:, :, :32]  # every block has gaps
    with pytest.raises(InvalidArgument, match="not one dense region"):
        tensor_layout(t, 0, "gappy")


def test_worker_tensors_must_agree_on_the_block_count():
    a = tensor_layout(torch.zeros(2, 10, 4), 1, "a")
    b = tensor_layout(torch.zeros(2, 11, 4), 1, "b")
    with pytest.raises(InvalidArgument, match="same number of blocks"):
        WorkerLayout.of([a, b])
    worker = WorkerLayout.of([a, a])
    assert worker.slot_offsets == (0, 32) and worker.block_bytes == 64


def test_layouts_with_the_same_page_size_but_another_element_order_do_not_match():
    nhd = torch.zeros(2, 10, 16, 8, 128, dtype=torch.bfloat16)
    hnd = torch.zeros(2, 10, 8, 16, 128, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    other_shape = torch.zeros(2, 10, 8, 16, 128, dtype=torch.bfloat16)
    signatures = {tensor_layout(t, 1, "x").signature() for t in (nhd, hnd, other_shape)}
    assert len(signatures) == 3
    assert tensor_layout(nhd, 1, "x").signature() == tensor_layout(
        torch.zeros(2, 99, 16, 8, 128, dtype=torch.bfloat16), 1, "y"
    ).signature()


def test_interleaved_k_and_v_pages_are_accepted_but_overlapping_blocks_are_not():
    # [blocks, 2, ...] memory viewed as [2, blocks, ...]: K and V of a block side by side.
    interleaved = torch.zeros(10, 2, 16, 8, 128).permute(1, 0, 2, 3, 4)
    assert tensor_layout(interleaved, 1, "kv").page_offsets == (0, 65536)
    overlapping = torch.zeros(100).as_strided((10, 16), (1, 1))
    with pytest.raises(InvalidArgument, match="overlap"):
        tensor_layout(overlapping, 0, "o")


def test_descriptors_beyond_any_real_kv_cache_are_refused_cheaply():
    from kvdepot.layout import describe

    with pytest.raises(InvalidArgument, match="1 to 8 dimensions"):
        describe(name="t", dtype="uint8", shape=[1] * 9, strides=[1] * 9, byte_offset=0,
                 storage_bytes=1 << 40, block_dim=0)
    with pytest.raises(InvalidArgument, match="pages per block"):
        describe(name="t", dtype="uint8", shape=[8192, 2, 64], strides=[128, 64, 1], byte_offset=0,
                 storage_bytes=1 << 40, block_dim=1)
