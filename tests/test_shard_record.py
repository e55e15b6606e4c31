"""Reading a whole pool's records at once (shard_record.unpack_all) decides
exactly as reading each one (unpack) does: the same records come back, bit
for bit, and every other one is counted under the same reason."""

from __future__ import annotations

import random
import struct

import pytest
import xxhash

from kvdepot.server.host import shard_record
from kvdepot.server.host.shard_record import (
    FLAG_GPU_HASH,
    FLAG_SEALED,
    FORMAT_VERSION,
    MAGIC,
    RECORD_BYTES,
    ShardRecord,
    pack,
    unpack,
    unpack_all,
)

FIELDS = shard_record._FIELDS  # the layout under test: a record is built field by field below


def sealed(ns, key, rank, tp_size, length, data_hash, generation, *, magic=MAGIC, version=FORMAT_VERSION,
           flags=FLAG_SEALED) -> bytes:
    """A record whose own hash holds, with any field as given (pack only writes good ones)."""
    fields = FIELDS.pack(magic, version, flags, generation, ns, key, rank, tp_size, length, data_hash)
    return (fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))).ljust(RECORD_BYTES, b"\0")


def reference(records: bytes) -> tuple[list[tuple[int, ShardRecord]], dict[str, int]]:
    found, reasons = [], {}
    for slot in range(len(records) // RECORD_BYTES):
        record, why = unpack(records[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES])
        if record is not None:
            found.append((slot, record))
        elif why != "empty":
            reasons[why] = reasons.get(why, 0) + 1
    return found, reasons


def test_every_kind_of_record_is_read_as_unpack_reads_it():
    ns, key = b"n" * 15 + b"\0", b"\0" * 31 + b"k"  # zero bytes at either end stay
    kinds = [
        bytes(RECORD_BYTES),  # never sealed
        pack(ShardRecord(ns, key, 0, 1, 4096, 7, 3)),
        pack(ShardRecord(b"\0" * 16, b"\0" * 32, 1, 2, 1 << 20, 2**64 - 1, 2**63, gpu_hashed=True)),
        sealed(ns, key, 0, 1, 4096, 7, 3, magic=b"OTHERFMT"),  # another format
        sealed(ns, key, 0, 1, 4096, 7, 3, version=FORMAT_VERSION + 1),
        sealed(ns, key, 0, 1, 4096, 7, 3, flags=0),  # written, not sealed: empty
        sealed(ns, key, 0, 1, 4096, 7, 3, flags=FLAG_GPU_HASH),  # not sealed either
        sealed(ns, key, 2, 2, 4096, 7, 3),  # a rank past its TP size: torn
        sealed(ns, key, 0, 0, 4096, 7, 3),  # no ranks: torn
        pack(ShardRecord(ns, key, 0, 1, 4096, 7, 3))[:100] + b"\1" + bytes(27),  # its own hash broken
        pack(ShardRecord(ns, key, 0, 1, 4096, 7, 3))[:40] + b"x" + pack(ShardRecord(ns, key, 0, 1, 4096, 7, 3))[41:],
        bytes(RECORD_BYTES - 1) + b"\1",  # only padding set: not our magic, all zero: empty
    ]
    records = b"".join(kinds)
    found, reasons = unpack_all(records)
    assert (found, reasons) == reference(records)
    assert [slot for slot, _ in found] == [1, 2]
    assert found[0][1].key == key and found[0][1].ns == ns and found[1][1].gpu_hashed
    assert reasons == {"format": 2, "torn": 4}


@pytest.fixture(params=["compiled", "python"])
def record_hashes(request, monkeypatch):
    """Records' own hashes taken by the native lane's library (one call a window), or one by one."""
    monkeypatch.setattr(shard_record, "_native_many", None)
    if request.param == "compiled":
        from kvdepot.server.native import binding

        try:
            lib = binding.load()
        except OSError as e:
            pytest.skip(f"the native lane is not built ({e})")
        monkeypatch.setattr(shard_record, "_native_many", lib.kvd_data_hash_many)
    return request.param


@pytest.mark.parametrize("window", [shard_record.UNPACK_WINDOW, 7])  # and windows that split the pool oddly
def test_a_pool_of_random_damage_is_read_as_unpack_reads_it(monkeypatch, window, record_hashes):
    monkeypatch.setattr(shard_record, "UNPACK_WINDOW", window)
    rng = random.Random(28)
    kinds = []
    for _ in range(4000):
        record = bytearray(pack(ShardRecord(rng.randbytes(16), rng.randbytes(32), rng.randrange(4), 4,
                                            rng.randrange(1, 1 << 30), rng.getrandbits(64), rng.getrandbits(64),
                                            gpu_hashed=rng.random() < 0.5)))
        roll = rng.random()
        if roll < 0.3:
            record = bytearray(RECORD_BYTES)
        elif roll < 0.5:
            record[rng.randrange(RECORD_BYTES)] ^= 1 << rng.randrange(8)  # a flipped bit anywhere
        kinds.append(bytes(record))
    records = bytearray(b"".join(kinds))
    found, reasons = unpack_all(memoryview(records))  # as the pool hands them: a view of its mapping
    assert (found, reasons) == reference(bytes(records))
    assert len(found) > 1500 and reasons["torn"] > 100
