"""The CUDA transport: the daemon copies between the workers' GPU KV caches,
opened once through CUDA IPC, and its pinned pool, on streams of its own.

Per GPU there is a store stream and a load stream (cuda_streams.py), so both
directions run at once; each stream's jobs complete in order. In "dma" mode
each direction also has a kernel stream: a job's pages are gathered into (or
scattered from) a ring of staging buffers in chunks, so that the copy engine
moves one chunk while the kernel prepares the next, also across jobs. A store
starts only once the worker's interprocess event, recorded after the compute
that wrote the blocks, has completed (the gate); a job is reported done only
once its copies have finished on the GPU. A worker's mappings are closed only
after the last copy touching them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch

from kvdepot import cuda, jobtrace
from kvdepot.errors import FailedPrecondition, InvalidArgument
from kvdepot.server.core.requests import JobKind
from kvdepot.server.core.transport import Finish, GpuStats, Transport
from kvdepot.server.host import numa
from kvdepot.server.transports import copy_kernel, cuda_calls, gpu_memory
from kvdepot.server.transports.cuda_streams import ComputeGate, CopyStream, completed, staging_chunks

log = logging.getLogger("kvdepot.cuda")

COPY_MODES = ("dma", "kernel")

# Interprocess events a worker may use (the client uses a small ring of them).
MAX_EVENTS_PER_WORKER = 1024


@dataclass
class _Device:
    index: int
    store: CopyStream
    load: CopyStream
    # The event loop thread's stream outside a job's enqueue (torch's default).
    default_stream: torch.cuda.Stream


@dataclass
class _Mapping:
    ptr: int
    size: int
    device: int
    users: int = 0


def _runs(slots: list[int], slots_per_registration: int) -> list[tuple[int, int, int]]:
    """(first slot, first row, count) of each run of consecutive slots inside one
    CUDA registration of the pool (a DMA copy cannot cross two)."""
    runs = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][2] == slot and slot % slots_per_registration:
            runs[-1][2] += 1
        else:
            runs.append([slot, row, 1])
    return [tuple(r) for r in runs]


class _ForeignMemory:
    """Lets torch.as_tensor view memory the daemon mapped from another process."""

    def __init__(self, ptr: int, count: int, typestr: str):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr, "data": (ptr, False), "version": 3}


@dataclass(eq=False)
class _WorkerCopies:
    device: _Device
    table: copy_kernel.PageTable
    mappings: list
    fence: torch.Tensor
    events: dict = field(default_factory=dict)
    in_flight: int = 0
    closing: bool = False


@dataclass(eq=False)
class _JobState:
    """Job.transport_state of a CUDA job."""

    copies: _WorkerCopies
    # A store's compute event, and the fence value its compute writes.
    event: torch.cuda.Event | None = None
    fence_seq: int = 0
    # The job's entries of its stream's IdRing, until it ends.
    span: tuple[int, int] | None = None


class CudaTransport(Transport):
    name = "cuda_ipc"
    handle_kind = "cuda_ipc"
    # Stores wait for the compute that wrote their blocks. Only a test turns
    # this off, to show that the ordering test can fail without it.
    wait_for_compute = True

    def __init__(
        self,
        finish: Finish,
        pool,
        *,
        mode: str = "dma",
        staging_bytes: int = 128 << 20,
        spin_bytes: int = 64 << 20,
        chunk_bytes: int = 16384,
        programs: int = 0,
    ):
        if mode not in COPY_MODES:
            raise ValueError(f"copy mode must be one of {COPY_MODES}, not {mode!r}")
        if staging_bytes < pool.slot_bytes:
            raise ValueError(
                f"staging_bytes ({staging_bytes}) must hold at least one pool slot ({pool.slot_bytes} bytes)"
            )
        self._finish_job = finish
        self._pool = pool
        self._pool_base = pool.base_address
        self._mode = mode
        self._staging_bytes = staging_bytes
        self._spin_bytes = spin_bytes
        self._chunk_bytes = chunk_bytes
        self._programs = programs
        self._loop = asyncio.get_running_loop()
        self._devices: dict[int, _Device] = {}
        self._mappings: dict[tuple[int, bytes], _Mapping] = {}
        self._workers: dict[int, _WorkerCopies] = {}
        self._gate = ComputeGate(self._loop, self._gate_opened, self._gate_failed)
        self._held_at_gate = 0
        # The pool as rows of slots, for the copy engines: registered with CUDA,
        # so torch copies it asynchronously.
        self._pool_rows = torch.frombuffer(pool.buffer, dtype=torch.uint8, count=pool.size).view(
            pool.num_slots, pool.slot_bytes
        )
        log.info("CUDA transport: %s copies; pool seen as pinned by torch: %s", mode, self._pool_rows.is_pinned())
        if not self.wait_for_compute:
            log.warning("stores do NOT wait for the workers' compute (a test's setting)")

    def shutdown(self) -> None:
        """Waits for copies on the GPU: the pool is unpinned after this."""
        for device in self._devices.values():
            for stream in (device.store, device.load):
                try:
                    stream.synchronize()
                except RuntimeError:
                    log.exception("GPU %d: could not wait for the daemon's copies", device.index)
                stream.stop()

    def gpu_stats(self) -> list:
        stats = []
        for index in sorted(self._devices):
            uuid = cuda.device_uuid(index)
            stats.append(GpuStats(index, uuid, gpu_memory.process_memory(uuid) or 0))
        return stats

    @property
    def open_mappings(self) -> int:
        return len(self._mappings)

    def _device(self, index: int) -> _Device:
        device = self._devices.get(index)
        if device is None:
            slot = self._pool.slot_bytes
            shape = (max(1, self._staging_bytes // slot), slot) if self._mode == "dma" else None
            # The daemon's kernels (copies) need no stack: the GPU memory that a
            # context reserves for it is left to the engines.
            try:
                cuda.set_stack_limit(index, 0)
            except cuda.CudaError as e:
                log.warning("GPU %d: could not lower the per-thread stack (%s); the context keeps it", index, e)
            with torch.cuda.device(index):
                device = _Device(
                    index,
                    CopyStream(index, "store", self._loop, self._finished_many, shape),
                    CopyStream(index, "load", self._loop, self._finished_many, shape),
                    torch.cuda.default_stream(index),
                )
            self._devices[index] = device
        return device

    # ------------------------------------------------------------ workers

    def open_worker(self, worker, spec) -> None:
        layout = worker.layout
        ipc = list(spec.handles)
        if spec.fence is None:
            raise InvalidArgument("a CUDA worker must register cuda_fence (see the proto)")
        index = cuda.device_index(ipc[0].device_uuid)
        if index is None:
            raise InvalidArgument(
                f"no GPU with UUID {ipc[0].device_uuid} is visible to the daemon; it must see every "
                "GPU its workers use (check CUDA_VISIBLE_DEVICES and the container's devices)"
            )
        if any(h.device_uuid != ipc[0].device_uuid for h in ipc):
            raise InvalidArgument("all tensors of a worker must be on one GPU")
        if not self._pool.pinned:
            raise FailedPrecondition("the daemon's pool is not pinned, so it cannot serve CUDA workers")
        mappings, addresses = [], []
        try:
            for tensor, handle in zip(layout.tensors, ipc):
                mapping = self._map(handle.mem_handle, index)
                mappings.append(mapping)
                if handle.storage_offset + tensor.storage_bytes > mapping.size:
                    raise InvalidArgument(
                        f"tensor {tensor.name!r}: its storage ends at byte "
                        f"{handle.storage_offset + tensor.storage_bytes} of an allocation of "
                        f"{mapping.size} bytes: the layout descriptor does not match the shared tensor"
                    )
                addresses.append(mapping.ptr + handle.storage_offset + tensor.byte_offset)
            problem = copy_kernel.check_alignment(layout, addresses, self._pool.slot_bytes)
            if problem:
                raise InvalidArgument(problem)
            fence_handle = spec.fence
            if fence_handle.device_uuid != ipc[0].device_uuid:
                raise InvalidArgument("the worker's cuda_fence must be on the GPU of its KV cache")
            fence_mapping = self._map(fence_handle.mem_handle, index)
            mappings.append(fence_mapping)
            if fence_handle.storage_offset + 8 > fence_mapping.size or fence_handle.storage_offset % 8:
                raise InvalidArgument("cuda_fence must be one aligned int64 inside its allocation")
            fence = torch.as_tensor(
                _ForeignMemory(fence_mapping.ptr + fence_handle.storage_offset, 1, "<i8"), device=f"cuda:{index}"
            )
            device = self._device(index)
            table = copy_kernel.PageTable.build(layout, addresses, torch.device("cuda", index))
        except BaseException:
            for mapping in mappings:
                self._unmap(mapping)
            raise
        self._workers[worker.id] = _WorkerCopies(device, table, mappings, fence)
        worker.node = numa.device_node(cuda.pci_bus_id(index))  # its stores take slots on its GPU's NUMA node

    def _map(self, mem_handle: bytes, device: int) -> _Mapping:
        # A process can open a handle only once; tensors sharing an allocation share the mapping.
        key = (device, bytes(mem_handle))
        mapping = self._mappings.get(key)
        if mapping is None:
            try:
                ptr = cuda.open_ipc_mem_handle(mem_handle, device)
            except cuda.CudaError as e:
                raise InvalidArgument(
                    f"cannot open the worker's CUDA IPC handle: {e}. The memory must come from "
                    "cudaMalloc (PyTorch: not expandable_segments) on a GPU this daemon sees"
                ) from None
            with torch.cuda.device(device):
                base, size = cuda.allocation_range(ptr)
            mapping = _Mapping(ptr, size - (ptr - base), device)
            self._mappings[key] = mapping
        mapping.users += 1
        return mapping

    def _unmap(self, mapping: _Mapping) -> None:
        mapping.users -= 1
        if mapping.users == 0:
            for key, value in list(self._mappings.items()):
                if value is mapping:
                    del self._mappings[key]
            cuda.close_ipc_mem_handle(mapping.ptr, mapping.device)

    def close_worker(self, worker) -> None:
        copies = self._workers.get(worker.id)
        if copies is None:
            return
        copies.closing = True
        if copies.in_flight == 0:
            self._release(worker.id)

    def _release(self, worker_id: int) -> None:
        copies = self._workers.pop(worker_id)
        for mapping in copies.mappings:
            self._unmap(mapping)
        log.info("closed the CUDA mappings of worker %d", worker_id)

    # ------------------------------------------------------------ jobs

    def prepare_job(self, worker, request) -> _JobState:
        copies = self._workers[worker.id]
        if request.kind is not JobKind.STORE or not self.wait_for_compute:
            return _JobState(copies)
        handle = request.compute_event
        if len(handle) != 64:
            raise InvalidArgument(
                "a CUDA store needs cuda_event_handle: the 64-byte IPC handle of an event "
                "recorded after the compute that wrote the blocks"
            )
        event = copies.events.get(handle)
        if event is None:
            if len(copies.events) >= MAX_EVENTS_PER_WORKER:
                raise InvalidArgument(
                    f"the worker has used {MAX_EVENTS_PER_WORKER} different compute events; reuse them"
                )
            try:
                event = torch.cuda.Event.from_ipc_handle(copies.device.index, handle)
            except RuntimeError as e:
                raise InvalidArgument(f"cannot open the store's cuda_event_handle: {e}") from None
            copies.events[handle] = event
        return _JobState(copies, event, request.compute_seq)

    def start(self, job) -> None:
        state: _JobState = job.transport_state
        state.copies.in_flight += 1
        if not job.blocks:
            self._loop.call_soon(self._finished, job, True, "")
        elif state.event is not None and (self._held_at_gate or not completed(state.event)):
            self._held_at_gate += 1
            self._gate.hold(job, state.event)
        else:
            # Most stores arrive after their compute ended: no trip through the
            # gate, unless stores wait there (they go first, in order).
            self._launch(job)

    def _gate_opened(self, job) -> None:
        self._held_at_gate -= 1
        self._launch(job)

    def _gate_failed(self, job, reason: str) -> None:
        self._held_at_gate -= 1
        self._fail(job, reason)

    def _fail(self, job, reason: str) -> None:
        self._finished(job, False, reason)

    def _launch(self, job) -> None:
        if job.trace is not None:
            job.trace["launch"] = jobtrace.now()
        copies = job.transport_state.copies
        if job.session.ended:
            self._fail(job, "the client went away before its compute finished")
            return
        to_host = job.kind is JobKind.STORE
        stream = copies.device.store if to_host else copies.device.load
        try:
            self._enqueue(job, copies, stream, to_host)
        except Exception as e:
            log.exception("%s job %d: could not start its copies", job.kind.value, job.id)
            try:
                # Whatever part was queued must end before the slots can be reused.
                stream.synchronize()
            except RuntimeError:
                log.critical("the CUDA context on GPU %d is broken: restart kvdepotd", copies.device.index)
            self._finished(job, False, f"the daemon could not start the copy: {e}")

    def _enqueue(self, job, copies, stream: CopyStream, to_host: bool) -> None:
        if stream.kernels is None:
            self._enqueue_kernel_mode(job, copies, stream, to_host)
            return
        state: _JobState = job.transport_state
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
        self._copy_via_staging(copies, stream, job.slots, ids, first_id, span, to_host, job.trace)
        fence = None
        if state.event is not None:
            # The fence the worker's compute wrote, read after the copy.
            array, index = fence_at
            address = array.data_ptr() if span is None else stream.ring.host_address + 8 * index
            cuda_calls.copy(address, copies.fence.data_ptr(), 8, stream.handle)
            fence = (array, index, state.fence_seq)
        # The end of a small job on an idle stream is waited for by spinning (the
        # driver's default, without the GIL): waking a thread that sleeps in the
        # driver costs such a job a noticeable part of its time. Behind other jobs,
        # or for a big job, the thread sleeps instead of spinning a core.
        spin = stream.idle and n * self._pool.slot_bytes <= self._spin_bytes
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
                copy_kernel.launch(copies.table, block_ids, slots, self._pool_base, self._pool.slot_bytes, to_host,
                                   self._chunk_bytes, self._programs or copy_kernel.pcie_programs(index))
                fence = None
                if job.transport_state.event is not None:
                    readback = torch.empty(1, dtype=torch.int64, pin_memory=True)
                    readback.copy_(copies.fence, non_blocking=True)
                    fence = (readback, 0, job.transport_state.fence_seq)
                spin = stream.idle and len(job.block_ids) * self._pool.slot_bytes <= self._spin_bytes
                end = stream.end_event(blocking=not spin)
                cuda_calls.record(end[1], stream.handle)
            finally:
                torch.cuda.set_stream(copies.device.default_stream)
        if job.trace is not None:
            job.trace["queued"] = jobtrace.now()
        # The index tensors must live until the kernel has read them.
        stream.track(end, job, (block_ids, slots), fence)

    def _copy_via_staging(self, copies, stream: CopyStream, slots, ids, first_id: int, span, to_host: bool,
                          trace=None) -> None:
        """Pages to or from a ring of staging buffers by kernel, on the direction's
        kernel stream; buffer rows to or from pool slots by the copy engines, one
        transfer per run of consecutive slots. Chunk by chunk, each side waits
        only for the other's part of the same buffer, so transfers of one chunk
        overlap the kernel of the next. ids[first_id:] hold the job's block ids:
        on the host side of the ring (span) until uploaded here."""
        rows = stream.rows
        programs = self._programs or copy_kernel.staging_programs(copies.device.index)
        per_registration = self._pool.registration_bytes // self._pool.slot_bytes
        slot_bytes, pool_base = self._pool.slot_bytes, self._pool_base
        transfers, kernels = stream.handle, stream.kernels_handle
        uploaded = span is None
        n = len(slots)
        for first, count in staging_chunks(n, rows, not to_host and stream.idle):
            b = stream.next_buffer
            stream.next_buffer = (b + 1) % len(stream.buffers)
            buffer = stream.buffer_addresses[b]
            filled, drained = stream.filled_handles[b], stream.drained_handles[b]
            runs = _runs(slots[first : first + count], per_registration)
            if to_host:
                if not uploaded:
                    self._upload_span(stream, span, n, kernels)
                    uploaded = True
                if stream.used[b]:
                    cuda_calls.wait(kernels, drained)
                copy_kernel.launch_at(copies.table, ids, first_id + first, count, stream.positions, buffer,
                                      slot_bytes, True, self._chunk_bytes, programs, stream.kernels)
                cuda_calls.record(filled, kernels)
                cuda_calls.wait(transfers, filled)
                for slot, row, k in runs:
                    cuda_calls.copy(pool_base + slot * slot_bytes, buffer + row * slot_bytes, k * slot_bytes,
                                    transfers)
                cuda_calls.record(drained, transfers)
            else:
                if stream.used[b]:
                    cuda_calls.wait(transfers, drained)
                for slot, row, k in runs:
                    cuda_calls.copy(buffer + row * slot_bytes, pool_base + slot * slot_bytes, k * slot_bytes,
                                    transfers)
                cuda_calls.record(filled, transfers)
                if not uploaded:
                    # Only now: the load's first transfer is queued already, and
                    # the copy engine does not wait for the upload.
                    self._upload_span(stream, span, n, kernels)
                    uploaded = True
                cuda_calls.wait(kernels, filled)
                copy_kernel.launch_at(copies.table, ids, first_id + first, count, stream.positions, buffer,
                                      slot_bytes, False, self._chunk_bytes, programs, stream.kernels)
                cuda_calls.record(drained, kernels)
            stream.used[b] = True
            if trace is not None and "first_chunk" not in trace:
                trace["first_chunk"] = jobtrace.now()

    @staticmethod
    def _upload_span(stream: CopyStream, span, n: int, on: int) -> None:
        ring = stream.ring
        cuda_calls.copy(ring.gpu_address + 8 * span[0], ring.host_address + 8 * span[0], 8 * n, on)

    @staticmethod
    def _upload_ids(block_ids, stream: CopyStream) -> torch.Tensor:
        """All the job's block ids in one upload, on the kernel stream (current)."""
        with torch.cuda.stream(stream.kernels):
            return torch.tensor(block_ids, dtype=torch.int64, pin_memory=True).to(stream.kernels.device,
                                                                                 non_blocking=True)

    def _finished_many(self, ended: list) -> None:
        for job, ok, error in ended:
            self._finished(job, ok, error)

    def _finished(self, job, ok: bool, error: str) -> None:
        state: _JobState = job.transport_state
        copies = state.copies
        if state.span is not None:
            stream = copies.device.store if job.kind is JobKind.STORE else copies.device.load
            stream.ring.give_back(state.span)
            state.span = None
        copies.in_flight -= 1
        if job.session.ended:
            ok, error = False, "the client went away during the job"
        self._finish_job(job, ok, error)
        if copies.closing and copies.in_flight == 0:
            self._release(job.worker.id)

    def abandon(self, job) -> None:
        # The session has ended (job.session.ended): a store still at the gate
        # is dropped there. Copies already queued on the GPU cannot be taken
        # back: the job ends (failed) when they have, and only then are its
        # slots and the worker's mappings released.
        pass
