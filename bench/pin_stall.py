"""How long one thread's mmap waits while another pins memory, by registration size.

cuMemHostRegister holds the process's memory-map lock for as long as one
registration takes, so every mmap of another thread (a library torch's
import loads, an allocation of Python's) waits for it. This pins SIZE of
populated shared memory through CUDA's driver (server/host/cuda_driver.py,
the daemon's way) in registrations of each size given, while the main thread
maps, touches and unmaps 1 MiB every 2 ms, and prints the registration rate
and how long those calls took. It needs a GPU.

    python bench/pin_stall.py --size 16GiB --chunks 1GiB,256MiB,64MiB,16MiB
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdepot.server.host.cuda_driver import open_driver  # noqa: E402
from kvdepot.settings import parse_size  # noqa: E402

GiB = 1 << 30
_MADV_POPULATE_WRITE = 23

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def pin_beside_maps(driver, base: int, size: int, chunk: int) -> dict:
    """Registers [base, base + size) in `chunk`s on a thread; times mmaps meanwhile; unregisters."""
    registered: list[int] = []
    took: list[float] = []
    errors: list[str] = []

    def register() -> None:
        started = time.monotonic()
        for offset in range(0, size, chunk):
            rc = driver.register(base + offset, min(chunk, size - offset))
            if rc:
                errors.append(f"cuMemHostRegister failed with CUDA error {rc}")
                break
            registered.append(base + offset)
        took.append(time.monotonic() - started)

    thread = threading.Thread(target=register)
    thread.start()
    waits = []
    while thread.is_alive():
        started = time.monotonic()
        scratch = mmap.mmap(-1, 1 << 20)
        scratch[0] = 1
        scratch.close()
        waits.append(time.monotonic() - started)
        time.sleep(0.002)
    thread.join()
    started = time.monotonic()
    for address in registered:
        driver.unregister(address)
    if errors:
        raise SystemExit(errors[0])
    waits.sort()
    return {"register_s": took[0], "unregister_s": time.monotonic() - started, "maps": len(waits),
            "p50_ms": waits[len(waits) // 2] * 1e3, "p99_ms": waits[int(len(waits) * 0.99)] * 1e3,
            "max_ms": waits[-1] * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="16GiB")
    parser.add_argument("--chunks", default="1GiB,256MiB,64MiB,16MiB", help="registration sizes, in turn")
    args = parser.parse_args()
    driver, why = open_driver()
    if driver is None:
        print(f"pin_stall: {why}", file=sys.stderr)
        return 1
    size = parse_size(args.size)
    fd = os.memfd_create("kvdepot-pin-stall")
    os.ftruncate(fd, size)
    memory = mmap.mmap(fd, size)
    os.close(fd)
    base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    started = time.monotonic()
    if libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(size), _MADV_POPULATE_WRITE):
        raise SystemExit(f"faulting the memory in failed: {os.strerror(ctypes.get_errno())}")
    print(f"{size / GiB:.0f} GiB of shared memory faulted in in {time.monotonic() - started:.2f} s")
    print("registration  s/GiB pinned  unregistered s  mmaps  p50 ms  p99 ms  max ms")
    for text in args.chunks.split(","):
        r = pin_beside_maps(driver, base, size, parse_size(text))
        print(f"{text:>12}  {r['register_s'] / (size / GiB):12.4f}  {r['unregister_s']:14.2f}  {r['maps']:5d}"
              f"  {r['p50_ms']:6.2f}  {r['p99_ms']:6.1f}  {r['max_ms']:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
