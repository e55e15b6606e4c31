"""A pool on huge pages (--pool-dir on a hugetlbfs mount). Runs where such a
mount has free pages, e.g. after `echo 64 > /proc/sys/vm/nr_hugepages` and
`mount -t hugetlbfs none /mnt/huge`; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from kvcache import attach_worker, block_of, prompt_keys

from kvdepot.server.host.pool_folder import _free_bytes


def hugetlbfs_with_room(need: int) -> str | None:
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and fields[2] == "hugetlbfs" and _free_bytes(fields[1]) >= need:
                return fields[1]
    return None


def test_a_pool_on_huge_pages_serves_blocks(start_daemon, client_factory):
    folder = hugetlbfs_with_room(8 << 20)
    if folder is None:
        pytest.skip("no hugetlbfs mount with 8 MiB of free huge pages")
    daemon = start_daemon(pool_dir=folder, pool_size="7MiB")  # not a multiple of 2 MiB: rounded up
    assert "MiB huge pages" in daemon.log()
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=50)
    keys = prompt_keys(16, prompt=50)
    client.submit_store(worker, 1, keys, list(range(16)))
    assert client.wait([1], 10)[1].ok
    client.submit_load(worker, 2, keys, list(range(64, 80)))
    assert client.wait([2], 10)[2].ok
    for i in range(16):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 64 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16))
