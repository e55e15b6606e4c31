"""The shared-memory transport, for workers whose KV cache is in host memory
(CPU engines, and every test): the daemon copies between the worker's staging
memory and its pool, on a thread of its own.

No client maps the pool. A worker hands the daemon a memfd over the job
socket (job_socket.py) with one row per block of its tensors, each laid out
like a slot; it fills the rows of a store before it submits, and reads the
rows of a load once the daemon says the job is done. What a worker can reach
is its own memory, and what the daemon copies is bounded by that memory's
size, checked when the worker registers.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import logging
import mmap
import os
import queue
import stat
import threading

from kvdepot.errors import InvalidArgument
from kvdepot.server.core.requests import JobKind
from kvdepot.server.core.transport import Finish, FinishMany, LaneWorker, Transport, one_by_one
from kvdepot.thread_names import name_os_thread

log = logging.getLogger("kvdepot.shm")

# Copy threads: a job's rows are copied by one thread, jobs run side by side.
COPY_THREADS = 2
# A job of at most this many bytes is copied on the event loop (tens of
# microseconds), not by a thread.
INLINE_BYTES = 256 << 10
# This transport in the native lane (server/native/src/lane.h TransportKind).
LANE_KIND = 1


class Staging:
    """A worker's staging memory as the daemon holds it: a sealed memfd, mapped.

    Mapped whole when it is handed over (charged to its user's staging
    budget), then cut to the rows its worker's layout needs when the worker
    registers. It is unmapped once nothing copies into or out of it any more,
    so that a session that ends mid-copy never pulls the mapping from under a
    copy; its charge is released then.
    """

    def __init__(self, fd: int, max_bytes: int, charge):
        try:
            self.size = _check_staging_fd(fd, max_bytes)
            self.mapped = _whole_pages(self.size)
            self._charge = charge(self.mapped)
            try:
                self.base = _map(fd, self.mapped)
            except OSError as e:
                self._charge.release()
                raise InvalidArgument(f"the staging memfd cannot be mapped: {e.strerror}") from None
        finally:
            os.close(fd)
        self.copies = 0
        self._closing = False

    def keep(self, nbytes: int) -> None:
        """Unmaps all but the first `nbytes` (what the worker's rows take)."""
        keep = _whole_pages(nbytes)
        if 0 < keep < self.mapped:
            _unmap(self.base + keep, self.mapped - keep)
            self.mapped = keep
            self._charge.shrink(keep)

    def close(self) -> None:
        """Unmaps now, or after the last copy running ends."""
        self._closing = True
        if self.copies == 0 and self.mapped:
            _unmap(self.base, self.mapped)
            self.mapped = 0
            self._charge.release()

    def copy_ended(self) -> None:
        self.copies -= 1
        if self._closing:
            self.close()


# Mapped with libc's mmap rather than Python's, whose object cannot give back
# part of its mapping: a tail unmapped behind its back could be handed to
# another mapping, which its close would then unmap.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
# fstatfs's f_type: the first field of struct statfs on every Linux ABI.
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6


def _whole_pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _map(fd: int, nbytes: int) -> int:
    base = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if base in (None, _MAP_FAILED):
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return base


def _unmap(base: int, nbytes: int) -> None:
    if _libc.munmap(base, nbytes) != 0:
        log.error("unmapping staging memory failed: %s", os.strerror(ctypes.get_errno()))


def _file_system(fd: int) -> int:
    buf = ctypes.create_string_buffer(256)
    if _libc.fstatfs(fd, buf) != 0:
        raise InvalidArgument(f"the staging descriptor's file system is unknown: {os.strerror(ctypes.get_errno())}")
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def _check_staging_fd(fd: int, max_bytes: int) -> int:
    """The size of a descriptor fit to copy through, else InvalidArgument.

    Fit means the daemon's copies can never fault: a fault in a copy is a
    SIGBUS that kills the daemon for every tenant.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument("the staging descriptor is not a memfd")
    # A page of hugetlbfs that the client punches out needs a free huge page
    # when the daemon touches it again, and none may be left; shmem (a memfd)
    # always allocates a page, and every other file system may fail a page in.
    fs = _file_system(fd)
    if fs == HUGETLBFS_MAGIC:
        raise InvalidArgument(
            "the staging memfd is on hugetlbfs (MFD_HUGETLB): the daemon's copy would fault (SIGBUS) when no "
            "huge page is free; create it with memfd_create without MFD_HUGETLB"
        )
    if fs != TMPFS_MAGIC:
        raise InvalidArgument(
            f"the staging descriptor is a file on a file system of type {fs:#x}, not a memfd: only "
            "memfd_create memory (shmem) is taken, whose pages never fault the daemon's copies"
        )
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidArgument("the staging descriptor is not a memfd (it takes no seals)") from None
    # A file that may shrink would fault (SIGBUS) the daemon's next copy.
    if not seals & fcntl.F_SEAL_SHRINK:
        raise InvalidArgument("the staging memfd must be sealed against shrinking (F_SEAL_SHRINK)")
    if not 0 < st.st_size <= max_bytes:
        raise InvalidArgument(
            f"the staging memfd has {st.st_size} bytes; the daemon takes 1 to {max_bytes} "
            "(--max-shm-worker-bytes)"
        )
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_ACCMODE != os.O_RDWR:
        raise InvalidArgument("the staging memfd must be open for reading and writing")
    return st.st_size


class SharedMemoryTransport(Transport):
    name = "shared_memory"
    handle_kind = "shared_memory"
    takes_memory = True

    def __init__(self, finish: Finish, pool, finish_many: FinishMany | None = None, threads: bool = True):
        """threads: False where the native lane copies (this transport then maps and checks)."""
        self._finish_many = finish_many or one_by_one(finish)
        self._pool = pool
        # Daemon threads: a copy still running when the daemon gives up
        # draining must not keep the process from exiting.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = COPY_THREADS if threads else 0
        for n in range(self._threads):
            threading.Thread(target=self._run_copies, name=f"kvdepot-shm-{n}", daemon=True).start()
        # worker id -> its Staging, while registered.
        self._staging: dict[int, Staging] = {}

    def take_memory(self, fd: int, max_bytes: int, charge) -> Staging:
        """A worker's staging memory from its descriptor (closed here whatever
        happens), checked and mapped; InvalidArgument when it is unfit,
        ResourceExhausted past its user's or the daemon's staging budget."""
        return Staging(fd, max_bytes, charge)

    def open_worker(self, worker, spec) -> None:
        staging = worker.session.staging.pop(spec.staging_id, None)
        if staging is None:
            raise InvalidArgument(
                f"no staging memory {spec.staging_id} in this session: hand it over on the job "
                "socket first (JobFrame.staging); each serves one worker"
            )
        needed = worker.layout.num_blocks * worker.layout.block_bytes
        if staging.size < needed:
            staging.close()
            raise InvalidArgument(
                f"the staging memory has {staging.size} bytes; the worker's {worker.layout.num_blocks} "
                f"blocks of {worker.layout.block_bytes} bytes need {needed}"
            )
        staging.keep(needed)
        self._staging[worker.id] = staging

    def lane_worker(self, worker) -> LaneWorker:
        staging = self._staging[worker.id]
        return LaneWorker(LANE_KIND, memory=staging.base, memory_bytes=staging.mapped)

    def close_worker(self, worker) -> None:
        staging = self._staging.pop(worker.id, None)
        if staging is not None:
            staging.close()

    def start(self, job) -> None:
        staging = self._staging[job.worker.id]
        staging.copies += 1
        loop = asyncio.get_running_loop()
        if len(job.blocks) * job.worker.layout.block_bytes <= INLINE_BYTES:
            # Copied now, on the loop: less than handing it to a thread and back.
            # It ends on the loop's next turn, never inside its own submit.
            loop.call_soon(self._copied_many, [(job, staging, self._try_copy(job, staging))])
            return
        self._queue.put((loop, job, staging))

    def _run_copies(self) -> None:
        name_os_thread()
        # Copies that end while others wait in the queue are handed to the event
        # loop together: one wake-up of the loop, however many.
        item = self._queue.get()
        while item is not None:
            ended = []
            while item:
                loop, job, staging = item
                ended.append((job, staging, self._try_copy(job, staging)))
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = False
            try:
                loop.call_soon_threadsafe(self._copied_many, ended)
            except RuntimeError:  # the loop is closed: the daemon is exiting
                return
            if item is False:
                item = self._queue.get()
        # None: shutting down

    def _try_copy(self, job, staging: Staging) -> Exception | None:
        try:
            self._copy(job, staging)
        except Exception as e:  # the job fails, with the reason
            return e
        return None

    def _copied_many(self, ended: list) -> None:
        reported = []
        for job, staging, error in ended:
            staging.copy_ended()
            if error is not None:
                log.error("%s job %d: copy failed: %s", job.kind.value, job.id, error)
                reported.append((job, False, f"the daemon's copy failed: {error}"))
            elif job.session.ended:
                reported.append((job, False, "the client went away during the job"))
            else:
                reported.append((job, True, ""))
        self._finish_many(reported)

    def _copy(self, job, staging: Staging) -> None:
        row = job.worker.layout.block_bytes
        slot_bytes, pool_base = self._pool.slot_bytes, self._pool.base_address
        # Bounds were checked before anything was reserved: block ids against
        # the worker's blocks (which the staging size covers), slots by the index.
        if job.kind is JobKind.STORE:
            for block_id, slot in zip(job.block_ids, job.slots):
                ctypes.memmove(pool_base + slot * slot_bytes, staging.base + block_id * row, row)
        else:
            for block_id, slot in zip(job.block_ids, job.slots):
                ctypes.memmove(staging.base + block_id * row, pool_base + slot * slot_bytes, row)

    def abandon(self, job) -> None:
        # The copy touches the daemon's own mapping alone: it ends, and its end
        # fails the job (the session has ended).
        pass

    def shutdown(self) -> None:
        for _ in range(self._threads):
            self._queue.put(None)
