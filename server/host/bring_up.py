"""Bringing the pool's memory up: faulting its pages in and pinning them, a chunk at a time.

A chunk is one CUDA registration of whole slots (HostPool.registration_bytes),
so that no DMA run crosses two. The daemon serves as soon as its first chunks
are up (HostPool._bring_up_first: the first of each NUMA range); the rest come
up behind it on a thread of their own (`start`), those holding kept blocks
first (the newest blocks' first). Every chunk is queued to the fault threads
at once, in that order, and each is registered as soon as its faults are
done, while later ones fault; the depot takes each chunk's slots as it comes.

Page faults run in parallel, each thread on a piece of one file; a pool
kept in several files (kvdepot/pool_parts.py) faults in several times
faster than one, whose faults queue on the file's locks. There each piece is
allocated first (fallocate takes the file's lock, so a pool of one file only
faults). A pool that does not fit fails here with a clear error instead of
SIGBUS on a later copy; populated page tables make the registration that
follows several times faster. Registrations run on one
thread: the driver serialises them, and more threads only made them slower
(docs/benchmarks.md).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Callable

from kvdepot.server.host.cuda_driver import DriverPinning, open_driver
from kvdepot.server.host.pool_map import PoolFiles
from kvdepot.thread_names import name_os_thread

log = logging.getLogger("kvdepot.pool")

# Faulted in this much at a time, by several threads.
POPULATE_CHUNK_BYTES = 256 << 20

# madvise(MADV_POPULATE_WRITE), Linux 5.14: faults in a range writable.
_MADV_POPULATE_WRITE = 23
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_LIBC.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)


def amount(nbytes: int) -> str:
    """Bytes as an operator reads them: GiB, or MiB below one GiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def pinning(pin: str) -> DriverPinning | None:
    """CUDA's driver to pin with (host/cuda_driver.py), None when the pool is not pinned."""
    if pin == "off":
        return None
    driver, why = open_driver()
    if driver is None:
        if pin == "on":
            raise PinError(f"--pin on needs CUDA, and this machine has none: {why}")
        log.info("%s: the pool is not pinned", why)
    return driver


