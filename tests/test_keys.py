"""Block keys: one definition (kvdepot/keys.py, docs/keys.md), the same in every process."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest
from conftest import subprocess_env

from kvdepot.keys import KEY_VERSION, ROOT, block_keys, chain_key, chain_plain, encode_extra

# Token ids and extra keys in, hex keys out: the vectors docs/keys.md lists.
# Another implementation of docs/keys.md must reproduce them.
VECTORS = [
    (list(range(8)), 4, None, [
        "003637281d6fea2b08f920ed7641c01c0c98b9d3a3d745dcdec53d19e49a210e",
        "0dc3dffc9861630cc7227a49b16a6543b26af0e84a0d173307ea0ce329a7e388",
    ]),
    ([0, 0, 0], 4, None, []),
    ([1, 2**40, -1, 151935, 7, 8], 3, [("my-lora",), ("my-lora", ("mm-hash-1", 0))], [
        "0ce33b3f4d93cbc65fa9b2be217e7d68181d2f8086b7334aba096e2eb2ccdfb2",
        "ac90cbe177263457291b2d8b1aa472ee1774fac65772687d2b2ad3b5a9e2f431",
    ]),
    (list(range(16)), 16, [("salt:abc",)], [
        "07bb29ea4b33a5c4a36776d79ad9affd56b85ada10c0a11f9bff981f1253e7ff",
    ]),
]


@pytest.mark.parametrize("tokens,block_size,extra_keys,expected", VECTORS)
def test_fixed_vectors(tokens, block_size, extra_keys, expected):
    assert [k.hex() for k in block_keys(tokens, block_size, extra_keys)] == expected


def test_the_specification_written_out_by_hand_gives_the_same_keys():
    # docs/keys.md, step by step, with nothing from kvdepot but the vectors.
    root = hashlib.sha256(b"kvdepot-keys-v1").digest()
    assert root == ROOT and KEY_VERSION == 1
    first = hashlib.sha256(root + struct.pack("<I", 4) + struct.pack("<4q", 0, 1, 2, 3) + b"n").digest()
    second = hashlib.sha256(first + struct.pack("<I", 4) + struct.pack("<4q", 4, 5, 6, 7) + b"n").digest()
    assert [first.hex(), second.hex()] == VECTORS[0][3]
    # Extra keys: a tuple of one string, tag t, count, then tag s, length, bytes.
    lora = b"t" + struct.pack("<I", 1) + b"s" + struct.pack("<I", 7) + b"my-lora"
    block0 = hashlib.sha256(root + struct.pack("<I", 3) + struct.pack("<3q", 1, 2**40, -1) + lora).digest()
    assert block0.hex() == VECTORS[2][3][0]


def test_extra_key_encoding_is_type_tagged():
    assert encode_extra(None) == b"n"
    assert encode_extra(True) == b"T" and encode_extra(False) == b"F"
    assert encode_extra(1) == b"i\x01\x00\x00\x001" != encode_extra("1") != encode_extra(b"1")
    assert encode_extra(1.5) == b"f" + struct.pack("<d", 1.5)
    # Nesting and order are part of the key.
    assert encode_extra(("a", ("b",))) != encode_extra(("a", "b")) != encode_extra(("b", "a"))


def test_keys_chain_over_the_prefix_and_ignore_a_partial_block():
    a = block_keys(list(range(40)), 16)
    b = block_keys(list(range(39)) + [999], 16)
    assert len(a) == 2 and a == b  # the differing token is in the partial third block
    c = block_keys([7] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change early changes every later key
    assert block_keys(list(range(40)), 16, extra_keys=[("lora-1",), ("lora-1",)]) != a
    # No extras and None extras are the same key; the fast path and the general one agree.
    assert block_keys(list(range(40)), 16, extra_keys=[None, None]) == a
    assert chain_plain(a[0], list(range(16, 32)), 16) == [chain_key(a[0], list(range(16, 32)))] == a[1:]
    assert all(len(k) == 32 for k in a)


def test_extra_keys_must_be_one_per_whole_block():
    with pytest.raises(ValueError, match="one per block"):
        block_keys(list(range(40)), 16, extra_keys=[("lora",)])
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2], 0)


def test_keys_do_not_depend_on_the_process_or_its_hash_seed():
    code = "from kvdepot.keys import block_keys; print(block_keys(list(range(64)), 16)[-1].hex())"
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=subprocess_env(PYTHONHASHSEED=seed)).stdout.strip()
        for seed in ("0", "1", "12345")
    }
    assert outputs == {block_keys(list(range(64)), 16)[-1].hex()}
