"""Block keys and namespaces of a vLLM engine.

vLLM's own block hashes start from a random seed unless PYTHONHASHSEED is
set, so they differ between processes and restarts. A request's keys are
kvdepot's own (kvdepot/keys.py, docs/keys.md) over its token ids and vLLM's
per-block extra keys (LoRA adapter, multimodal inputs, cache salt, prompt
embeddings): the same prompt gives the same keys in every engine, every time,
and the same as any other client that follows docs/keys.md.

What must match for engines to share blocks at all (model, dtype, block size,
layout, TP size) goes into the namespace, not the keys.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from kvdepot.connector import vllm_compat
from kvdepot.keys import chain_key, chain_plain
from kvdepot.model_identity import model_identity
from kvdepot.proto import kvdepot_pb2 as pb

log = logging.getLogger("kvdepot.connector")

_extra_keys = vllm_compat.block_hash_extra_keys()


class RequestKeys:
    """The keys of a request's whole blocks, extended as its tokens grow."""

    def __init__(self, request, block_size: int):
        self._request = request
        self._block_size = block_size
        self._tokens = vllm_compat.request_token_ids(request)
        self._keys: list[bytes] = []
        self._next_mm_index = 0
        # Most requests have no extra keys at all; they skip vLLM's per-block scan.
        self._plain = not vllm_compat.request_has_extra_keys(request)

    def upto(self, num_blocks: int) -> list[bytes]:
        """Keys of blocks [0, num_blocks); num_blocks must be whole blocks of the request."""
        self.extend(num_blocks)
        return self._keys[:num_blocks]

    def range(self, start: int, end: int) -> list[bytes]:
        self.extend(end)
        return self._keys[start:end]

    def extend(self, num_blocks: int) -> None:
        keys = self._keys
        have = len(keys)
        if have >= num_blocks:
            return
        request, size, tokens = self._request, self._block_size, self._tokens
        if num_blocks * size > len(tokens):
            raise ValueError(f"request {request.request_id} has no block {num_blocks - 1} yet")
        if self._plain and (have > 0 or not request.cache_salt):
            # Blocks without extra keys: where decode spends its time.
            keys += chain_plain(keys[-1] if keys else None, tokens[have * size : num_blocks * size], size)
            return
        while len(keys) < num_blocks:
            start = len(keys) * size
            if self._plain and (start > 0 or not request.cache_salt):
                extra = None
            else:
                extra, self._next_mm_index = _extra_keys(request, start, start + size, self._next_mm_index)
            keys.append(chain_key(keys[-1] if keys else None, tokens[start : start + size], extra))


@dataclass(frozen=True)
class GroupInfo:
    """One KV-cache group that kvdepot offloads."""

    group_idx: int
    kind: str  # "full", "sliding_window", "mla"
    block_size: int
    # Tokens of a sliding window (None for other kinds).
    window_tokens: int | None
    # Blocks a sliding-window group needs before a position: ceil(window / block).
    window_blocks: int | None
    layer_names: tuple[str, ...]
    namespace: pb.NamespaceSpec


def offloaded_groups(vllm_config, kv_cache_config, model_id: str | None = None) -> list[GroupInfo]:
    """The groups to offload, each with the namespace its engines share.

    The namespace names the model's weights (model_identity.py), never its
    path. Raises ValueError for a group kind kvdepot cannot offload (Mamba
    state, cross-attention, ...), rather than offloading a model half-way.
    """
    specs = vllm_compat.kv_cache_spec_types()
    model_config = vllm_config.model_config
    load_config = getattr(vllm_config, "load_config", None)
    identity = model_identity(
        str(model_config.model), model_config.revision, str(getattr(load_config, "load_format", "auto")), model_id
    )
    log.info("kvdepot: namespace of %s@%s, from %s", identity.label, identity.revision, identity.source)
    # What else changes the KV of the same weights: the dtype the model computes
    # in, its quantization, and config overrides.
    computed = f",dtype={str(model_config.dtype).removeprefix('torch.')}"
    if getattr(model_config, "quantization", None):
        computed += f",quant={model_config.quantization}"
    overrides = getattr(model_config, "hf_overrides", None)
    if overrides:
        computed += ",overrides=" + hashlib.sha256(repr(overrides).encode()).hexdigest()[:12]
    parallel = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype == "auto":
        cache_dtype = str(model_config.dtype).removeprefix("torch.")
    device = vllm_config.device_config.device_type
    groups = []
    for idx, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, specs.uniform):
            layer_specs = list(spec.kv_cache_specs.values())
            spec = layer_specs[0]
            if not all(type(s) is type(spec) and s == spec for s in layer_specs):
                raise ValueError(f"KV-cache group {idx} mixes layer specs; kvdepot needs uniform groups")
        window_blocks = window_tokens = None
        if isinstance(spec, specs.mla):
            kind = "mla"
        elif isinstance(spec, specs.sliding_window):
            kind = "sliding_window"
            # As vLLM counts a sliding-window hit: the blocks the next token attends to.
            window_blocks = -(-(spec.sliding_window - 1) // spec.block_size)
            window_tokens = spec.sliding_window
        elif isinstance(spec, specs.full):
            kind = "full"
        else:
            raise ValueError(
                f"KV-cache group {idx} is {type(spec).__name__}; kvdepot offloads full attention, "
                "sliding-window attention and MLA only"
            )
        shape = f"heads={spec.num_kv_heads},head_size={spec.head_size}"
        if kind == "sliding_window":
            shape += f",window={spec.sliding_window}"
        namespace = pb.NamespaceSpec(
            model=identity.label,
            revision=identity.revision,
            kv_dtype=cache_dtype,
            block_size=spec.block_size,
            layout=f"vllm/{device}/{kind}",
            # Every rank of the engine holds a shard (TP) or a stage (PP): a
            # block is ready once all of them stored theirs.
            tp_size=parallel.world_size,
            kv_group=idx,
            extra=(
                f"{shape},layers={len(group.layer_names)},tp={parallel.tensor_parallel_size},"
                f"pp={parallel.pipeline_parallel_size}{computed}"
            ),
        )
        groups.append(
            GroupInfo(idx, kind, spec.block_size, window_tokens, window_blocks, tuple(group.layer_names), namespace)
        )
    if not groups:
        raise ValueError("the model has no KV-cache group kvdepot can offload")
    sizes = {g.block_size for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"KV-cache groups have different block sizes {sorted(sizes)}; kvdepot needs one")
    return groups
