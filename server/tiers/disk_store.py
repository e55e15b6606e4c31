"""The local disk tier: shards appended as self-describing records to segment files.

A directory (disk_folder.py: its lock and fingerprint) holds segments of at
most `segment_bytes` each (segments.py: their format and scan). Space comes
back a whole segment at a time: the oldest goes when a new one would not fit
in the capacity. This module is the store over them: the index of records,
batched writes, checked reads and eviction, which share one lock's state
(disk_io.py: how one record is written and read; disk_counters.py: what
the store counts).

Nothing but the files is trusted at start: the scan follows each segment's
chain of self-hashed record headers (one 4 KiB read a record, no data read),
and read() checks the data against its record's hash. The chain is never
resynchronised past a bad header, and a segment is never written again after
a failed write or a restart: data pages, which tenants choose, are never read
as headers, so a tenant cannot forge a record of another namespace.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from dataclasses import replace

from kvdepot.logsafe import RateLimitedLog
from kvdepot.server.host.shard_record import ShardRecord
from kvdepot.server.tiers.disk_counters import DiskCounters, ScanCounts
from kvdepot.server.tiers.disk_folder import (
    PAGE,
    DiskTierError,
    check_fingerprint,
    load_cleared,
    open_directory,
    probe_direct,
    save_cleared,
    take_lock,
)
from kvdepot.server.tiers.disk_io import FLUSH_BYTES, ZEROS, Batch, bytes_view, read_record
from kvdepot.server.tiers.disk_shares import ShareRule, choose_victims
from kvdepot.server.tiers.segments import RecordKey, Segment, page_padded, scan_folder, segment_header

# Kept free beyond a segment's bytes for the filesystem's own blocks of it (extent trees).
SLACK = 64 << 10
SEGMENT_BYTES = 256 << 20


# The log a tier writes to unless told another (the tests give their own).
DISK_LOG = logging.getLogger("kvdepot.disk")


class DiskTier:
    def __init__(
        self,
        directory: str,
        capacity: int,
        *,
        segment_bytes: int = SEGMENT_BYTES,
        direct: str = "auto",
        fresh: bool = False,
        log: logging.Logger = DISK_LOG,
    ):
        if direct not in ("auto", "on", "off"):
            raise ValueError(f"direct must be auto, on or off, not {direct!r}")
        self.directory = os.path.abspath(directory)
        self.capacity = int(capacity)
        self.segment_bytes = segment_bytes // PAGE * PAGE
        self._log = log
        self._limited = RateLimitedLog(log)
        if self.segment_bytes < 2 * PAGE:
            raise DiskTierError(f"segment_bytes ({segment_bytes}) must be at least {2 * PAGE}")
        if self.capacity < self.segment_bytes + SLACK:
            raise DiskTierError(
                f"the disk tier's capacity ({self.capacity / 2**20:.1f} MiB) is smaller than one segment "
                f"({(self.segment_bytes + SLACK) / 2**20:.1f} MiB): raise the capacity or lower segment_bytes"
            )
        self._lock = threading.Lock()  # the index, the segments' table and the counters
        self._write_lock = threading.Lock()  # one writer at a time; the current segment and the bounce buffer
        self._local = threading.local()
        self._index: dict[RecordKey, tuple[int, int, ShardRecord]] = {}  # key -> (sequence, offset, record)
        self._segments: dict[int, Segment] = {}  # in sequence order: oldest first
        self._current: Segment | None = None
        self._next_seq = 1
        self._lock_fd = -1
        self._dir_fd = -1
        self._bounce: mmap.mmap | None = None
        self._direct = False
        # Its records, bytes_used and segments are left at 0: the snapshot counts them.
        self._counts = DiskCounters()
        # Called (on the writing thread) with the keys each eviction dropped.
        self.on_evict = None
        # Whose records go when the disk is full (disk_shares.py); its bytes by
        # namespace follow the index, under the lock.
        self.shares = ShareRule(self.capacity)
        # Every name below is reached through this descriptor (disk_folder.py).
        self._dir_fd = open_directory(self.directory)
        try:
            self._lock_fd = take_lock(self.directory, self._dir_fd)
        except BaseException:
            os.close(self._dir_fd)
            raise
        try:
            check_fingerprint(self.directory, self._dir_fd, fresh, log)
            self._direct = probe_direct(self.directory, self._dir_fd, direct, log)
            self._cleared = load_cleared(self.directory, self._dir_fd)
            self._bounce = mmap.mmap(-1, FLUSH_BYTES + PAGE)
            self.scan()
            try:
                self._evict_until(0)  # a capacity lowered since the last run
            except OSError as e:
                log.warning("could not evict disk tier segments down to its capacity: %s", e)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ start-up

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _pages(self) -> tuple[memoryview, memoryview]:
        """Two page-aligned pages of this thread's (a header, a data tail)."""
        pages = getattr(self._local, "pages", None)
        if pages is None:
            view = memoryview(mmap.mmap(-1, 2 * PAGE))
            pages = self._local.pages = (view[:PAGE], view[PAGE:])
        return pages

    def scan(self) -> ScanCounts:
        """Rebuilds the index from the segment files; returns what it found."""
        with self._write_lock:
            self._seal()
            started = time.monotonic()
            index, segments, counts, last = scan_folder(
                self.directory, self._dir_fd, self._pages()[0], self._direct, self._log
            )
            self._drop_cleared(index, segments, counts)
            counts.records = len(index)
            counts.bytes = sum(loc[2].length for loc in index.values())
            with self._lock:
                self._index, self._segments, self._counts.scan = index, segments, counts
                self.shares.ns_bytes = {}
                for (digest, _, _), (_, _, record) in index.items():
                    self.shares.add(digest, record.length)
                self._next_seq = max(last, self._next_seq - 1) + 1
            problems = counts.problems()
            self._log.info(
                "disk tier at %s: %d records (%.2f GiB) in %d segments, scanned in %.1f s%s (%s I/O)",
                self.directory, counts.records, counts.bytes / 2**30, counts.segments,
                time.monotonic() - started, f"; {problems}" if problems else "",
                "direct" if self._direct else "buffered")
            return replace(counts)

    # ------------------------------------------------------------ queries

    @property
    def direct(self) -> bool:
        return self._direct

    def contains(self, key: RecordKey) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[RecordKey]:
        with self._lock:
            return list(self._index)

    def record(self, key: RecordKey) -> ShardRecord | None:
        with self._lock:
            loc = self._index.get(key)
        return None if loc is None else loc[2]

    def _drop_cleared(self, index: dict, segments: dict, counts: ScanCounts) -> None:
        """Leaves out the records of namespaces cleared after they were written."""
        if not self._cleared:
            return
        everything = self._cleared.get("*", 0)
        for key, (seq, _, _) in list(index.items()):
            if seq <= max(everything, self._cleared.get(key[0].hex(), 0)):
                del index[key]
                counts.cleared += 1
        # A clear older than every segment left has nothing more to hide.
        oldest = min(segments, default=None)
        kept = {n: seq for n, seq in self._cleared.items() if oldest is not None and seq >= oldest}
        if kept != self._cleared:
            self._cleared = kept
            save_cleared(self.directory, self._dir_fd, kept)

    def forget(self, digest: bytes | None) -> None:
        """`kvdepot clear`: the namespace's records (all when None) leave the
        index now, and stay out at the next start (blocking: a thread's job)."""
        with self._write_lock:
            self._seal()  # later records go to newer segments, which the clear spares
            with self._lock:
                name = "*" if digest is None else digest.hex()
                self._cleared[name] = self._next_seq - 1
                for key in [k for k in self._index if digest is None or k[0] == digest]:
                    self._unindex(key)
                cleared = dict(self._cleared)
            save_cleared(self.directory, self._dir_fd, cleared)

    def discard(self, key: RecordKey) -> None:
        """Forgets one record; its space comes back with its segment."""
        with self._lock:
            self._unindex(key)

    @property
    def counters(self) -> DiskCounters:
        with self._lock:
            return replace(
                self._counts, records=len(self._index), bytes_used=sum(s.physical for s in self._segments.values()),
                segments=len(self._segments), scan=replace(self._counts.scan))

    # ------------------------------------------------------------ writing

    def write(self, items: list[tuple[ShardRecord, memoryview]]) -> list[RecordKey]:
        """Appends records (blocking: call it from a worker thread); returns the keys
        written. Keys already on disk are skipped. An I/O error stops the write
        without raising: what landed before it is indexed and returned."""
        checked = []
        for record, data in items:
            view = bytes_view(data)
            if len(view) != record.length:
                raise ValueError(f"a record of {record.length} bytes given {len(view)} bytes of data")
            checked.append((record, view))
        written: list[RecordKey] = []
        with self._write_lock:
            if self._lock_fd < 0:
                raise ValueError("the disk tier is closed")
            batch = None
            seen = set()
            try:
                for record, view in checked:
                    key = (record.ns, record.key, record.rank)
                    with self._lock:
                        known = key in self._index
                    if known or key in seen:
                        continue
                    seen.add(key)
                    size = PAGE + page_padded(record.length)
                    if max(self.segment_bytes, PAGE + size) + SLACK > self.capacity:
                        with self._lock:
                            self._counts.too_large += 1
                        self._limited.warning("too_large", "a record of %d bytes does not fit in the disk tier's "
                                              "capacity: not written", record.length)
                        continue
                    segment = self._current
                    end = batch.end if batch is not None else segment.end if segment else 0
                    if segment is None or (end + size > self.segment_bytes and end > PAGE):
                        self._flush(batch, written)
                        self._roll(size, self.shares.scope_of(record.ns))
                        batch = None
                    if batch is None or not batch.fits(record):
                        self._flush(batch, written)
                        batch = Batch(self._current.end, self._bounce, self._direct)
                    batch.add(key, record, view)
                    if batch.nbytes >= FLUSH_BYTES:
                        self._flush(batch, written)
                        batch = None
                self._flush(batch, written)
            except OSError as e:
                self._write_failed(e, len(written))
        return written

    def _flush(self, batch: Batch | None, written: list[RecordKey]) -> None:
        if batch is None or not batch.iov:
            return
        segment = self._current
        landed, error = batch.write(segment.fd)
        if landed:
            segment.end = landed[-1][3]
        try:
            physical = os.fstat(segment.fd).st_blocks * 512
        except OSError:
            physical = segment.physical
        with self._lock:
            for key, record, offset, _ in landed:
                self._unindex(key)
                self._index[key] = (segment.seq, offset, record)
                self.shares.add(key[0], record.length)
                segment.keys.append(key)
                self._counts.bytes_written += record.length
            segment.physical = physical
        written.extend(p[0] for p in landed)
        if error is not None:
            raise error

    def _write_failed(self, error: OSError, landed: int) -> None:
        with self._lock:
            self._counts.write_errors += 1
        segment = self._current
        self._limited.warning("write", "writing to the disk tier failed (%s) in %s; %d records were written",
                              error.strerror or error, segment.path if segment else self.directory, landed)
        if segment is not None:
            # Never written again: a later record must not land on a region that
            # may hold a part of this write.
            try:
                os.ftruncate(segment.fd, segment.end)
            except OSError:
                pass
            self._seal(sync=False)

    def _seal(self, sync: bool = True) -> None:
        """Closes the current segment; the next write starts a new one."""
        segment, self._current = self._current, None
        if segment is None:
            return
        try:
            if sync:
                os.fdatasync(segment.fd)
            physical = os.fstat(segment.fd).st_blocks * 512
            with self._lock:
                segment.physical = physical
        except OSError as e:
            with self._lock:
                self._counts.write_errors += 1
            self._limited.warning("seal", "syncing disk tier segment %s failed: %s", segment.path, e.strerror)
        finally:
            os.close(segment.fd)
            segment.fd = -1

    def _roll(self, size: int, scope: str) -> None:
        self._seal()
        if not self._evict_until(max(self.segment_bytes, PAGE + size) + SLACK, scope):
            raise OSError(errno.ENOSPC, "no room in the disk tier's capacity")
        seq = self._next_seq
        self._next_seq += 1
        name = f"seg-{seq:012d}.kvd"
        path = self._path(name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if self._direct else 0)
        fd = os.open(name + ".partial", flags, 0o600, dir_fd=self._dir_fd)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            page = self._pages()[0]
            page[:] = ZEROS
            header = segment_header(seq)
            page[: len(header)] = header
            if os.pwrite(fd, page, 0) != PAGE:
                raise OSError(errno.EIO, "short write of a segment header")
            os.rename(name + ".partial", name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
            physical = os.fstat(fd).st_blocks * 512
        except BaseException:
            os.close(fd)
            try:
                os.unlink(name + ".partial", dir_fd=self._dir_fd)
            except OSError:
                pass
            raise
        segment = Segment(seq, path, physical, fd)
        with self._lock:
            self._segments[seq] = segment
        self._current = segment

    def _unindex(self, key: RecordKey) -> None:
        """Drops a record from the index (under the lock), and its bytes from its namespace's."""
        loc = self._index.pop(key, None)
        if loc is not None:
            self.shares.add(key[0], -loc[2].length)

    def _evict_until(self, reserve: int, scope: str | None = None) -> bool:
        """Frees room until `reserve` more bytes fit, for a record of `scope`
        (disk_shares.py: whose records go); False if they cannot."""
        while True:
            with self._lock:
                if sum(s.physical for s in self._segments.values()) + reserve <= self.capacity:
                    return True
                segment, dropped = choose_victims(self._segments, self._index, self._current, scope, self.shares)
                if segment is None and not dropped:
                    return False
                # Out of the index before the file goes: a reader that finds the
                # file gone then finds its key gone too, and counts no error.
                for key in dropped:
                    self._unindex(key)
                if segment is not None:
                    del self._segments[segment.seq]
            if segment is not None:
                try:
                    os.unlink(os.path.basename(segment.path), dir_fd=self._dir_fd)
                except FileNotFoundError:
                    pass
                except OSError:
                    with self._lock:  # still there, and still taking its space
                        self._segments = {segment.seq: segment, **self._segments}
                    raise
            with self._lock:
                self._counts.segments_evicted += segment is not None
                self._counts.records_evicted += len(dropped)
            if self.on_evict is not None and dropped:
                self.on_evict(dropped)
            if segment is not None:
                self._log.debug("evicted disk tier segment %s (%d records)", segment.path, len(dropped))

    # ------------------------------------------------------------ reading

    def read(self, key: RecordKey, into: memoryview) -> bool:
        """Reads a record's data into `into` (blocking: call it from a worker thread)
        and checks it against its record. False, the key dropped, if it is not all there."""
        with self._lock:
            loc = self._index.get(key)
        if loc is None:
            return False
        seq, offset, record = loc
        into = bytes_view(into)
        if len(into) < record.length:
            raise ValueError(f"a record of {record.length} bytes read into {len(into)} bytes")
        name = f"seg-{seq:012d}.kvd"
        path = self._path(name)
        try:
            why = read_record(name, self._dir_fd, offset, record, into, self._pages(), self._direct)
            io_error = False
        except OSError as e:
            with self._lock:
                if self._index.get(key) is not loc:
                    return False  # evicted or discarded meanwhile
            why, io_error = e.strerror or str(e), True
        with self._lock:
            if not why:
                self._counts.bytes_read += record.length
                return True
            if self._index.get(key) is loc:
                self._unindex(key)
            if io_error:
                self._counts.read_errors += 1
            else:
                self._counts.corrupt += 1
        self._limited.warning(
            "read_errors" if io_error else "corrupt", "disk tier record %s rank %d at %d of %s failed (%s): dropped",
            key[1][:8].hex(), key[2], offset, path, why,
        )
        return False

    # ------------------------------------------------------------ end

    def close(self) -> None:
        """Syncs and closes the current segment and releases the directory's lock."""
        with self._write_lock:
            self._seal()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
                self._dir_fd = -1
            if self._bounce is not None:
                try:
                    self._bounce.close()
                except BufferError:  # a view of it outlived a failed write; it goes with the object
                    pass
                self._bounce = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
