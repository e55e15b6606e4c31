"""Builds the native lane (server/native/src/*.cpp) into one shared library.

    python -m kvdepot.server.native.build [--force] [--quiet]

It needs only a C++17 compiler (g++ or clang++, $CXX wins): no Python headers,
no CUDA toolkit (the CUDA calls are made through the functions torch loaded,
whose addresses Python hands over). The library goes beside this file, named
for the sources' digest, which it also carries (kvd_build_id): a library built
from other sources is never loaded. `make install`, `make run` and `make test`
run this; where it cannot build, the daemon runs the pure-Python lane and says
so at start.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"
THIRD_PARTY = HERE / "third_party"
FLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-pthread", "-Wall", "-Wextra",
         "-Wno-unused-parameter", "-fno-strict-aliasing", "-Wl,--no-undefined"]


def sources() -> list[Path]:
    return sorted([*SOURCES.glob("*.cpp"), *SOURCES.glob("*.h"), *THIRD_PARTY.rglob("*.h")])


def build_id() -> str:
    """A digest of the sources and the flags: what a library must carry to be loaded."""
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for path in sources():
        digest.update(path.relative_to(HERE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    return HERE / f"_lane-{build_id()}.so"


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def build(force: bool = False, quiet: bool = False) -> Path:
    """The library for the current sources, built if it is not there; raises
    RuntimeError saying why it cannot be built."""
    target = library_path()
    if target.exists() and not force:
        return target
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, clang++ or $CXX) on the PATH")
    cpp = [str(p) for p in sorted(SOURCES.glob("*.cpp"))]
    # Built beside the target under a name nobody can guess, then renamed: a
    # half-written library is never loaded, and two builds at once do not clash.
    fd, partial = tempfile.mkstemp(prefix=".lane-", suffix=".so", dir=HERE)
    os.close(fd)
    command = [cxx, *FLAGS, f'-DKVD_BUILD_ID="{build_id()}"', *cpp, "-o", partial]
    if not quiet:
        print("building the native lane:", " ".join(command[:2]), "...", file=sys.stderr)
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{done.stderr[-4000:]}")
        os.chmod(partial, 0o755)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    for stale in HERE.glob("_lane-*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="build even if the library is there")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    try:
        path = build(args.force, args.quiet)
    except RuntimeError as e:
        print(f"the native lane cannot be built, the daemon will run the Python lane: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
