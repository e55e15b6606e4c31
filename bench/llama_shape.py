"""A model of Llama-3.1-8B's shape in plain torch, for the GPU benchmarks.

Random weights, the real shapes: hidden 4096, 32 layers, 32 query heads, 8 KV
heads, head dim 128, SwiGLU MLP 14336, vocab 128256, RMSNorm, RoPE theta
500000 (without Llama 3.1's long-context frequency scaling, which changes the
values and not the cost). Its point is the time and the memory traffic of a
prefill and of a decode step, not its outputs; `selfcheck` shows that its
prefill and its decode agree, so the K/V it writes is what a real model of this
shape would write.

- `prefill` runs one prompt and writes every layer's K/V into a paged cache of
  vLLM's per-layer layout ([2, num_blocks, block_size, kv_heads, head_dim] a
  layer) through a slot mapping, as vLLM's reshape_and_cache does.
- `decode` runs one token for each of N requests whose K/V is kept contiguous
  per request ([N, kv_heads, context, head_dim] a layer).

Used by bench/prefill_vs_load.py and bench/decode_step.py. No vLLM or
transformers needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0
    eps: float = 1e-5
    block_size: int = 16

    @property
    def page_bytes(self) -> int:
        """One K or V page of one layer: block_size tokens, bf16."""
        return self.block_size * self.kv_heads * self.head_dim * 2

    @property
    def block_bytes(self) -> int:
        """One block of every layer, K and V: what one pool slot holds."""
        return self.layers * 2 * self.page_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


LLAMA_8B = Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
# --tiny: the same structure (GQA of 4 query heads a KV head, SwiGLU), small enough for a CPU.
TINY = Shape(hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, intermediate=512, vocab=1024)


def sdpa_backends(device: torch.device):
    """SDPA kernels allowed for a long prefill. On CUDA the math kernel is left
    out: at 32k tokens it would materialise 64 GB of scores, and failing at once
    says more than an out-of-memory error."""
    from torch.nn.attention import SDPBackend

    if device.type == "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


class LlamaShape:
    def __init__(self, shape: Shape, device, dtype=torch.bfloat16, seed: int = 0, mlp_chunk: int = 8192):
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        self.mlp_chunk = mlp_chunk
        s = shape
        torch.manual_seed(seed)

        def weight(out_features: int, in_features: int) -> torch.Tensor:
            # Unit-variance outputs keep 32 random layers finite in bf16.
            w = torch.empty(out_features, in_features, device=self.device, dtype=dtype)
            return w.normal_(0.0, in_features**-0.5)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=dtype)

        self.embed = torch.empty(s.vocab, s.hidden, device=self.device, dtype=dtype).normal_(0.0, 1.0)
        self.layers = []
        for _ in range(s.layers):
            self.layers.append(dict(
                norm1=ones(s.hidden),
                # Q, K and V in one matrix, gate and up in another, as vLLM fuses them.
                qkv=weight((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),
                o=weight(s.hidden, s.heads * s.head_dim),
                norm2=ones(s.hidden),
                gate_up=weight(2 * s.intermediate, s.hidden),
                down=weight(s.hidden, s.intermediate),
            ))
        self.norm = ones(s.hidden)
        self.lm_head = weight(s.vocab, s.hidden)
        self.inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=self.device,
                                                               dtype=torch.float32) / s.head_dim))

    def param_bytes(self) -> int:
        tensors = [self.embed, self.norm, self.lm_head] + [t for layer in self.layers for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------ pieces

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.eps)
        return xf.to(self.dtype) * weight

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; cos, sin [T, head_dim / 2]. The rotate-half form."""
        xf = x.float()
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    def split_qkv(self, h: torch.Tensor, layer: dict, cos, sin):
        s = self.shape
        qkv = F.linear(h, layer["qkv"])
        q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
        q = self.rope(q.view(-1, s.heads, s.head_dim), cos, sin)
        k = self.rope(k.view(-1, s.kv_heads, s.head_dim), cos, sin)
        return q, k, v.reshape(-1, s.kv_heads, s.head_dim)

    def mlp_into(self, x: torch.Tensor, layer: dict) -> None:
        """x += MLP(norm(x)), in chunks of tokens: the [tokens, 2 x 14336]
        intermediate of a 32k prompt at once would take 1.9 GB more."""
        for start in range(0, x.shape[0], self.mlp_chunk):
            part = x[start:start + self.mlp_chunk]
            gate, up = F.linear(self.rms_norm(part, layer["norm2"]), layer["gate_up"]).chunk(2, dim=-1)
            part += F.linear(F.silu(gate) * up, layer["down"])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.rms_norm(x, self.norm), self.lm_head)

    # ------------------------------------------------------------ prefill

    def prefill(self, tokens: torch.Tensor, kv_cache: list[torch.Tensor], slot_mapping: torch.Tensor) -> torch.Tensor:
        """One prompt (tokens [T]); writes layer i's K and V of token t into
        kv_cache[i][0 / 1] at flat slot slot_mapping[t] (block * block_size +
        offset). Returns the last token's logits [vocab], as vLLM computes logits
        only where it samples."""
        s = self.shape
        n = tokens.shape[0]
        cos, sin = self.rope_tables(torch.arange(n, device=self.device))
        x = F.embedding(tokens, self.embed)
        group = s.heads // s.kv_heads
        from torch.nn.attention import sdpa_kernel

        for layer, cache in zip(self.layers, kv_cache):
            q, k, v = self.split_qkv(self.rms_norm(x, layer["norm1"]), layer, cos, sin)
            flat = cache.view(2, -1, s.kv_heads, s.head_dim)
            flat[0].index_copy_(0, slot_mapping, k)
            flat[1].index_copy_(0, slot_mapping, v)
            # K/V repeated to every query head (GQA): 0.5 GB at 32k tokens, so
            # that any fused kernel takes it (not all take enable_gqa).
            kr = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]
            vr = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
            with sdpa_kernel(sdpa_backends(self.device)):
                attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kr, vr, is_causal=True)
            x = x + F.linear(attn[0].transpose(0, 1).reshape(n, s.heads * s.head_dim), layer["o"])
            self.mlp_into(x, layer)
        return self.logits(x[-1:])[0]

    # ------------------------------------------------------------ decode

    def decode(self, tokens: torch.Tensor, position: int, k_cache: list[torch.Tensor],
               v_cache: list[torch.Tensor]) -> torch.Tensor:
        """One token for each of N requests (tokens [N]), all at `position`:
        writes its K/V at that position of k_cache[i] / v_cache[i] ([N, kv_heads,
        length, head_dim], length > position) and attends to positions 0 to
        `position`. Returns the logits [N, vocab]. Static shapes and no host
        syncs, so that it can be captured in a CUDA graph."""
        s = self.shape
        n = tokens.shape[0]
        group = s.heads // s.kv_heads
        cos, sin = self.rope_tables(torch.full((n,), position, device=self.device))
        x = F.embedding(tokens, self.embed)
        for layer, kc, vc in zip(self.layers, k_cache, v_cache):
            q, k, v = self.split_qkv(self.rms_norm(x, layer["norm1"]), layer, cos, sin)
            kc[:, :, position] = k
            vc[:, :, position] = v
            # The `group` query heads that share a KV head become `group` query
            # rows against it: GQA without copying K/V, as paged decode kernels
            # read it. No mask: every row sees the whole context.
            attn = F.scaled_dot_product_attention(
                q.view(n, s.kv_heads, group, s.head_dim), kc[:, :, :position + 1], vc[:, :, :position + 1])
            x = x + F.linear(attn.reshape(n, s.heads * s.head_dim), layer["o"])
            self.mlp_into(x, layer)
        return self.logits(x)


