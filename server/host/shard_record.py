"""The self-describing record of one stored shard, in the pool and on disk.

A record names what its bytes are (the namespace's digest, the block key, the
TP rank and rank count, the length) and carries a hash of those bytes and of
itself, so that a daemon that finds it later (after a restart, in a segment
file) can tell a committed shard from a torn, stale or foreign one without
trusting anything else. The same 128 bytes head a pool slot's record and a
record on disk.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import struct
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import xxhash

from kvdepot.defaults import KEY_BYTES
from kvdepot.server.host import shard_hash

MAGIC = b"KVDSHRD1"
# Bumped whenever the bytes of a record, a pool header or a segment change
# meaning: a daemon discards records of any other format.
FORMAT_VERSION = 1
RECORD_BYTES = 128
NS_DIGEST_BYTES = 16

# magic, format, flags, generation, namespace digest, key, rank, tp_size,
# length, data hash; then the hash of all of these.
_FIELDS = struct.Struct(f"<8sIIQ{NS_DIGEST_BYTES}s{KEY_BYTES}sIIQQ")
_HASH = struct.Struct("<Q")
_PAD = RECORD_BYTES - _FIELDS.size - _HASH.size
assert _PAD >= 0

FLAG_SEALED = 1
# The data hash is host/shard_hash.py's (the GPU computed it as it stored the
# bytes), not xxh3. A daemon that does not know the flag checks it as xxh3 and
# discards the record: never a wrong byte.
FLAG_GPU_HASH = 2


class ShardRecord(NamedTuple):
    ns: bytes  # the namespace's digest (ns_digest)
    key: bytes
    rank: int
    tp_size: int
    length: int
    data_hash: int
    generation: int = 0
    # data_hash is shard_hash.gpu_hash's (FLAG_GPU_HASH).
    gpu_hashed: bool = False


def data_hash(data) -> int:
    """The hash of a shard's bytes (xxh3, 64 bits: tens of GB/s on one core,
    and it releases the GIL, so several threads hash in parallel)."""
    return xxhash.xxh3_64_intdigest(data)


def hash_of(record: ShardRecord, data) -> int:
    """`data`'s hash as `record` says it was taken (to compare with its data_hash)."""
    return shard_hash.gpu_hash(data, record.length) if record.gpu_hashed else data_hash(data)


def pack(record: ShardRecord) -> bytes:
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        FLAG_SEALED | (FLAG_GPU_HASH if record.gpu_hashed else 0),
        record.generation,
        record.ns,
        record.key,
        record.rank,
        record.tp_size,
        record.length,
        record.data_hash,
    )
    return fields + _HASH.pack(xxhash.xxh3_64_intdigest(fields)) + bytes(_PAD)


def unpack(raw) -> tuple[ShardRecord | None, str]:
    """The record in `raw` (at least RECORD_BYTES), or None and why not:
    "empty" (never sealed, or cleared), "format" (another format) or "torn"
    (its own hash does not hold)."""
    raw = bytes(raw[:RECORD_BYTES])
    if len(raw) < RECORD_BYTES:
        return None, "torn"
    fields = raw[: _FIELDS.size]
    magic, version, flags, generation, ns, key, rank, tp_size, length, hashed = _FIELDS.unpack(fields)
    if magic != MAGIC:
        return None, "empty" if magic == bytes(8) else "format"
    if version != FORMAT_VERSION:
        return None, "format"
    (stored,) = _HASH.unpack_from(raw, _FIELDS.size)
    if stored != xxhash.xxh3_64_intdigest(fields):
        return None, "torn"
    if not flags & FLAG_SEALED:
        return None, "empty"
    if tp_size < 1 or rank >= tp_size:
        return None, "torn"
    return ShardRecord(ns, key, rank, tp_size, length, hashed, generation, bool(flags & FLAG_GPU_HASH)), ""


# The same layout as numpy reads it, for reading a pool's records many at once
# (void, not "S", fields: numpy strips the trailing zero bytes of an "S" value).
_TABLE = np.dtype([("magic", "<u8"), ("version", "<u4"), ("flags", "<u4"), ("generation", "<u8"),
                   ("ns", f"V{NS_DIGEST_BYTES}"), ("key", f"V{KEY_BYTES}"), ("rank", "<u4"), ("tp_size", "<u4"),
                   ("length", "<u8"), ("data_hash", "<u8"), ("hash", "<u8"), ("pad", f"V{_PAD}")])
assert _TABLE.itemsize == RECORD_BYTES
_MAGIC_WORD = int.from_bytes(MAGIC, "little")


# Records read at once by unpack_all: 128 MiB of them, whatever the pool's size.
UNPACK_WINDOW = 1 << 20

# `many(base, offsets, length, hashes, n)`: data_hash of `length` bytes at
# each offset, in one call; `at(addresses, lengths, hashes, n)`: data_hash of
# `lengths[i]` bytes at each address (the native lane's library registers both).
_native_many = None
_native_at = None


def use_native(many, at=None) -> None:
    global _native_many, _native_at
    _native_many, _native_at = many, at


