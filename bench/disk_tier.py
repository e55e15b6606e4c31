"""Throughput of the disk tier's segment store, against the disk measured in the same run.

    python bench/disk_tier.py [--dir DIR] [--total 2GiB] [--record-bytes 2MiB]
                              [--batch-bytes 64MiB] [--read-threads 4] [--json OUT]

In one directory (default ./.bench-disk, removed after):
1. The baseline: one file written with O_DIRECT (buffered where the filesystem
   has none) in 16 MiB aligned pwrites and fsync'd, then read back with O_DIRECT
   in 16 MiB preads after dropping it from the page cache; and read again a
   record's size a call on --read-threads threads, as the tier reads.
2. DiskTier.write of the same bytes as records of --record-bytes, in calls of
   --batch-bytes, then os.sync(); then DiskTier.read of every record (its hash
   checked) on --read-threads threads, after dropping the segments from the
   page cache.
Rates are GB/s (1e9 bytes) of record data; the ratios are tier / baseline.
A --record-bytes that is not a multiple of 4 KiB measures the copy through the
bounce buffer that O_DIRECT then needs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import errno
import json
import logging
import mmap
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvdepot.server.host.shard_record import ShardRecord, data_hash  # noqa: E402
from kvdepot.server.tiers.disk_store import DiskTier  # noqa: E402
from kvdepot.settings import parse_size  # noqa: E402

CHUNK = 16 << 20
PAGE = 4096


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def open_direct(path: str, flags: int) -> tuple[int, bool]:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o600), False


def baseline(directory: str, total: int, record_bytes: int, threads: int) -> dict:
    path = os.path.join(directory, "baseline.bin")
    buffer = mmap.mmap(-1, CHUNK)
    buffer[:] = os.urandom(CHUNK)
    fd, direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    started = time.perf_counter()
    try:
        for offset in range(0, total, CHUNK):
            os.pwrite(fd, buffer, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - started
    drop_cache(path)
    fd, _ = open_direct(path, os.O_RDONLY)
    started = time.perf_counter()
    try:
        for offset in range(0, total, CHUNK):
            if os.preadv(fd, [buffer], offset) != CHUNK:
                raise SystemExit("short read of the baseline file")
    finally:
        os.close(fd)
    read_s = time.perf_counter() - started
    # The same file read as the tier reads: a record a call, on as many threads.
    drop_cache(path)
    fd, _ = open_direct(path, os.O_RDONLY)
    size = -(-record_bytes // PAGE) * PAGE
    offsets = list(range(0, total - size + 1, size))

    def read_some(part: list) -> None:
        into = mmap.mmap(-1, size)
        for offset in part:
            os.preadv(fd, [into], offset)

    started = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(read_some, [offsets[i::threads] for i in range(threads)]))
    finally:
        os.close(fd)
    record_read_s = time.perf_counter() - started
    os.unlink(path)
    return {"direct": direct, "write_gbs": total / write_s / 1e9, "read_gbs": total / read_s / 1e9,
            "record_read_gbs": len(offsets) * size / record_read_s / 1e9}


def tier_run(directory: str, total: int, record_bytes: int, batch_bytes: int, threads: int) -> dict:
    per_batch = max(1, batch_bytes // record_bytes)
    slot = -(-record_bytes // PAGE) * PAGE
    # Page-aligned slots, as the host pool's are; random bytes, hashed once.
    source = mmap.mmap(-1, per_batch * slot)
    source[:] = os.urandom(len(source))
    views = [memoryview(source)[i * slot : i * slot + record_bytes] for i in range(per_batch)]
    hashes = [data_hash(v) for v in views]
    count = total // record_bytes
    ns = bytes(16)
    records = [ShardRecord(ns, i.to_bytes(32, "little"), 0, 1, record_bytes, hashes[i % per_batch])
               for i in range(count)]
    segment_bytes = 256 << 20
    capacity = count * (slot + PAGE) + 4 * segment_bytes  # nothing evicted
    tier = DiskTier(os.path.join(directory, "tier"), capacity, segment_bytes=segment_bytes)
    try:
        started = time.perf_counter()
        written = 0
        for first in range(0, count, per_batch):
            batch = [(records[i], views[i % per_batch]) for i in range(first, min(count, first + per_batch))]
            written += len(tier.write(batch))
        os.sync()
        write_s = time.perf_counter() - started
        if written != count:
            raise SystemExit(f"the tier wrote {written} of {count} records: {tier.counters}")
        for name in os.listdir(tier.directory):
            if name.startswith("seg-"):
                drop_cache(os.path.join(tier.directory, name))

        def read_some(part: list) -> int:
            into = memoryview(mmap.mmap(-1, slot))
            failed = 0
            for record in part:
                failed += not tier.read((record.ns, record.key, record.rank), into)
            return failed

        parts = [records[i::threads] for i in range(threads)]
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            failed = sum(pool.map(read_some, parts))
        read_s = time.perf_counter() - started
        if failed:
            raise SystemExit(f"{failed} reads failed: {tier.counters}")
        segments = tier.counters.segments
    finally:
        tier.close()
    return {"direct": tier.direct, "write_gbs": count * record_bytes / write_s / 1e9,
            "read_gbs": count * record_bytes / read_s / 1e9, "records": count, "segments": segments}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="./.bench-disk")
    parser.add_argument("--total", default="2GiB")
    parser.add_argument("--record-bytes", default="2MiB")
    parser.add_argument("--batch-bytes", default="64MiB")
    parser.add_argument("--read-threads", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3, help="baseline and tier runs, alternately")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    total = parse_size(args.total) // CHUNK * CHUNK
    record_bytes = parse_size(args.record_bytes)
    batch_bytes = parse_size(args.batch_bytes)
    created = not os.path.exists(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    runs = []
    print(f"{total / 2**30:.2f} GiB in {args.dir}, records of {record_bytes} bytes, "
          f"writes of {batch_bytes >> 20} MiB, reads on {args.read_threads} threads")
    try:
        for rep in range(args.reps):
            base = baseline(args.dir, total, record_bytes, args.read_threads)
            tier = tier_run(args.dir, total, record_bytes, batch_bytes, args.read_threads)
            shutil.rmtree(os.path.join(args.dir, "tier"))
            runs.append({"baseline": base, "tier": tier, "write_ratio": tier["write_gbs"] / base["write_gbs"],
                         "read_ratio": tier["read_gbs"] / base["read_gbs"],
                         "record_read_ratio": tier["read_gbs"] / base["record_read_gbs"]})
            io = "O_DIRECT" if base["direct"] else "buffered (no O_DIRECT here)"
            print(f"run {rep + 1}: baseline ({io}, 16 MiB calls) write+fsync {base['write_gbs']:.2f} GB/s, "
                  f"read {base['read_gbs']:.2f} GB/s, read a record a call {base['record_read_gbs']:.2f} GB/s; "
                  f"DiskTier ({'O_DIRECT' if tier['direct'] else 'buffered'}, {tier['segments']} segments) "
                  f"write+sync {tier['write_gbs']:.2f} GB/s, read+hash {tier['read_gbs']:.2f} GB/s")
    finally:
        if created:
            shutil.rmtree(args.dir, ignore_errors=True)
    medians = {k: statistics.median(r[k] for r in runs) for k in ("write_ratio", "read_ratio", "record_read_ratio")}
    print(f"tier / baseline (median of {len(runs)}): write {medians['write_ratio']:.2f}, "
          f"read {medians['read_ratio']:.2f}; read / baseline reads of a record a call "
          f"{medians['record_read_ratio']:.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"total_bytes": total, "record_bytes": record_bytes, "batch_bytes": batch_bytes,
                       "read_threads": args.read_threads, "runs": runs, "medians": medians}, f, indent=2)


if __name__ == "__main__":
    main()
