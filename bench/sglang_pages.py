"""SGLang's HiCache L3 calls through kvdepotd, against SGLang's own `file` backend and a memcpy.

    .venv-sglang/bin/python bench/sglang_pages.py [--pages 128] [--rounds 5] [--layers 32]
        [--page-tokens 16] [--file-dir DIR]

Run by the SGLang environment's Python (`make test` makes .venv-sglang). Starts a real `kvdepotd`
(unpinned pool on /dev/shm), makes kvdepot's backend as SGLang does (StorageBackendFactory,
"dynamic", the README's extra config) over a host pool in SGLang's page_first layout (a
Llama-3.1-8B rank by default: 32 layers x 8 KV heads x 128, bf16, 16 tokens a page = 2 MiB a page),
and times, per batch of `--pages` pages (SGLang's STORAGE_BATCH_SIZE is 128):

  kvdepot set / get   batch_set_v1 / batch_get_v1 of new keys / of the keys just stored
  file set / get      SGLang's HiCacheFile batch_set / batch_get of the same pages' flat bytes,
                      in --file-dir (default: a temp folder on the machine's disk)
  memcpy              one copy of the same bytes from the host pool into another buffer

Each is the median of --rounds batches; GB/s counts the pages' bytes once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_daemon import Daemon  # noqa: E402


class PageFirstPool:
    """A host pool as SGLang's MHA host pool lays out page_first: [2, tokens, layers, heads, dim]."""

    layout = "page_first"

    def __init__(self, pages: int, page_size: int, layers: int, heads: int, dim: int):
        self.page_size, self.layer_num, self.dtype = page_size, layers, torch.bfloat16
        self.kv_buffer = torch.randn(2, pages * page_size, layers, heads, dim).to(torch.bfloat16)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.get_data_page(0).numel(), dtype=self.dtype)


def timed(fn, ok) -> float:
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    if not ok(result):
        raise SystemExit(f"a batch failed: {str(result)[:200]}")
    return seconds


def all_true(result) -> bool:
    return all(x is True for x in result)


def all_pages(result) -> bool:
    return result is True or (isinstance(result, list) and all(x is not None for x in result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--file-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    ps, n = args.page_tokens, args.pages
    pool = PageFirstPool(n, ps, args.layers, args.heads, args.head_dim)
    page_bytes = pool.get_data_page(0).numel() * 2
    batch_bytes = n * page_bytes
    pool_size = max(1 << 30, 2 * (args.rounds + 1) * batch_bytes)
    folder = Path(tempfile.mkdtemp(prefix="kvdepot-bench-sglang-"))
    daemon = Daemon(folder, f"{pool_size >> 20}MiB", f"{max(page_bytes, 16 << 10) >> 10}KiB", pool_parent="/dev/shm")
    file_dir = tempfile.mkdtemp(prefix="kvdepot-bench-hicache-file-", dir=args.file_dir)
    try:
        extra = {"backend_name": "kvdepot", "module_path": "kvdepot.sglang_backend", "class_name": "KVDepotStorage",
                 "interface_v1": 1, "socket": daemon.socket, "model_id": "bench-llama-3.1-8b-shape"}
        config = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                      enable_storage_metrics=False, is_page_first_layout=True, model_name="bench/llama-3.1-8b-shape")
        backend = StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(**config, extra_config=extra),
                                                       pool)
        backend.register_mem_pool_host(pool)
        files = HiCacheFile(HiCacheStorageConfig(**config, extra_config={"file_storage_path": file_dir}))
        indices = torch.arange(n * ps, dtype=torch.int64)
        flat = [pool.get_data_page(i * ps) for i in range(n)]
        targets = [pool.get_dummy_flat_data_page() for _ in range(n)]
        copy_to = torch.empty_like(pool.kv_buffer)
        names = ("kvdepot set", "kvdepot get", "file set", "file get", "memcpy")
        times: dict[str, list[float]] = {k: [] for k in names}
        for r in range(args.rounds + 1):  # the first round warms up
            tokens = [r * 10_000_000 + i for i in range(n * ps)]
            keys = get_storage_hash_str(tokens, None, page_size=ps)
            got = {"kvdepot set": timed(lambda keys=keys: backend.batch_set_v1(keys, indices), all_true)}
            # As SGLang does, a get follows an exists that found the pages (the daemon's
            # notice that they are stored reaches the instance a moment after the store).
            deadline = time.monotonic() + 10
            while backend.batch_exists(keys) < n and time.monotonic() < deadline:
                time.sleep(0.001)
            got["kvdepot get"] = timed(lambda keys=keys: backend.batch_get_v1(keys, indices), all_true)
            got["file set"] = timed(lambda keys=keys: files.batch_set(keys, flat), all_pages)
            got["file get"] = timed(lambda keys=keys: files.batch_get(keys, targets), all_pages)
            got["memcpy"] = timed(lambda: copy_to.copy_(pool.kv_buffer), lambda _: True)
            if r:
                for k, v in got.items():
                    times[k].append(v)
        backend.close()
    finally:
        daemon.stop()
    memcpy = statistics.median(times["memcpy"])
    print(f"{n} pages of {page_bytes / 2**20:.2f} MiB a batch ({batch_bytes / 2**20:.0f} MiB), median of "
          f"{args.rounds} batches; file backend in {file_dir}")
    print(f"{'':14} {'ms/batch':>9} {'GB/s':>7} {'x memcpy':>9}")
    rows = {}
    for name, values in times.items():
        s = statistics.median(values)
        rows[name] = {"ms": s * 1e3, "gbps": batch_bytes / s / 1e9, "memcpy_ratio": memcpy / s}
        print(f"{name:14} {s * 1e3:9.1f} {batch_bytes / s / 1e9:7.2f} {memcpy / s:9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"pages": n, "page_bytes": page_bytes, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
