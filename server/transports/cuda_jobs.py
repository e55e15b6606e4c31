"""How one job's copies are queued on its GPU (the CUDA transport's data path).

In "dma" mode a job is: its block ids written to the stream's ring and copied
up in one transfer; per staging chunk a gather (store) or scatter (load)
kernel and one cudaMemcpyAsync per run of consecutive slots, ordered by the
buffers' events; a store's fence read back; and an event at its end, which
the stream's thread waits for. Every call is a direct one (cuda_calls.py): no
tensor, stream object or event is made for a job.
"""

from __future__ import annotations

import torch

from kvdepot import jobtrace
from kvdepot.server.transports import copy_kernel, cuda_calls
from kvdepot.server.transports.cuda_streams import CopyStream, staging_chunks


def _runs(slots: list[int], slots_per_registration: int, span: int = 1) -> list[tuple[int, int, int]]:
    """(first slot, first block, blocks) of each run of blocks whose runs of
    `span` slots follow each other inside one CUDA registration of the pool
    (a DMA copy cannot cross two)."""
    runs = []
    for at, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][2] * span == slot and slot % slots_per_registration:
            runs[-1][2] += 1
        else:
            runs.append([slot, at, 1])
    return [tuple(r) for r in runs]


class JobQueue:
    def __init__(self, pool, spin_bytes: int, chunk_bytes: int, programs: int):
        self._pool_base = pool.base_address
        self._slot_bytes = pool.slot_bytes
        self._span = pool.span
        # A DMA copy cannot cross two CUDA registrations of the pool.
        self._per_registration = pool.registration_bytes // pool.slot_bytes
        self._spin_bytes = spin_bytes
        self._chunk_bytes = chunk_bytes
        self._programs = programs

    def enqueue(self, job, copies, stream: CopyStream, to_host: bool) -> None:
        """Queues the job's copies on its GPU and hands its end to `stream`'s thread."""
        if stream.kernels is None:
            self._enqueue_kernel_mode(job, copies, stream, to_host)
            return
        state = job.transport_state
        n = len(job.block_ids)
        # The job's block ids, and a store's fence readback after them.
        span = state.span = stream.ring.take(n + 1)
        cuda_calls.set_device(copies.device.index)
        if span is None:  # the ring is full: tensors of the job's own
            with torch.cuda.device(copies.device.index):
                ids = self._upload_ids(job.block_ids, stream)
            readback = torch.empty(1, dtype=torch.int64, pin_memory=True)
            fence_at, first_id, keep_alive = (readback, 0), 0, (ids, readback)
        else:
            ids, first_id, keep_alive = stream.ring.gpu, span[0], None
            stream.ring.host[span[0] : span[0] + n] = job.block_ids
            fence_at = (stream.ring.host, span[0] + n)
        self._copy_via_staging(copies, stream, job.slots, ids, first_id, span, to_host, job.trace,
                               self._span(job.worker.layout.block_bytes))
        fence = None
        if state.event is not None:
            # The fence the worker's compute wrote, read after the copy.
            array, index = fence_at
            address = array.data_ptr() if span is None else stream.ring.host_address + 8 * index
            cuda_calls.copy(address, copies.fence_address, 8, stream.handle)
            fence = (array, index, state.fence_seq)
        # The end of a small job on an idle stream is waited for by spinning (the
        # driver's default, without the GIL): waking a thread that sleeps in the
        # driver costs such a job a noticeable part of its time. Behind other jobs,
        # or for a big job, the thread sleeps instead of spinning a core.
        spin = stream.idle and n * self._span(job.worker.layout.block_bytes) * self._slot_bytes <= self._spin_bytes
        end = stream.end_event(blocking=not spin)
        # A store ends with its last transfer, a load with its last scatter.
        cuda_calls.record(end[1], stream.handle if to_host else stream.kernels_handle)
        if job.trace is not None:
            job.trace["queued"] = jobtrace.now()
        stream.track(end, job, keep_alive, fence)

    def _enqueue_kernel_mode(self, job, copies, stream: CopyStream, to_host: bool) -> None:
        """The "kernel" mode: one kernel reads or writes the pinned pool itself."""
        index = copies.device.index
        with torch.cuda.device(index):
            try:
                torch.cuda.set_stream(stream.stream)
                block_ids = torch.tensor(job.block_ids, dtype=torch.int64, pin_memory=True).to(
                    stream.stream.device, non_blocking=True
                )
                slots = torch.tensor(job.slots, dtype=torch.int64, pin_memory=True).to(
                    stream.stream.device, non_blocking=True
                )
                copy_kernel.launch(copies.table, block_ids, slots, self._pool_base, self._slot_bytes, to_host,
                                   self._chunk_bytes, self._programs or copy_kernel.pcie_programs(index))
                fence = None
                if job.transport_state.event is not None:
                    readback = torch.empty(1, dtype=torch.int64, pin_memory=True)
                    readback.copy_(copies.fence, non_blocking=True)
                    fence = (readback, 0, job.transport_state.fence_seq)
                nbytes = len(job.block_ids) * self._span(job.worker.layout.block_bytes) * self._slot_bytes
                spin = stream.idle and nbytes <= self._spin_bytes
                end = stream.end_event(blocking=not spin)
                cuda_calls.record(end[1], stream.handle)
            finally:
                torch.cuda.set_stream(copies.device.default_stream)
        if job.trace is not None:
            job.trace["queued"] = jobtrace.now()
        # The index tensors must live until the kernel has read them.
        stream.track(end, job, (block_ids, slots), fence)

    def _copy_via_staging(self, copies, stream: CopyStream, slots, ids, first_id: int, span, to_host: bool,
                          trace=None, block_span: int = 1) -> None:
        """Pages to or from a ring of staging buffers by kernel, on the direction's
        kernel stream; buffer rows to or from pool slots by the copy engines, one
        transfer per run of consecutive slots. Chunk by chunk, each side waits
        only for the other's part of the same buffer, so transfers of one chunk
        overlap the kernel of the next. ids[first_id:] hold the job's block ids:
        on the host side of the ring (span) until uploaded here. A block
        takes `block_span` slots in the pool and as many rows of a buffer:
        block i of a chunk sits at buffer + i * pitch, the pitch the kernel
        takes where it took a row's bytes (server/native/src/cuda_staging.cpp alike)."""
        programs = self._programs or copy_kernel.staging_programs(copies.device.index)
        slot_bytes, pool_base = self._slot_bytes, self._pool_base
        pitch = block_span * slot_bytes
        per_chunk = max(1, stream.rows // block_span)
        transfers, kernels = stream.handle, stream.kernels_handle
        n = len(slots)
        uploaded = span is None

        def upload() -> None:
            nonlocal uploaded
            if not uploaded:
                ring = stream.ring
                cuda_calls.copy(ring.gpu_address + 8 * span[0], ring.host_address + 8 * span[0], 8 * n, kernels)
                uploaded = True
                stamp("ids_up")

        def launch(first: int, count: int, buffer: int) -> None:
            copy_kernel.launch_at(copies.table, ids, first_id + first, count, stream.positions, buffer, pitch,
                                  to_host, self._chunk_bytes, programs, stream.kernels, kernels)
            stamp("kernel")

        def stamp(stage: str) -> None:
            if trace is not None and stage not in trace:
                trace[stage] = jobtrace.now()

        for first, count in staging_chunks(n, per_chunk, not to_host and stream.idle):
            b = stream.next_buffer
            stream.next_buffer = (b + 1) % len(stream.buffers)
            buffer = stream.buffer_addresses[b]
            filled, drained = stream.filled_handles[b], stream.drained_handles[b]
            # Pool side and buffer side of each transfer, in the job's direction.
            runs = [(pool_base + slot * slot_bytes, buffer + at * pitch, k * pitch)
                    for slot, at, k in _runs(slots[first : first + count], self._per_registration, block_span)]
            if to_host:
                upload()
                if stream.used[b]:
                    cuda_calls.wait(kernels, drained)
                launch(first, count, buffer)
                cuda_calls.record(filled, kernels)
                cuda_calls.wait(transfers, filled)
                for pool_address, buffer_address, nbytes in runs:
                    cuda_calls.copy(pool_address, buffer_address, nbytes, transfers)
                cuda_calls.record(drained, transfers)
            else:
                if stream.used[b]:
                    cuda_calls.wait(transfers, drained)
                for pool_address, buffer_address, nbytes in runs:
                    cuda_calls.copy(buffer_address, pool_address, nbytes, transfers)
                cuda_calls.record(filled, transfers)
                stamp("transfers")
                # Only now: the load's first transfer is queued already, and
                # the copy engine does not wait for the upload.
                upload()
                cuda_calls.wait(kernels, filled)
                launch(first, count, buffer)
                cuda_calls.record(drained, kernels)
            stream.used[b] = True
            stamp("first_chunk")

    @staticmethod
    def _upload_ids(block_ids, stream: CopyStream) -> torch.Tensor:
        """All the job's block ids in one upload, on the kernel stream (current)."""
        with torch.cuda.stream(stream.kernels):
            return torch.tensor(block_ids, dtype=torch.int64, pin_memory=True).to(stream.kernels.device,
                                                                                 non_blocking=True)

