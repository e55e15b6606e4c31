"""How much GPU memory this daemon process holds on each GPU (its CUDA context,
streams and staging buffers), read from NVML, the driver's management library.

torch only knows its own allocations; the context, often the larger part, is
visible only to the driver. Returns None where NVML cannot tell.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger("kvdepot.gpu_memory")


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_t (v2 and v3 share this layout)
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


@functools.cache
def _nvml():
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
    except OSError:
        return None
    return lib


def _device_handle(lib, uuid: str):
    handle = ctypes.c_void_p()
    wanted = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    if lib.nvmlDeviceGetHandleByUUID(wanted.encode(), ctypes.byref(handle)) != 0:
        return None
    return handle


def process_memory(uuid: str, pid: int | None = None) -> int | None:
    """Bytes the process `pid` (default: this one) holds on the GPU with this UUID."""
    lib = _nvml()
    if lib is None:
        return None
    handle = _device_handle(lib, uuid)
    if handle is None:
        return None
    pid = os.getpid() if pid is None else pid
    count = ctypes.c_uint(64)
    infos = (_ProcessInfo * 64)()
    getter = getattr(lib, "nvmlDeviceGetComputeRunningProcesses_v3", None)
    getter = getter or lib.nvmlDeviceGetComputeRunningProcesses_v2
    if getter(handle, ctypes.byref(count), infos) != 0:
        return None
    for info in infos[: count.value]:
        if info.pid == pid:
            # NVML_VALUE_NOT_AVAILABLE where the driver cannot tell (e.g. some VMs)
            return None if info.usedGpuMemory == 0xFFFFFFFFFFFFFFFF else int(info.usedGpuMemory)
    return None
