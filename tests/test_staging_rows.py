"""A CPU worker's staging rows in this process (client/shm_copy.py): copies by runs or by
gather give the same bytes, and rows of ended jobs stay in memory within the budget,
least recently used given back first, never a row a job in flight has taken."""

from __future__ import annotations

import random

import pytest
import torch

import kvdepot.client.shm_copy as shm_copy
from kvdepot.client.shm_copy import BlockCopier, StagingMemory
from kvdepot.client.tensors import tensor_layout
from kvdepot.layout import WorkerLayout

NUM_BLOCKS = 24


def copier() -> tuple[BlockCopier, list[torch.Tensor]]:
    # vLLM's CPU per-layer layout: [2 (K, V), blocks, ...]; block dimension 1.
    tensors = [torch.randn(2, NUM_BLOCKS, 4, 64) for _ in range(3)]
    layout = WorkerLayout.of([tensor_layout(t, 1, f"l{i}") for i, t in enumerate(tensors)])
    return BlockCopier(tensors, layout), tensors


@pytest.mark.parametrize("min_run_bytes", [0, 1 << 40], ids=["runs", "gather"])
@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [9, 2, 17, 3, 11, 23, 0]], ids=["consecutive", "scattered"])
def test_blocks_round_trip_through_the_staging_rows(monkeypatch, min_run_bytes, ids):
    monkeypatch.setattr(shm_copy, "MIN_RUN_COPY_BYTES", min_run_bytes)
    cp, tensors = copier()
    before = [t.clone() for t in tensors]
    cp.to_staging(ids)
    for t in tensors:
        t.zero_()
    cp.from_staging(ids)
    others = [b for b in range(NUM_BLOCKS) if b not in ids]
    for t, b in zip(tensors, before):
        assert torch.equal(t[:, ids], b[:, ids])
        assert not t[:, others].any()  # nothing else written


def test_rows_of_ended_jobs_stay_within_the_budget_least_recently_used_given_back_first():
    row = 3 * shm_copy._PAGE
    staging = StagingMemory(8, row, resident_bytes=3 * row)
    staging.rows.fill_(7)
    staging.take(range(8))
    staging.release([0, 1, 2])
    assert all(staging.rows[b].eq(7).all() for b in range(8))  # within the budget
    staging.release([3])  # row 0 is the least recently used: given back
    assert not staging.rows[0].any()
    assert all(staging.rows[b].eq(7).all() for b in range(1, 8))
    staging.take([1])  # a job uses row 1 again: never given back while it does
    staging.release([4, 5])  # rows 2 to 5 ended: 2 is given back
    assert not staging.rows[2].any()
    assert all(staging.rows[b].eq(7).all() for b in (1, 3, 4, 5, 6, 7))
    staging.close()


def test_a_budget_of_nothing_gives_every_row_back_when_its_job_ends():
    rng = random.Random(5)
    row = 2 * shm_copy._PAGE
    staging = StagingMemory(6, row, resident_bytes=0)
    staging.rows.fill_(1)
    ids = rng.sample(range(6), 3)
    staging.take(ids)
    staging.release(ids)
    for b in range(6):
        assert bool(staging.rows[b].any()) == (b not in ids)
    staging.close()
