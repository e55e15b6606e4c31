"""Block contents that follow from the block's key, so that any process can
check any block it loads, whoever stored it: the fuzz and chaos tests' way of
telling a corrupt byte from a right one."""

from __future__ import annotations

import functools
import hashlib

import torch


@functools.lru_cache(maxsize=4096)
def _content(key: bytes, layer: int, shape) -> torch.Tensor:
    # Cached (and never written): the chaos clients spend their time in jobs, not here.
    seed = int.from_bytes(hashlib.blake2b(key + bytes([layer]), digest_size=8).digest(), "little") >> 1
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, tuple(shape), dtype=torch.int16, generator=generator)


def _pages(tensors: list[torch.Tensor], block_id: int) -> list[torch.Tensor]:
    # The per_layer layout of tests/kvcache.py: [2, blocks, ...], bit patterns as int16.
    return [t.view(torch.int16)[:, block_id] for t in tensors]


def write_blocks(tensors: list[torch.Tensor], block_ids, keys) -> None:
    for block_id, key in zip(block_ids, keys):
        for layer, page in enumerate(_pages(tensors, block_id)):
            page.copy_(_content(key, layer, tuple(page.shape)))


def clear_blocks(tensors: list[torch.Tensor], block_ids) -> None:
    for block_id in block_ids:
        for page in _pages(tensors, block_id):
            page.zero_()


def wrong_blocks(tensors: list[torch.Tensor], block_ids, keys) -> list[int]:
    """Positions whose block does not hold its key's content."""
    return [
        position
        for position, (block_id, key) in enumerate(zip(block_ids, keys))
        if not all(torch.equal(page, _content(key, layer, tuple(page.shape)))
                   for layer, page in enumerate(_pages(tensors, block_id)))
    ]


class KeyedEngine:
    """A well-behaved engine of the per_layer layout: stores blocks whose content
    follows from their keys, loads whatever is ready back into other blocks and
    checks every byte. A refused or failed load is fine (the engine recomputes);
    a load that ends ok with a wrong byte is the one thing that must never happen."""

    STORE_IDS = range(0, 8)
    LOAD_IDS = range(64, 72)

    def __init__(self, client, model: str, seed: int):
        from kvcache import make_kv_cache, namespace

        ns = namespace("per_layer", model=model)
        self.client = client
        self.tensors, block_dim = make_kv_cache("per_layer", seed)
        self.worker = client.register_worker(ns, rank=0, tensors=self.tensors, block_dim=block_dim)
        self.engine = client.register_engine(ns)
        self.next_job = 1
        self.counts: dict[str, int] = {}
        # What was wrong with each load that gave wrong bytes.
        self.wrong: list[str] = []

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def _run(self, kind: str, keys, block_ids) -> bool:
        from kvdepot.errors import KVDepotError

        job, self.next_job = self.next_job, self.next_job + 1
        submit = self.client.submit_store if kind == "store" else self.client.submit_load
        try:
            submit(self.worker, job, keys, block_ids)
        except KVDepotError as e:
            self.count(f"{kind} refused {type(e).__name__}")
            return False
        result = self.client.wait([job], timeout=30)[job]
        self.count(f"{kind} {'ok' if result.ok else 'failed'}")
        return result.ok

    def round(self, keys) -> None:
        """Stores `keys` (at most 8), then loads back as many as are ready and checks them."""
        store_ids = list(self.STORE_IDS)[: len(keys)]
        write_blocks(self.tensors, store_ids, keys)
        self._run("store", keys, store_ids)
        ready = self.client.lookup(self.engine, keys).ready_blocks
        if not ready:
            return
        load_ids = list(self.LOAD_IDS)[:ready]
        clear_blocks(self.tensors, load_ids)
        if self._run("load", keys[:ready], load_ids):
            wrong = wrong_blocks(self.tensors, load_ids, keys[:ready])
            if wrong:
                self.wrong.append(f"keys {[keys[i].hex() for i in wrong]} loaded with other bytes")
            self.count("blocks verified", ready - len(wrong))
