"""The pool's files, opened and mapped into one range of addresses
(kvdepot/pool_parts.py says which bytes each file holds).

One file is mapped as it is. Several are mapped stripe by stripe over a
range reserved first, so that slots, records and the CUDA registration see
one range of addresses whatever the files behind it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

from kvdepot.pool_parts import Layout, part_path
from kvdepot.server.host.own_files import open_own

_MAP_FIXED = 0x10
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)


class PoolFiles:
    """The files of the pool named `path`, created (`create`) or opened as
    they are, each checked on its descriptor to be this user's alone, and
    mapped: `buffer` spans the whole range, at `base`. OSError (ForeignFile
    among them) when a file cannot be made, opened or mapped; what this made
    is gone again."""

    def __init__(self, path: str, layout: Layout, create: bool):
        self.layout = layout
        self.paths = [part_path(path, layout, part) for part in range(layout.parts)]
        self.fds: list[int] = []
        self._made = 0  # files this created: removed again if the rest fails
        sizes = layout.part_sizes()
        try:
            for part, name in enumerate(self.paths):
                fd = open_own(name, os.O_RDWR | os.O_CREAT | os.O_EXCL if create else os.O_RDWR)
                self.fds.append(fd)
                self._made += create
                os.fchmod(fd, 0o600)  # whatever the umask
                if create:
                    os.ftruncate(fd, sizes[part])
                elif os.fstat(fd).st_size != sizes[part]:
                    raise OSError(f"{name} has {os.fstat(fd).st_size} bytes where its pool's header makes "
                                  f"{sizes[part]}")
            self.buffer = self._map()
        except BaseException:
            self.close()
            _unlink(self.paths[: self._made][::-1])
            raise
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))

    def _map(self) -> mmap.mmap:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if self.layout.parts == 1:
            return mmap.mmap(self.fds[0], self.layout.size, mmap.MAP_SHARED, prot)
        buffer = reserve(self.layout.size)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        try:
            for offset, length, part, file_offset in self.layout.pieces():
                got = _LIBC.mmap(base + offset, length, prot, mmap.MAP_SHARED | _MAP_FIXED, self.fds[part],
                                 file_offset)
                if got != base + offset:
                    code = ctypes.get_errno()
                    hint = " (vm.max_map_count, a mapping a stripe)" if code == errno.ENOMEM else ""
                    raise OSError(code, f"mapping {self.paths[part]} into the pool: {os.strerror(code)}{hint}")
        except BaseException:
            buffer.close()
            raise
        return buffer

    def pieces(self, offset: int, length: int, most: int) -> list[tuple[int, int, int, int]]:
        """(offset in the pool, length, file descriptor, offset in that file)
        of [offset, offset + length), in pieces of at most `most` bytes that
        each lie in one file."""
        out = []
        for at, size, part, file_at in self.layout.pieces(offset, length):
            for step in range(0, size, most):
                out.append((at + step, min(most, size - step), self.fds[part], file_at + step))
        return out

    def close(self, remove: bool = False) -> None:
        """Closes the descriptors (the mapping stays with `buffer`); with `remove`, the files go."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if remove:  # the first file last, as kept_pools.discard
            _unlink(self.paths[::-1])


def reserve(size: int) -> mmap.mmap:
    """`size` bytes of addresses for the files' mappings to replace: a
    shared mapping of an empty memfd, never touched. Shared file mappings
    take no commit charge, where a private writable one would take the
    pool's size at once under vm.overcommit_memory=2."""
    fd = os.memfd_create("kvdepot-pool-range", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _unlink(paths: list[str]) -> None:
    for name in paths:
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
