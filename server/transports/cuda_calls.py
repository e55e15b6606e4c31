"""The CUDA calls a job makes, as direct calls into the CUDA libraries that
torch loaded: asynchronous copies, event records and waits, and the launch of
a compiled copy kernel by its handle.

A job of a few blocks makes about ten of them. Through torch each one costs
tens of microseconds of Python (a tensor slice and its copy_, a pinned tensor
for its block ids, an Event object, stream switches), and Triton's launcher
binds its arguments anew on every call; on one event-loop thread that was most
of what a small job cost the daemon (docs/benchmarks.md, issue 27). Here each
is one foreign call with its argument types declared once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

from kvdepot import cuda

log = logging.getLogger("kvdepot.cuda")

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the addresses (UVA)


@functools.cache
def _runtime():
    """libcudart as torch loaded it, its calls made without letting go of the
    GIL: each takes microseconds and never waits, and letting go of the GIL for
    each would hand it to another thread about a dozen times a job (the
    completion and hashing threads), the event loop waiting to get it back."""
    lib = ctypes.PyDLL(cuda._cudart()._name)
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    lib.cudaSetDevice.argtypes = [ctypes.c_int]
    lib.cudaEventQuery.argtypes = [ctypes.c_void_p]
    return lib


@functools.cache
def _blocking_runtime():
    """libcudart for the calls that wait: these let go of the GIL."""
    lib = cuda._cudart()
    lib.cudaEventSynchronize.argtypes = [ctypes.c_void_p]
    return lib


@functools.cache
def _driver():
    lib = ctypes.PyDLL(cuda._libcuda()._name)  # as _runtime: no GIL hand-over a launch
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 6, ctypes.c_uint, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p]
    info = getattr(lib, "cuFuncGetParamInfo", None)
    if info is not None:
        info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                         ctypes.POINTER(ctypes.c_size_t)]
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        cuda._check(rc, what)


_NOT_READY = 600  # cudaErrorNotReady

# The device this thread made current last (the event loop's thread is the
# only one that sets it): switching costs a call, keeping it none.
_current = threading.local()


def set_device(index: int) -> None:
    if getattr(_current, "device", None) != index:
        _check(_runtime().cudaSetDevice(index), "cudaSetDevice")
        _current.device = index


def forget_device() -> None:
    """Torch (or anyone) may have made another device current since."""
    _current.device = None


def synchronize(event: int) -> None:
    """Waits for the event, without the GIL (ctypes lets it go); CudaError if
    the work before it failed."""
    _check(_blocking_runtime().cudaEventSynchronize(event), "cudaEventSynchronize")


def query(event: int) -> bool:
    """Whether the work before the event has completed; CudaError if it failed."""
    rc = _runtime().cudaEventQuery(event)
    if rc == _NOT_READY:
        return False
    _check(rc, "cudaEventQuery")
    return True


def copy(dst: int, src: int, nbytes: int, stream: int) -> None:
    """cudaMemcpyAsync between any two addresses CUDA knows (device, pinned host)."""
    _check(_runtime().cudaMemcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")


def record(event: int, stream: int) -> None:
    _check(_runtime().cudaEventRecord(event, stream), "cudaEventRecord")


def wait(stream: int, event: int) -> None:
    _check(_runtime().cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")


def event_handle(event) -> int:
    """The cudaEvent_t of a torch.cuda.Event, created (torch makes it on first record)."""
    import torch

    if not event.cuda_event:
        event.record(torch.cuda.current_stream())
    return event.cuda_event


def entry_points() -> dict[str, int]:
    """The addresses of the CUDA functions a native caller makes (the native
    lane), in the libraries torch loaded."""
    runtime, driver = _runtime(), _driver()
    names = ("cudaSetDevice", "cudaMemcpyAsync", "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventQuery",
             "cudaEventSynchronize", "cudaEventCreateWithFlags", "cudaEventDestroy", "cudaIpcOpenEventHandle",
             "cudaStreamSynchronize", "cudaGetErrorString")
    addresses = {name: ctypes.cast(getattr(runtime, name), ctypes.c_void_p).value for name in names}
    addresses["cuLaunchKernel"] = ctypes.cast(driver.cuLaunchKernel, ctypes.c_void_p).value
    return addresses


class KernelLaunch:
    """Launches one compiled Triton kernel with cuLaunchKernel, its parameters
    packed by the sizes the driver reports for the function.

    `of` returns None when anything about the kernel is not what this packs
    (another Triton's compiled-kernel fields, scratch memory, clusters, a
    driver without cuFuncGetParamInfo); the caller then launches through
    Triton, which is slower but always right.
    """

    def __init__(self, function: int, block: int, shared: int, sizes: list[int], args: int):
        self._function = function
        self._block = block
        self._shared = shared
        self._values = [(ctypes.c_uint64 if size == 8 else ctypes.c_uint32)() for size in sizes]
        self._pointers = (ctypes.c_void_p * len(sizes))(*[ctypes.addressof(v) for v in self._values])
        self._args = args
        self._masks = [(1 << (8 * size)) - 1 for size in sizes]

    @property
    def function(self) -> int:
        return self._function

    @property
    def block(self) -> int:
        return self._block

    @property
    def shared(self) -> int:
        return self._shared

    @property
    def param_sizes(self) -> tuple[int, ...]:
        return tuple(ctypes.sizeof(v) for v in self._values)

    @classmethod
    def of(cls, kernel, args: int) -> KernelLaunch | None:
        """`kernel`: what Triton's first launch returned; `args`: how many of the
        kernel's parameters the caller passes (the rest are Triton's own
        scratch pointers, given null)."""
        try:
            metadata = kernel.metadata
            if getattr(kernel, "function", None) is None and hasattr(kernel, "_init_handles"):
                kernel._init_handles()
            function = kernel.function
            if getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0):
                return None
            if getattr(metadata, "num_ctas", 1) != 1 or tuple(getattr(metadata, "cluster_dims", (1, 1, 1))) not in (
                (1, 1, 1), (0, 0, 0)):
                return None
            if getattr(metadata, "launch_cooperative_grid", False) or getattr(metadata, "launch_pdl", False):
                return None
            info = getattr(_driver(), "cuFuncGetParamInfo", None)
            if info is None or not function:
                return None
            sizes = []
            offset, size = ctypes.c_size_t(), ctypes.c_size_t()
            while info(function, len(sizes), ctypes.byref(offset), ctypes.byref(size)) == 0:
                sizes.append(size.value)
                if len(sizes) > 64:
                    return None
            if len(sizes) < args or any(s not in (4, 8) for s in sizes) or any(s != 8 for s in sizes[args:]):
                return None
            return cls(function, 32 * metadata.num_warps, metadata.shared, sizes, args)
        except Exception:  # another Triton: its launcher does it
            log.info("launching the copy kernel through Triton's launcher", exc_info=True)
            return None

    def __call__(self, grid: int, stream: int, *args: int) -> None:
        values, masks = self._values, self._masks
        for i, value in enumerate(args):
            values[i].value = value & masks[i]
        rc = _driver().cuLaunchKernel(self._function, grid, 1, 1, self._block, 1, 1, self._shared, stream,
                                      self._pointers, None)
        _check(rc, "cuLaunchKernel")
