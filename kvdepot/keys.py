"""Block keys: the one definition every engine and tool shares.

docs/keys.md specifies it byte by byte, so that an engine in another language
can compute the same keys from token ids. In short, the key of block i is

    SHA-256( key of block i-1 (ROOT for block 0)
             || uint32 LE: tokens in the block
             || int64 LE: each token id
             || encode_extra(the block's extra keys) )

so two sequences share exactly the keys of their common whole-block prefix,
and nothing depends on the process, PYTHONHASHSEED or the platform. Extra keys
are whatever else changes a block's KV content (a LoRA adapter, multimodal
inputs, a cache salt); vLLM's connector passes vLLM's own per-block extra keys.

KEY_VERSION names this definition. It is part of every namespace (the client
fills it in), so that keys of a future definition can never be mixed with
these: a change to anything in this file that changes a key must bump it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

KEY_VERSION = 1

# The parent of a sequence's first block.
ROOT = hashlib.sha256(b"kvdepot-keys-v1").digest()


def encode_extra(value: Any) -> bytes:
    """A canonical, type-tagged encoding of a block's extra keys (docs/keys.md)."""
    if value is None:
        return b"n"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        text = str(value).encode()
        return b"i" + struct.pack("<I", len(text)) + text
    if isinstance(value, float):
        return b"f" + struct.pack("<d", value)
    if isinstance(value, str):
        data = value.encode()
        return b"s" + struct.pack("<I", len(data)) + data
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return b"b" + struct.pack("<I", len(data)) + data
    if isinstance(value, (tuple, list)):
        return b"t" + struct.pack("<I", len(value)) + b"".join(encode_extra(v) for v in value)
    # Another type (a future vLLM extra key): its repr is stable for value
    # types, and a change only costs cache misses, never wrong blocks.
    data = repr(value).encode()
    return b"r" + struct.pack("<I", len(data)) + data


NO_EXTRA = encode_extra(None)
_sha256 = hashlib.sha256
_TOKEN_FORMATS: dict[int, struct.Struct] = {}


def _token_format(n: int) -> struct.Struct:
    fmt = _TOKEN_FORMATS.get(n)
    if fmt is None:
        fmt = _TOKEN_FORMATS[n] = struct.Struct(f"<{n}q")
    return fmt


def chain_key(parent: bytes | None, token_ids: Sequence[int], extra: Any = None) -> bytes:
    """The key of one block, given its parent's key (None for the first block)."""
    n = len(token_ids)
    tail = NO_EXTRA if extra is None else encode_extra(extra)
    return _sha256((parent or ROOT) + struct.pack("<I", n) + _token_format(n).pack(*token_ids) + tail).digest()


def chain_plain(parent: bytes | None, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of consecutive whole blocks without extra keys, after `parent`.

    The same bytes as chain_key, hashed the way decode needs it cheap: one pack
    for all the blocks, then one SHA-256 per block.
    """
    packed = _token_format(len(token_ids)).pack(*token_ids)
    head = struct.pack("<I", block_size)
    width = 8 * block_size
    keys = []
    parent = parent or ROOT
    for i in range(0, len(packed) - width + 1, width):
        parent = _sha256(parent + head + packed[i : i + width] + NO_EXTRA).digest()
        keys.append(parent)
    return keys


def block_keys(token_ids: Sequence[int], block_size: int, extra_keys: Sequence[Any] | None = None) -> list[bytes]:
    """Keys of the whole blocks of `token_ids`; a partial last block has none.

    extra_keys: None, or one entry per whole block (None where a block has
    none), e.g. ("my-lora",) on every block of a LoRA adapter's requests.
    """
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    whole = len(token_ids) // block_size
    if extra_keys is None:
        return chain_plain(None, token_ids[: whole * block_size], block_size)
    if len(extra_keys) != whole:
        raise ValueError(f"{len(extra_keys)} extra keys for {whole} whole blocks: give one per block")
    keys: list[bytes] = []
    for i in range(whole):
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        keys.append(chain_key(keys[-1] if keys else None, tokens, extra_keys[i]))
    return keys