def paged_to_contiguous(kv_cache: list[torch.Tensor], slot_mapping: torch.Tensor, length: int):
    """One request's K and V out of a paged cache, as [1, kv_heads, length, head_dim] a layer."""
    ks, vs = [], []
    for cache in kv_cache:
        flat = cache.view(2, -1, cache.shape[-2], cache.shape[-1])
        k = torch.zeros(1, cache.shape[-2], length, cache.shape[-1], dtype=cache.dtype, device=cache.device)
        v = torch.zeros_like(k)
        k[0, :, :slot_mapping.numel()] = flat[0][slot_mapping].transpose(0, 1)
        v[0, :, :slot_mapping.numel()] = flat[1][slot_mapping].transpose(0, 1)
        ks.append(k)
        vs.append(v)
    return ks, vs


def selfcheck(device, dtype=torch.bfloat16, prompt: int = 40, strict: bool = True) -> float:
    """The tiny model's prefill and decode agree: two prompts of `prompt` tokens
    are prefilled into a paged cache (scattered blocks, a partial last block),
    their K/V gathered per request, and one decode step of both at once must
    give the logits that a prefill of the prompt plus that token gives. Checks
    the RoPE positions, the GQA head mapping and the cache layout of both paths.
    Returns the smallest cosine similarity; raises below 0.999 if `strict`
    (a wrong position or head mapping gives 0.99 or less; bf16 on a CPU 1.0)."""
    device = torch.device(device)
    model = LlamaShape(TINY, device, dtype, seed=1)
    s = TINY
    num_blocks = 16
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, s.vocab, (prompt + 1,), generator=generator).to(device) for _ in range(2)]
    ks, vs, expected = [], [], []
    for tokens in prompts:
        cache = [torch.zeros(2, num_blocks, s.block_size, s.kv_heads, s.head_dim, dtype=dtype, device=device)
                 for _ in range(s.layers)]
        blocks = torch.randperm(num_blocks, generator=generator)[: -(-prompt // s.block_size)].to(device)
        positions = torch.arange(prompt, device=device)
        slots = blocks[positions // s.block_size] * s.block_size + positions % s.block_size
        model.prefill(tokens[:prompt], cache, slots)
        k, v = paged_to_contiguous(cache, slots, prompt + 1)
        ks.append(k)
        vs.append(v)
        fresh = [torch.zeros_like(c) for c in cache]
        whole = torch.arange(prompt + 1, device=device)
        expected.append(model.prefill(tokens, fresh, whole).float())
    k_cache = [torch.cat([k[layer] for k in ks]) for layer in range(s.layers)]
    v_cache = [torch.cat([v[layer] for v in vs]) for layer in range(s.layers)]
    got = model.decode(torch.stack([t[prompt] for t in prompts]), prompt, k_cache, v_cache).float()
    worst = min(F.cosine_similarity(got[i], expected[i], dim=0).item() for i in range(len(prompts)))
    if strict and not worst > 0.999:
        raise AssertionError(f"prefill and decode disagree: cosine similarity {worst:.5f}")
    return worst
