"""Block keys are the same in every process and chain over the prefix."""

from __future__ import annotations

import subprocess
import sys

from conftest import subprocess_env
from kvdepot.client.keys import block_keys


def test_keys_chain_over_the_prefix_and_ignore_a_partial_block():
    a = block_keys(list(range(40)), 16)
    b = block_keys(list(range(39)) + [999], 16)
    assert len(a) == 2 and a == b  # the differing token is in the partial third block
    c = block_keys([7] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change early changes every later key
    assert block_keys(list(range(40)), 16, extra=b"lora:1") != a
    assert all(len(k) == 32 for k in a)


def test_keys_do_not_depend_on_the_process_or_its_hash_seed():
    code = "from kvdepot.client.keys import block_keys; print(block_keys(list(range(64)), 16)[-1].hex())"
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=subprocess_env(PYTHONHASHSEED=seed)).stdout.strip()
        for seed in ("0", "1", "12345")
    }
    assert outputs == {block_keys(list(range(64)), 16)[-1].hex()}
