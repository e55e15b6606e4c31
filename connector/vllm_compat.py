"""Everything the connector uses from vLLM beyond the connector interface's own arguments.

Supported: vLLM 0.32 and 0.33 (both tested). Rules:
- The vLLM version is checked when the connector is constructed
  (`check_version`): another version gets a warning naming the supported ones,
  and runs if what follows is there.
- What the connector needs is resolved once, at start-up (import of the
  connector module or construction of a side), and a missing piece raises
  `VllmCompatError` naming it, then and not in the middle of a step. What
  has a correct public fallback (the manager's block lists, a request's own
  token list) is not required.
- Accessors are bound once and are plain attribute reads or functions called
  at most once per request or per step; nothing here runs per block.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvdepot.connector")

SUPPORTED_VERSIONS = ((0, 32), (0, 33))
SUPPORTED_TEXT = "vLLM 0.32 and 0.33"


class VllmCompatError(RuntimeError):
    """This vLLM lacks something the connector needs; the message names it."""


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _missing(name: str, why: str) -> VllmCompatError:
    return VllmCompatError(
        f"kvdepot's connector needs {name} ({why}), which vLLM {_vllm_version()} does not have; "
        f"the connector supports {SUPPORTED_TEXT}"
    )


def need(module: str, name: str, why: str) -> Any:
    """`module.name`, or VllmCompatError saying what it is needed for."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise _missing(f"{module}.{name}", why) from e


def check_version(version: str | None = None) -> bool:
    """True for a supported vLLM version; for another one, logs a warning naming the supported ones."""
    version = _vllm_version() if version is None else version
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and (int(match.group(1)), int(match.group(2))) in SUPPORTED_VERSIONS:
        return True
    log.warning(
        "kvdepot: the connector supports %s; this is vLLM %s. It starts if the vLLM internals it uses "
        "are there, but it was not tested with this version",
        SUPPORTED_TEXT,
        version,
    )
    return False


# ------------------------------------------------------------ logging


def use_vllm_logging() -> None:
    """kvdepot's log lines in a vLLM process go out like vLLM's own: its handler
    (format, process name and pid, stream) and its level (VLLM_LOGGING_LEVEL).

    Left alone where the application configured logging itself (handlers on
    the root or the `kvdepot` logger: records reach those already) or vLLM
    configures none (VLLM_CONFIGURE_LOGGING=0). Without it, Python prints
    kvdepot's warnings as bare lines and drops its INFO lines. Called when a
    connector is made, after vLLM has configured its logging.
    """
    ours, theirs = logging.getLogger("kvdepot"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)


# ------------------------------------------------------------ connector interface

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
KVConnectorBase_V1 = need(_BASE, "KVConnectorBase_V1", "the connector's base class")
KVConnectorMetadata = need(_BASE, "KVConnectorMetadata", "what the scheduler side sends the workers")
KVConnectorWorkerMetadata = need(_BASE, "KVConnectorWorkerMetadata", "what the workers report back")
KVConnectorRole = need(_BASE, "KVConnectorRole", "which side a connector instance is")
KVConnectorTransferResults = need(_BASE, "KVConnectorTransferResults", "finished and failed transfers")
SupportsHMA = need(_BASE, "SupportsHMA", "hybrid models, one namespace per KV-cache group")
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
KVConnectorStats = need(_METRICS, "KVConnectorStats", "the connector's counters in vLLM's stats")
KVConnectorPromMetrics = need(_METRICS, "KVConnectorPromMetrics", "the connector's counters in vLLM's /metrics")


# ------------------------------------------------------------ requests


def request_token_ids(request) -> list[int]:
    """The request's own token list, which vLLM extends in place as it generates.

    Its public `all_token_ids` wraps the same list in a ConstantList whose
    slicing is a Python call; hashing slices it every block. Read once per request.
    """
    tokens = getattr(request, "_all_token_ids", None)
    return tokens if tokens is not None else request.all_token_ids


def request_has_extra_keys(request) -> bool:
    """Whether vLLM's block hashes of this request have extra keys past the first block.

    Those come from a LoRA adapter, multimodal inputs and prompt embeddings
    (`generate_block_hash_extra_keys`); a cache salt is in the first block's only.
    """
    return bool(
        request.lora_request
        or getattr(request, "mm_features", None)
        or getattr(request, "prompt_embeds", None) is not None
    )


