"""vLLM's CPU engine with its default block size (128 tokens) through a daemon
with its default options (issue 28): a Llama-shaped model of 20 layers has
2.5 MiB blocks, more than the 2 MiB slot that every block once had to fit
(the engine stopped at start with "more than a pool slot"). Greedy output is
the output without kvdepot, and a second engine process loads what the
first stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import vllm_harness as h
from test_vllm_e2e import generate, with_kvdepot

from kvdepot.client import KVDepotClient

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 20, 2, 64, 128
BLOCK_BYTES = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4  # K and V, float32: 2.5 MiB


@pytest.fixture(scope="module")
def model():
    return h.make_tiny_model(Path(h.DEFAULT_MODEL_DIR).parent / "kvdepot-tiny-llama-20-layers", num_layers=LAYERS,
                             num_kv_heads=KV_HEADS)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from vllm_generate import make_prompts

    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    # 3 prompts of 300 tokens: 2 whole blocks of 128 each.
    path.write_text(json.dumps(make_prompts(3, 300, seed=11)))
    return path


def test_the_cpu_default_block_size_runs_through_a_daemon_with_default_options(model, prompts, start_daemon,
                                                                                tmp_path):
    baseline = generate(model, prompts, tmp_path / "baseline", "--block-size", "0")["rounds"][0]["outputs"]
    daemon = start_daemon(pool_size=None, slot_size=None)  # the daemon's defaults (1 GiB, 64 KiB slots)
    first = generate(model, prompts, tmp_path / "first", "--block-size", "0", *with_kvdepot(daemon))
    assert first["rounds"][0]["outputs"] == baseline
    second = generate(model, prompts, tmp_path / "second", "--block-size", "0", *with_kvdepot(daemon))
    assert second["rounds"][0]["outputs"] == baseline
    assert second["rounds"][0]["num_cached_tokens"] == [2 * BLOCK] * 3
    with KVDepotClient(daemon.socket, name="test-stats") as client:
        stats = client.connect(10).stats()
    [ns] = [n for n in stats.namespaces if n.ready_blocks]
    assert ns.block_bytes == BLOCK_BYTES and ns.ready_blocks == 6
    assert stats.totals.loaded_blocks >= 6 and stats.totals.hit_blocks >= 6
