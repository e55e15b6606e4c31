"""KVDepotStorage: SGLang's HiCache storage backend (L3) on the node's kvdepotd.

SGLang loads it with `--hicache-storage-backend dynamic` and
`--hicache-storage-backend-extra-config` naming this module and class
(README, "SGLang"). One instance per TP rank: it registers the rank's host
pool as a kvdepot worker (the shared-memory transport: the client copies
pages between the pool and a staging memfd, the daemon between that and its
pool) and an engine of the same namespace for lookups.

SGLang's threads call it synchronously (prefetch, backup), so every call here
answers, and soon: a failure, a dead daemon or a timeout is a miss (False, 0,
None where the interface says None means "not found"), never an exception or a
result of the wrong type for SGLang to handle.

Settings, in the extra config beside backend_name/module_path/class_name:
`socket` (the daemon's, default kvdepot's default), `model_id` (names the
weights instead of the model path's fingerprint), `connect_timeout` (seconds
the first attach may take before the backend starts answering misses; default
5) and `job_timeout` (seconds a batch may take before it is a miss; default 5:
SGLang's prefetch thread waits on it, and its own prefetch timeout is about 1 s).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvdepot.client import KVDepotClient
from kvdepot.errors import InvalidArgument, KVDepotError
from kvdepot.model_identity import model_identity
from kvdepot.sglang_backend.host_pages import HostPages, host_pages, page_ids

# The longest batch_exists waits for pages the daemon brings up from its disk
# or its remote store (SGLang's prefetch then loads what is ready).
BELOW_DRAM_WAIT_S = 1.0

log = logging.getLogger("kvdepot.sglang")

SETTING = "hicache-storage-backend-extra-config's model_id"
# SGLang's page keys: the hex SHA-256 chain of sglang.srt.mem_cache.utils.
_HEX_KEY_CHARS = 64


def page_key(key: str) -> bytes:
    """The block key of an SGLang page key: its 32 bytes where it is SGLang's hex SHA-256,
    else a SHA-256 of the string (keys of other shapes, e.g. another pool's suffixed keys)."""
    if len(key) == _HEX_KEY_CHARS:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(b"kvdepot-sglang-key\0" + key.encode("utf-8", "surrogatepass")).digest()


class KVDepotStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        self.job_timeout = float(extra.get("job_timeout", 5.0))
        self.mla = bool(storage_config.is_mla_model)
        if storage_config.dcp_size > 1:
            raise InvalidArgument("kvdepot does not serve SGLang's decode context parallelism (dcp_size > 1) yet")
        self._model = engine_model(storage_config.model_name, extra.get("model_id") or None)
        self._identity = model_identity(
            self._model.path, self._model.revision, self._model.load_format, extra.get("model_id") or None, SETTING
        )
        self.client = KVDepotClient(extra.get("socket") or None, name=f"sglang-tp{storage_config.tp_rank}")
        self._pages: HostPages | None = None
        self._scratch_worker = None
        self.worker = None
        self.engine = None
        self._job_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stats = _Stats()
        self._warned: set[str] = set()
        try:
            self.client.connect(timeout=float(extra.get("connect_timeout", 5.0)))
        except KVDepotError as e:
            # The session keeps trying in the background; until then every page is a miss.
            log.warning("kvdepot: %s; SGLang's L3 pages are misses until kvdepotd answers", e)

    # ------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = host_pages(mem_pool_host, self.mla)
        config = self.config
        stored = str(pages.tensor.dtype).removeprefix("torch.")
        page_shape = [n for d, n in enumerate(pages.tensor.shape) if d != pages.block_dim]
        namespace = {
            "model": self._identity.label,
            "revision": self._identity.revision,
            # SGLang keeps every fp8 format as uint8: the engine's KV dtype tells them apart.
            "kv_dtype": self._model.kv_cache_dtype or stored,
            "block_size": pages.page_size,
            "layout": pages.namespace_layout,
            # MLA's KV is the same on every TP rank: one shard, written by one rank.
            "tp_size": 1 if self.mla else config.tp_size,
            # The page's shape (layers, with any draft layers packed in; heads; head size):
            # another shape is another model's pages, not a layout conflict.
            "extra": (
                f"sglang-page-keys;pp={config.pp_rank}/{config.pp_size};"
                f"cp={config.attn_cp_rank}/{config.attn_cp_size};"
                f"stored={stored};page={'x'.join(map(str, page_shape))}"
            ),
        }
        rank = 0 if self.mla else config.tp_rank
        self.worker = self.client.register_worker(
            namespace, rank=rank, tensors=[pages.tensor], block_dim=pages.block_dim
        )
        self.engine = self.client.register_engine(namespace)
        # One page of the pool's shape, a worker of the same namespace, through
        # which the generic path's flat pages travel (get/set).
        shape = list(pages.tensor.shape)
        shape[pages.block_dim] = 1
        scratch = torch.zeros(shape, dtype=pages.tensor.dtype)
        self._scratch_worker = self.client.register_worker(
            namespace, rank=rank, tensors=[scratch], block_dim=pages.block_dim
        )
        self._scratch_page = scratch.select(pages.block_dim, 0)
        self._scratch_lock = threading.Lock()
        self._pages = pages
        log.info(
            "kvdepot: SGLang host pool of %d pages of %d tokens (%s) registered as rank %d of %s",
            pages.num_pages, pages.page_size, pages.namespace_layout, rank, identity_text(self._identity),
        )

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(host_pool_name) != PoolName.KV.value:
            self._warn_once(
                f"pool:{host_pool_name}",
                "kvdepot: SGLang's %r host pool is not served by kvdepot (only the KV pool is); "
                "prefixes that need it are misses",
                str(host_pool_name),
            )

    # ------------------------------------------------------------ lookups

    def _ready(self, keys: list[str]) -> int:
        return self._ready_blocks([page_key(k) for k in keys])

    def _ready_blocks(self, block_keys: list[bytes]) -> int:
        if self.engine is None or not block_keys:
            return 0
        engine = self.engine
        ready = self.client.cached_lookup(engine, block_keys).ready_blocks
        if ready < len(block_keys) and (engine.remote or block_keys[ready] in engine.lower):
            # Below DRAM (the daemon's disk, or its remote store, which the copy
            # does not list): SGLang asks from its prefetch thread, not its
            # scheduler, so this waits, briefly, for the daemon to bring them up.
            return self._brought_up(block_keys, ready)
        return ready

    def _brought_up(self, block_keys: list[bytes], ready: int) -> int:
        deadline = time.monotonic() + min(self.job_timeout, BELOW_DRAM_WAIT_S)
        while True:
            answer = self.client.lookup(self.engine, block_keys)  # the daemon asks its tiers
            if not answer.available:
                return ready
            if not answer.not_yet or time.monotonic() >= deadline:
                return answer.ready_blocks
            time.sleep(0.005)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            return self._ready(keys)
        except Exception:
            log.exception("kvdepot: batch_exists failed; answering a miss")
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        others = [t.name for t in pool_transfers or [] if str(t.name) != PoolName.KV.value]
        if others:
            # The prefix needs pages of pools kvdepot does not hold: none of it is restorable.
            self._warn_once(f"exists:{others}", "kvdepot: prefixes that need SGLang pools %s are misses", others)
            return PoolTransferResult(0, {})
        hit = self.batch_exists(keys, extra_info)
        return PoolTransferResult(hit, {PoolName.KV: hit} if hit else {}, list(range(1, hit + 1)))

    # ------------------------------------------------------------ zero-copy v1: pages of the host pool

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        try:
            return self._move("load", keys, host_indices)
        except Exception:
            log.exception("kvdepot: batch_get_v1 failed; answering misses")
            return [False] * len(keys)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        try:
            return self._move("store", keys, host_indices)
        except Exception:
            log.exception("kvdepot: batch_set_v1 failed; the pages are not stored")
            return [False] * len(keys)

    def _move(self, kind: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        pages = self._pages
        if pages is None or self.worker is None or not keys:
            return [False] * len(keys)
        ids = page_ids(host_indices, len(keys), pages.page_size, pages.num_pages)
        if ids is None:
            self._warn_once("indices", "kvdepot: host indices that are not whole pages of the host pool; refused")
            return [False] * len(keys)
        block_keys = [page_key(k) for k in keys]
        count = len(keys)
        if kind == "load":
            count = self._ready_blocks(block_keys)  # a load of a missing page would fail the whole batch
            if count == 0:
                return [False] * len(keys)
        ok = self._run(kind, self.worker, block_keys[:count], ids[:count])
        return [ok] * count + [False] * (len(keys) - count)

    def _run(self, kind: str, worker, block_keys: list, block_ids: list) -> bool:
        """One job, waited for: SGLang's storage threads call synchronously."""
        with self._lock:
            job = next(self._job_ids)
        started = time.perf_counter()
        submit = self.client.submit_store if kind == "store" else self.client.submit_load
        submit(worker, job, block_keys, block_ids)
        try:
            result = self.client.wait([job], self.job_timeout)[job]
        except TimeoutError:
            self.client.cancel(job, f"no answer in {self.job_timeout} s")
            result = self.client.wait([job], 5)[job]
        if not result.ok:
            self._warn_once(f"{kind}:{result.error}", "kvdepot: a %s of SGLang pages failed: %s", kind, result.error)
            return False
        if result.not_stored:
            # Every slot was pinned by jobs in flight: these pages are not backed up.
            self._warn_once("not_stored", "kvdepot: the daemon's pool was full of pages in flight; "
                            "a batch of SGLang pages was not stored")
            return False
        self._stats.add(kind, len(block_ids), len(block_ids) * worker.layout.block_bytes,
                        time.perf_counter() - started)
        return True

    # ------------------------------------------------------------ one page at a time (SGLang's generic path)

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None):
        """The page into `target_location` (a flat page, as SGLang's generic path passes), or None if absent."""
        try:
            return self._get_flat(key, target_location)
        except Exception:
            log.exception("kvdepot: get failed; answering a miss")
            return None

    def batch_get(self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None):
        try:
            targets = [None] * len(keys) if target_locations is None else list(target_locations)
            return [self.get(k, t) for k, t in zip(keys, targets)] + [None] * (len(keys) - len(targets))
        except Exception:
            log.exception("kvdepot: batch_get failed; answering misses")
            return [None] * len(keys)

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        try:
            return self._set_flat(key, value)
        except Exception:
            log.exception("kvdepot: set failed; the page is not stored")
            return False

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        try:
            values = [None] * len(keys) if values is None else list(values)
            return len(values) == len(keys) and all([self.set(k, v) for k, v in zip(keys, values)])
        except Exception:
            log.exception("kvdepot: batch_set failed; the pages are not stored")
            return False

    def _get_flat(self, key: str, target):
        if self._pages is None or target is None or self._ready([key]) != 1:
            return None
        page = self._scratch_page
        if target.numel() * target.element_size() != page.numel() * page.element_size():
            self._warn_once("flat-size", "kvdepot: a flat page of %d bytes is not one page of %d; refused",
                            target.numel() * target.element_size(), page.numel() * page.element_size())
            return None
        with self._scratch_lock:
            if not self._run("load", self._scratch_worker, [page_key(key)], [0]):
                return None
            target.view(page.dtype).view(page.shape).copy_(page)
        return target

    def _set_flat(self, key: str, value) -> bool:
        if self._pages is None or value is None:
            return False
        page = self._scratch_page
        if value.numel() * value.element_size() != page.numel() * page.element_size():
            return False
        with self._scratch_lock:
            page.copy_(value.contiguous().view(page.dtype).view(page.shape))
            return self._run("store", self._scratch_worker, [page_key(key)], [0])

    # ------------------------------------------------------------ v2 (hybrid models' pools)

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None):
        return {t.name: self._v2(t, "load") for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None):
        return {t.name: self._v2(t, "store") for t in transfers}

    def _v2(self, transfer: PoolTransfer, kind: str) -> list[bool]:
        keys = transfer.keys or []
        if str(transfer.name) != PoolName.KV.value:
            self._warn_once(f"v2:{transfer.name}", "kvdepot: SGLang's %r pool is not served by kvdepot",
                            str(transfer.name))
            return [False] * len(keys)
        if kind == "load":
            return self.batch_get_v1(keys, transfer.host_indices)
        return self.batch_set_v1(keys, transfer.host_indices)

    # ------------------------------------------------------------ operators

    def clear(self) -> bool:
        """Clears this namespace's pages (the tenant's own: the daemon clears nothing of another's)."""
        try:
            if self.engine is None or not self.engine.namespace_name:
                return False
            self.client.clear(self.engine.namespace_name)
            return True
        except Exception:
            log.exception("kvdepot: clear failed")
            return False

    def get_stats(self):
        """SGLang's StorageMetrics of the pages moved since the last call (None where SGLang's
        metrics module cannot be imported, which SGLang reads as no metrics)."""
        return self._stats.take()

    def close(self) -> None:
        self.client.close(timeout=self.job_timeout)

    def _warn_once(self, cause: str, message: str, *args) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            log.warning(message, *args)


