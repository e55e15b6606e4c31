"""The self-describing record of one stored shard, in the pool and on disk.

A record names what its bytes are (the namespace's digest, the block key, the
TP rank and rank count, the length) and carries a hash of those bytes and of
itself, so that a daemon that finds it later (after a restart, in a segment
file) can tell a committed shard from a torn, stale or foreign one without
trusting anything else. The same 128 bytes head a pool slot's record and a
record on disk.
"""

from __future__ import annotations

import hashlib
import json
import struct
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


# The same layout as numpy reads it, for reading a pool's records all at once
# (void, not "S", fields: numpy strips the trailing zero bytes of an "S" value).
_TABLE = np.dtype([("magic", "<u8"), ("version", "<u4"), ("flags", "<u4"), ("generation", "<u8"),
                   ("ns", f"V{NS_DIGEST_BYTES}"), ("key", f"V{KEY_BYTES}"), ("rank", "<u4"), ("tp_size", "<u4"),
                   ("length", "<u8"), ("data_hash", "<u8"), ("hash", "<u8"), ("pad", f"V{_PAD}")])
assert _TABLE.itemsize == RECORD_BYTES
_MAGIC_WORD = int.from_bytes(MAGIC, "little")


def unpack_all(records) -> tuple[list[tuple[int, ShardRecord]], dict[str, int]]:
    """Every record in `records` (whole records, one after another; slot i's
    at i * RECORD_BYTES) as unpack reads one: the (slot, record) of those that
    unpack, and how many did not, by reason ("empty" is not counted). The
    checks run over all of them at once (numpy) but each record's own hash,
    so that a pool of millions of records is read in a fraction of a second."""
    table = np.frombuffer(records, dtype=_TABLE)
    words = np.frombuffer(records, dtype="<u8").reshape(-1, RECORD_BYTES // 8)
    slots = np.flatnonzero(words.any(axis=1))  # most records of a pool are empty (a run's is at its first slot)
    found = table[slots]
    reasons: dict[str, int] = {}

    def discard(reason: str, mask) -> None:
        if count := int(np.count_nonzero(mask)):
            reasons[reason] = reasons.get(reason, 0) + count

    ours = found["magic"] == _MAGIC_WORD
    discard("format", ~ours & (found["magic"] != 0))  # an all-zero magic is "empty"
    discard("format", ours & (found["version"] != FORMAT_VERSION))
    ours &= found["version"] == FORMAT_VERSION
    view = memoryview(records).cast("B")
    at = (slots[ours] * RECORD_BYTES).tolist()
    held = np.fromiter((xxhash.xxh3_64_intdigest(view[a : a + _FIELDS.size]) for a in at), dtype="<u8", count=len(at))
    whole = np.zeros(len(found), dtype=bool)
    whole[ours] = held == found["hash"][ours]
    discard("torn", ours & ~whole)
    sealed = whole & (found["flags"] & FLAG_SEALED != 0)
    fits = (found["tp_size"] >= 1) & (found["rank"] < found["tp_size"])
    discard("torn", sealed & ~fits)
    good = found[sealed & fits]
    records_found = [
        (slot, ShardRecord(ns, key, rank, tp_size, length, data_hash, generation, bool(flags & FLAG_GPU_HASH)))
        for slot, ns, key, rank, tp_size, length, data_hash, generation, flags in zip(
            slots[sealed & fits].tolist(), good["ns"].tolist(), good["key"].tolist(), good["rank"].tolist(),
            good["tp_size"].tolist(), good["length"].tolist(), good["data_hash"].tolist(),
            good["generation"].tolist(), good["flags"].tolist(), strict=True)
    ]
    return records_found, reasons


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
