"""The worker's half of the CUDA transport: IPC handles of its KV-cache tensors
and the interprocess event that orders the daemon's stores after its compute."""

from __future__ import annotations

import threading

import torch

from kvdepot import cuda
from kvdepot.errors import InvalidArgument
from kvdepot.proto import kvdepot_pb2 as pb


def cuda_handles(tensors: list[torch.Tensor]) -> list[pb.TensorHandle]:
    if cuda.expandable_segments_enabled():
        raise InvalidArgument(
            "PyTorch's expandable segments are on (PYTORCH_CUDA_ALLOC_CONF), and CUDA IPC cannot "
            "share their memory: start the engine without expandable_segments:True"
        )
    handles = []
    by_base: dict[int, bytes] = {}
    for tensor in tensors:
        storage_ptr = tensor.untyped_storage().data_ptr()
        with torch.cuda.device(tensor.device):
            base, _ = cuda.allocation_range(storage_ptr)
        if base not in by_base:
            try:
                with torch.cuda.device(tensor.device):
                    by_base[base] = cuda.ipc_mem_handle(base)
            except cuda.CudaError as e:
                raise InvalidArgument(
                    f"cannot share the KV cache over CUDA IPC ({e}): it must be cudaMalloc memory, "
                    "e.g. from PyTorch's default caching allocator without expandable segments"
                ) from None
        handles.append(
            pb.TensorHandle(
                cuda_ipc=pb.CudaIpcHandle(
                    mem_handle=by_base[base],
                    device_uuid=cuda.device_uuid(tensor.device.index or 0),
                    storage_offset=storage_ptr - base,
                )
            )
        )
    return handles


class ComputeFence:
    """Orders the daemon's stores after this worker's compute, and proves it ran.

    Each store records an interprocess event on the current stream (where the
    engine launched the compute that wrote the blocks) after writing a growing
    sequence number into a small GPU tensor that the daemon reads after its copy.
    The events form a ring: the daemon sees only an event's latest record, so
    one event re-recorded for every store would keep delaying stores still
    waiting on an earlier one while the CPU runs ahead of the GPU.
    """

    RING = 32

    def __init__(self, device: torch.device):
        self.device = device
        with torch.cuda.device(device):
            self.events = [torch.cuda.Event(interprocess=True) for _ in range(self.RING)]
            for event in self.events:
                event.record()  # an IPC handle exists only for a recorded event
            self.handles = [bytes(event.ipc_handle()) for event in self.events]
            self.tensor = torch.zeros(1, dtype=torch.int64, device=device)
        self.seq = 0
        self._lock = threading.Lock()
        self.handle = cuda_handles([self.tensor])[0].cuda_ipc
        self._index, self._address = self.tensor.device.index, self.tensor.data_ptr()
        # A stream memory write and a raw event record: a few microseconds a
        # store instead of a torch fill kernel and event objects (docs/benchmarks.md).
        self._raw = True

    def mark(self) -> tuple[bytes, int]:
        # On the current stream of the tensor's device (the engine's compute
        # stream): the write and the record follow the compute launched there.
        with self._lock:
            self.seq += 1
            slot = self.seq % self.RING
            if self._raw and torch.cuda.current_device() == self._index:
                stream = cuda.current_raw_stream(self._index)
                if cuda.write_value64(stream, self._address, self.seq):
                    cuda.record_event(self.events[slot], stream)
                    return self.handles[slot], self.seq
                self._raw = False  # no stream memory operations here: torch's way from now on
            self.tensor.fill_(self.seq)
            self.events[slot].record(torch.cuda.current_stream(self.device))
            return self.handles[slot], self.seq
