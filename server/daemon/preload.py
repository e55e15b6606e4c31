"""Loading torch's largest shared libraries without holding Python's lock.

The daemon imports torch on a thread once it serves (daemon/main.py
add_cuda_transport). Python's import, like ctypes.CDLL, holds the
interpreter's lock through each dlopen, and the dlopen of torch's libraries
takes hundreds of milliseconds, during which the event loop answers no call
(docs/benchmarks.md). dlopen called as a C function through ctypes lets the
lock go, and the import that follows finds those libraries already loaded.

Only what torch's import loads first, and as it loads it: its global
dependencies (CUDA's runtime libraries on a CUDA build) with RTLD_GLOBAL, as
torch/__init__.py does before anything else, then the CPU library. The CUDA
library (libtorch_cuda.so) is left to the import: torch loads some of CUDA's
libraries by path between the two (pytorch#138460), and loading it first
could pick others from the library path.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

# In torch/lib, in the order torch's import loads them, with the flags it uses.
TORCH_LIBRARIES = (("libtorch_global_deps.so", os.RTLD_NOW | os.RTLD_GLOBAL),
                   ("libc10.so", os.RTLD_NOW), ("libtorch_cpu.so", os.RTLD_NOW))


def package_folder(name: str) -> str | None:
    """Where top-level package `name` is, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = spec.submodule_search_locations if spec is not None else None
    return locations[0] if locations else None


def torch_libraries() -> list[tuple[str, int]]:
    """(path, dlopen flags) of the torch libraries to load first; none without torch."""
    folder = package_folder("torch")
    if folder is None:
        return []
    found = [(os.path.join(folder, "lib", name), flags) for name, flags in TORCH_LIBRARIES]
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
