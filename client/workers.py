"""A worker's KV-cache tensors as the client registers them, for either transport."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.client.shm_copy import BlockCopier
from kvdepot.client.tensors import normalize_block_dims, tensor_layout, tensor_spec
from kvdepot.errors import InvalidArgument
from kvdepot.layout import WorkerLayout
from kvdepot.proto import kvdepot_pb2 as pb


@dataclass(eq=False)
class WorkerHandle:
    namespace: pb.NamespaceSpec
    rank: int
    device: str
    tensors: list
    layout: WorkerLayout
    # What the daemon needs to reach the tensors: TensorHandle messages.
    handles: list
    # Shared-memory transport: copies between the tensors and the staging rows.
    copier: BlockCopier | None = None
    # CUDA transport: orders stores after the compute that wrote the blocks.
    compute_fence: object = None
    worker_id: int | None = None
    namespace_name: str = ""

    @property
    def registered(self) -> bool:
        return self.worker_id is not None

    def request(self, session_id: str, staging_id: int = 0) -> pb.RegisterWorkerRequest:
        request = pb.RegisterWorkerRequest(
            session_id=session_id,
            namespace=self.namespace,
            rank=self.rank,
            device=self.device,
            tensors=[tensor_spec(t) for t in self.layout.tensors],
            handles=self.handles,
            staging_id=staging_id,
        )
        if self.compute_fence is not None:
            request.cuda_fence.CopyFrom(self.compute_fence.handle)
        return request


def make_worker(
    namespace: pb.NamespaceSpec,
    rank: int,
    tensors: Sequence,
    block_dim: int | Sequence[int],
    device: str | None,
    names: Sequence[str] | None,
) -> WorkerHandle:
    """Checks the tensors as the daemon will, and prepares what their transport needs."""
    tensors = list(tensors)
    dims = normalize_block_dims(tensors, block_dim)
    names = list(names) if names is not None else [f"kv{i}" for i in range(len(tensors))]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise InvalidArgument(f"all tensors of a worker must be on one device, not {sorted(map(str, devices))}")
    layout = WorkerLayout.of([tensor_layout(t, d, n) for t, d, n in zip(tensors, dims, names)])
    worker = WorkerHandle(namespace, rank, device or str(tensors[0].device), tensors, layout, handles=[])
    if tensors[0].device.type == "cuda":
        from kvdepot.client.cuda_worker import ComputeFence, cuda_handles

        worker.handles = cuda_handles(tensors)
        worker.compute_fence = ComputeFence(tensors[0].device)
    elif tensors[0].device.type == "cpu":
        worker.handles = [pb.TensorHandle(shared_memory=pb.SharedMemoryWorker()) for _ in tensors]
        worker.copier = BlockCopier(tensors, layout)
    else:
        raise InvalidArgument(f"no transport for tensors on {tensors[0].device}")
    return worker
