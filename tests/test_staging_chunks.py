"""How the CUDA transport cuts a job into staging chunks (server/transports/cuda_streams.py):
every block once, in order, no chunk larger than a staging buffer, and a small last chunk only
for a load alone, whose scatter of that chunk is all that is left once the bus is done."""

from __future__ import annotations

import pytest

from kvdepot.server.transports.cuda_streams import TAIL_CHUNK_SHARE, staging_chunks


@pytest.mark.parametrize("blocks", [1, 2, 7, 16, 64, 128, 129, 300, 2048])
@pytest.mark.parametrize("rows", [1, 3, 64, 128])
@pytest.mark.parametrize("small_tail", [False, True])
def test_chunks_cover_every_block_once_in_order_within_a_buffer(blocks, rows, small_tail):
    chunks = staging_chunks(blocks, rows, small_tail)
    covered = [b for first, count in chunks for b in range(first, first + count)]
    assert covered == list(range(blocks))
    assert all(0 < count <= rows for _, count in chunks)


def test_a_load_alone_ends_with_a_small_chunk_and_a_job_behind_others_does_not():
    assert staging_chunks(16, 64, small_tail=True) == [(0, 14), (14, 2)]
    assert staging_chunks(64, 64, small_tail=True) == [(0, 56), (56, 64 // TAIL_CHUNK_SHARE)]
    assert staging_chunks(300, 128, small_tail=True)[-1] == (284, 128 // TAIL_CHUNK_SHARE)
    assert staging_chunks(16, 64, small_tail=False) == [(0, 16)]
    assert staging_chunks(300, 128, small_tail=False) == [(0, 128), (128, 128), (256, 44)]
    assert staging_chunks(1, 64, small_tail=True) == [(0, 1)]
