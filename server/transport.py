"""Who moves a job's bytes: the interface, and the shared-memory transport.

Everything above a transport (index, pins, jobs, completion, stats) is the same
code whichever moves the bytes. A transport whose `worker_copies` is true leaves
the copy to the worker process, which reports it with CompleteJob; one that
copies itself (CUDA) calls `Depot.finish_job` when the GPU is done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdepot.errors import InvalidArgument
from kvdepot.layout import WorkerLayout
from kvdepot.proto import kvdepot_pb2 as pb

if TYPE_CHECKING:
    from kvdepot.server.depot import Job, Worker


class Transport:
    name: str = ""
    worker_copies: bool = False
    # Mappings of workers' memory the transport holds open now.
    open_mappings: int = 0

    def open_worker(self, worker: "Worker", layout: WorkerLayout, request: pb.RegisterWorkerRequest) -> None:
        """Checks (and opens) the worker's handles; raises InvalidArgument if unusable."""
        raise NotImplementedError

    def gpu_stats(self) -> list:
        """GpuStats of the GPUs the transport uses."""
        return []

    def validate_job(self, worker: "Worker", request, kind: str) -> None:
        """Refuses a job request this transport cannot run; raises InvalidArgument."""

    def shutdown(self) -> None:
        """The daemon exits: wait for (or stop) whatever the transport still runs."""

    def start(self, job: "Job") -> None:
        """Starts the job's copies. Ordering and completion are the transport's."""
        raise NotImplementedError

    def abandon(self, job: "Job") -> None:
        """The job's client is gone: finish or cancel its copies, then finish the job."""
        raise NotImplementedError

    def close_worker(self, worker: "Worker") -> None:
        """Releases the worker's mappings once no copy touches them any more."""
        raise NotImplementedError


class SharedMemoryTransport(Transport):
    """The worker maps the pool file and copies; the daemon assigns and commits.

    It needs no handle: the daemon never touches the worker's memory, so the
    descriptor is checked for consistency only, and bounds for every request.
    """

    name = "shared_memory"
    worker_copies = True

    def __init__(self, depot) -> None:
        self._depot = depot

    def open_worker(self, worker, layout, request) -> None:
        for position, handle in enumerate(request.handles):
            if handle.WhichOneof("transport") != "shared_memory":
                raise InvalidArgument(
                    f"tensor {position}: all handles of a worker must be of one transport"
                )

    def start(self, job) -> None:
        # The worker copies after the submit call returns, then calls CompleteJob.
        pass

    def abandon(self, job) -> None:
        # The session's stream closed. Usually the process died (the kernel
        # unmaps its memory before it closes the socket), but a live client whose
        # stream broke could still be copying: the slots of a store stay out of
        # use until its process is gone.
        self._depot.finish_job(
            job, ok=False, error="the client went away during the job", writer_may_live=True
        )

    def close_worker(self, worker) -> None:
        pass
