"""A lock file held for the process's life, naming the holder's pid.

The kernel releases an flock when its process dies, so a lock left by a crash
is free again, while a live holder's pid is there to name in the message.
The file may be in a folder others can write (the pool's /dev/shm): it is
opened without following links and must be this user's alone (own_files.py),
so that nobody can point the daemon's truncate and write at another file, nor
hold the lock for it.
"""

from __future__ import annotations

import errno
import fcntl
import os

from kvdepot.server.host.own_files import open_own


def take(path: str, dir_fd: int | None = None) -> tuple[int, str]:
    """(descriptor, "") once `path` is locked for this process, its pid written
    in; (-1, the holder's pid) when another process holds it. ForeignFile when
    something not this user's is at `path` (relative to `dir_fd` where given);
    OSError when it cannot be opened."""
    fd = open_own(path, os.O_RDWR | os.O_CREAT, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        raw = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise
        return -1, raw if raw.isdigit() else "unknown"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd, ""
