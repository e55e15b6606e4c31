"""The wire's messages read into the core's plain values (core/requests.py).

Nothing here checks more than the message's shape: the core checks what the
values mean, whichever way they came (gRPC or the job socket).
"""

from __future__ import annotations

from kvdepot.proto import kvdepot_pb2 as pb
from kvdepot.server.core.requests import CudaIpcHandle, JobKind, JobRequest, NamespaceSpec, TensorSpec, WorkerSpec


def namespace_spec(message: pb.NamespaceSpec) -> NamespaceSpec:
    return NamespaceSpec(
        model=message.model,
        revision=message.revision,
        kv_dtype=message.kv_dtype,
        block_size=message.block_size,
        layout=message.layout,
        tp_size=message.tp_size,
        kv_group=message.kv_group,
        extra=message.extra,
        key_version=message.key_version,
    )


def _tensor(message: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(
        name=message.name,
        dtype=message.dtype,
        shape=tuple(message.shape),
        strides=tuple(message.strides),
        byte_offset=message.byte_offset,
        storage_bytes=message.storage_bytes,
        block_dim=message.block_dim,
        page_bytes=message.page_bytes,
    )


def _cuda_ipc(message: pb.CudaIpcHandle) -> CudaIpcHandle:
    return CudaIpcHandle(bytes(message.mem_handle), message.device_uuid, message.storage_offset)


def worker_spec(message: pb.RegisterWorkerRequest) -> WorkerSpec:
    kinds = {handle.WhichOneof("transport") for handle in message.handles}
    # A worker's handles are all of one transport; None tells the core they are not.
    transport = kinds.pop() if len(kinds) == 1 else None
    handles = tuple(
        _cuda_ipc(handle.cuda_ipc) if handle.WhichOneof("transport") == "cuda_ipc" else None
        for handle in message.handles
    )
    return WorkerSpec(
        namespace=namespace_spec(message.namespace),
        rank=message.rank,
        device=message.device,
        tensors=tuple(_tensor(t) for t in message.tensors),
        transport=transport,
        handles=handles,
        staging_id=message.staging_id,
        fence=_cuda_ipc(message.cuda_fence) if message.HasField("cuda_fence") else None,
    )


def store_job(message: pb.SubmitStoreRequest) -> JobRequest:
    return JobRequest(
        JobKind.STORE,
        message.worker_id,
        message.job_id,
        list(message.keys),
        list(message.block_ids),
        compute_event=message.cuda_event_handle,
        compute_seq=message.cuda_fence_seq,
    )


def load_job(message: pb.SubmitLoadRequest) -> JobRequest:
    return JobRequest(JobKind.LOAD, message.worker_id, message.job_id, list(message.keys), list(message.block_ids))
