"""The shared-memory transport: the worker maps the pool file and copies; the
daemon assigns the slots and commits them when the worker reports the copy.

It needs no handle: the daemon never touches the worker's memory, so a
worker's descriptor is checked for consistency only, and every request's
bounds by the depot.
"""

from __future__ import annotations

from kvdepot.errors import InvalidArgument
from kvdepot.server.transports.base import Finish, Transport


class SharedMemoryTransport(Transport):
    name = "shared_memory"
    handle_kind = "shared_memory"
    worker_copies = True

    def __init__(self, finish: Finish):
        self._finish = finish

    def open_worker(self, worker, request) -> None:
        for position, handle in enumerate(request.handles):
            if handle.WhichOneof("transport") != self.handle_kind:
                raise InvalidArgument(f"tensor {position}: all handles of a worker must be of one transport")

    def close_worker(self, worker) -> None:
        pass

    def start(self, job) -> None:
        # The worker copies once its submit call returns, then calls CompleteJob.
        pass

    def abandon(self, job) -> None:
        # Usually the client's process died (the kernel unmaps its memory before
        # it closes the socket), but a live client whose stream broke could
        # still be copying: the depot keeps a store's slots out of use until its
        # process is gone (worker_copies).
        self._finish(job, False, "the client went away during the job")
