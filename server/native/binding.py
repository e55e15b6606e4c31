"""The native lane's C functions (src/capi.cpp, src/capi_index.cpp), declared for ctypes, and the
records it hands Python (src/jobs.h, Events).

ctypes rather than a CPython extension: the library then needs no Python
headers to build, and one build serves any interpreter. A call costs about a
microsecond, and the lane is called per batch of ready work, not per job.
"""

from __future__ import annotations

import ctypes
import enum
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvdepot.server.host import shard_hash, shard_record
from kvdepot.server.native import build

c_u8p = ctypes.POINTER(ctypes.c_uint8)


class Range(ctypes.Structure):
    _fields_ = [("node", ctypes.c_int32), ("first", ctypes.c_int64), ("count", ctypes.c_int64)]


class LaneConfig(ctypes.Structure):
    _fields_ = [
        ("pool_base", ctypes.c_uint64),
        ("slot_bytes", ctypes.c_uint64),
        ("num_slots", ctypes.c_int64),
        ("records_base", ctypes.c_uint64),
        ("arc", ctypes.c_uint32),
        ("tracing", ctypes.c_uint32),
        ("check", ctypes.c_uint32),
        ("n_ranges", ctypes.c_uint32),
        ("ranges", ctypes.POINTER(Range)),
        ("seed", ctypes.c_uint64),
        ("max_unread", ctypes.c_uint64),
        ("chunk_slots", ctypes.c_int64),
        ("extent_slots", ctypes.c_int64),
        ("max_frame_bytes_per_uid", ctypes.c_uint64),
    ]


