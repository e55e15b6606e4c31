"""A lock file held for the process's life, naming the holder's pid.

The kernel releases an flock when its process dies, so a lock left by a crash
is free again, while a live holder's pid is there to name in the message.
"""

from __future__ import annotations

import errno
import fcntl
import os


def take(path: str) -> tuple[int, str]:
    """(descriptor, "") once `path` is locked for this process, its pid written
    in; (-1, the holder's pid) when another process holds it. OSError when the
    file cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise
        return -1, holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd, ""
