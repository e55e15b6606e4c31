"""The disk tier's segment store, on real files: what comes back, what survives
a restart, what is refused, and that the capacity holds."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import random
import shutil
import stat
import tempfile
import threading

import pytest

from kvdepot.server.host.pool_folder import filesystem_type
from kvdepot.server.host.shard_record import ShardRecord, data_hash
from kvdepot.server.tiers import disk_io
from kvdepot.server.tiers import disk_store as disk_module
from kvdepot.server.tiers.disk_folder import probe_direct
from kvdepot.server.tiers.disk_store import PAGE, DiskTier, DiskTierError, segment_header

NS = bytes(range(16))
SEGMENT = 256 << 10


def make(i: int, length: int, rng: random.Random, ns: bytes = NS, rank: int = 0):
    data = rng.randbytes(length)
    return ShardRecord(ns, i.to_bytes(32, "little"), rank, 2, length, data_hash(data)), data


def key(record: ShardRecord):
    return (record.ns, record.key, record.rank)


def segment_files(directory) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.startswith("seg-"))


def read_back(tier: DiskTier, record: ShardRecord) -> bytes | None:
    into = bytearray(record.length + 5)  # larger than the record, and not page aligned
    return bytes(into[: record.length]) if tier.read(key(record), memoryview(into)) else None


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.fixture(params=["auto", "off"])
def direct(request):
    return request.param


LENGTHS = [0, 1, 4095, 4096, 4097, 3 * 4096, 100_000, 300_000]  # one larger than a segment


def test_bytes_round_trip_exactly(tmp_path, direct):
    rng = random.Random(1)
    items = [make(i, n, rng) for i, n in enumerate(LENGTHS)]
    # Page-aligned sources too (slots of an mmap), whose pages O_DIRECT writes without a copy.
    source = mmap.mmap(-1, 16 * PAGE)
    for i, n in enumerate((PAGE, 3 * PAGE, 5000)):
        record, data = make(100 + i, n, rng)
        source[4 * PAGE * i : 4 * PAGE * i + n] = data
        items.append((record, memoryview(source)[4 * PAGE * i : 4 * PAGE * i + n]))
    with DiskTier(str(tmp_path / "d"), 8 << 20, segment_bytes=SEGMENT, direct=direct) as tier:
        assert tier.write([(r, memoryview(d)) for r, d in items]) == [key(r) for r, _ in items]
        for record, data in items:
            assert read_back(tier, record) == bytes(data)
            # And into page-aligned memory, which O_DIRECT reads into.
            into = memoryview(mmap.mmap(-1, max(PAGE, -(-record.length // PAGE) * PAGE)))
            assert tier.read(key(record), into)
            assert into[: record.length] == bytes(data)
        assert tier.counters.bytes_written == tier.counters.bytes_read // 2 == sum(r.length for r, _ in items)
        assert tier.counters.corrupt == tier.counters.read_errors == 0
        assert tier.direct == (direct == "auto" and filesystem_type(str(tmp_path)) not in ("tmpfs", "ramfs"))


def test_restart_finds_every_record_bit_exact(tmp_path, direct):
    rng = random.Random(2)
    items = [make(i, rng.choice(LENGTHS[1:]), rng) for i in range(30)]
    with DiskTier(str(tmp_path), 16 << 20, segment_bytes=SEGMENT, direct=direct) as tier:
        for start in range(0, 30, 7):  # several writes, several segments
            tier.write([(r, memoryview(d)) for r, d in items[start : start + 7]])
    with DiskTier(str(tmp_path), 16 << 20, segment_bytes=SEGMENT, direct=direct) as tier:
        assert sorted(tier.keys()) == sorted(key(r) for r, _ in items)
        assert tier.counters.scan.records == 30 and tier.counters.scan.torn == 0
        for record, data in items:
            assert tier.record(key(record)) == record
            assert read_back(tier, record) == data


def test_flipped_data_byte_fails_the_read_and_drops_the_key(tmp_path):
    rng = random.Random(3)
    record, data = make(1, 10_000, rng)
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        tier.write([(record, memoryview(data))])
        # The segment header page, the record's header page, then its data.
        flip(segment_files(tmp_path)[0], 2 * PAGE + 7000)
        assert read_back(tier, record) is None
        assert not tier.contains(key(record))
        assert tier.counters.corrupt == 1 and tier.counters.records == 0


def test_flipped_header_byte_is_skipped_at_restart(tmp_path):
    rng = random.Random(4)
    items = [make(i, 5000, rng) for i in range(3)]  # 4 KiB header + 8 KiB data each
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        tier.write([(r, memoryview(d)) for r, d in items])
    flip(segment_files(tmp_path)[0], PAGE + 3 * PAGE + 100)  # the second record's header
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        assert tier.counters.scan.torn == 1
        # The chain of headers stops there: a data page is never taken for a header.
        assert tier.keys() == [key(items[0][0])]
        assert read_back(tier, items[0][0]) == items[0][1]


def test_a_record_a_tenant_forged_in_its_data_is_never_indexed(tmp_path):
    """A tenant chooses its blocks' bytes: one whose data is a well-formed record
    header (its own hash right) of another namespace, with data after it, must
    never become that namespace's record, even when the chain of real headers
    breaks just before it (a torn write, a flipped bit)."""
    rng = random.Random(6)
    victim_ns = b"V" * 16
    forged_data = rng.randbytes(PAGE)
    forged = ShardRecord(victim_ns, b"K" * 32, 0, 1, PAGE, data_hash(forged_data))
    from kvdepot.server.host.shard_record import pack

    payload = pack(forged).ljust(PAGE, b"\0") + forged_data  # a header page, then its data page
    honest, data = make(1, 5000, rng)
    tenant = ShardRecord(NS, (2).to_bytes(32, "little"), 0, 2, len(payload), data_hash(payload))
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        tier.write([(honest, memoryview(data)), (tenant, memoryview(payload))])
    flip(segment_files(tmp_path)[0], PAGE + 3 * PAGE + 100)  # the tenant's record header
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        assert (victim_ns, b"K" * 32, 0) not in tier.keys()
        assert tier.keys() == [key(honest)]


def test_segment_of_another_format_is_skipped_and_left_alone(tmp_path):
    foreign = tmp_path / "seg-000000000007.kvd"
    foreign.write_bytes(b"not a segment".ljust(3 * PAGE, b"\xff"))
    other_format = tmp_path / "seg-000000000008.kvd"
    header = bytearray(segment_header(8))
    header[8] = 99  # the format field
    other_format.write_bytes(bytes(header).ljust(2 * PAGE, b"\0"))
    rng = random.Random(5)
    record, data = make(1, 5000, rng)
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        assert tier.counters.scan.segments_skipped == 2
        assert tier.counters.segments == 0 and tier.counters.bytes_used == 0
        tier.write([(record, memoryview(data))])
        assert read_back(tier, record) == data
    assert foreign.read_bytes().startswith(b"not a segment")
    assert other_format.stat().st_size == 2 * PAGE
    assert len(segment_files(tmp_path)) == 3  # a new sequence, past the foreign ones


def test_second_tier_on_the_same_directory_is_refused(tmp_path):
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT):
        with pytest.raises(DiskTierError, match=f"pid {os.getpid()}"):
            DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT)
    DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT).close()  # free again after close()


def test_fingerprint_of_another_format_is_refused_and_fresh_clears_only_segments(tmp_path):
    rng = random.Random(6)
    record, data = make(1, 5000, rng)
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        tier.write([(record, memoryview(data))])
    (tmp_path / "kvdepot-disk.json").write_text('{"format": 999, "alignment": 4096, "kind": "kvdepot disk tier"}')
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DiskTierError, match="format 999"):
        DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT)
    assert len(segment_files(tmp_path)) == 1  # a refusal deletes nothing
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT, fresh=True) as tier:
        assert tier.keys() == [] and segment_files(tmp_path) == []
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT):  # the fingerprint is this format's again
        pass


def test_fresh_discards_segments_of_this_format_too(tmp_path):
    rng = random.Random(7)
    record, data = make(1, 5000, rng)
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        tier.write([(record, memoryview(data))])
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT, fresh=True) as tier:
        assert not tier.contains(key(record))


def physical_bytes(directory) -> int:
    return sum(os.stat(p).st_blocks * 512 for p in segment_files(directory))


def test_capacity_holds_evicting_oldest_whole_segments_across_restarts(tmp_path, direct):
    capacity = 4 * SEGMENT + (64 << 10)
    rng = random.Random(8)
    items = [make(i, rng.randrange(1, 40_000), rng) for i in range(180)]  # about 3x the capacity
    for part in (items[:90], items[90:]):
        with DiskTier(str(tmp_path), capacity, segment_bytes=SEGMENT, direct=direct) as tier:
            for start in range(0, len(part), 6):
                tier.write([(r, memoryview(d)) for r, d in part[start : start + 6]])
                assert tier.counters.bytes_used <= capacity
                assert physical_bytes(tmp_path) <= capacity
            assert tier.counters.segments_evicted > 0 and tier.counters.records_evicted > 0
    with DiskTier(str(tmp_path), capacity, segment_bytes=SEGMENT, direct=direct) as tier:
        kept = set(tier.keys())
        assert physical_bytes(tmp_path) <= capacity
        # The newest stay, the oldest went, and whatever stays reads back exactly.
        assert key(items[-1][0]) in kept and key(items[0][0]) not in kept
        assert len(kept) > 20
        for record, data in items:
            if key(record) in kept:
                assert read_back(tier, record) == data


def test_lower_capacity_at_restart_evicts_down_to_it(tmp_path):
    rng = random.Random(9)
    items = [make(i, 30_000, rng) for i in range(60)]
    with DiskTier(str(tmp_path), 16 << 20, segment_bytes=SEGMENT) as tier:
        tier.write([(r, memoryview(d)) for r, d in items])
    capacity = 2 * SEGMENT + (64 << 10)
    with DiskTier(str(tmp_path), capacity, segment_bytes=SEGMENT) as tier:
        assert tier.counters.bytes_used <= capacity and physical_bytes(tmp_path) <= capacity
        assert tier.contains(key(items[-1][0]))


def test_a_key_already_on_disk_is_not_rewritten(tmp_path):
    rng = random.Random(10)
    items = [make(i, 9000, rng) for i in range(4)]
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        assert len(tier.write([(r, memoryview(d)) for r, d in items[:2]])) == 2
        size = physical_bytes(tmp_path), os.path.getsize(segment_files(tmp_path)[-1])
        assert tier.write([(r, memoryview(d)) for r, d in items[:2]]) == []
        assert (physical_bytes(tmp_path), os.path.getsize(segment_files(tmp_path)[-1])) == size
        # In one call, a key given twice is written once.
        assert tier.write([(items[2][0], memoryview(items[2][1]))] * 2) == [key(items[2][0])]
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        assert tier.write([(r, memoryview(d)) for r, d in items]) == [key(items[3][0])]
        assert tier.counters.bytes_written == 9000


def test_files_are_0600_and_the_directory_0700(tmp_path):
    rng = random.Random(11)
    record, data = make(1, 5000, rng)
    old = os.umask(0)  # the most permissive umask: the modes must not depend on it
    try:
        directory = tmp_path / "new" / "tier"
        with DiskTier(str(directory), 4 << 20, segment_bytes=SEGMENT) as tier:
            tier.write([(record, memoryview(data))])
    finally:
        os.umask(old)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    names = sorted(os.listdir(directory))
    assert names == ["kvdepot-disk.json", "kvdepot-disk.lock", "seg-000000000001.kvd"]
    for name in names:
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600, name


def supports_o_direct(folder) -> bool:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return probe_direct(str(folder), fd, "auto", logging.getLogger("test"))
    finally:
        os.close(fd)


@pytest.fixture
def no_direct_dir(tmp_path):
    """A folder without O_DIRECT (tmpfs before Linux 6.6): tmp_path, or one in /dev/shm."""
    folder = tmp_path if filesystem_type(str(tmp_path)) == "tmpfs" else None
    if folder is None and os.path.isdir("/dev/shm") and filesystem_type("/dev/shm") == "tmpfs":
        folder = tempfile.mkdtemp(dir="/dev/shm", prefix="kvdepot-test-")
    try:
        if folder is None or supports_o_direct(folder):
            pytest.skip("every folder here supports O_DIRECT (tmpfs has since Linux 6.6)")
        yield folder
    finally:
        if folder is not None and folder != tmp_path:
            shutil.rmtree(folder)


def check_no_direct(folder) -> None:
    with pytest.raises(DiskTierError, match="O_DIRECT.*not supported"):
        DiskTier(str(folder), 4 << 20, segment_bytes=SEGMENT, direct="on")
    rng = random.Random(12)
    record, data = make(1, 5000, rng)
    with DiskTier(str(folder), 4 << 20, segment_bytes=SEGMENT, direct="auto") as tier:
        assert not tier.direct
        tier.write([(record, memoryview(data))])
        assert read_back(tier, record) == data
    with DiskTier(str(folder), 4 << 20, segment_bytes=SEGMENT, direct="auto") as tier:
        assert read_back(tier, record) == data


def test_a_filesystem_without_o_direct_is_refused_with_direct_on(no_direct_dir):
    check_no_direct(no_direct_dir)


def test_without_o_direct_auto_falls_back_to_buffered(tmp_path, monkeypatch):
    # As a filesystem without O_DIRECT answers, wherever this runs.
    real = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(disk_module.os, "open", no_direct)
    check_no_direct(tmp_path)


def test_a_failed_write_returns_what_landed_and_raises_nothing(tmp_path, monkeypatch):
    rng = random.Random(13)
    items = [make(i, 20_000, rng) for i in range(12)]  # 24 KiB each on disk
    real = os.pwritev
    budget = [5 * 24 * 1024 + 2 * PAGE]  # room for five records and a part of the sixth

    def full_disk(fd, buffers, offset):
        total = sum(len(b) for b in buffers)
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if total > budget[0]:  # a short write, as a filling disk gives
            keep, left = [], budget[0] // PAGE * PAGE
            for b in buffers:
                if left <= 0:
                    break
                keep.append(b[:left])
                left -= len(keep[-1])
            buffers = keep
        written = real(fd, buffers, offset)
        budget[0] -= written
        return written

    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=1 << 20) as tier:
        monkeypatch.setattr(disk_io.os, "pwritev", full_disk)
        written = tier.write([(r, memoryview(d)) for r, d in items])
        monkeypatch.setattr(disk_io.os, "pwritev", real)
        assert written == [key(r) for r, _ in items[:5]]
        assert tier.counters.write_errors == 1
        assert sorted(tier.keys()) == sorted(written)
        # The next write goes on, in a new segment.
        assert tier.write([(r, memoryview(d)) for r, d in items]) == [key(r) for r, _ in items[5:]]
        assert len(segment_files(tmp_path)) == 2
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=1 << 20) as tier:
        assert tier.counters.scan.records == 12
        for record, data in items:
            assert read_back(tier, record) == data


def test_a_record_larger_than_the_capacity_is_skipped(tmp_path):
    rng = random.Random(14)
    big, data = make(1, 5 << 20, rng)
    small, small_data = make(2, 100, rng)
    with DiskTier(str(tmp_path), 4 << 20, segment_bytes=SEGMENT) as tier:
        assert tier.write([(big, memoryview(data)), (small, memoryview(small_data))]) == [key(small)]
        assert tier.counters.too_large == 1


def test_reads_on_several_threads_while_writing_and_evicting(tmp_path):
    rng = random.Random(15)
    items = [make(i, rng.randrange(1, 30_000), rng) for i in range(300)]
    data_of = {key(r): d for r, d in items}
    problems = []
    with DiskTier(str(tmp_path), 4 * SEGMENT + (64 << 10), segment_bytes=SEGMENT) as tier:
        done = threading.Event()

        def reader():
            while not done.is_set():
                for k in tier.keys()[-20:]:
                    record = tier.record(k)
                    into = bytearray(30_000)
                    if record and tier.read(k, memoryview(into)) and bytes(into[: record.length]) != data_of[k]:
                        problems.append(k)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for start in range(0, len(items), 10):
            tier.write([(r, memoryview(d)) for r, d in items[start : start + 10]])
        done.set()
        for t in threads:
            t.join()
        assert problems == []
        assert tier.counters.corrupt == 0 and tier.counters.read_errors == 0
        assert tier.counters.segments_evicted > 0
