"""Small KV caches and namespaces that the tests and their worker processes share."""

from __future__ import annotations

import torch

from kvdepot.keys import KEY_VERSION, block_keys

LAYERS = 4
NUM_BLOCKS = 128
BLOCK_SIZE = 16
KV_HEADS = 2
HEAD_DIM = 32


def namespace(layout: str, tp_size: int = 1, model: str = "tiny-llama") -> dict:
    return dict(
        model=model,
        kv_dtype="bfloat16",
        block_size=BLOCK_SIZE,
        layout=layout,
        tp_size=tp_size,
        key_version=KEY_VERSION,
    )


def make_kv_cache(layout: str, seed: int) -> tuple[list[torch.Tensor], int]:
    """Random bf16 KV tensors and the dimension that indexes blocks.

    per_layer: one [2, blocks, block_size, heads, head_dim] tensor a layer (vLLM's
    FlashAttention layout; K and V of a block are two pages).
    block_major: one [blocks, layers, 2, block_size, heads, head_dim] tensor (all
    layers of a block contiguous).
    """
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    if layout == "per_layer":
        return [rand(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)], 1
    if layout == "block_major":
        return [rand(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)], 0
    if layout == "mla":
        # One latent tensor a layer (DeepSeek's MLA: kv_lora_rank + rope dims).
        return [rand(NUM_BLOCKS, BLOCK_SIZE, 64) for _ in range(LAYERS)], 0
    if layout == "group1":
        # A second KV-cache group with another page size (a sliding-window group
        # of a hybrid model, with fewer heads).
        return [rand(2, NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_DIM) for _ in range(LAYERS)], 1
    raise ValueError(layout)


def block_of(tensors: list[torch.Tensor], layout: str, block_id: int) -> list[torch.Tensor]:
    if layout in ("per_layer", "group1"):
        return [t[:, block_id] for t in tensors]
    return [t[block_id] for t in tensors]


def prompt_keys(n_blocks: int, prompt: int = 0) -> list[bytes]:
    tokens = [(prompt * 7919 + i) % 50000 for i in range(n_blocks * BLOCK_SIZE)]
    return block_keys(tokens, BLOCK_SIZE)


def attach_worker(client, seed: int, layout: str = "per_layer"):
    """Registers a fresh random KV cache as rank 0, and an engine, of one namespace."""
    ns = namespace(layout)
    tensors, block_dim = make_kv_cache(layout, seed)
    worker = client.register_worker(ns, rank=0, tensors=tensors, block_dim=block_dim)
    engine = client.register_engine(ns)
    return worker, engine, tensors


def tier(stats, name: str):
    """Tier `name`'s row of a stats reply."""
    [found] = [t for t in stats.tiers if t.name == name]
    return found


def dram(stats):
    """The kept pool's row of a stats reply."""
    return tier(stats, "dram")
