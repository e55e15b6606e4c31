"""glibc's malloc, told to keep large freed blocks for reuse.

The remote tier's client allocates a fresh 2 MiB buffer for every value it
sends or receives. glibc serves such sizes with mmap (or trims them back to the
kernel when freed), so each one costs page faults and the kernel's zeroing of
512 pages, more CPU than the HMAC that checks the value (perf on this daemon:
a quarter of its cycles in clear_page while publishing). Raising the mmap and
trim thresholds lets freed blocks be reused: the daemon keeps up to
TRIM_THRESHOLD of freed heap, next to a pool of hundreds of GiB.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("kvdepot.host")

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest dynamic threshold: blocks below it come from the heap
TRIM_THRESHOLD = 256 << 20
TOP_PAD = 64 << 20


def keep_freed_memory() -> bool:
    """Tunes glibc's malloc as above; False where the C library has no mallopt (musl)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not done:
        log.info("glibc refused a malloc setting: large buffers are allocated fresh each time")
    return done
