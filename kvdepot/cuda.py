"""The few CUDA runtime and driver calls that torch does not expose: IPC memory
handles and allocation ranges. Imported only where CUDA is used.

The libraries are the ones torch already loaded, found in /proc/self/maps, so
the daemon and the worker call the same CUDA that torch runs on.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

IPC_HANDLE_BYTES = 64
_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CudaError(RuntimeError):
    pass


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def _loaded_library(stem: str) -> str | None:
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if os.path.basename(path).startswith(stem):
                return path
    return None


@functools.cache
def _cudart() -> ctypes.CDLL:
    torch.cuda.init()
    path = _loaded_library("libcudart.so")
    lib = ctypes.CDLL(path) if path else ctypes.CDLL("libcudart.so")
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_void_p]
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint]
    lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return lib


@functools.cache
def _libcuda() -> ctypes.CDLL:
    torch.cuda.init()
    path = _loaded_library("libcuda.so")
    lib = ctypes.CDLL(path or "libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        message = _cudart().cudaGetErrorString(rc).decode()
        raise CudaError(f"{what} failed: {message} (CUDA error {rc})")


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the cudaMalloc allocation that contains `ptr`."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    if rc != 0:
        raise CudaError(f"cuMemGetAddressRange failed for 0x{ptr:x} (CUDA driver error {rc})")
    return base.value, size.value


def ipc_mem_handle(base: int) -> bytes:
    handle = _IpcMemHandle()
    _check(_cudart().cudaIpcGetMemHandle(ctypes.byref(handle), base), "cudaIpcGetMemHandle")
    # (handle.reserved would stop at the first zero byte.)
    return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)


def open_ipc_mem_handle(handle: bytes, device: int) -> int:
    if len(handle) != IPC_HANDLE_BYTES:
        raise CudaError(f"a CUDA IPC memory handle has {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
    raw = _IpcMemHandle()
    ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_BYTES)
    ptr = ctypes.c_void_p()
    with torch.cuda.device(device):
        rc = _cudart().cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, _IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    _check(rc, "cudaIpcOpenMemHandle")
    return ptr.value


def close_ipc_mem_handle(ptr: int, device: int) -> None:
    with torch.cuda.device(device):
        _check(_cudart().cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")


_LIMIT_STACK_SIZE = 0  # cudaLimitStackSize


def current_raw_stream(device: int) -> int:
    """The current stream of `device` as a CUDA handle, without making a
    torch.cuda.Stream (several microseconds; this is on every store's path)."""
    return torch._C._cuda_getCurrentRawStream(device)


@functools.cache
def _stream_ops():
    # Called without letting go of the GIL (PyDLL): neither waits, and each
    # hand-over of the GIL to another of the engine's threads costs more than
    # the call itself.
    lib = ctypes.PyDLL(_libcuda()._name)
    write = getattr(lib, "cuStreamWriteValue64_v2", None) or lib.cuStreamWriteValue64
    write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    record = ctypes.PyDLL(_cudart()._name).cudaEventRecord
    record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return write, record


def write_value64(stream: int, address: int, value: int) -> bool:
    """Enqueues a write of `value` to the GPU address on `stream`, after the
    stream's earlier work (a memory fence first); False where the GPU or driver
    has no stream memory operations."""
    return _stream_ops()[0](stream, address, value, 0) == 0


def record_event(event: torch.cuda.Event, stream: int) -> None:
    """cudaEventRecord of an event torch has created (recorded once already)."""
    _check(_stream_ops()[1](event.cuda_event, stream), "cudaEventRecord")


def set_stack_limit(device: int, nbytes: int) -> None:
    """Sets the stack each GPU thread of this process reserves on `device`. The
    context reserves it for every thread the GPU can run at once, so it is most
    of a context's memory (1 KiB, the default, is 264 MiB on an H100); the
    driver raises it again for any kernel that needs more."""
    with torch.cuda.device(device):
        _check(_cudart().cudaDeviceSetLimit(_LIMIT_STACK_SIZE, ctypes.c_size_t(nbytes)), "cudaDeviceSetLimit")


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


@functools.cache
def pci_bus_id(index: int) -> str | None:
    """GPU `index`'s PCI address as CUDA writes it (0000:3B:00.0); None where
    the runtime cannot tell."""
    buffer = ctypes.create_string_buffer(64)
    try:
        rc = _cudart().cudaDeviceGetPCIBusId(buffer, ctypes.c_int(len(buffer)), ctypes.c_int(index))
    except (AttributeError, OSError):  # a runtime without it: the node stays unknown
        return None
    return buffer.value.decode("ascii", "replace") if rc == 0 else None


def device_index(uuid: str) -> int | None:
    wanted = uuid.removeprefix("GPU-")
    for index in range(torch.cuda.device_count()):
        if device_uuid(index).removeprefix("GPU-") == wanted:
            return index
    return None


def expandable_segments_enabled() -> bool:
    """PyTorch's expandable segments allocate with cuMemMap, which legacy IPC cannot share."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        setting = os.environ.get(name, "").replace(" ", "").lower()
        if "expandable_segments:true" in setting:
            return True
    return False
