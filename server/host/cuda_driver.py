"""Pinning the pool through CUDA's driver (libcuda), without torch.

Importing torch takes 4-8 s on the GPU hosts, more than the rest of a start
together, and pinning needs none of it: the pool is registered here, in the
primary context of the first GPU (the one torch's runtime uses later), as
portable and mapped memory, which every GPU's context sees and whose host
addresses kernels may use (UVA). torch comes up behind the start, for the
copies (daemon/main.py).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("kvdepot.pool")

# cuMemHostRegister's flags: usable from every context, and mapped into the GPUs' address space.
_PORTABLE = 0x01
_DEVICEMAP = 0x02


class DriverPinning:
    """Registers and unregisters host memory with the CUDA driver."""

    def __init__(self, lib: ctypes.CDLL, context: ctypes.c_void_p):
        self._lib = lib
        self._context = context
        self._register = getattr(lib, "cuMemHostRegister_v2", None) or lib.cuMemHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]

    def register(self, address: int, length: int) -> int:
        """0, or the CUDA error code. The calling thread takes the context first
        (start-up and the bring-up thread both pin)."""
        rc = self._lib.cuCtxSetCurrent(self._context)
        return rc or self._register(address, length, _PORTABLE | _DEVICEMAP)

    def unregister(self, address: int) -> int:
        rc = self._lib.cuCtxSetCurrent(self._context)
        return rc or self._lib.cuMemHostUnregister(address)


def open_driver() -> tuple[DriverPinning | None, str]:
    """The driver's pinning, or None and why not (no driver, no GPU)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, "no CUDA driver (libcuda.so.1) on this machine"
    rc = lib.cuInit(0)
    if rc:
        return None, f"CUDA's driver did not start (cuInit: error {rc}; 100 is no GPU)"
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc or count.value < 1:
        return None, "CUDA's driver sees no GPU"
    device = ctypes.c_int(0)
    context = ctypes.c_void_p()
    rc = lib.cuDeviceGet(ctypes.byref(device), 0) or lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
    if rc:
        return None, f"CUDA's driver gave no context for the first GPU (error {rc})"
    return DriverPinning(lib, context), ""