def interleaved(chunks: list[tuple[int, int]], ranges) -> list[int]:
    """Chunk indices taking NUMA ranges in turn, so that every node's slots grow together."""
    per = chunks[0][1] if chunks else 1
    lists = [range(r.first // per, (r.first + r.count - 1) // per + 1) for r in ranges]
    order = [chunks[column] for column in range(max(map(len, lists), default=0)) for chunks in lists
             if column < len(chunks)]
    return list(dict.fromkeys(order))


class BringUpError(RuntimeError):
    """Part of the pool could not be faulted in or pinned; the message says why."""


class PinError(BringUpError):
    """CUDA refused to pin part of the pool."""


class BringUp:
    """Faults in and pins the byte ranges of one mapping (`base`)."""

    def __init__(self, files: PoolFiles, directory: str, threads: int, piece: int,
                 pinning: DriverPinning | None = None, not_pinnable_hint: str = ""):
        self.files = files
        self.base = files.base
        # Several files: each piece is allocated in its file first, which the
        # file's lock then serialises with that file's pieces only.
        self._allocate_first = files.layout.parts > 1
        self.directory = directory
        self.piece = piece  # a multiple of the pool's page size
        self.pinning = pinning  # None: nothing is pinned
        self._hint = not_pinnable_hint
        self.registered: list[int] = []
        self.fault_seconds = 0.0
        self.pin_seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Named for the kernel too (top -H): kvdepot-fault_0, kvdepot-fault_1, ...
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kvdepot-fault",
                                                               initializer=name_os_thread)
        self.error = ""  # why the last chunks did not come up

    # ------------------------------------------------------------ one range

    def _populate(self, offset: int, length: int, fd: int, file_offset: int) -> None:
        if self._allocate_first and _LIBC.fallocate(fd, 0, file_offset, length):
            code = ctypes.get_errno()
            if code not in (errno.EOPNOTSUPP, errno.ENOSYS):  # ramfs: the faults allocate
                raise self._no_room(code)
        if _LIBC.madvise(ctypes.c_void_p(self.base + offset), ctypes.c_size_t(length), _MADV_POPULATE_WRITE):
            code = ctypes.get_errno()
            if code == errno.EINVAL:  # kernels before 5.14
                os.posix_fallocate(fd, file_offset, length)
                return
            raise self._no_room(code)

    def _no_room(self, code: int) -> BringUpError:
        return BringUpError(
            f"could not allocate the pool in {self.directory} ({os.strerror(code)}): lower "
            "--pool-size or set --pool-dir to a tmpfs with room"
        )

    def fault(self, offset: int, length: int) -> list[concurrent.futures.Future]:
        """Starts faulting in [offset, offset + length) on the threads, a piece of one file each."""
        return [self._executor.submit(self._populate, *piece)
                for piece in self.files.pieces(offset, length, self.piece)]

    def wait(self, futures: list[concurrent.futures.Future]) -> None:
        started = time.monotonic()
        for future in futures:
            future.result()
        self.fault_seconds += time.monotonic() - started

    def register(self, offset: int, length: int) -> None:
        if self.pinning is None:
            return
        started = time.monotonic()
        # Portable and mapped (cuda_driver.py): the copy kernel uses its host addresses.
        rc = self.pinning.register(self.base + offset, length)
        if rc:
            raise PinError(f"pinning (cuMemHostRegister) failed with CUDA error {rc}{self._hint}")
        self.registered.append(self.base + offset)
        self.pin_seconds += time.monotonic() - started

    # ------------------------------------------------------------ chunks

    def bring(self, chunks: list[tuple[int, int]], done: Callable[[int], None]) -> None:
        """Faults in and pins `chunks` (offset, length) in order; `done(i)`
        after the `i`th is up. Raises BringUpError; stops quietly once `stop`
        was called.

        Every chunk's faults are queued at once: queued a chunk at a time, from
        this thread between its registrations, they left the registrations,
        which bound the whole, 0.9 s behind at 96 GiB (docs/benchmarks.md). The
        threads take the pieces in order, so the chunks first in line still
        come up first.
        """
        faulting: list[list[concurrent.futures.Future]] = []
        try:
            for chunk in chunks:
                faulting.append(self.fault(*chunk))
            for i, (offset, length) in enumerate(chunks):
                waited, pinned = self.fault_seconds, self.pin_seconds
                self.wait(faulting[i])
                if self._stop.is_set():
                    return
                self.register(offset, length)
                log.debug("chunk at %d MiB up: %.3f s waiting on its faults, %.3f s pinning", offset >> 20,
                          self.fault_seconds - waited, self.pin_seconds - pinned)
                done(i)
        finally:
            for futures in faulting:  # a stop or a failure: the pieces not started yet stay undone
                for future in futures:
                    future.cancel()

    def start(self, chunks: list[tuple[int, int]], done: Callable[[int], None],
              finished: Callable[[str], None]) -> None:
        """Brings `chunks` up on a thread of its own; `finished(error)` at the end ('' when all came up)."""

        def run() -> None:
            name_os_thread()
            try:
                self.bring(chunks, done)
            except BringUpError as e:
                self.error = str(e)
            except Exception as e:  # the daemon goes on with the chunks that are up
                log.exception("bringing the pool up failed")
                self.error = f"bringing the pool up failed: {e}"
            finished(self.error)

        self._thread = threading.Thread(target=run, name="kvdepot-bringup", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread after the chunk it is on; needed before the mapping goes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def unregister(self) -> None:
        for ptr in self.registered:
            self.pinning.unregister(ptr)
        self.registered = []

    def close(self) -> None:
        self.stop()
