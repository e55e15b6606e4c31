"""How fast a pool's memory is faulted in: one tmpfs file against several.

A cold start's whole pool comes up at the pace of page faults into its tmpfs
file. This faults SIZE of shared memory in on THREADS threads, as the daemon
does (madvise(MADV_POPULATE_WRITE) in 256 MiB pieces; with --fallocate,
posix_fallocate first), once with the memory in one file and once in FILES
files mapped side by side into one range, and with --register pins it
afterwards through CUDA's driver in 1 GiB registrations (the daemon's way,
server/host/cuda_driver.py).

    python bench/pool_faults.py --size 16GiB --files 1,16 --register
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import mmap
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdepot.server.host.cuda_driver import open_driver  # noqa: E402
from kvdepot.settings import parse_size  # noqa: E402

GiB = 1 << 30
PIECE = 256 << 20
_MADV_POPULATE_WRITE = 23
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def one_run(folder: str, total: int, files: int, threads: int, fallocate: bool, pinning) -> tuple[float, float]:
    """Seconds faulting in, and pinning (0 without `pinning`)."""
    per = total // files
    base = libc.mmap(None, total, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    fds = []
    try:
        for i in range(files):
            fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
            fds.append(fd)
            os.ftruncate(fd, per)
            flags = mmap.MAP_SHARED | _MAP_FIXED
            if libc.mmap(base + i * per, per, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0) != base + i * per:
                raise OSError(ctypes.get_errno(), "mmap")
        # File after file within each offset, so that the threads spread over the files.
        pieces = [(i, at) for at in range(0, per, PIECE) for i in range(files)]

        def fault(piece: tuple[int, int]) -> None:
            i, at = piece
            n = min(PIECE, per - at)
            if fallocate:
                os.posix_fallocate(fds[i], at, n)
            if libc.madvise(base + i * per + at, n, _MADV_POPULATE_WRITE):
                raise OSError(ctypes.get_errno(), "madvise")

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(threads) as executor:
            list(executor.map(fault, pieces))
        faulted = time.monotonic() - started
        pinned = 0.0
        if pinning is not None:
            started = time.monotonic()
            for at in range(0, total, GiB):
                rc = pinning.register(base + at, min(GiB, total - at))
                if rc:
                    raise RuntimeError(f"cuMemHostRegister failed with CUDA error {rc}")
            pinned = time.monotonic() - started
            for at in range(0, total, GiB):
                pinning.unregister(base + at)
        return faulted, pinned
    finally:
        libc.munmap(base, total)
        for fd in fds:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--files", default="1,16", help="file counts to compare, comma-separated")
    parser.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--folder", default="/dev/shm")
    parser.add_argument("--fallocate", action="store_true", help="posix_fallocate each piece before faulting it")
    parser.add_argument("--register", action="store_true", help="pin it afterwards (needs a GPU)")
    args = parser.parse_args()
    total = parse_size(args.size)
    pinning = None
    if args.register:
        pinning, why = open_driver()
        if pinning is None:
            raise SystemExit(f"--register: {why}")
    print(f"{total / GiB:.1f} GiB in {args.folder}, {args.threads} threads"
          f"{', fallocate then populate' if args.fallocate else ', populate'}")
    print(f"{'files':>5}  {'fault s':>8}  {'s/GiB':>6}  {'pin s':>6}  {'s/GiB':>6}")
    for files in (int(n) for n in args.files.split(",")):
        faulted, pinned = one_run(args.folder, total - total % (files * PIECE), files, args.threads,
                                  args.fallocate, pinning)
        print(f"{files:>5}  {faulted:>8.2f}  {faulted / (total / GiB):>6.3f}  {pinned:>6.2f}  "
              f"{pinned / (total / GiB):>6.3f}")


if __name__ == "__main__":
    main()
