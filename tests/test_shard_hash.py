"""The hash a GPU takes of a shard it stores (host/shard_hash.py): what
changes it, the compiled version agrees with the definition, and a record
says which hash it carries, so that adoption checks each the right way."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvdepot.server.host import shard_hash, shard_record
from kvdepot.server.host.shard_record import ShardRecord, data_hash, hash_of, pack, unpack


@pytest.fixture
def no_native():
    """Neither hash compiled (a test that loads the library sets both again)."""
    saved = (shard_hash._native, shard_hash._native_many), (shard_record._native_many, shard_record._native_at)
    shard_hash.use_native(None)
    shard_record.use_native(None)
    yield
    shard_hash.use_native(*saved[0])
    shard_record.use_native(*saved[1])


def test_a_changed_word_swapped_blocks_and_another_length_change_the_hash(no_native):
    data = bytearray(os.urandom(5 * 4096 + 64))
    h = shard_hash.gpu_hash(bytes(data))
    for at in (0, 7, 4095, 4096 + 8, len(data) - 1):
        changed = bytearray(data)
        changed[at] ^= 0x10
        assert shard_hash.gpu_hash(bytes(changed)) != h
    swapped = bytearray(data)
    swapped[0:4096], swapped[4096:8192] = data[4096:8192], data[0:4096]
    assert shard_hash.gpu_hash(bytes(swapped)) != h
    zeros = bytes(8192)
    assert len({shard_hash.gpu_hash(zeros, n) for n in (8, 16, 4096, 4104, 8192)}) == 5
    with pytest.raises(ValueError, match="whole 8-byte words"):
        shard_hash.gpu_hash(bytes(12))


def test_the_compiled_hash_is_the_definitions():
    binding = pytest.importorskip("kvdepot.server.native.binding")
    try:
        lib = binding.load()
    except OSError as e:
        pytest.skip(f"the native lane is not built ({e})")
    memory = mmap.mmap(-1, 3 << 20)
    memory[:] = os.urandom(3 << 20)
    view = memoryview(memory)
    for length in (8, 4096, 4104, 18432, 2 << 20, 3 << 20):
        shard_hash.use_native(lib.kvd_gpu_hash)
        fast = shard_hash.gpu_hash(view, length)
        shard_hash.use_native(None)
        assert fast == shard_hash.gpu_hash(view, length), length
    shard_hash.use_native(lib.kvd_gpu_hash, lib.kvd_gpu_hash_many)
    view.release()
    memory.close()


@pytest.mark.parametrize("compiled", [True, False])
def test_shards_hashed_at_once_are_each_hashed_alone(compiled, no_native):
    """Adoption hashes a part of the kept shards in one call: each hash is
    that shard's own, whatever its length and place."""
    if compiled:
        binding = pytest.importorskip("kvdepot.server.native.binding")
        try:
            binding.load()  # sets the compiled functions, which the fixture then restores
        except OSError as e:
            pytest.skip(f"the native lane is not built ({e})")
    memory = mmap.mmap(-1, 4 << 20)
    memory[:] = os.urandom(4 << 20)
    offsets = np.array([0, 4096, 1 << 20, (4 << 20) - 8, 24], dtype=np.uint64)
    lengths = np.array([4096, 18432, 3 << 20, 8, 8], dtype=np.uint64)
    hashes = shard_hash.gpu_hash_at(memory, offsets, lengths)
    view = memoryview(memory)
    for at, n, h in zip(offsets.tolist(), lengths.tolist(), hashes.tolist(), strict=True):
        assert h == shard_hash.gpu_hash(bytes(view[at : at + n])), (at, n)
    assert len(shard_hash.gpu_hash_at(memory, offsets[:0], lengths[:0])) == 0
    for bad_offsets, bad_lengths in (([4 << 20], [8]), ([(4 << 20) - 8], [16]), ([0], [12]), ([2**64 - 8], [16])):
        with pytest.raises(ValueError, match="outside the buffer|8-byte words"):
            shard_hash.gpu_hash_at(memory, np.array(bad_offsets, dtype=np.uint64),
                                   np.array(bad_lengths, dtype=np.uint64))
    view.release()
    memory.close()


@pytest.mark.parametrize("compiled", [True, False])
def test_cpu_sealed_shards_hashed_at_once_are_each_hashed_alone(compiled, no_native):
    """Adoption checks a part of the CPU-sealed shards (xxh3) in one call too:
    each hash is that shard's own, and a changed byte in one changes only its."""
    if compiled:
        binding = pytest.importorskip("kvdepot.server.native.binding")
        try:
            binding.load()
        except OSError as e:
            pytest.skip(f"the native lane is not built ({e})")
        assert shard_record._native_at is not None
    memory = mmap.mmap(-1, 4 << 20)
    memory[:] = os.urandom(4 << 20)
    offsets = np.array([0, 4096, 1 << 20, (4 << 20) - 1, 24, 77], dtype=np.uint64)
    lengths = np.array([4096, 18432, 3 << 20, 1, 8, 0], dtype=np.uint64)
    hashes = shard_record.data_hash_at(memory, offsets, lengths)
    view = memoryview(memory)
    for at, n, h in zip(offsets.tolist(), lengths.tolist(), hashes.tolist(), strict=True):
        assert h == data_hash(bytes(view[at : at + n])), (at, n)
    memory[4096 + 100] ^= 0x01  # in the second shard only
    again = shard_record.data_hash_at(memory, offsets, lengths)
    assert [a != b for a, b in zip(hashes.tolist(), again.tolist(), strict=True)] == [False, True, False, False,
                                                                                       False, False]
    assert len(shard_record.data_hash_at(memory, offsets[:0], lengths[:0])) == 0
    wraps = 2**64 - 8  # with a length of 16, the sum wraps to 8
    for bad_offsets, bad_lengths in (([4 << 20], [8]), ([(4 << 20) - 8], [16]), ([wraps], [16]), ([8], [wraps])):
        with pytest.raises(ValueError, match="outside the buffer"):
            shard_record.data_hash_at(memory, np.array(bad_offsets, dtype=np.uint64),
                                      np.array(bad_lengths, dtype=np.uint64))
    view.release()
    memory.close()


def test_a_record_says_which_hash_it_carries():
    data = os.urandom(8192)
    gpu = ShardRecord(b"n" * 16, b"k" * 32, 0, 1, len(data), shard_hash.gpu_hash(data), 5, gpu_hashed=True)
    cpu = ShardRecord(b"n" * 16, b"k" * 32, 0, 1, len(data), data_hash(data), 6)
    for record in (gpu, cpu):
        back, why = unpack(pack(record))
        assert why == "" and back == record
        assert hash_of(back, data) == back.data_hash
    # A record of one hash read as the other never holds.
    assert hash_of(gpu._replace(gpu_hashed=False), data) != gpu.data_hash
