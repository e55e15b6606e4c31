"""Loading torch's and Triton's largest shared libraries without holding Python's lock.

The daemon imports torch and Triton on a thread once it serves (daemon/main.py
add_cuda_transport). Python's import, like ctypes.CDLL, holds the
interpreter's lock through each dlopen, and the dlopen of those libraries
takes hundreds of milliseconds, during which the event loop answers no call
(docs/benchmarks.md). dlopen called as a C function through ctypes lets the
lock go, and the imports that follow find those libraries already loaded.

Each is loaded as its import would load it, and only those that are safe to
load first. For torch, what its import loads first: its global dependencies
(CUDA's runtime libraries on a CUDA build) with RTLD_GLOBAL, as
torch/__init__.py does before anything else, then the CPU library. The CUDA
library (libtorch_cuda.so) is left to the import: torch loads some of CUDA's
libraries by path between the two (pytorch#138460), and loading it first
could pick others from the library path. For Triton, its extension module,
with the flags Python's import uses (its own module initialisation still
runs in the import).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

# By package, in the order its import loads them, with the flags it uses.
LIBRARIES = {
    "torch": (("lib/libtorch_global_deps.so", os.RTLD_NOW | os.RTLD_GLOBAL), ("lib/libc10.so", os.RTLD_NOW),
              ("lib/libtorch_cpu.so", os.RTLD_NOW)),
    "triton": (("_C/libtriton.so", sys.getdlopenflags()),),
}


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
            break  # the next may need it: torch's import takes it from here
        loaded.append(path)
    return loaded


def load_all() -> list[str]:
    """Every package's libraries (LIBRARIES); the paths loaded."""
    return [path for package in LIBRARIES for path in load(libraries(package))]