def data_hash_at(base, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """uint64[n]: data_hash of each shard (shard_hash.hashes_at): adoption checks what the CPU sealed."""
    return shard_hash.hashes_at(base, offsets, lengths, data_hash, _native_at)


def _own_hashes(view: memoryview, offsets: np.ndarray) -> np.ndarray:
    """Each record's own hash (of its fields) at `offsets` of `view`."""
    if _native_many is None or view.readonly or not len(offsets):
        return np.fromiter((xxhash.xxh3_64_intdigest(view[o : o + _FIELDS.size]) for o in offsets.tolist()),
                           dtype="<u8", count=len(offsets))
    hashes = np.zeros(len(offsets), dtype="<u8")
    offsets = np.ascontiguousarray(offsets, dtype="<u8")
    base = ctypes.addressof(ctypes.c_char.from_buffer(view))
    _native_many(base, offsets.ctypes.data, _FIELDS.size, hashes.ctypes.data, len(offsets))
    return hashes


@dataclass(frozen=True)
class Columns:
    """Records that unpack, as columns (numpy arrays, one row a record): what
    adoption reads a kept pool's hundreds of thousands of records as, making
    a ShardRecord only of those it must handle one by one."""

    slot: np.ndarray  # int64
    ns: np.ndarray  # V16
    key: np.ndarray  # V32
    rank: np.ndarray
    tp_size: np.ndarray
    length: np.ndarray
    data_hash: np.ndarray
    generation: np.ndarray
    gpu_hashed: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.slot)

    def take(self, rows) -> Columns:
        return Columns(*(getattr(self, f.name)[rows] for f in fields(self)))

    def records(self) -> list[tuple[int, ShardRecord]]:
        """(slot, record) of each row."""
        columns = (getattr(self, name).tolist() for name in _RECORD_COLUMNS)
        return list(zip(self.slot.tolist(), map(ShardRecord._make, zip(*columns)), strict=True))

    @classmethod
    def joined(cls, parts: list[Columns]) -> Columns:
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)))


# ShardRecord's fields, in its order.
_RECORD_COLUMNS = ("ns", "key", "rank", "tp_size", "length", "data_hash", "generation", "gpu_hashed")


def unpack_all(records) -> tuple[list[tuple[int, ShardRecord]], dict[str, int]]:
    """Every record in `records` (whole records, one after another; slot i's
    at i * RECORD_BYTES) as unpack reads one: the (slot, record) of those that
    unpack, and how many did not, by reason ("empty" is not counted)."""
    columns, reasons = unpack_columns(records)
    return columns.records(), reasons


def unpack_columns(records) -> tuple[Columns, dict[str, int]]:
    """unpack_all's records as columns. The checks run over a window of
    records at once (numpy), but each record's own hash."""
    view = memoryview(records).cast("B")
    parts: list[Columns] = []
    reasons: dict[str, int] = {}
    count = len(view) // RECORD_BYTES
    for first in range(0, count, UNPACK_WINDOW):
        last = min(count, first + UNPACK_WINDOW)
        parts.append(_unpack_window(view[first * RECORD_BYTES : last * RECORD_BYTES], first, reasons))
    if not parts:
        parts.append(_unpack_window(view[:0], 0, reasons))
    return Columns.joined(parts), reasons


def _unpack_window(view: memoryview, first_slot: int, reasons: dict[str, int]) -> Columns:
    words = np.frombuffer(view, dtype="<u8").reshape(-1, RECORD_BYTES // 8)
    at = np.flatnonzero(words.any(axis=1))  # most records of a pool are empty (a run's is at its first slot)
    table = np.frombuffer(view, dtype=_TABLE)[at]

    def discard(reason: str, mask) -> None:
        if n := int(np.count_nonzero(mask)):
            reasons[reason] = reasons.get(reason, 0) + n

    ours = table["magic"] == _MAGIC_WORD
    discard("format", ~ours & (table["magic"] != 0))  # an all-zero magic is "empty"
    discard("format", ours & (table["version"] != FORMAT_VERSION))
    ours &= table["version"] == FORMAT_VERSION
    held = _own_hashes(view, at[ours] * RECORD_BYTES)
    whole = np.zeros(len(table), dtype=bool)
    whole[ours] = held == table["hash"][ours]
    discard("torn", ours & ~whole)
    sealed = whole & (table["flags"] & FLAG_SEALED != 0)
    fits = (table["tp_size"] >= 1) & (table["rank"] < table["tp_size"])
    discard("torn", sealed & ~fits)
    keep = sealed & fits
    good = table[keep]
    return Columns(
        (at[keep] + first_slot).astype(np.int64), good["ns"].copy(), good["key"].copy(), good["rank"].copy(),
        good["tp_size"].copy(), good["length"].copy(), good["data_hash"].copy(), good["generation"].copy(),
        good["flags"] & FLAG_GPU_HASH != 0,
    )


def newest_generation(records) -> int:
    """The highest generation the records in `records` (whole records, one
    after another) claim: 0 where none is sealed, -1 where all are empty.
    Read with numpy, not checked: for ordering only, never for trust."""
    words = np.frombuffer(records, dtype="<u8").reshape(-1, RECORD_BYTES // 8)
    if not words.any():
        return -1
    # The magic is the first word, the generation the third (_FIELDS).
    generations = words[words[:, 0] == np.uint64(_MAGIC_WORD), 2]
    return int(generations.max()) if len(generations) else 0


def ns_digest(identity: tuple) -> bytes:
    """A namespace identity's digest: what a record stores to name it."""
    return hashlib.sha256(json.dumps(list(identity)).encode()).digest()[:NS_DIGEST_BYTES]
