"""The connector's own counters, reported through vLLM's KV-connector stats so
that they appear in vLLM's /metrics (and its periodic "KV Transfer metrics" log line).

vLLM asks the scheduler side for stats after every step
(`get_kv_connector_stats`), ships them to its front-end as a plain dict, and
there rebuilds them (`build_kv_connector_stats`) for its log and hands them to
the Prometheus metrics the connector registered (`build_prom_metrics`). Every
number here is counted on the scheduler side, which sees each lookup and each
job once whatever the TP size (the workers would count a job once per rank).
Each report holds what was counted since the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.connector.vllm_compat import KVConnectorPromMetrics, KVConnectorStats

# The scheduler side's counter -> (vLLM metric name, help). vLLM's metrics
# share the `vllm:` prefix (and its registry clean-up relies on it).
COUNTERS = {
    "lookups": ("vllm:kvdepot_lookups", "Requests kvdepot looked up, counted when vLLM scheduled them."),
    "hit_blocks": (
        "vllm:kvdepot_lookup_hit_blocks",
        "Blocks past the GPU prefix-cache hit that kvdepot had (vLLM loads them instead of computing).",
    ),
    "miss_blocks": ("vllm:kvdepot_lookup_miss_blocks", "Blocks past the GPU prefix-cache hit that kvdepot lacked."),
    "deferred": (
        "vllm:kvdepot_deferrals",
        "Times a request waited a step for blocks being stored, or loaded by this engine (at most max_defer_s).",
    ),
    "loads": ("vllm:kvdepot_load_jobs", "Load jobs started (one per request that hit)."),
    "stores": ("vllm:kvdepot_store_jobs", "Store jobs started (one per step that completed blocks)."),
    "flushed": ("vllm:kvdepot_flushed_store_jobs", "Store jobs waited for before vLLM reused their blocks."),
    "load_failures": ("vllm:kvdepot_load_failures", "Load jobs that failed; vLLM recomputed their blocks."),
    "store_failures": ("vllm:kvdepot_store_failures", "Store jobs that failed; their blocks are later misses."),
}


@dataclass
class KVDepotConnectorStats(KVConnectorStats):
    """`data`: counter name -> what it counted in the interval (see COUNTERS)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, count in other.data.items():
            self.data[name] = self.data.get(name, 0) + count
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsReport:
    """What the scheduler side's counters (cumulative, counted in place) gained since the last report."""

    def __init__(self, counters: dict[str, int]):
        self._counters = counters
        self._reported = dict.fromkeys(COUNTERS, 0)

    def take(self) -> KVDepotConnectorStats | None:
        counters = self._counters
        gained = {name: counters[name] - self._reported[name] for name in COUNTERS}
        if not any(gained.values()):
            return None
        for name in COUNTERS:
            self._reported[name] = counters[name]
        return KVDepotConnectorStats(data={name: n for name, n in gained.items() if n})


class KVDepotPromMetrics(KVConnectorPromMetrics):
    """One counter per entry of COUNTERS, labelled per engine as vLLM's own metrics are."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._bound = {}
        for name, (metric, help) in COUNTERS.items():
            counter = self._counter_cls(name=metric, documentation=help, labelnames=labelnames)
            for engine, values in per_engine_labelvalues.items():
                self._bound[engine, name] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        for name, count in transfer_stats_data.items():
            bound = self._bound.get((engine_idx, name))
            if bound is not None and count > 0:
                bound.inc(count)
