"""One SGLang "instance" for the SGLang tests: run by the SGLang environment's
Python (.venv-sglang), it makes kvdepot's backend the way SGLang does
(StorageBackendFactory.create_backend("dynamic", ...) with the README's extra
config), hands it a host pool, and stores or loads one prompt's pages through
SGLang's HiCacheStorage calls. It prints one JSON line of what it saw.

The host pool: SGLang's own MHA/MLA host pool classes import its GPU stack
(sgl_kernel, tvm_ffi, torchvision's ops), which does not run here, so HostPool
below allocates kv_buffer with the dimensions SGLang's init_kv_buffer gives each
layout and answers the calls the storage path makes (get_data_page,
get_dummy_flat_data_page, set_from_flat_data_page), as SGLang's do.

usage: sglang_instance.py SOCKET EXTRA_CONFIG_JSON {store,load,store_generic,load_generic,exists,clear}
                          LAYOUT MLA(0/1) PROMPT PAGES [TP_RANK TP_SIZE]
"""

from __future__ import annotations

import json
import os
import sys

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE_SIZE, LAYERS, HEADS, HEAD_DIM, MLA_DIM = 4, 3, 2, 8, 24
HOST_PAGES = 32


class HostPool:
    def __init__(self, layout: str, mla: bool):
        self.layout, self.page_size, self.dtype, self.mla = layout, PAGE_SIZE, torch.bfloat16, mla
        self.size, self.page_num, self.layer_num = HOST_PAGES * PAGE_SIZE, HOST_PAGES, LAYERS
        ps, n, L = PAGE_SIZE, self.size, LAYERS
        tail = (1, MLA_DIM) if mla else (HEADS, HEAD_DIM)
        dims = {
            (False, "layer_first"): (2, L, n, *tail),
            (False, "page_first"): (2, n, L, *tail),
            (False, "page_first_direct"): (2, self.page_num, L, ps, *tail),
            (False, "page_head"): (2, self.page_num, HEADS, ps, L, HEAD_DIM),
            (True, "layer_first"): (L, n, *tail),
            (True, "page_first"): (n, L, *tail),
            (True, "page_first_direct"): (self.page_num, L, ps, *tail),
        }[(mla, layout)]
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)

    def _page(self, index: int) -> torch.Tensor:
        """SGLang's get_data_page(index, flat=False) for this layout."""
        k = slice(index, index + self.page_size)
        one = slice(index // self.page_size, index // self.page_size + 1)
        if self.mla:
            return {"layer_first": lambda: self.kv_buffer[:, k], "page_first": lambda: self.kv_buffer[k],
                    "page_first_direct": lambda: self.kv_buffer[one]}[self.layout]()
        return {"layer_first": lambda: self.kv_buffer[:, :, k], "page_first": lambda: self.kv_buffer[:, k],
                "page_first_direct": lambda: self.kv_buffer[:, one],
                "page_head": lambda: self.kv_buffer[:, one]}[self.layout]()

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self._page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))


def page_bytes(prompt: int, page: int, like: torch.Tensor) -> torch.Tensor:
    """What page `page` of prompt `prompt` holds: the same in every instance."""
    g = torch.Generator().manual_seed(prompt * 1000 + page)
    return torch.randn(like.shape, generator=g).to(like.dtype)


def publish_model(settings: dict) -> None:
    """SGLang's model settings as a launched server publishes them (runtime_context.get_model());
    building its real ServerArgs here would need transformers and its model configs."""
    import types

    from sglang.srt import runtime_context

    bag = types.SimpleNamespace(**{"revision": None, "load_format": "auto", "kv_cache_dtype": "auto", **settings})
    runtime_context.get_model = lambda: bag


def main() -> None:
    if os.environ.get("KVDEPOT_TEST_SGLANG_MODEL"):
        publish_model(json.loads(os.environ["KVDEPOT_TEST_SGLANG_MODEL"]))
    socket, extra_json, mode, layout, mla, prompt, pages = sys.argv[1:8]
    tp_rank, tp_size = (int(sys.argv[8]), int(sys.argv[9])) if len(sys.argv) > 9 else (0, 1)
    mla, prompt, pages = mla == "1", int(prompt), int(pages)
    extra = {**json.loads(extra_json), "socket": socket, "connect_timeout": 5, "job_timeout": 20}
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=layout.startswith("page_first"),
        model_name="test-org/tiny-model", extra_config=extra,
    )
    pool = HostPool(layout, mla)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    tokens = [prompt * 100_000 + i for i in range(pages * PAGE_SIZE)]
    keys = get_storage_hash_str(tokens, None, page_size=PAGE_SIZE)
    out: dict = {"backend": type(backend).__name__}
    # Pages go to host pool pages other than their index, as SGLang's allocator may place them.
    host_pages = [(HOST_PAGES - 1 - i) if mode.startswith("load") else i for i in range(pages)]
    host_indices = torch.tensor([p * PAGE_SIZE + t for p in host_pages for t in range(PAGE_SIZE)], dtype=torch.int64)
    if mode in ("store", "store_generic"):
        for i, p in enumerate(host_pages):
            page = pool.get_data_page(p * PAGE_SIZE, flat=False)
            page.copy_(page_bytes(prompt, i, page))
        if mode == "store":
            out["set"] = backend.batch_set_v1(keys, host_indices)
        else:
            out["set"] = [backend.set(k, pool.get_data_page(p * PAGE_SIZE)) for k, p in zip(keys, host_pages)]
    elif mode in ("load", "load_generic", "exists"):
        out["exists"] = backend.batch_exists(keys)
        if mode == "load":
            out["got"] = backend.batch_get_v1(keys, host_indices)
        elif mode == "load_generic":
            got = []
            for k, p in zip(keys, host_pages):
                flat = backend.get(k, pool.get_dummy_flat_data_page())
                got.append(flat is not None)
                if flat is not None:
                    pool.set_from_flat_data_page(p * PAGE_SIZE, flat)
            out["got"] = got
        out["equal"] = [
            bool(torch.equal(pool.get_data_page(p * PAGE_SIZE, flat=False),
                             page_bytes(prompt, i, pool.get_data_page(p * PAGE_SIZE, flat=False))))
            for i, p in enumerate(host_pages)
        ]
    elif mode == "clear":
        out["cleared"] = backend.clear()
    out["stats"] = backend.get_stats() is None or type(backend.get_stats()).__name__
    backend.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
