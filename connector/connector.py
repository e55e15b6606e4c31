"""KVDepotConnector: vLLM's v1 KV-connector interface, backed by the node's kvdepotd.

vLLM creates one instance in the scheduler process (role SCHEDULER) and one in
each worker (role WORKER); each delegates to its side. Load it out of tree:

    --kv-transfer-config '{"kv_connector": "KVDepotConnector",
                           "kv_connector_module_path": "kvdepot.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvdepot/kvdepot.sock"}}'
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvdepot.connector import vllm_compat
from kvdepot.connector.config import ConnectorConfig
from kvdepot.connector.engine_keys import offloaded_groups
from kvdepot.connector.metadata import KVDepotMetadata, KVDepotWorkerMetadata
from kvdepot.connector.metrics import KVDepotConnectorStats, KVDepotPromMetrics
from kvdepot.connector.vllm_compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

log = logging.getLogger("kvdepot.connector")


# SupportsHMA: full-attention plus sliding-window models are stored per group
# (offloaded_groups refuses Mamba and other group kinds at start-up).
class KVDepotConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        vllm_compat.use_vllm_logging()
        vllm_compat.check_version()
        transfer = vllm_config.kv_transfer_config
        config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        groups = offloaded_groups(vllm_config, kv_cache_config, config.model_id)
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvdepot.connector.scheduler import SchedulerSide

            # A cache can always be recomputed: a block that fails to load
            # (evicted meanwhile, daemon gone) must not fail the request, which
            # is what vLLM's default "fail" policy, made for P/D hand-offs, does.
            # The Scheduler reads the policy after creating its connector.
            if transfer.kv_load_failure_policy != "recompute":
                log.info("kvdepot: kv_load_failure_policy %r -> 'recompute'", transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"

            self._scheduler = SchedulerSide(config, vllm_config, groups)
        else:
            from kvdepot.connector.worker import WorkerSide

            self._worker = WorkerSide(config, vllm_config, kv_cache_config, groups)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        # vLLM 0.33 asks this when enable_sleep_mode is set (the base class says
        # True). The daemon holds this worker's KV-cache registration (CUDA IPC
        # handles, or the CPU tensors' addresses), which sleep frees and wake-up
        # remaps, and there is no unregister_kv_caches/restore_kv_caches here:
        # refuse at config time rather than copy into stale memory. 0.32 never
        # calls it.
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a dropped store is a later miss, not lost data.
        return False

    # ------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        # Store planning reads a request's block ids from its per-group lists.
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    def take_events(self) -> Iterable:
        return self._scheduler.take_events()

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    # ------------------------------------------------------------ metrics (connector/metrics.py)

    def get_kv_connector_stats(self) -> KVDepotConnectorStats | None:
        # The scheduler side counts everything: a worker would count each job once per rank.
        return self._scheduler.stats.take() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVDepotConnectorStats:
        return KVDepotConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVDepotPromMetrics:
        return KVDepotPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker.handle_preemptions(_checked(kv_connector_metadata))

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start_load_kv(_checked(self._get_connector_metadata()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are whole-request and asynchronous: vLLM schedules a request
        # only after get_transfer_results (or get_finished) reported its load.
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        # Stores are whole blocks, submitted once per step (wait_for_save).
        return

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(_checked(self._get_connector_metadata()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # No failed set here: failed loads come out of get_block_ids_with_load_errors.
        sending, recving, _ = self._worker.transfer_results(failed_as_block_ids=True)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.transfer_results(failed_as_block_ids=False)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVDepotWorkerMetadata | None:
        return self._worker.build_connector_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        for side in (self._worker, self._scheduler):
            if side is not None:
                side.shutdown()


def _checked(meta) -> KVDepotMetadata:
    if not isinstance(meta, KVDepotMetadata):
        raise TypeError(f"KVDepotConnector got {type(meta).__name__} metadata; is another connector configured?")
    return meta
