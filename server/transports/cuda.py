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
from kvdepot.server.core.transport import (
    Finish,
    FinishMany,
    GpuStats,
    LaneDevice,
    LaneKernel,
    LaneStream,
    LaneWorker,
    Transport,
    one_by_one,
)
from kvdepot.server.host import numa
from kvdepot.server.transports import copy_kernel, cuda_calls, gpu_memory, hash_kernel
from kvdepot.server.transports.cuda_jobs import JobQueue
from kvdepot.server.transports.cuda_streams import RING_ENTRIES, ComputeGate, CopyStream, completed

log = logging.getLogger("kvdepot.cuda")

COPY_MODES = ("dma", "kernel")

# Interprocess events a worker may use (the client uses a small ring of them).
MAX_EVENTS_PER_WORKER = 1024
# This transport in the native lane (server/native/src/lane.h TransportKind).
LANE_KIND = 2


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

    @property
    def fence_address(self) -> int:
        return self.fence.data_ptr()


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
        finish_many: FinishMany | None = None,
        native: bool = False,
    ):
        """native: the native lane runs the jobs (lane_worker); this transport
        sets up the GPUs and the workers' mappings, and starts no thread."""
        if mode not in COPY_MODES:
            raise ValueError(f"copy mode must be one of {COPY_MODES}, not {mode!r}")
        if staging_bytes < pool.slot_bytes:
            raise ValueError(
                f"staging_bytes ({staging_bytes}) must hold at least one pool slot ({pool.slot_bytes} bytes)"
            )
        self._finish_many = finish_many or one_by_one(finish)
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
        self._native = native
        self._gate = None if native else ComputeGate(self._loop, self._gate_opened, self._gate_failed)
        self._lane_devices: dict[int, LaneDevice] = {}
        # GPU memory the lane's store hashes use, kept for the daemon's life.
        self._hash_memory: dict[int, tuple] = {}
        self._held_at_gate = 0
        # The pool as rows of slots, for the copy engines: registered with CUDA,
        # so torch copies it asynchronously.
        pool_rows = torch.frombuffer(pool.buffer, dtype=torch.uint8, count=pool.size)
        log.info("CUDA transport: %s copies; pool seen as pinned by torch: %s", mode, pool_rows.is_pinned())
        self._queue = JobQueue(pool, spin_bytes, chunk_bytes, programs)
        if not self.wait_for_compute:
            log.warning("stores do NOT wait for the workers' compute (a test's setting)")

    def shutdown(self) -> None:
        """Waits for copies on the GPU: the pool is unpinned after this."""
        if self._gate is not None:  # first: a store it let go would start a copy on a stopped stream
            self._gate.stop()
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
            # The lane waits for room in the ring rather than making tensors of
            # a job's own: any job must fit in it alone.
            ring = (max(RING_ENTRIES, self._pool.num_slots + 2), False) if self._native else ()
            # The daemon's kernels (copies) need no stack: the GPU memory that a
            # context reserves for it is left to the engines.
            try:
                cuda.set_stack_limit(index, 0)
            except cuda.CudaError as e:
                log.warning("GPU %d: could not lower the per-thread stack (%s); the context keeps it", index, e)
            with torch.cuda.device(index):
                device = _Device(
                    index,
                    CopyStream(index, "store", self._loop, self._finished_many, shape, *ring),
                    CopyStream(index, "load", self._loop, self._finished_many, shape, *ring),
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
        span, rows = self._pool.span(layout.block_bytes), self._staging_bytes // self._pool.slot_bytes
        if self._mode == "dma" and span > rows:  # a block takes `span` rows of a staging buffer
            raise InvalidArgument(
                f"a block of {layout.block_bytes} bytes takes {span} pool slots of {self._pool.slot_bytes} bytes, "
                f"and the daemon's GPU staging buffers (--staging-bytes {self._staging_bytes}) hold {rows}: "
                "the daemon needs a larger --staging-bytes for this layout")
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

    # ------------------------------------------------------------ the native lane

    def lane_worker(self, worker) -> LaneWorker:
        if self._mode != "dma":
            raise FailedPrecondition("the native lane copies in dma mode only: start kvdepotd with --lane python")
        copies = self._workers[worker.id]
        return LaneWorker(LANE_KIND, device=self._lane_device(copies.device), table=copies.table.pointers,
                          pages_per_block=copies.table.pages_per_block, max_page_bytes=copies.table.max_page_bytes,
                          fence=copies.fence_address)

    def _lane_device(self, device: _Device) -> LaneDevice:
        lane_device = self._lane_devices.get(device.index)
        if lane_device is None:
            lane_device = self._lane_devices[device.index] = LaneDevice(
                device.index, self.wait_for_compute, self._chunk_bytes, self._spin_bytes,
                self._pool.registration_bytes // self._pool.slot_bytes, self._lane_stream(device, device.store, True),
                self._lane_stream(device, device.load, False), cuda_calls.entry_points())
        return lane_device

    def _lane_stream(self, device: _Device, stream: CopyStream, to_host: bool) -> LaneStream:
        slot = self._pool.slot_bytes
        launch = copy_kernel.prepared(stream.positions, stream.buffer_addresses[0], slot, to_host, self._chunk_bytes)
        hashing = hash_kernel.prepared(device.index) if to_host else None
        if launch is None or (to_host and hashing is None):
            raise FailedPrecondition("the native lane cannot launch this Triton's kernels by their handles: "
                                     "start kvdepotd with --lane python")
        ring = stream.ring
        copy = LaneKernel(launch.function, launch.block, launch.shared, launch.param_sizes,
                          self._programs or copy_kernel.staging_programs(device.index))
        hashes = {}
        if hashing is not None:
            # A store's rows are hashed on the GPU for their records: no CPU reads them to seal.
            blocks, rows, keys = hashing
            scratch = [torch.empty(stream.rows * hash_kernel.blocks_per_row(slot), dtype=torch.int64,
                                   device=stream.positions.device) for _ in stream.buffers]
            self._hash_memory[device.index] = (keys, scratch)
            hashes = dict(
                hash_blocks=LaneKernel(blocks.function, blocks.block, blocks.shared, blocks.param_sizes),
                hash_rows=LaneKernel(rows.function, rows.block, rows.shared, rows.param_sizes),
                hash_keys=keys.data_ptr(), hash_scratch=tuple(t.data_ptr() for t in scratch))
        return LaneStream(
            stream.handle, stream.kernels_handle, tuple(stream.buffer_addresses), stream.rows,
            tuple(stream.filled_handles), tuple(stream.drained_handles), ring.host_address, ring.gpu_address,
            len(ring.host), stream.positions.data_ptr(), copy, **hashes)

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
            self._queue.enqueue(job, copies, stream, to_host)
        except Exception as e:
            log.exception("%s job %d: could not start its copies", job.kind.value, job.id)
            try:
                # Whatever part was queued must end before the slots can be reused.
                stream.synchronize()
            except RuntimeError:
                log.critical("the CUDA context on GPU %d is broken: restart kvdepotd", copies.device.index)
            self._finished(job, False, f"the daemon could not start the copy: {e}")

    def _finished(self, job, ok: bool, error: str) -> None:
        self._finished_many([(job, ok, error)])

    def _finished_many(self, ended: list) -> None:
        """Jobs whose copies ended (in order, on one stream, or one job)."""
        reported = []
        for job, ok, error in ended:
            state: _JobState = job.transport_state
            copies = state.copies
            if state.span is not None:
                stream = copies.device.store if job.kind is JobKind.STORE else copies.device.load
                stream.ring.give_back(state.span)
                state.span = None
            copies.in_flight -= 1
            if job.session.ended:
                ok, error = False, "the client went away during the job"
            reported.append((job, ok, error))
        self._finish_many(reported)
        for job, _, _ in ended:
            copies = job.transport_state.copies
            if copies.closing and copies.in_flight == 0 and job.worker.id in self._workers:
                self._release(job.worker.id)

    def abandon(self, job) -> None:
        # The session has ended (job.session.ended): a store still at the gate
        # is dropped there. Copies already queued on the GPU cannot be taken
        # back: the job ends (failed) when they have, and only then are its
        # slots and the worker's mappings released.
        pass
