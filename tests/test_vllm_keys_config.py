"""Connector keys (deterministic, content-complete) and its settings (checked, explained)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

pytestmark = pytest.mark.vllm

KEYS_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import vllm_harness as h
from vllm.lora.request import LoRARequest
from kvdepot.connector.engine_keys import RequestKeys
tokens = list(range(3, 3 + 48))
variants = {
    "plain": {},
    "salt": {"cache_salt": "tenant-a"},
    "salt2": {"cache_salt": "tenant-b"},
    "lora": {"lora_request": LoRARequest("adapter", 1, "/adapters/a")},
}
out = {}
for name, kw in variants.items():
    request = h.make_request(name, tokens, **kw)
    out[name] = [k.hex() for k in RequestKeys(request, 16).upto(3)]
print(json.dumps(out))
"""


def keys_in_a_process(hash_seed: str) -> dict:
    env = subprocess_env(PYTHONHASHSEED=hash_seed, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", KEYS_SCRIPT, str(REPO / "tests")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_keys_are_the_same_in_every_process_and_cover_salt_and_lora():
    first, second = keys_in_a_process("1"), keys_in_a_process("random")
    assert first == second
    plain = first["plain"]
    assert len(set(plain)) == 3
    # A cache salt changes every block (the chain starts at the salted first
    # block); so does a LoRA adapter.
    for name in ("salt", "salt2", "lora"):
        assert not set(first[name]) & set(plain), name
    assert first["salt"] != first["salt2"]


def test_request_keys_grown_block_by_block_are_the_keys_any_client_computes():
    # RequestKeys hashes plain blocks on a faster path, block by block as a
    # request grows; the keys must be block_keys' (kvdepot/keys.py, the README's
    # and docs/keys.md's), or a tool or another engine would share nothing with
    # vLLM engines.
    sys.path.insert(0, str(REPO / "tests"))
    import vllm_harness as h

    from kvdepot.connector.engine_keys import RequestKeys
    from kvdepot.keys import block_keys

    prompt = [(i * 7919) % 30000 + 3 for i in range(40)]
    for kw in ({}, {"cache_salt": "tenant-a"}):
        request = h.make_request("r", prompt, max_tokens=64, **kw)
        keys = RequestKeys(request, 16)
        assert len(keys.upto(2)) == 2  # the prompt's whole blocks, as on arrival
        for step in range(50):  # decode: one token a step, a block every 16
            request.append_output_token_ids(100 + step)
            keys.extend(request.num_tokens // 16)
        tokens = list(request.all_token_ids)
        blocks = len(tokens) // 16
        # vLLM puts a cache salt in the extra keys of a request's first block.
        extra = [(("cache_salt", "tenant-a"),)] + [None] * (blocks - 1) if kw else None
        assert keys.upto(blocks) == block_keys(tokens, 16, extra), kw


def test_extra_config_errors_name_the_key():
    from kvdepot.connector.config import ConfigError, ConnectorConfig

    with pytest.raises(ConfigError, match="unknown key.*'sockt'"):
        ConnectorConfig.from_extra_config({"sockt": "/x"})
    with pytest.raises(ConfigError, match="mode must be one of"):
        ConnectorConfig.from_extra_config({"mode": "sometimes"})
    with pytest.raises(ConfigError, match="store: a fraction must be between 0 and 1"):
        ConnectorConfig.from_extra_config({"store": 1.5})
    with pytest.raises(ConfigError, match="min_prompt_tokens must be a number >= 0"):
        ConnectorConfig.from_extra_config({"min_prompt_tokens": -1})
    with pytest.raises(ConfigError, match="daemon_uids must be a list of uids"):
        ConnectorConfig.from_extra_config({"daemon_uids": "1000"})
    assert ConnectorConfig.from_extra_config({"daemon_uids": [1000]}).daemon_uids == (1000,)
    config = ConnectorConfig.from_extra_config({"store": 64, "store_decode": False, "mode": "lazy"})
    assert config.mode == "lazy"
    assert config.default_policy.store_limit_tokens(prompt_len=100, total_tokens=150) == 64


def test_request_params_override_or_are_ignored_with_a_warning(caplog):
    from kvdepot.connector.config import ConnectorConfig

    config = ConnectorConfig.from_extra_config({"min_prompt_tokens": 10})
    assert config.policy_for("r", 5, None).store_limit_tokens(5, 8) == 0  # too short
    assert config.policy_for("r", 100, {"kvdepot_store": 0.25}).store_limit_tokens(100, 120) == 25
    assert config.policy_for("r", 100, {"kvdepot_store": "prompt"}).store_limit_tokens(100, 120) == 120
    no_decode = config.policy_for("r", 100, {"kvdepot_store_decode": False})
    assert no_decode.store_limit_tokens(100, 120) == 100
    assert config.policy_for("r", 100, {"kvdepot_load": False}).load is False
    with caplog.at_level("WARNING", logger="kvdepot.connector"):
        policy = config.policy_for("r", 100, {"kvdepot_store": -3, "kvdepot_store_decode": "yes"})
    assert policy == config.default_policy
    assert "kvdepot_store" in caplog.text and "kvdepot_store_decode" in caplog.text


def test_module_path_loads_in_a_fresh_process():
    # What vLLM does with kv_connector_module_path.
    done = subprocess.run(
        [sys.executable, "-c",
         "import importlib; print(importlib.import_module('kvdepot.connector').KVDepotConnector)"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.expanduser("~"),
    )
    assert done.returncode == 0 and "KVDepotConnector" in done.stdout, done.stderr[-2000:]


def test_a_group_of_uniform_layer_specs_is_offloaded_as_its_layers_kind():
    # vLLM groups layers of one kind with different sizes as UniformTypeKVCacheSpecs.
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, UniformTypeKVCacheSpecs

    from kvdepot.connector.engine_keys import offloaded_groups

    layer = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    group = KVCacheGroupSpec(["l0", "l1"],
                             UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"l0": layer, "l1": layer}))
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(world_size=1, tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        device_config=SimpleNamespace(device_type="cpu"),
    )
    [info] = offloaded_groups(vllm_config, SimpleNamespace(kv_cache_groups=[group]))
    assert info.kind == "full" and info.block_size == 16 and info.layer_names == ("l0", "l1")