def block_hash_extra_keys() -> Callable:
    """vLLM's `generate_block_hash_extra_keys(request, start, end, mm_index) -> (keys or None, mm_index)`."""
    return need(
        "vllm.v1.core.kv_cache_utils",
        "generate_block_hash_extra_keys",
        "a block's LoRA, multimodal, cache-salt and prompt-embedding keys",
    )


# ------------------------------------------------------------ KV-cache groups


@dataclass(frozen=True)
class SpecTypes:
    """vLLM's KV-cache spec classes that tell a group's kind."""

    full: type
    mla: type
    sliding_window: type
    uniform: type  # a group whose layers have specs of one type, kept per layer


def kv_cache_spec_types() -> SpecTypes:
    module, why = "vllm.v1.kv_cache_interface", "the kind of each KV-cache group"
    return SpecTypes(
        full=need(module, "FullAttentionSpec", why),
        mla=need(module, "MLAAttentionSpec", why),
        sliding_window=need(module, "SlidingWindowSpec", why),
        uniform=need(module, "UniformTypeKVCacheSpecs", why),
    )


# ------------------------------------------------------------ scheduler state


def manager_block_lists(kv_cache_manager, group_indices: list[int]) -> list[dict] | None:
    """Per group: the KV-cache manager's own `req_id -> [KVCacheBlock]` (each with `.block_id`), or None.

    `kv_cache_manager.coordinator.single_type_managers[g].req_to_blocks` in
    vLLM 0.32 and 0.33: exact, with vLLM's null block (id 0) where a sliding
    window freed one, and reading a few entries costs less than copying every
    id of a request (`get_block_ids`). They are defaultdicts: read with `.get`.
    """
    managers = getattr(getattr(kv_cache_manager, "coordinator", None), "single_type_managers", None)
    if managers is None or not all(hasattr(m, "req_to_blocks") for m in managers):
        log.info("kvdepot: vLLM's KV-cache manager has no per-group block lists; using get_block_ids")
        return None
    return [managers[g].req_to_blocks for g in group_indices]


def check_scheduler_output() -> None:
    """The scheduler's fields the connector reads beyond the obvious ones are there.

    `scheduled_cached_reqs.resumed_req_ids`: a resumed request's new block ids
    replace its old ones instead of extending them; read as an attribute then.
    """
    why = "which requests resumed after a preemption"
    cached = need("vllm.v1.core.sched.output", "CachedRequestData", why)
    if "resumed_req_ids" not in {f.name for f in dataclasses.fields(cached)}:
        raise _missing("CachedRequestData.resumed_req_ids", why)
    # Without it the workers' reports never reach the scheduler side: no job
    # would ever finish, and finished requests would keep their blocks.
    why = "the workers' reports of finished jobs"
    output = need("vllm.v1.outputs", "KVConnectorOutput", why)
    if "kv_connector_worker_meta" not in {f.name for f in dataclasses.fields(output)}:
        raise _missing("KVConnectorOutput.kv_connector_worker_meta", why)


# ------------------------------------------------------------ KV events


@dataclass(frozen=True)
class KVEventTypes:
    block_stored: type
    block_removed: type
    medium_cpu: str
    # vLLM's block hash as its own events publish it (bytes or int, by its settings).
    external_hash: Callable


def kv_event_types() -> KVEventTypes:
    why = "KV events (kv_events_config)"
    return KVEventTypes(
        block_stored=need("vllm.distributed.kv_events", "BlockStored", why),
        block_removed=need("vllm.distributed.kv_events", "BlockRemoved", why),
        medium_cpu=need("vllm.distributed.kv_events", "MEDIUM_CPU", why),
        external_hash=need("vllm.v1.core.kv_cache_utils", "maybe_convert_block_hash", why),
    )


# ------------------------------------------------------------ workers


def world_rank(vllm_config) -> int:
    """This worker's rank among all of the engine's workers (TP x PP)."""
    get_world_group = need("vllm.distributed.parallel_state", "get_world_group", "the worker's rank")
    try:
        group = get_world_group()
    except AssertionError:  # vLLM's "world group is not initialized"
        group = None
    # Without distributed state there is one worker, in the engine's process.
    return vllm_config.parallel_config.rank if group is None else group.rank_in_group
