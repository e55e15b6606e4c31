"""Copy throughput of the CUDA transport, against the bus measured in the same run.

    python bench/cuda_copy.py [--sizes 16,64,512,2048] [--layouts per_layer,block_major]

1. The ceiling: one pinned contiguous 1 GiB copy each way, and both ways at
   once on two streams.
2. Through the real daemon (started here) from this process as the worker:
   store and load jobs of N blocks of a Llama-3.1-8B rank (32 layers, 8 KV heads,
   head dim 128, 16 tokens a block, bf16: 32 KiB pages, 2 MiB a block), in the
   per-layer layout ([2, blocks, 16, 8, 128] a layer) and the block-major one
   ([blocks, 32, 2, 16, 8, 128]), one job at a time and sustained (--depth
   jobs of each direction in flight, the next submitted as the oldest ends);
   a store and a load at once; and the submit-to-completion latency of a
   16-block job.
3. The baseline: one cudaMemcpyAsync per page, in this process.
Times are medians of --reps runs after a warm-up; rates are GB/s (1e9 bytes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvdepotd import BenchDaemon  # noqa: E402

from kvdepot.client import KVDepotClient  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
PAGE = BLOCK_SIZE * HEADS * HEAD_DIM * 2
BLOCK = LAYERS * 2 * PAGE


def timings(fn, reps: int) -> list[float]:
    """Seconds of `reps` calls of fn, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn, reps: int) -> float:
    return statistics.median(timings(fn, reps))


def best_time(fn, reps: int) -> float:
    return min(timings(fn, reps))


def registered_host(n: int):
    """n bytes of page-locked host memory made the way the daemon makes its pool
    (ordinary pages, then cudaHostRegister), and the mmap that owns them."""
    import mmap

    area = mmap.mmap(-1, n)
    tensor = torch.frombuffer(area, dtype=torch.uint8, count=n)
    tensor.fill_(1)  # touch every page before registering, as the pool does
    rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), n, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")
    return tensor, area


def peak(reps: int) -> dict:
    """The bus ceiling each way and both ways at once (the sum of the two
    directions' rates while both run): the best of max(reps, 8) 1 GiB copies,
    from two kinds of pinned memory (torch's cudaHostAlloc, and
    registered pages like the daemon's pool). The best, not the median: a
    ceiling measured low makes every ratio divided by it read high (an H100
    run once measured H2D at 47.2 GB/s while the daemon's loads moved 53.8)."""
    reps = max(reps, 8)
    best = {"d2h": 0.0, "h2d": 0.0, "both": 0.0}
    registered = registered_host(2 << 30)
    kinds = {
        "cudaHostAlloc": (torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True),
                          torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)),
        "registered": (registered[0][: 1 << 30], registered[0][1 << 30:]),
    }
    for name, (host, host2) in kinds.items():
        for key, value in _peak_of(host, host2, reps).items():
            best[key] = max(best[key], value)
            best[f"{key}_{name}"] = value
    del kinds
    torch.cuda.cudart().cudaHostUnregister(registered[0].data_ptr())
    return best


def _peak_of(host, host2, reps: int) -> dict:
    n = host.numel()
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    gpu2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def d2h():
        host.copy_(gpu, non_blocking=True)
        torch.cuda.synchronize()

    def h2d():
        gpu.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def both() -> float:
        # Each direction timed on its own stream: 2n bytes over the slower
        # one's time would count the end, where the faster one has finished
        # and the other runs alone, as two-way time (and read low).
        with torch.cuda.stream(s1):
            marks[0].record()
            host.copy_(gpu, non_blocking=True)
            marks[1].record()
        with torch.cuda.stream(s2):
            marks[2].record()
            gpu2.copy_(host2, non_blocking=True)
            marks[3].record()
        torch.cuda.synchronize()
        return sum(n / (marks[a].elapsed_time(marks[b]) / 1e3) for a, b in ((0, 1), (2, 3))) / 1e9

    both()
    result = {"d2h": n / best_time(d2h, reps) / 1e9, "h2d": n / best_time(h2d, reps) / 1e9,
              "both": max(both() for _ in range(reps))}
    return result