@dataclass(frozen=True)
class EngineModel:
    path: str
    revision: str | None
    load_format: str
    # The engine's KV-cache dtype as SGLang names it ("fp8_e4m3", ...); None: the pool's.
    kv_cache_dtype: str | None


def engine_model(served_name: str | None, model_id: str | None) -> EngineModel:
    """The weights the engine runs, from SGLang's published model settings: the
    storage config's model_name is the *served* name (`--served-model-name`),
    which two different models may share."""
    try:
        from sglang.srt.runtime_context import get_model

        model = get_model()
        dtype = str(model.kv_cache_dtype)
        return EngineModel(str(model.model_path), model.revision or None, str(model.load_format or "auto"),
                           None if dtype in ("", "auto", "None") else dtype)
    except Exception:
        if not model_id:
            log.warning(
                "kvdepot: SGLang's model settings are not published in this process; the namespace names the "
                "model by its served name %r: set %s to name the weights", served_name, SETTING,
            )
        return EngineModel(served_name or "unnamed", None, "auto", None)


def identity_text(identity) -> str:
    return f"{identity.label}@{identity.revision}" if identity.revision else identity.label


class _Stats:
    """Pages and bandwidth of each batch, drained by get_stats as SGLang's other backends do."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: dict[str, list] = {"load": [], "store": []}

    def add(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            batches = self._batches[kind]
            if len(batches) < 4096:
                batches.append((pages, nbytes / max(seconds, 1e-9) / 1e9))

    def take(self):
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:
            return None
        with self._lock:
            loads, stores = self._batches["load"], self._batches["store"]
            self._batches = {"load": [], "store": []}
        return StorageMetrics(
            prefetch_pgs=[p for p, _ in loads], backup_pgs=[p for p, _ in stores],
            prefetch_bandwidth=[b for _, b in loads], backup_bandwidth=[b for _, b in stores],
        )
