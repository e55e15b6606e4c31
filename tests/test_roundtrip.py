"""Two client processes share blocks through the real daemon, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env
from kvcache import NUM_BLOCKS, block_of

WORKER = str(Path(__file__).resolve().parent / "worker_proc.py")


def run_worker(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, WORKER, *args], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["per_layer", "block_major"])
def test_blocks_stored_by_one_process_load_bit_exact_in_another(daemon, tmp_path, layout):
    a_out, b_before, b_out = tmp_path / "a.pt", tmp_path / "b-before.pt", tmp_path / "b.pt"
    stored = run_worker("store", "--socket", daemon.socket, "--layout", layout, "--seed", "1",
                        "--blocks", "64", "--first-block", "0", "--out", str(a_out))
    assert stored["ok"]
    loaded = run_worker("load", "--socket", daemon.socket, "--layout", layout, "--seed", "2",
                        "--blocks", "64", "--first-block", "50", "--before", str(b_before), "--out", str(b_out))
    assert loaded["ok"] and loaded["ready"] == 64

    a, before, b = torch.load(a_out), torch.load(b_before), torch.load(b_out)
    for i in range(64):
        for src, dst in zip(block_of(a, layout, i), block_of(b, layout, 50 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16)), f"block {i} differs"
    # Every block B did not load is exactly as B made it.
    for block_id in [*range(0, 50), *range(114, NUM_BLOCKS)]:
        for orig, now in zip(block_of(before, layout, block_id), block_of(b, layout, block_id)):
            assert torch.equal(orig.view(torch.int16), now.view(torch.int16)), f"block {block_id} was touched"
    # The load changed what it should: B's own data differed there.
    assert not torch.equal(block_of(before, layout, 50)[0], block_of(b, layout, 50)[0])