def make_cache(layout: str, num_blocks: int):
    if layout == "per_layer":
        return [torch.randn(2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
                for _ in range(LAYERS)], 1
    return [torch.randn(num_blocks, LAYERS, 2, BLOCK_SIZE, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)], 0


class Jobs:
    def __init__(self, client, worker):
        self.client, self.worker, self.next = client, worker, 0

    def run(self, kind: str, keys, block_ids):
        self.next += 1
        submit = self.client.submit_store if kind == "store" else self.client.submit_load
        submit(self.worker, self.next, keys, block_ids)
        return self.next

    def wait(self, *ids):
        results = self.client.wait(ids, timeout=120)
        bad = [r for r in results.values() if not r.ok]
        if bad:
            raise RuntimeError(f"job failed: {bad[0].error}")
        # Rates count every block a job names: one the daemon skipped would inflate them.
        skipped = sum(r.not_stored + r.already_stored for r in results.values())
        if skipped:
            raise RuntimeError(f"{skipped} block(s) of a store were not copied (every slot pinned by jobs in "
                               "flight, or stored already): raise --pool-size or lower --depth")

    def sustained(self, plan, depth: int, reps: int = 3) -> float:
        """Runs the (kind, keys, block_ids) jobs of `plan` with up to `depth` of each
        kind in flight, submitting the next as the oldest ends, as an engine does
        step after step; returns the median over `reps` runs of the seconds from
        the first submit to the last end. keys None: fresh keys for each run (a
        store of keys stored already copies nothing), made before the clock starts."""
        times = []
        for _ in range(reps):
            fresh = [(kind, [os.urandom(32) for _ in ids] if keys is None else keys, ids) for kind, keys, ids in plan]
            times.append(self._sustained_once(fresh, depth))
        return statistics.median(times)

    def _sustained_once(self, plan, depth: int) -> float:
        in_flight = deque()
        todo = deque(plan)
        torch.cuda.synchronize()
        start = time.perf_counter()
        while todo or in_flight:
            while todo and len(in_flight) < depth * len({kind for kind, _, _ in plan}):
                in_flight.append(self.run(*todo.popleft()))
            self.wait(in_flight.popleft())
        return time.perf_counter() - start


def through_daemon(socket: str, layout: str, sizes: list[int], reps: int, depth: int) -> dict:
    largest = max(sizes)
    tensors, block_dim = make_cache(layout, 2 * largest)
    client = KVDepotClient(socket, name=f"bench-{layout}").connect(30)
    ns = dict(model="bench-llama-8b", kv_dtype="bfloat16", block_size=BLOCK_SIZE, layout=layout, tp_size=1)
    worker = client.register_worker(ns, rank=0, tensors=tensors, block_dim=block_dim)
    jobs = Jobs(client, worker)
    results = {}
    for n in sizes:
        low, high = list(range(n)), list(range(largest, largest + n))
        # Enough jobs for a steady state, but about 1 GB at least.
        count = max(3 * depth, (1 << 30) // (n * BLOCK))

        def fresh_keys(n=n):
            return [os.urandom(32) for _ in range(n)]

        def store(low=low):
            jobs.wait(jobs.run("store", fresh_keys(), low))

        loaded_keys = fresh_keys()

        def load(loaded_keys=loaded_keys, high=high):
            jobs.wait(jobs.run("load", loaded_keys, high))

        def both(loaded_keys=loaded_keys, low=low, high=high):
            a = jobs.run("store", fresh_keys(), low)
            b = jobs.run("load", loaded_keys, high)
            jobs.wait(a, b)

        nbytes = n * BLOCK
        results[n] = {"store": nbytes / median_time(store, reps) / 1e9}
        stores = [("store", None, low)] * count
        results[n]["store_sustained"] = count * nbytes / jobs.sustained(stores, depth) / 1e9
        # Stored after the timed stores, so they cannot have evicted it; loads keep it recent.
        jobs.wait(jobs.run("store", loaded_keys, low))
        loads = [("load", loaded_keys, high)] * count
        mixed = [job for pair in zip(loads, stores) for job in pair]
        results[n].update({
            "load": nbytes / median_time(load, reps) / 1e9,
            "load_sustained": count * nbytes / jobs.sustained(loads, depth) / 1e9,
            "both": 2 * nbytes / median_time(both, reps) / 1e9,
            "both_sustained": 2 * count * nbytes / jobs.sustained(mixed, depth) / 1e9,
        })
        if n == 16:
            results[n]["latency_ms"] = 1e3 * median_time(store, max(reps, 20))
        torch.cuda.synchronize()
    client.close()
    torch.cuda.empty_cache()
    return results


def bare_context_memory() -> str:
    """What a process that only starts torch's CUDA context holds on the GPU:
    the part of the daemon's footprint that is not its own buffers."""
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from cuda_copy import daemon_gpu_memory; "
            "import os; torch.zeros(1, device='cuda'); torch.cuda.synchronize(); print(daemon_gpu_memory(os.getpid()))")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(REPO / "bench")], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                 filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))))
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def daemon_gpu_memory(pid: int) -> str:
    """What nvidia-smi says the daemon process holds on the GPU (context, streams, staging)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if fields and fields[0] == str(pid):
            return fields[1]
    return "unknown (not listed by nvidia-smi)"


def interference(socket: str, seconds: float = 3.0) -> dict:
    """bf16 matmul throughput on this GPU alone, then while the daemon stores and
    loads 512-block jobs in the background: how much the copies slow compute."""
    import threading

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def tflops() -> float:
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(10):
                a @ b
            torch.cuda.synchronize()
            iters += 10
        return 2 * 8192**3 * iters / (time.perf_counter() - start) / 1e12

    alone = tflops()
    tensors, block_dim = make_cache("per_layer", 1024)
    client = KVDepotClient(socket, name="bench-interference").connect(30)
    ns = dict(model="bench-interference", kv_dtype="bfloat16", block_size=BLOCK_SIZE, layout="per_layer", tp_size=1)
    jobs = Jobs(client, client.register_worker(ns, rank=0, tensors=tensors, block_dim=block_dim))
    loaded = [os.urandom(32) for _ in range(512)]
    jobs.wait(jobs.run("store", loaded, list(range(512))))
    stop, moved = threading.Event(), [0]

    def pump():
        while not stop.is_set():
            s_id = jobs.run("store", [os.urandom(32) for _ in range(512)], list(range(512)))
            l_id = jobs.run("load", loaded, list(range(512, 1024)))
            jobs.wait(s_id, l_id)
            moved[0] += 2 * 512 * BLOCK

    thread = threading.Thread(target=pump)
    thread.start()
    time.sleep(0.5)
    start = time.perf_counter()
    moved[0] = 0
    busy = tflops()
    rate = moved[0] / (time.perf_counter() - start) / 1e9
    stop.set()
    thread.join()
    client.close()
    return {"alone": alone, "with_copies": busy, "copy_gbps": rate}


def per_page_baseline(n: int, reps: int) -> dict:
    tensors, _ = make_cache("per_layer", n)
    host = torch.empty(n * BLOCK, dtype=torch.uint8, pin_memory=True).view(n, LAYERS, 2, PAGE)
    pages = [(b, layer, kv) for b in range(n) for layer in range(LAYERS) for kv in range(2)]
    stream = torch.cuda.Stream()
    views = [t.view(torch.uint8).view(2, n, PAGE) for t in tensors]

    def d2h():
        with torch.cuda.stream(stream):
            for b, layer, kv in pages:
                host[b, layer, kv].copy_(views[layer][kv, b], non_blocking=True)
        torch.cuda.synchronize()

    def h2d():
        with torch.cuda.stream(stream):
            for b, layer, kv in pages:
                views[layer][kv, b].copy_(host[b, layer, kv], non_blocking=True)
        torch.cuda.synchronize()

    result = {"store": n * BLOCK / median_time(d2h, reps) / 1e9, "load": n * BLOCK / median_time(h2d, reps) / 1e9}
    torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,64,512,2048")
    parser.add_argument("--layouts", default="per_layer,block_major")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--depth", type=int, default=4,
                        help="jobs of each direction in flight in the sustained runs (default 4)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the slow per-page baseline")
    parser.add_argument("--interference", action="store_true",
                        help="also measure how much the copies slow a bf16 matmul on the same GPU")
    parser.add_argument("--pool-size", default="24GiB")
    parser.add_argument("--pool-dir", default=None,
                        help="the daemon's --pool-dir (default: a folder in /dev/shm); "
                             "a hugetlbfs mount for huge pages")
    args, daemon_args = parser.parse_known_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"copy mode {os.environ.get('KVDEPOT_COPY_MODE', 'dma')}", flush=True)
    ceiling = peak(args.reps)
    print(f"peak pinned contiguous 1 GiB (best of {max(args.reps, 8)}): D2H {ceiling['d2h']:.1f}  "
          f"H2D {ceiling['h2d']:.1f}  both ways {ceiling['both']:.1f} GB/s", flush=True)
    for kind in ("cudaHostAlloc", "registered"):
        print(f"  from {kind} memory: D2H {ceiling['d2h_' + kind]:.1f}  H2D {ceiling['h2d_' + kind]:.1f}  "
              f"both {ceiling['both_' + kind]:.1f}")

    with BenchDaemon(args.pool_size, BLOCK, pool_dir=args.pool_dir, extra=daemon_args) as daemon:
        daemon.wait_ready()
        daemon.wait_pool()
        socket = daemon.socket
        rows = []
        for layout in args.layouts.split(","):
            for n, r in through_daemon(socket, layout, sizes, args.reps, args.depth).items():
                rows.append((layout, n, r))
        daemon_mib = daemon_gpu_memory(daemon.pid)
        context_mib = bare_context_memory()
        slowdown = interference(socket) if args.interference else None
        baseline = {} if args.no_baseline else {
            n: per_page_baseline(n, max(1, args.reps // 2)) for n in sizes if n <= 512}

    print()
    print(f"Alone: one job at a time, submit to completion. Sustained: {args.depth} jobs of each direction in "
          "flight, the next submitted as the oldest ends. Ratios: to the one-way peak, or the two-way peak for both.")
    print(f"{'layout':<12} {'blocks':>6} {'store alone':>15} {'store sustained':>15} {'load alone':>15} "
          f"{'load sustained':>15} {'both alone':>15} {'both sustained':>15} {'vs per-page':>12}")

    def cell(rate: float, peak_rate: float) -> str:
        return f"{rate:.1f} ({rate / peak_rate:.2f})"

    for layout, n, r in rows:
        vs = ""
        if layout == "per_layer" and n in baseline:
            vs = f"{r['store'] / baseline[n]['store']:.1f}x/{r['load'] / baseline[n]['load']:.1f}x"
        print(f"{layout:<12} {n:>6} {cell(r['store'], ceiling['d2h']):>15} "
              f"{cell(r['store_sustained'], ceiling['d2h']):>15} "
              f"{cell(r['load'], ceiling['h2d']):>15} {cell(r['load_sustained'], ceiling['h2d']):>15} "
              f"{cell(r['both'], ceiling['both']):>15} {cell(r['both_sustained'], ceiling['both']):>15} {vs:>12}")
    for n, b in baseline.items():
        print(f"one cudaMemcpyAsync per page, {n} blocks: store {b['store']:.1f}  load {b['load']:.1f} GB/s")
    print(f"daemon's GPU memory after serving the jobs above: {daemon_mib} "
          f"(a bare torch CUDA context on this GPU: {context_mib})")
    if slowdown:
        print(f"bf16 matmul: {slowdown['alone']:.0f} TFLOP/s alone, {slowdown['with_copies']:.0f} with "
              f"{slowdown['copy_gbps']:.1f} GB/s of copies running ({slowdown['with_copies'] / slowdown['alone']:.2f})")
    for layout, _, r in rows:
        if "latency_ms" in r:
            print(f"{layout}: submit-to-completion of a 16-block store: {r['latency_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
