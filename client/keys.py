"""Block keys: content hashes chained over token ids, the same in every process.

The key of block i covers the tokens of blocks 0..i and `extra` (anything else
that changes KV content: LoRA adapter, multimodal inputs, cache salt), so two
prompts share exactly the keys of their common whole-block prefix. SHA-256 of
explicit little-endian bytes: no dependence on PYTHONHASHSEED or the platform.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

from kvdepot.defaults import KEY_BYTES

_ROOT = b"\0" * KEY_BYTES


def block_keys(token_ids: Sequence[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """Keys of the whole blocks of `token_ids`; a partial last block has none."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    keys = []
    parent = hashlib.sha256(_ROOT + extra).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}q", *block)).digest()
        keys.append(parent)
    return keys
