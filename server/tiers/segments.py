"""The disk tier's segment files: their header, their name, and the scan of them.

A segment, seg-<sequence>.kvd, is a 4 KiB segment header (magic, format,
sequence, their hash), then records: each a 4 KiB header page (the shard's
record.pack() and zeros) and its data padded to 4 KiB, so that every record
can be written and read with O_DIRECT. The scan trusts nothing but the
self-hashed headers: it follows their chain and stops at the first that fails,
never resynchronising, since data pages (which tenants choose) must never be
read as headers.
"""

from __future__ import annotations

import os
import re
import struct
import time

import xxhash

from kvdepot.server.host.shard_record import FORMAT_VERSION, ShardRecord, unpack
from kvdepot.server.tiers.disk_counters import ScanCounts
from kvdepot.server.tiers.disk_folder import PAGE

RecordKey = tuple[bytes, bytes, int]  # (namespace digest, block key, rank)

SEGMENT_MAGIC = b"KVDSEGM1"
SEGMENT_NAME = re.compile(r"seg-(\d{12})\.kvd(\.partial)?\Z")
# magic, format, reserved, sequence; then the xxh3 of these.
_SEGMENT_HEADER = struct.Struct("<8sIIQ")
_HASH = struct.Struct("<Q")


def page_padded(n: int) -> int:
    return (n + PAGE - 1) & -PAGE


def segment_header(sequence: int) -> bytes:
    fields = _SEGMENT_HEADER.pack(SEGMENT_MAGIC, FORMAT_VERSION, 0, sequence)
    return fields + _HASH.pack(xxhash.xxh3_64_intdigest(fields))


def _segment_problem(raw, sequence: int) -> str:
    """Why the segment header in `raw` is not ours for `sequence`; "" when it is."""
    magic, version, _, found = _SEGMENT_HEADER.unpack_from(raw)
    if magic != SEGMENT_MAGIC:
        return "not a kvdepot segment"
    if version != FORMAT_VERSION:
        return f"a segment of format {version}, not {FORMAT_VERSION}"
    (stored,) = _HASH.unpack_from(raw, _SEGMENT_HEADER.size)
    if stored != xxhash.xxh3_64_intdigest(bytes(raw[: _SEGMENT_HEADER.size])) or found != sequence:
        return "its segment header is damaged"
    return ""


class Segment:
    """A segment file: its sequence, physical bytes, the keys it holds, and
    (the one being written) its descriptor and end."""

    __slots__ = ("seq", "path", "physical", "keys", "fd", "end")

    def __init__(self, seq: int, path: str, physical: int, fd: int = -1, end: int = PAGE):
        self.seq, self.path, self.physical, self.fd, self.end = seq, path, physical, fd, end
        self.keys: list[RecordKey] = []


def scan_segment(
    seq: int, path: str, dir_fd: int, index: dict, counts: ScanCounts, page, direct: bool, log
) -> Segment | None:
    """Indexes segment `seq`'s records into `index` by following its chain of
    record headers (one page read a record, `page` a page-aligned buffer);
    None, counted, for a segment that is not ours. `path` names it in the
    folder `dir_fd`, where it is opened."""
    try:
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if direct else 0)
        fd = os.open(os.path.basename(path), flags, dir_fd=dir_fd)
    except OSError as e:
        log.warning("skipping disk tier segment %s: %s", path, e.strerror)
        counts.segments_skipped += 1
        return None
    try:
        st = os.fstat(fd)
        size = st.st_size
        why = "it is too short" if size < PAGE or os.preadv(fd, [page], 0) < PAGE else _segment_problem(page, seq)
        if why:
            log.warning("skipping %s, %s: left in place, its space not counted", path, why)
            counts.segments_skipped += 1
            return None
        segment = Segment(seq, path, st.st_blocks * 512)
        offset = PAGE
        while offset < size:
            if offset + PAGE > size or os.preadv(fd, [page], offset) < PAGE:
                counts.torn += 1
                break
            record, why = unpack(page)
            if record is None:
                counts.ended_at(why)
                break
            end = offset + PAGE + page_padded(record.length)
            if end > size:
                counts.torn += 1
                break
            key = (record.ns, record.key, record.rank)
            index[key] = (seq, offset, record)  # a later copy of a key wins
            segment.keys.append(key)
            offset = end
        counts.segments += 1
        return segment
    except OSError as e:
        log.warning("reading disk tier segment %s failed (%s): skipped", path, e.strerror)
        counts.segments_skipped += 1
        return None
    finally:
        os.close(fd)


def scan_folder(
    directory: str, dir_fd: int, page, direct: bool, log
) -> tuple[dict, dict[int, Segment], ScanCounts, int]:
    """Indexes the segments in `directory`, oldest first, so that a later copy
    of a key wins: the index, the segments by sequence, what the scan found,
    and the highest sequence a file names (0 for none), a skipped one's too,
    since a new segment must not take its name."""
    counts = ScanCounts()
    index: dict[RecordKey, tuple[int, int, ShardRecord]] = {}  # key -> (sequence, offset, record)
    segments: dict[int, Segment] = {}
    found = []
    for name in os.listdir(dir_fd):
        match = SEGMENT_NAME.match(name)
        if match and match.group(2):  # a segment whose header was never written
            os.unlink(name, dir_fd=dir_fd)
        elif match:
            found.append((int(match.group(1)), name))
    found.sort()
    last = time.monotonic()
    for i, (seq, name) in enumerate(found):
        segment = scan_segment(seq, os.path.join(directory, name), dir_fd, index, counts, page, direct, log)
        if segment is not None:
            segments[seq] = segment
        if time.monotonic() - last >= 1.0:
            last = time.monotonic()
            log.info("scanning the disk tier: %d of %d segments, %d records", i + 1, len(found), len(index))
    return index, segments, counts, max((seq for seq, _ in found), default=0)
