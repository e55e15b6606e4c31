"""How long a job's small copies wait beside other streams' big ones (needs a GPU).

    python bench/small_copy_wait.py [--rounds 40]

A store uploads its block ids (a few dozen bytes, host to device) before its
gather, while loads' transfers fill the same direction of the bus. This times,
from the host, a 512-byte host-to-device copy on one stream, and a kernel that
reads the same bytes straight from mapped host memory instead, first alone and
then beside another stream's 256 MiB copies each way. It is how the small
upload was ruled out as what held stores back (docs/benchmarks.md, 2026-11-29).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    import triton
    import triton.language as tl

    @triton.jit
    def read_host(src, dst):
        offsets = tl.arange(0, 64)
        tl.store(dst + offsets, tl.load(src + offsets))

    big_host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    big_gpu = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ids_host = torch.arange(64, dtype=torch.int64).pin_memory()
    ids_gpu = torch.empty(64, dtype=torch.int64, device="cuda")
    background, foreground = torch.cuda.Stream(), torch.cuda.Stream()
    ways = {"small host-to-device copy": lambda: ids_gpu.copy_(ids_host, non_blocking=True),
            "kernel reading host memory": lambda: read_host[(1,)](ids_host, ids_gpu)}

    def timed(op) -> str:
        times = []
        for _ in range(args.rounds):
            done = torch.cuda.Event()
            start = time.perf_counter()
            with torch.cuda.stream(foreground):
                op()
                done.record()
            done.synchronize()
            times.append((time.perf_counter() - start) * 1e6)
            time.sleep(0.0002)
        times.sort()
        return f"p50 {statistics.median(times):6.1f} µs, p90 {times[int(0.9 * len(times))]:6.1f} µs"

    def fill(direction: str) -> None:
        with torch.cuda.stream(background):
            for _ in range(60):  # about 0.3 s of copies, longer than the timing
                if direction == "host-to-device":
                    big_gpu.copy_(big_host, non_blocking=True)
                else:
                    big_host.copy_(big_gpu, non_blocking=True)

    for op in ways.values():  # compiled and warm before timing
        op()
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    for beside in ("nothing", "host-to-device", "device-to-host"):
        for name, op in ways.items():
            if beside != "nothing":
                fill(beside)
                time.sleep(0.01)
            print(f"beside {beside:15} {name:27} {timed(op)}")
            torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
