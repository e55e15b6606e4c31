"""How one record goes into a segment file and comes back out of it.

A record is a header page and its data padded to whole pages (segments.py),
so that O_DIRECT can take it; but O_DIRECT also wants page-aligned memory,
which a caller's buffer may not be. Writes gather records into one pwritev,
copying through a bounce buffer only what O_DIRECT cannot take as it is;
reads land in the caller's buffer where they can, a tail page aside.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

from kvdepot.server.host.shard_record import RECORD_BYTES, ShardRecord, data_hash, pack, unpack
from kvdepot.server.tiers.disk_folder import PAGE
from kvdepot.server.tiers.segments import RecordKey, page_padded

# A pwritev gathers up to this much (and IOV_MAX buffers): few, large syscalls.
FLUSH_BYTES = 32 << 20
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
ZEROS = memoryview(bytes(PAGE))


def address(view: memoryview) -> int | None:
    """The address of a writable buffer; None for a read-only or empty one."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def bytes_view(data) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def pwritev_all(fd: int, iov: list, offset: int) -> tuple[int, OSError | None]:
    """Writes all of `iov` at `offset`: the bytes written, and the error that stopped it."""
    done = 0
    while iov:
        try:
            n = os.pwritev(fd, iov, offset + done)
        except OSError as e:
            return done, e
        if n == 0:
            return done, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n
        while iov and n >= len(iov[0]):
            n -= len(iov.pop(0))
        if n:
            iov[0] = iov[0][n:]
    return done, None


class Batch:
    """Records gathered for one pwritev at `start` of a segment, their header
    pages (and what O_DIRECT cannot take as it is) copied into `bounce`."""

    def __init__(self, start: int, bounce: mmap.mmap, direct: bool):
        self.start = start
        self._bounce = bounce
        self._direct = direct
        self.iov: list = []
        self.pending: list[tuple[RecordKey, ShardRecord, int, int]] = []  # key, record, offset, end
        self.nbytes = 0
        self.bounce_used = 0

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    def fits(self, record: ShardRecord) -> bool:
        """Whether `record` can join this write; +3: its header, its data and its padding."""
        return (self.bounce_used + PAGE + page_padded(record.length) <= len(self._bounce)
                and len(self.iov) + 3 <= IOV_MAX)

    def add(self, key: RecordKey, record: ShardRecord, view: memoryview) -> None:
        bounce = memoryview(self._bounce)
        offset = self.end
        header = bounce[self.bounce_used : self.bounce_used + PAGE]
        header[:RECORD_BYTES] = pack(record)
        header[RECORD_BYTES:] = ZEROS[RECORD_BYTES:]
        self.bounce_used += PAGE
        self.iov.append(header)
        length, padded = record.length, page_padded(record.length)
        if length:
            at = address(view) if self._direct else None
            if not self._direct:
                self.iov.append(view)
                if padded > length:
                    self.iov.append(ZEROS[: padded - length])
            elif at is not None and at % PAGE == 0 and length == padded:
                self.iov.append(view)  # zero copy
            else:  # O_DIRECT needs aligned memory and whole pages
                if PAGE + padded > len(self._bounce):
                    copy = memoryview(mmap.mmap(-1, padded))  # larger than the bounce buffer: its own
                else:
                    copy = bounce[self.bounce_used : self.bounce_used + padded]
                    self.bounce_used += padded
                copy[:length] = view
                copy[length:] = bytes(padded - length)
                self.iov.append(copy)
        self.nbytes += PAGE + padded
        self.pending.append((key, record, offset, offset + PAGE + padded))

    def write(self, fd: int) -> tuple[list[tuple[RecordKey, ShardRecord, int, int]], OSError | None]:
        """Writes what is gathered: the records that landed whole (as `pending`
        holds them), and the error that stopped the rest."""
        done, error = pwritev_all(fd, self.iov, self.start)
        landed = [p for p in self.pending if p[3] <= self.start + done]
        self.iov.clear()
        self.pending.clear()
        return landed, error


def read_record(
    name: str, dir_fd: int, offset: int, record: ShardRecord, into: memoryview, pages: tuple, direct: bool
) -> str:
    """Why the record at `offset` of segment `name` (in the folder `dir_fd`) is
    not `record`; "" when its data, now in `into`, is. `pages`: two
    page-aligned pages (a header, a data tail)."""
    header, tail_page = pages
    length = record.length
    tail = 0
    at = address(into) if direct else None
    if at is not None and at % PAGE == 0:
        floor = length & -PAGE
        tail = length - floor
        iov = [header] + ([into[:floor]] if floor else []) + ([tail_page] if tail else [])
        expect, flags = PAGE + page_padded(length), os.O_DIRECT
    else:
        iov = [header] + ([into[:length]] if length else [])
        expect, flags = PAGE + length, 0
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | flags, dir_fd=dir_fd)
    try:
        n = os.preadv(fd, iov, offset)
    finally:
        os.close(fd)
    if n < expect:
        return "the segment ends inside it"
    found, why = unpack(header)
    if found != record:
        return f"its header changed ({why or 'another record'})"
    if tail:
        into[length - tail : length] = tail_page[:tail]
    if data_hash(into[:length]) != record.data_hash:
        return "its data does not match its hash"
    return ""
