"""The worker's half of the CUDA transport: IPC handles of its KV-cache tensors
and the interprocess event that orders the daemon's stores after its compute."""

from __future__ import annotations

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
    """

    def __init__(self, device: torch.device):
        with torch.cuda.device(device):
            self.event = torch.cuda.Event(interprocess=True)
            self.event.record()  # an IPC handle exists only for a recorded event
            self.tensor = torch.zeros(1, dtype=torch.int64, device=device)
        self.seq = 0
        self.handle = cuda_handles([self.tensor])[0].cuda_ipc

    def mark(self) -> tuple[bytes, int]:
        self.seq += 1
        self.tensor.fill_(self.seq)
        self.event.record()
        return bytes(self.event.ipc_handle()), self.seq
