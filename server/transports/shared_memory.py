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
from kvdepot.server.core.transport import Finish, Transport

log = logging.getLogger("kvdepot.shm")

# Copy threads: a job's rows are copied by one thread, jobs run side by side.
COPY_THREADS = 2


class Staging:
    """A worker's staging memory as the daemon holds it: a sealed memfd, mapped.

    It is closed once nothing copies into or out of it any more, so that a
    session that ends mid-copy never pulls the mapping from under a copy.
    """

    def __init__(self, fd: int, max_bytes: int):
        try:
            self.size = _check_staging_fd(fd, max_bytes)
            self._mmap = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise InvalidArgument(f"the staging memfd cannot be mapped: {e.strerror}") from None
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self.base = ctypes.addressof(self._anchor)
        self.copies = 0
        self._closing = False

    def close(self) -> None:
        """Unmaps now, or after the last copy running ends."""
        self._closing = True
        if self.copies == 0 and self._mmap is not None:
            del self._anchor
            self._mmap.close()
            self._mmap = None

    def copy_ended(self) -> None:
        self.copies -= 1
        if self._closing:
            self.close()


def _check_staging_fd(fd: int, max_bytes: int) -> int:
    """The size of a descriptor fit to copy through, else InvalidArgument."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument("the staging descriptor is not a memfd")
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

    def __init__(self, finish: Finish, pool):
        self._finish = finish
        self._pool = pool
        # Daemon threads: a copy still running when the daemon gives up
        # draining must not keep the process from exiting.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for n in range(COPY_THREADS):
            threading.Thread(target=self._run_copies, name=f"kvdepot-shm-{n}", daemon=True).start()
        # worker id -> its Staging, while registered.
        self._staging: dict[int, Staging] = {}

    def take_memory(self, fd: int, max_bytes: int) -> Staging:
        """A worker's staging memory from its descriptor (closed here whatever
        happens), checked and mapped; InvalidArgument when it is unfit."""
        return Staging(fd, max_bytes)

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
        self._staging[worker.id] = staging

    def close_worker(self, worker) -> None:
        staging = self._staging.pop(worker.id, None)
        if staging is not None:
            staging.close()

    def start(self, job) -> None:
        staging = self._staging[job.worker.id]
        staging.copies += 1
        self._queue.put((asyncio.get_running_loop(), job, staging))

    def _run_copies(self) -> None:
        while (item := self._queue.get()) is not None:
            loop, job, staging = item
            error = None
            try:
                self._copy(job, staging)
            except Exception as e:
                error = e
            try:
                loop.call_soon_threadsafe(self._copied, job, staging, error)
            except RuntimeError:  # the loop is closed: the daemon is exiting
                return

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

    def _copied(self, job, staging: Staging, error: BaseException | None) -> None:
        staging.copy_ended()
        if error is not None:
            log.error("%s job %d: copy failed: %s", job.kind.value, job.id, error)
            self._finish(job, False, f"the daemon's copy failed: {error}")
        elif job.session.ended:
            self._finish(job, False, "the client went away during the job")
        else:
            self._finish(job, True, "")

    def abandon(self, job) -> None:
        # The copy touches the daemon's own mapping alone: it ends, and its end
        # fails the job (the session has ended).
        pass

    def shutdown(self) -> None:
        for _ in range(COPY_THREADS):
            self._queue.put(None)
