"""The transport interface: who moves a job's bytes.

Everything above a transport (the block index, pins, jobs, completion, stats)
is the same code whichever moves the bytes. A transport's primitives:

- `open_worker` / `close_worker`: take (and check) a worker's handles when it
  registers; let go of them once no copy touches them any more.
- `prepare_job`: check a store or load request before the depot reserves
  anything, and return the transport's own state for the job (opaque to the
  depot, kept in `Job.transport_state`).
- `take_memory`: keep memory a client hands over (a descriptor) for a worker
  it registers next; only a transport with `takes_memory` does.
- `start`: begin the job's copies. The transport reports the end with the
  `finish` callback it was made with (`Depot.finish_job`), or several ends at
  once with `finish_many` (`Depot.finish_jobs`: their clients are told with one
  write a connection, before the bookkeeping).
- `abandon`: the job's session ended while the job was in flight; finish or
  cancel its copies, then report the end.

Only the daemon writes the pool, whatever the transport: a store's slots are
never written by a client, so a client that goes away mid-job leaves nothing
to wait for but the daemon's own copies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvdepot.errors import FailedPrecondition

if TYPE_CHECKING:
    from kvdepot.server.core.requests import JobRequest, WorkerSpec
    from kvdepot.server.core.sessions import Job, Worker

# Depot.finish_job(job, ok, error).
Finish = Callable[["Job", bool, str], None]
# Depot.finish_jobs([(job, ok, error), ...]).
FinishMany = Callable[[list], None]


def one_by_one(finish: Finish) -> FinishMany:
    """finish_many for a transport given `finish` alone."""

    def finish_many(ended: list) -> None:
        for job, ok, error in ended:
            finish(job, ok, error)

    return finish_many


@dataclass(frozen=True)
class GpuStats:
    """A GPU a transport copies to and from (proto: GpuStats)."""

    index: int
    uuid: str
    # GPU memory the daemon's process holds there; 0 where NVML cannot tell.
    daemon_memory_bytes: int


@dataclass(frozen=True)
class LaneKernel:
    """A compiled kernel the native lane launches by its handle (cuda_calls.KernelLaunch)."""

    function: int
    block: int
    shared: int
    param_sizes: tuple[int, ...]
    # Programs a launch runs at most (the copy kernel's), 0: as many as its work.
    programs: int = 0


@dataclass(frozen=True)
class LaneStream:
    """One direction of one GPU as the native lane runs its copies (its CUDA
    handles and addresses; transports/cuda_streams.py CopyStream has each)."""

    stream: int
    kernels: int
    buffers: tuple[int, int]
    rows: int
    filled: tuple[int, int]
    drained: tuple[int, int]
    ring_host: int
    ring_gpu: int
    ring_entries: int
    positions: int
    copy: LaneKernel
    # A store's: the rows' hashes for their records (hash_kernel.py), with the
    # hash's keys and a scratch array per buffer; None: sealed on the CPU.
    hash_blocks: LaneKernel | None = None
    hash_rows: LaneKernel | None = None
    hash_keys: int = 0
    hash_scratch: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class LaneDevice:
    """A GPU as the native lane runs its copies."""

    index: int
    wait_for_compute: bool
    chunk_bytes: int
    spin_bytes: int
    # Slots of one CUDA registration of the pool (a DMA copy cannot cross two).
    per_registration: int
    store: LaneStream
    load: LaneStream
    # The CUDA entry points torch loaded, by name, at their addresses.
    api: dict[str, int]


@dataclass(frozen=True)
class LaneWorker:
    """What the native lane needs of a worker: its transport's kind there
    (server/native/src/lane.h TransportKind), and that transport's part."""

    kind: int
    # Shared memory: the staging rows the daemon mapped.
    memory: int = 0
    memory_bytes: int = 0
    # CUDA: its GPU, its page table there (copy_kernel.PageTable.pointers) and its fence.
    device: LaneDevice | None = None
    table: tuple[int, ...] = ()
    pages_per_block: int = 0
    max_page_bytes: int = 0
    fence: int = 0


class Transport(ABC):
    # For logs and stats.
    name: str = ""
    # Which TensorHandle (the `transport` oneof) a worker registers with.
    handle_kind: str = ""
    # Whether clients hand this transport memory of theirs (take_memory).
    takes_memory: bool = False

    @abstractmethod
    def open_worker(self, worker: Worker, spec: WorkerSpec) -> None:
        """Checks (and opens) the worker's handles; raises InvalidArgument if unusable."""

    @abstractmethod
    def close_worker(self, worker: Worker) -> None:
        """Releases the worker's handles once no copy touches them any more."""

    def prepare_job(self, worker: Worker, request: JobRequest) -> object:
        """Refuses a job request this transport cannot run (InvalidArgument);
        returns the transport's state for the job."""
        return None

    @abstractmethod
    def start(self, job: Job) -> None:
        """Starts the job's copies. Ordering and completion are the transport's."""

    @abstractmethod
    def abandon(self, job: Job) -> None:
        """The job's session has ended: finish or cancel its copies, then finish the job."""

    @property
    def open_mappings(self) -> int:
        """Mappings of workers' memory the transport holds open now."""
        return 0

    def lane_worker(self, worker: Worker) -> LaneWorker:
        """What the native lane needs of a registered worker to run its jobs."""
        raise FailedPrecondition(f"the native lane cannot run the {self.name} transport's jobs")

    def take_memory(self, fd: int, max_bytes: int, charge) -> object:
        """Keeps the memory behind `fd` (the caller closes `fd`) for a worker;
        `charge(nbytes)` accounts for what is mapped (a StagingCharge) or
        raises ResourceExhausted."""
        raise FailedPrecondition(f"the {self.name} transport takes no memory from clients")

    def gpu_stats(self) -> list[GpuStats]:
        """The GPUs the transport uses."""
        return []

    def shutdown(self) -> None:
        """The daemon exits: wait for (or stop) whatever the transport still runs."""
