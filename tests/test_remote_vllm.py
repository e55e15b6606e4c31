"""Two nodes of a fleet in real vLLM (CPU build): an engine on node A serves
prompts through its daemon; an engine on node B, whose daemon has nothing in
DRAM or on disk, then serves the same prompts from the shared Valkey cluster,
token for token as without any connector, with remote hits in B's stats."""

from __future__ import annotations

import pytest
from conftest import wait_until
from test_remote_tier import cluster, empty_store, node, remote, whole_cluster  # noqa: F401 (fixtures)
from test_vllm_e2e import DAEMON_OPTIONS, baseline, generate, model, prompts, with_kvdepot  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# 4 prompts of 200 tokens at vLLM's CPU block size of 32: 6 whole blocks each,
# the first 2 shared.
BLOCKS = 4 * 6 - 3 * 2


def test_node_b_serves_node_as_prompts_from_the_remote_tier(
    model, prompts, baseline, start_daemon, client_factory, tmp_path, cluster  # noqa: F811
):
    daemon_a = node(start_daemon, tmp_path, cluster, "a", **DAEMON_OPTIONS)
    first = generate(model, prompts, tmp_path / "engine-a", *with_kvdepot(daemon_a))
    assert first["rounds"][0]["outputs"] == baseline
    a = client_factory(daemon_a)
    wait_until(lambda: remote(a.stats()).written_shards >= BLOCKS, timeout=30, what="node A's blocks published")

    daemon_b = node(start_daemon, tmp_path, cluster, "b", **DAEMON_OPTIONS)
    second = generate(model, prompts, tmp_path / "engine-b", *with_kvdepot(daemon_b))
    assert second["rounds"][0]["outputs"] == baseline
    assert second["rounds"][0]["num_cached_tokens"] == [192] * 4
    b = client_factory(daemon_b)
    tier = remote(b.stats())
    assert tier.promotions >= BLOCKS and tier.failed_promotions == 0
    assert b.stats().totals.loaded_blocks >= BLOCKS


def test_a_store_whose_values_were_all_altered_serves_nothing_and_changes_no_output(
    model, prompts, baseline, start_daemon, client_factory, tmp_path, cluster  # noqa: F811
):
    daemon_a = node(start_daemon, tmp_path, cluster, "a", **DAEMON_OPTIONS)
    generate(model, prompts, tmp_path / "engine-a", *with_kvdepot(daemon_a))
    a = client_factory(daemon_a)
    wait_until(lambda: remote(a.stats()).written_shards >= BLOCKS, timeout=30, what="node A's blocks published")
    store = whole_cluster(cluster)
    for key in store.keys("kvdepot:*", target_nodes=store.ALL_NODES):
        value = bytearray(store.get(key))
        value[len(value) // 2] ^= 0x40  # one bit of the payload
        store.set(key, bytes(value))

    daemon_b = node(start_daemon, tmp_path, cluster, "b", **DAEMON_OPTIONS)
    second = generate(model, prompts, tmp_path / "engine-b", *with_kvdepot(daemon_b))
    assert second["rounds"][0]["outputs"] == baseline
    b = client_factory(daemon_b)
    tier = remote(b.stats())
    assert tier.promotions == 0 and tier.discarded.get("corrupt", 0) >= 1
    assert b.stats().totals.loaded_blocks == 0
