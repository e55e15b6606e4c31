"""The hash a GPU computes of a shard it stores, so that no CPU reads the
bytes to seal their record (server/transports/hash_kernel.py computes it on
the GPU from the staging rows it fills anyway; the native lane seals with it).
This is its definition, and the CPU's way to check a record that carries it.

NH (the multilinear hash of UMAC) twice, with two key sets, over blocks of 4
KiB of the shard's bytes read as little-endian 64-bit words, each block's
two sums mixed with its position, the mixed values summed, and the sum mixed
with the length:

    A_j = sum over word w at position i of block j of
          ((lo(w) + KA_lo[i]) mod 2^32) * ((hi(w) + KA_hi[i]) mod 2^32)   (mod 2^64)
    B_j = the same with KB
    H   = mix(sum_j mix(A_j xor mix(B_j + j + 1)) + length)                (mod 2^64)

where mix is splitmix64's finalizer and the keys are 32-bit values of a
splitmix64 stream of a fixed seed. Every word of a block multiplies a
different pair of keys, so a changed word, a torn write or two blocks
swapped change H but with a chance of about 2^-64 for bytes that change by
accident (the pool file is the daemon's alone: nobody chooses its bytes to
collide). Sums are order-free, which is what lets a GPU compute it in
parallel. Lengths are a multiple of 8 (a shard's pages are 16-byte aligned).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

BLOCK_WORDS = 512  # 4 KiB
SEED = 0x6B766465706F7421  # "kvdepot!"
MASK64 = (1 << 64) - 1


def mix(z: int) -> int:
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@functools.cache
def keys() -> np.ndarray:
    """uint32[4, BLOCK_WORDS]: KA_lo, KA_hi, KB_lo, KB_hi."""
    values, x = [], SEED
    for _ in range(4 * BLOCK_WORDS):
        x = (x + 0x9E3779B97F4A7C15) & MASK64
        values.append(mix(x) & 0xFFFFFFFF)
    return np.array(values, dtype=np.uint32).reshape(4, BLOCK_WORDS)


def _mix_array(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


# A compiled version (the native lane's library registers it, use_native):
# numpy's takes tens of milliseconds a 2 MiB shard.
_native = None
_native_many = None


def use_native(function, many=None) -> None:
    """`function(address, length) -> int` computes gpu_hash of memory at
    `address`; `many(addresses, lengths, hashes, n)` that of `n` shards at
    once, from and into uint64 arrays."""
    global _native, _native_many
    _native, _native_many = function, many


def hashes_at(base, offsets: np.ndarray, lengths: np.ndarray, one, many, words: int = 1) -> np.ndarray:
    """uint64[n]: `one(bytes)` of the `lengths[i]` bytes at `offsets[i]` of
    the writable buffer `base`, through `many(addresses, lengths, hashes, n)`
    in one compiled call where there is one (the GIL released for all of them,
    not taken back a shard at a time). Lengths must be multiples of `words`."""
    raw = memoryview(base).cast("B")
    offsets = np.ascontiguousarray(offsets, dtype=np.uint64)
    lengths = np.ascontiguousarray(lengths, dtype=np.uint64)  # passed by address
    size = np.uint64(len(raw))
    # Compared without adding: an offset and a length that wrap around 2**64 would pass a sum.
    if len(offsets) and (bool((offsets > size).any()) or bool((lengths > size - np.minimum(offsets, size)).any())
                         or bool((lengths % words).any())):
        raise ValueError("a shard outside the buffer" + (f", or not of whole {words}-byte words" if words > 1 else ""))
    if many is None or raw.readonly:
        return np.array([one(raw[o : o + n]) for o, n in zip(offsets.tolist(), lengths.tolist())], dtype=np.uint64)
    hashes = np.zeros(len(offsets), dtype=np.uint64)
    if len(offsets):
        addresses = offsets + np.uint64(ctypes.addressof(ctypes.c_char.from_buffer(raw)))
        many(addresses.ctypes.data, lengths.ctypes.data, hashes.ctypes.data, len(offsets))
    return hashes


def gpu_hash_at(base, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """uint64[n]: H of each shard (hashes_at): adoption checks what the GPU sealed."""
    return hashes_at(base, offsets, lengths, gpu_hash, _native_many, words=8)


def gpu_hash(data, length: int | None = None) -> int:
    """H of the first `length` bytes of `data` (all of it by default)."""
    raw = memoryview(data).cast("B")
    length = len(raw) if length is None else length
    if length % 8 or length > len(raw):
        raise ValueError(f"a shard of {length} bytes in {len(raw)}: the hash reads whole 8-byte words")
    if _native is not None and not raw.readonly:
        return _native(ctypes.addressof(ctypes.c_char.from_buffer(raw)), length)
    words = np.frombuffer(raw, dtype="<u8", count=length // 8)
    n_blocks = -(-len(words) // BLOCK_WORDS)
    if n_blocks == 0:
        return mix(length)
    padded = np.zeros(n_blocks * BLOCK_WORDS, dtype=np.uint64)
    padded[: len(words)] = words
    live = np.arange(n_blocks * BLOCK_WORDS) < len(words)
    lo = (padded & np.uint64(0xFFFFFFFF)).reshape(n_blocks, BLOCK_WORDS)
    hi = (padded >> np.uint64(32)).reshape(n_blocks, BLOCK_WORDS)
    live = live.reshape(n_blocks, BLOCK_WORDS)
    k = keys().astype(np.uint64)
    m32 = np.uint64(0xFFFFFFFF)
    with np.errstate(over="ignore"):
        a = (((lo + k[0]) & m32) * ((hi + k[1]) & m32)) * live
        b = (((lo + k[2]) & m32) * ((hi + k[3]) & m32)) * live
        sums_a = a.sum(axis=1, dtype=np.uint64)
        sums_b = b.sum(axis=1, dtype=np.uint64)
        positions = np.arange(1, n_blocks + 1, dtype=np.uint64)
        blocks = _mix_array(sums_a ^ _mix_array(sums_b + positions))
        total = int(blocks.sum(dtype=np.uint64))
    return mix(total + length)
