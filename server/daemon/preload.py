"""Loading Triton's library without holding Python's lock.

The daemon imports the CUDA transport's modules, torch and Triton among them,
on a thread once it serves (daemon/main.py add_cuda_transport). Python's
import, like ctypes.CDLL, holds the interpreter's lock through each dlopen,
and a large library takes a tenth of a second or more to load, during which
the event loop answers no call (docs/benchmarks.md). dlopen called as a C
function through ctypes lets the lock go, and the import that follows finds
the library loaded.

Only a library that is safe to load before its package's import, with the
flags that import would use: Triton's extension library, which needs nothing
of CUDA's to load (its module's initialisation still runs in the import).
torch's are left to its import: the large ones (libtorch_cpu.so,
libtorch_cuda.so) come after torch has loaded CUDA's libraries by path (its
_preload_cuda_deps; pytorch#138460), and on a CUDA build they need some of
them (CUDA's runtime; CUPTI for its profiler), which loaded earlier could
come from LD_LIBRARY_PATH instead. What torch's import loads first (its
global dependencies, c10) took no measurable time off the wait.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

# By package, in the order its import loads them, with the flags it uses.
LIBRARIES = {"triton": (("_C/libtriton.so", sys.getdlopenflags()),)}


def package_folder(name: str) -> str | None:
    """Where top-level package `name` is, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = spec.submodule_search_locations if spec is not None else None
    return locations[0] if locations else None


def libraries(package: str) -> list[tuple[str, int]]:
    """(path, dlopen flags) of `package`'s libraries to load first; none without the package."""
    folder = package_folder(package)
    if folder is None:
        return []
    found = [(os.path.join(folder, name), flags) for name, flags in LIBRARIES[package]]
    return [(path, flags) for path, flags in found if os.path.isfile(path)]


def load(libraries: list[tuple[str, int]]) -> list[str]:
    """dlopen each (path, flags) with the interpreter's lock let go; the paths
    loaded. One that does not load is left to the import, which says why."""
    dlopen = ctypes.CDLL(None).dlopen  # a plain CDLL's call releases the lock
    dlopen.restype = ctypes.c_void_p
    dlopen.argtypes = (ctypes.c_char_p, ctypes.c_int)
    loaded = []
    for path, flags in libraries:
        if not dlopen(os.fsencode(path), flags):
            break  # the next may need it: the import takes it from here
        loaded.append(path)
    return loaded


def load_all() -> list[str]:
    """Every package's libraries (LIBRARIES); the paths loaded."""
    return [path for package in LIBRARIES for path in load(libraries(package))]
