"""Which of the daemon's copies wait for the GPU's time slice while another process computes.

    python bench/time_slice.py

Without MPS a GPU runs one process's kernels at a time, switching between processes in time
slices. This measures, in this process, the copies a load is made of, while a second process
keeps the GPU computing (none; back-to-back `torch.cuda._sleep` kernels; back-to-back bf16
matmuls), for 4 and 64 blocks of a Llama-3.1-8B rank in the per-layer layout (2 MiB a block,
32 KiB pages, as bench/cuda_copy.py):

  flat h2d / flat d2h        one cudaMemcpyAsync of the job's bytes (the copy engines only)
  scatter kernel only        the copy kernel from a GPU staging buffer into the cache's pages
  flat h2d + scatter kernel  a load as the daemon queues it
  2D DMA per page            a load with no kernel: one cudaMemcpy2DAsync per page of a block
                             (the blocks' ids evenly spaced, so one call covers every block)

Each figure is the median (and p90) of 40 runs, from the first call to the stream's end, with
1.3 ms between runs so that they land at different points of the other process's slice.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMPUTE = r"""
import sys, time, torch
mode = sys.argv[1]
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("ready", flush=True)
end = time.time() + float(sys.argv[2])
while time.time() < end:
    for _ in range(8):
        if mode == "sleep":
            torch.cuda._sleep(20_000_000)
        else:
            a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""
H2D, D2H = 1, 2
REPS = 40


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its cudaMemcpy2DAsync is not in torch's API)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart" in line:
                return ctypes.CDLL(line.split()[-1])
    raise SystemExit("torch's CUDA runtime is not loaded in this process")


def main() -> None:
    # No options: the parser is there for --help, which works without a GPU.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from cuda_copy import BLOCK, LAYERS, PAGE, make_cache

    from kvdepot.server.transports import copy_kernel

    rt = cudart()
    dev = torch.device("cuda", 0)
    stream = torch.cuda.Stream(dev)
    raw = ctypes.c_void_p(stream.cuda_stream)
    most = 64
    tensors, _ = make_cache("per_layer", 2 * most + 2)
    host = torch.empty(most * BLOCK, dtype=torch.uint8, pin_memory=True)
    staging = torch.empty(most * BLOCK, dtype=torch.uint8, device=dev)
    gpu, stride, offset, size = [], [], [], []
    for layer, tensor in enumerate(tensors):
        for kv in range(2):
            gpu.append(tensor[kv].data_ptr())
            stride.append(tensor.stride(1) * tensor.element_size())
            offset.append((2 * layer + kv) * PAGE)
            size.append(PAGE)

    def up(values):
        return torch.tensor(values, dtype=torch.int64, device=dev)

    table = copy_kernel.PageTable(up(gpu), up(stride), up(offset), up(size), PAGE)
    programs = copy_kernel.staging_programs(0)

    def check(rc) -> None:
        if rc != 0:
            raise RuntimeError(f"CUDA error {rc}")

    def ops(n: int) -> dict:
        ids = torch.arange(n, dtype=torch.int64, device=dev) * 2  # every other block: evenly spaced
        slots = torch.arange(n, dtype=torch.int64, device=dev)
        nbytes = ctypes.c_size_t(n * BLOCK)
        h, s = ctypes.c_void_p(host.data_ptr()), ctypes.c_void_p(staging.data_ptr())

        def flat_h2d():
            check(rt.cudaMemcpyAsync(s, h, nbytes, H2D, raw))

        def flat_d2h():
            check(rt.cudaMemcpyAsync(h, s, nbytes, D2H, raw))

        def scatter():
            with torch.cuda.stream(stream):
                copy_kernel.launch(table, ids, slots, staging.data_ptr(), BLOCK, False, 16384, programs)

        def load():
            flat_h2d()
            scatter()

        def dma_per_page():
            for k in range(2 * LAYERS):
                check(rt.cudaMemcpy2DAsync(
                    ctypes.c_void_p(gpu[k]), ctypes.c_size_t(2 * stride[k]),
                    ctypes.c_void_p(host.data_ptr() + k * PAGE), ctypes.c_size_t(BLOCK),
                    ctypes.c_size_t(PAGE), ctypes.c_size_t(n), H2D, raw))

        return {"flat h2d": flat_h2d, "flat d2h": flat_d2h, "scatter kernel only": scatter,
                "flat h2d + scatter kernel": load, "2D DMA per page": dma_per_page}

    def measure(fn) -> tuple[float, float]:
        fn()
        stream.synchronize()
        times = []
        for _ in range(REPS):
            start = time.perf_counter()
            fn()
            stream.synchronize()
            times.append((time.perf_counter() - start) * 1e6)
            time.sleep(0.0013)
        times.sort()
        return times[len(times) // 2], times[int(len(times) * 0.9)]

    # The kernel-free load lands the same bytes as the daemon's.
    host.copy_(torch.randint(0, 255, (most * BLOCK,), dtype=torch.uint8))
    for t in tensors:
        t.zero_()
    ops(4)["2D DMA per page"]()
    stream.synchronize()
    by_dma = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    ops(4)["flat h2d + scatter kernel"]()
    stream.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(by_dma, tensors))
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; "
          f"2D DMA lands the bytes the kernel does: {same}")
    print(f"{'beside':8} {'blocks':>6}  {'copy':28} {'p50 µs':>8} {'p90 µs':>8} {'GB/s':>6}")
    for mode in ("nothing", "sleep", "matmul"):
        other = None
        if mode != "nothing":
            other = subprocess.Popen([sys.executable, "-c", COMPUTE, mode, "60"], stdout=subprocess.PIPE, text=True)
            other.stdout.readline()
            time.sleep(1.0)
        try:
            for n in (4, 64):
                for name, fn in ops(n).items():
                    p50, p90 = measure(fn)
                    print(f"{mode:8} {n:6}  {name:28} {p50:8.0f} {p90:8.0f} {n * BLOCK / p50 / 1e3:6.1f}", flush=True)
        finally:
            if other:
                other.kill()
                other.wait()


if __name__ == "__main__":
    main()