class CudaApi(ctypes.Structure):
    """src/transports.h CudaApi: the CUDA entry points, at the addresses torch loaded them."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "set_device", "memcpy_async", "event_record", "stream_wait_event", "event_query", "event_synchronize",
        "event_create", "event_destroy", "ipc_open_event", "stream_synchronize", "error_string", "launch_kernel")]


# CudaApi's fields and the CUDA functions they are.
CUDA_ENTRY_POINTS = (
    ("set_device", "cudaSetDevice"), ("memcpy_async", "cudaMemcpyAsync"), ("event_record", "cudaEventRecord"),
    ("stream_wait_event", "cudaStreamWaitEvent"), ("event_query", "cudaEventQuery"),
    ("event_synchronize", "cudaEventSynchronize"), ("event_create", "cudaEventCreateWithFlags"),
    ("event_destroy", "cudaEventDestroy"), ("ipc_open_event", "cudaIpcOpenEventHandle"),
    ("stream_synchronize", "cudaStreamSynchronize"), ("error_string", "cudaGetErrorString"),
    ("launch_kernel", "cuLaunchKernel"),
)


class KernelConfig(ctypes.Structure):
    _fields_ = [
        ("function", ctypes.c_uint64), ("block", ctypes.c_uint32), ("shared", ctypes.c_uint32),
        ("programs", ctypes.c_uint32), ("n_params", ctypes.c_uint32), ("param_sizes", ctypes.c_uint32 * 32),
    ]


class CudaStreamConfig(ctypes.Structure):
    _fields_ = [
        ("stream", ctypes.c_uint64), ("kernels", ctypes.c_uint64), ("buffers", ctypes.c_uint64 * 2),
        ("rows", ctypes.c_uint64), ("filled", ctypes.c_uint64 * 2), ("drained", ctypes.c_uint64 * 2),
        ("ring_host", ctypes.c_uint64), ("ring_gpu", ctypes.c_uint64), ("ring_entries", ctypes.c_uint64),
        ("positions", ctypes.c_uint64), ("copy", KernelConfig), ("hash_blocks", KernelConfig),
        ("hash_rows", KernelConfig), ("hash_keys", ctypes.c_uint64), ("hash_scratch", ctypes.c_uint64 * 2),
    ]


class CudaDeviceConfig(ctypes.Structure):
    _fields_ = [
        ("index", ctypes.c_int32), ("wait_for_compute", ctypes.c_uint32), ("chunk_bytes", ctypes.c_uint64),
        ("spin_bytes", ctypes.c_uint64), ("per_registration", ctypes.c_uint64), ("store", CudaStreamConfig),
        ("load", CudaStreamConfig),
    ]


def _kernel_config(k) -> KernelConfig:
    if k is None:
        return KernelConfig()
    if len(k.param_sizes) > 32:
        raise ValueError(f"a kernel of {len(k.param_sizes)} parameters; the lane packs at most 32")
    return KernelConfig(function=k.function, block=k.block, shared=k.shared, programs=k.programs,
                        n_params=len(k.param_sizes), param_sizes=(ctypes.c_uint32 * 32)(*k.param_sizes))


def _stream_config(s) -> CudaStreamConfig:
    return CudaStreamConfig(
        stream=s.stream, kernels=s.kernels, buffers=(ctypes.c_uint64 * 2)(*s.buffers), rows=s.rows,
        filled=(ctypes.c_uint64 * 2)(*s.filled), drained=(ctypes.c_uint64 * 2)(*s.drained), ring_host=s.ring_host,
        ring_gpu=s.ring_gpu, ring_entries=s.ring_entries, positions=s.positions, copy=_kernel_config(s.copy),
        hash_blocks=_kernel_config(s.hash_blocks), hash_rows=_kernel_config(s.hash_rows), hash_keys=s.hash_keys,
        hash_scratch=(ctypes.c_uint64 * 2)(*s.hash_scratch))


def device_config(device) -> CudaDeviceConfig:
    """A core/transport.py LaneDevice as the lane reads it."""
    return CudaDeviceConfig(
        index=device.index, wait_for_compute=int(device.wait_for_compute), chunk_bytes=device.chunk_bytes,
        spin_bytes=device.spin_bytes, per_registration=device.per_registration, store=_stream_config(device.store),
        load=_stream_config(device.load))


_P = ctypes.c_void_p
_U32, _U64, _I32, _I64, _INT = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "kvd_build_id": ([], ctypes.c_char_p),
    "kvd_open": ([ctypes.POINTER(LaneConfig), ctypes.c_char_p, ctypes.c_size_t], _P),
    "kvd_close": ([_P], None),
    "kvd_error": ([_P], ctypes.c_char_p),
    "kvd_events_fd": ([_P], _INT),
    "kvd_take_events": ([_P, ctypes.POINTER(c_u8p)], ctypes.c_size_t),
    "kvd_scope": ([_P, ctypes.c_char_p, _I64], _U32),
    "kvd_ns_add": ([_P, _U32, _U32, _U32, ctypes.c_char_p, ctypes.c_char_p], None),
    "kvd_ns_follow": ([_P, _U32, _INT], None),
    "kvd_ns_remove": ([_P, _U32], None),
    "kvd_ns_counts": ([_P, _U32, ctypes.POINTER(_I64), ctypes.POINTER(_U64)], _INT),
    "kvd_ns_count": ([_P, _U32, _U32, _INT, _U64], None),
    "kvd_session_add": ([_P, _U32, _U32, ctypes.c_char_p, _U64], None),
    "kvd_session_end": ([_P, _U32], None),
    "kvd_session_info": ([_P, _U32, ctypes.POINTER(_U64), ctypes.POINTER(_U64)], _INT),
    "kvd_worker_add": ([_P, _U32, _U32, _U32, _U32, _U64, _U64, _I32, _INT, _U64, _U64], _INT),
    "kvd_conn_add": ([_P, _U32, _INT, ctypes.c_char_p, _U32, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                      ctypes.c_size_t, _INT], _I64),
    "kvd_submit": ([_P, _U32, _INT, _U32, _U64, ctypes.c_char_p, ctypes.POINTER(_U64), _U32, ctypes.POINTER(_U32),
                    _U32, ctypes.c_char_p, ctypes.c_size_t, _U64, ctypes.POINTER(_U32)], _INT),
    "kvd_set_draining": ([_P, _INT], None),
    "kvd_set_demote": ([_P, _INT], None),
    "kvd_lookup": ([_P, _U32, ctypes.c_char_p, _U32, _U32, _INT, ctypes.POINTER(_U32)], _INT),
    "kvd_contains": ([_P, _U32, ctypes.c_char_p], _INT),
    "kvd_keys_of": ([_P, _U32, _INT, ctypes.POINTER(c_u8p)], ctypes.c_size_t),
    "kvd_clear": ([_P, _I64, ctypes.POINTER(_U64)], None),
    "kvd_restore_many": ([_P, _U32, _U64, _U32, ctypes.c_char_p, ctypes.POINTER(_I64), ctypes.POINTER(_U64), _INT,
                          ctypes.POINTER(ctypes.c_uint8)], _U64),
    "kvd_release_slots": ([_P, ctypes.POINTER(_I64), ctypes.c_size_t, _INT], None),
    "kvd_keep_only": ([_P, ctypes.POINTER(_I64), ctypes.POINTER(_I64), ctypes.c_size_t, _I64], None),
    "kvd_span_at": ([_P, _I64], _I64),
    "kvd_reserve_promotion": ([_P, _U32, ctypes.c_char_p, ctypes.POINTER(_U64), ctypes.POINTER(_I64)], _U64),
    "kvd_finish_promotion": ([_P, _U64, _INT], None),
    "kvd_holds": ([_P, _U64], _INT),
    "kvd_hold": ([_P, _U64], None),
    "kvd_let_go": ([_P, _U64], None),
    "kvd_block_info": ([_P, _U64, _U32, ctypes.POINTER(_I64), ctypes.c_char_p], _INT),
    "kvd_counts": ([_P, ctypes.POINTER(_I64)], None),
    "kvd_free_in": ([_P, _U32], _I64),
    "kvd_set_online": ([_P, ctypes.POINTER(_I64), ctypes.POINTER(_I64), ctypes.c_size_t], None),
    "kvd_add_online": ([_P, _I64, _I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64), ctypes.c_size_t], _I64),
    "kvd_online_in": ([_P, _U32], _I64),
    "kvd_totals": ([_P, ctypes.POINTER(_U64)], None),
    "kvd_job_times": ([_P, ctypes.POINTER(_U64), ctypes.POINTER(ctypes.c_double), ctypes.POINTER(_U64)], None),
    "kvd_set_generation": ([_P, _U64], None),
    "kvd_verify": ([_P], ctypes.c_char_p),
    "kvd_decode_frame": ([ctypes.c_char_p, ctypes.c_size_t], ctypes.c_char_p),
    "kvd_test_hold_copies": ([_P, ctypes.c_char_p], None),
    "kvd_gpu_hash": ([ctypes.c_void_p, ctypes.c_size_t], _U64),
    "kvd_gpu_hash_many": ([_P, _P, _P, ctypes.c_size_t], None),
    "kvd_data_hash_many": ([_P, _P, _U64, _P, ctypes.c_size_t], None),
    "kvd_data_hash_at": ([_P, _P, _P, ctypes.c_size_t], None),
    "kvd_cuda_init": ([_P, ctypes.POINTER(CudaApi)], None),
    "kvd_cuda_has_device": ([_P, _INT], _INT),
    "kvd_cuda_device": ([_P, ctypes.POINTER(CudaDeviceConfig)], None),
    "kvd_cuda_worker": ([_P, _U32, _U32, _INT, ctypes.POINTER(_U64), _U64, _U64, _U64], _INT),
}


def load(path: Path | None = None) -> ctypes.CDLL:
    """The library for the current sources; OSError if it is not built (or
    was built from other sources)."""
    path = path or build.library_path()
    if not path.exists():
        raise OSError(f"{path.name} is not built (python -m kvdepot.server.native.build)")
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
    if lib.kvd_build_id().decode() != build.build_id():
        raise OSError(f"{path.name} was built from other sources")
    shard_hash.use_native(lib.kvd_gpu_hash, lib.kvd_gpu_hash_many)  # records the GPU sealed, checked at adoption
    # Each kept record's own hash, and the bytes of those the CPU sealed, at adoption.
    shard_record.use_native(lib.kvd_data_hash_many, lib.kvd_data_hash_at)
    return lib


class EventType(enum.IntEnum):
    CHANGE = 1
    JOB_DONE = 2
    LOG = 3
    RELEASED = 4
    CONN_CLOSED = 5
    COMMITTED = 6
    TRACE = 7


@dataclass(frozen=True)
class Event:
    type: EventType
    payload: bytes


_HEADER = struct.Struct("<BI")


def events(data: bytes) -> Iterator[Event]:
    at = 0
    while at < len(data):
        kind, length = _HEADER.unpack_from(data, at)
        at += _HEADER.size
        yield Event(EventType(kind), data[at : at + length])
        at += length


# Payloads (src/jobs.cpp, Events).
CHANGE = struct.Struct("<IB32s")
JOB_DONE = struct.Struct("<IQBII")
CONN_CLOSED = struct.Struct("<IIB")
COMMITTED = struct.Struct("<IIQ")
COMMITTED_BLOCK = struct.Struct("<Q32s")
TRACE = struct.Struct("<IQBI")
STAMP = struct.Struct("<Bq")

# Trace stages by the numbers jobs.cpp and cuda_streams.h stamp (kvdepot/jobtrace.py names).
STAGES = ("received", "begin", "launch", "ids_up", "kernel", "transfers", "first_chunk", "queued", "gpu_done",
          "finish", "done_sent", "committed")

# kvd_counts' fields, in order.
COUNTS = ("used_slots", "pinned_slots", "eviction_size", "jobs_in_flight", "sessions_ended", "sealed",
          "not_sealed", "unsealed", "store_busy_ns", "load_busy_ns", "connections", "free_slots",
          "free_extent_slots")
