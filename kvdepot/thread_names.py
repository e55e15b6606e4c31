"""Threads named for the operating system too (`top -H`, /proc/PID/task/*/comm),
not only inside Python, so that a daemon's CPU can be told apart by thread."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading

_PR_SET_NAME = 15
_NAME_BYTES = 15  # the kernel keeps 15 bytes and a NUL


@functools.cache
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def name_os_thread(name: str | None = None) -> None:
    """Gives the calling thread `name` (its Python name by default) in the kernel; never fails."""
    name = name or threading.current_thread().name
    try:
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode("ascii", "replace")[:_NAME_BYTES]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
