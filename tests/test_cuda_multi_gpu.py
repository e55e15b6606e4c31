"""One daemon serves every GPU of the node: two worker processes, one per GPU,
as the two ranks of one engine with TP = 2 (`pytest -m cuda` on a 2-GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import subprocess_env  # noqa: E402
from kvcache import block_of, namespace, prompt_keys  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

WORKER = str(Path(__file__).resolve().parent / "worker_proc.py")


def run_workers(*commands: list[str]) -> list[dict]:
    """Runs worker processes at the same time, as an engine's ranks run."""
    procs = [subprocess.Popen([sys.executable, WORKER, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=subprocess_env()) for c in commands]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def test_tp2_ranks_on_two_gpus_store_and_load_through_one_daemon(start_daemon, client_factory, tmp_path):
    daemon = start_daemon(pin="on", pool_dir="/dev/shm", pool_size="64MiB", slot_size="16KiB")
    common = ["--socket", daemon.socket, "--tp", "2", "--blocks", "64"]
    engine_client = client_factory(daemon, name="scheduler")
    engine = engine_client.register_engine(namespace("per_layer", tp_size=2))
    keys = prompt_keys(64)

    # Rank 0 alone: its shards are stored, but no block is ready without rank 1's.
    [r0] = run_workers(["store", *common, "--rank", "0", "--device", "cuda:0", "--seed", "100",
                        "--out", str(tmp_path / "a0.pt")])
    assert r0["ok"]
    assert engine_client.lookup(engine, keys).ready_blocks == 0
    [r1] = run_workers(["store", *common, "--rank", "1", "--device", "cuda:1", "--seed", "101",
                        "--out", str(tmp_path / "a1.pt")])
    assert r1["ok"]
    assert engine_client.lookup(engine, keys).ready_blocks == 64
    assert engine_client.stats().open_ipc_mappings == 0  # the storing processes are gone

    loads = run_workers(*[
        ["load", *common, "--rank", str(rank), "--device", f"cuda:{rank}", "--seed", str(200 + rank),
         "--first-block", "50", "--before", str(tmp_path / f"b{rank}-before.pt"),
         "--out", str(tmp_path / f"b{rank}.pt")]
        for rank in (0, 1)
    ])
    assert all(r["ok"] and r["ready"] == 64 for r in loads)
    for rank in (0, 1):
        stored, loaded = torch.load(tmp_path / f"a{rank}.pt"), torch.load(tmp_path / f"b{rank}.pt")
        for i in range(64):
            for src, dst in zip(block_of(stored, "per_layer", i), block_of(loaded, "per_layer", 50 + i)):
                assert torch.equal(src.view(torch.int16), dst.view(torch.int16)), f"rank {rank} block {i}"
