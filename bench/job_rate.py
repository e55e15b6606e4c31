"""Jobs a second through one daemon: a whole node's workers sending small jobs at once.

    python bench/job_rate.py [--transport cuda|shm] [--grid 1x4x4,8x4x4] [--seconds 10]
                             [--gpus 2] [--json out.json] [--label new]
    python bench/job_rate.py --plot docs/job_rate.png base.json new.json
    python bench/job_rate.py --transport shm --grid 1x4x4,2x4x4,4x4x4 --plot rate.png

Starts the real `kvdepotd`, then for each point of the grid (WORKERSxBLOCKSxDEPTH) that
many worker processes, one per engine rank, spread over the first --gpus GPUs (CUDA
transport: a Llama-3.1-8B rank's per-layer cache, 2 MiB a block, as bench/cuda_copy.py)
or over the shared-memory transport (--transport shm, no GPU: CPU caches of
--shm-block-bytes a block, which measures the per-job path without the bus). Each worker
first stores the blocks it will load, then for --seconds keeps DEPTH jobs of BLOCKS blocks
in flight, stores of new keys alternating with loads of stored ones, submitting the next
as each ends. Every worker starts and stops at the same moment. The worker processes are
started once and kept for every point (a point of N workers uses the first N): a CUDA worker
takes seconds to start.

For each point it prints the node's jobs/s, the p50 and p99 of submit to done (the
client knows the job ended) over every job of every worker, the worst worker's p99,
the daemon's CPU seconds per job (its utime + stime over the window, from /proc), and
the GB/s the jobs moved. --json keeps the figures; --plot draws p50 and p99 against
jobs/s for one or more such files (the versions compared in one run), or, given no file,
for the points it has just run. The points drawn are those of one job size and depth
(--plot-blocks, --plot-depth; by default the pair most of the points have), in order of load.

--stages turns the daemon's job tracing on (KVDEPOT_TRACE_JOBS, kvdepot/jobtrace.py) and
prints, for stores and loads of each point, the p50 and p99 of each step the daemon stamps
(received -> begin: checked, slots reserved; begin -> launch: a store waiting for its compute
at the gate; launch -> queued: its copies queued; queued -> gpu_done: the GPU's queue and the
copy; gpu_done -> finish: the completion thread's hand-over; finish -> done_sent), and what
is left of submit-to-done outside the daemon (p50 of the whole less p50 of the daemon's span).
Tracing costs the daemon's event loop a line a job: the rates it prints are a little lower.

--compute-us N (CUDA) puts a kernel of N µs on a worker's stream before each of its stores, as
the forward pass that wrote the blocks would be: the store waits for it at the daemon's gate,
and the daemon's own kernels take turns on the GPU with it. It shows what serving costs the
gate (--threads: its CPU a job) and what a busy GPU does to the loads.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

DEFAULT_GRID = "1x4x4,2x4x4,4x4x4,8x4x4,4x16x4,4x1x8"
# The daemon's stamps a job goes through, in order (a transport stamps those it has).
STAGES = ("received", "begin", "launch", "queued", "gpu_done", "finish", "done_sent")


def _cpu_seconds(pid: int, thread: int | None = None) -> float:
    """utime + stime of the process, or of one of its threads."""
    if thread is not None:
        # A thread's time in ns where the kernel keeps it: stat counts 10 ms
        # ticks, and a thread that ran less than one in the window shows 0.
        try:
            return int(Path(f"/proc/{pid}/task/{thread}/schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads_cpu(pid: int) -> dict[str, tuple[float, int]]:
    """(CPU seconds, times put on a core) of the daemon's threads, summed by
    name (digits dropped: kvdepot-store-0 and -1 are one), the event loop's
    thread as "loop". A thread that sleeps between jobs is put on a core once
    a wake: the second figure counts the hand-overs it took."""
    threads: dict[str, tuple[float, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            used = _cpu_seconds(pid, int(task.name))
            runs = int((task / "schedstat").read_text().split()[2])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        name = "loop" if int(task.name) == pid else name.rstrip("0123456789").rstrip("-_")
        seconds, count = threads.get(name, (0.0, 0))
        threads[name] = (seconds + used, count + runs)
    return threads


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ------------------------------------------------------------ one worker process


def _take_some(client, timeout: float):
    """Results of jobs that ended, waiting up to `timeout` for one. Through the
    client's job book, so the benchmark runs unchanged on older versions."""
    book = client._jobs
    with book._changed:
        book._changed.wait_for(lambda: book._results, timeout)
    return client.take_finished()


def _worker_cache(args, index: int):
    """(tensors, block_dim, namespace, block bytes) of worker `index`."""
    import torch

    blocks = args.cache_blocks
    if args.transport == "cuda":
        from cuda_copy import BLOCK, BLOCK_SIZE, HEAD_DIM, HEADS, LAYERS

        torch.cuda.set_device(index % args.gpus)
        tensors = [torch.zeros(2, blocks, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                   for _ in range(LAYERS)]
        block_bytes, block_size = BLOCK, BLOCK_SIZE
    else:
        layers, block_size = 4, 16
        page = args.shm_block_bytes // (2 * layers)
        tensors = [torch.zeros(2, blocks, block_size, page // (block_size * 2), dtype=torch.bfloat16)
                   for _ in range(layers)]
        block_bytes = 2 * layers * page
    ns = dict(model=f"bench-rate-{args.transport}", kv_dtype="bfloat16", block_size=block_size,
              layout="per_layer", tp_size=1)
    return tensors, 1, ns, block_bytes


def _compute_cycles(us: float) -> int:
    """The GPU clock cycles torch.cuda._sleep spins for `us` µs on this card."""
    import torch

    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return max(1, int(cycles * us / (start.elapsed_time(end) * 1000)))


def worker_main(args) -> int:
    """One worker process, kept for every point of the grid: it registers once,
    then for each point stores what its loads will read ("point BLOCKS DEPTH",
    answered "ready"), runs the window ("go START STOP", answered with its
    figures as JSON), until "quit"."""
    import torch

    from kvdepot.client import KVDepotClient

    index = args.index
    tensors, block_dim, ns, _ = _worker_cache(args, index)
    compute_cycles = _compute_cycles(args.compute_us) if args.transport == "cuda" and args.compute_us > 0 else 0
    client = KVDepotClient(args.socket, name=f"rate-{index}").connect(60)
    worker = client.register_worker(ns, rank=0, tensors=tensors, block_dim=block_dim)
    client.wait_connected(60)
    # Block ids: stores read rows [0, half), loads write rows [half, cache).
    half = args.cache_blocks // 2
    prefix = os.getpid().to_bytes(4, "little")
    counter = job_id = 0

    def new_keys(n: int) -> list[bytes]:
        nonlocal counter
        keys = [prefix + (counter + i).to_bytes(8, "little") + bytes(20) for i in range(n)]
        counter += n
        return keys

    print("up", flush=True)
    for line in sys.stdin:
        command, *values = line.split()
        if command == "quit":
            break
        if command == "point":
            blocks, depth = (int(v) for v in values)
            # What the loads read: stored before the window (check_node_args: within half the pool, all workers').
            stored = [new_keys(blocks) for _ in range(args.load_sets)]
            for keys in stored:
                job_id += 1
                client.submit_store(worker, job_id, keys, [i % half for i in range(blocks)])
                result = client.wait([job_id], 60)[job_id]
                if not result.ok or result.not_stored:
                    raise SystemExit(f"worker {index}: could not store its load set: {result}")
            print("ready", flush=True)
            continue
        start_at, stop_at = (float(v) for v in values)
        time.sleep(max(0.0, start_at - time.time()))
        submitted: dict[int, tuple[float, str, float]] = {}
        latencies: dict[str, list[float]] = {"store": [], "load": []}
        failed = turn = 0
        store_ids = [i % half for i in range(blocks)]
        load_ids = [half + i % half for i in range(blocks)]
        while True:
            now = time.time()
            if now >= stop_at and not submitted:
                break
            while now < stop_at and len(submitted) < depth:
                job_id += 1
                turn += 1
                kind = "store" if turn % 2 else "load"
                submitted[job_id] = (time.perf_counter(), kind, now)
                if kind == "store":
                    if compute_cycles:
                        torch.cuda._sleep(compute_cycles)  # the forward pass that wrote the blocks
                    client.submit_store(worker, job_id, new_keys(blocks), store_ids)
                else:
                    client.submit_load(worker, job_id, stored[turn // 2 % len(stored)], load_ids)
            for result in _take_some(client, 1.0):
                started, kind, wall = submitted.pop(result.job_id)
                if not result.ok or result.not_stored:
                    failed += 1
                elif wall < stop_at:  # jobs submitted in the window count
                    latencies[kind].append(time.perf_counter() - started)
        print(json.dumps({"latencies": latencies, "failed": failed}), flush=True)
    client.close()
    return 0


# ------------------------------------------------------------ the node


class Workers:
    """The worker processes, started once for the whole grid (starting a CUDA
    worker takes seconds); a point uses the first N."""

    def __init__(self, args, socket: str, count: int):
        command = [sys.executable, __file__, "--role", "worker", "--socket", socket, "--transport", args.transport,
                   "--gpus", str(args.gpus), "--cache-blocks", str(args.cache_blocks),
                   "--shm-block-bytes", str(args.shm_block_bytes), "--load-sets", str(args.load_sets),
                   "--compute-us", str(args.compute_us)]
        env = dict(os.environ,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        env.pop("KVDEPOT_TRACE_JOBS", None)  # the daemon's stamps alone
        self.procs = [subprocess.Popen([*command, "--index", str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env=env) for i in range(count)]
        for proc in self.procs:
            self._expect(proc, "up")

    @staticmethod
    def _expect(proc, word: str) -> None:
        line = proc.stdout.readline()
        if line.strip() != word:
            raise SystemExit(f"a worker did not say {word!r} (it said {line!r}, exit code {proc.poll()})")

    def tell(self, procs, line: str) -> None:
        for proc in procs:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def close(self) -> None:
        for proc in self.procs:
            try:
                self.tell([proc], "quit")
                proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()


def run_point(args, pool: Workers, daemon_pid: int, workers: int, blocks: int, depth: int) -> dict:
    procs = pool.procs[:workers]
    pool.tell(procs, f"point {blocks} {depth}")
    for proc in procs:
        pool._expect(proc, "ready")
    start_at = time.time() + 0.5
    stop_at = start_at + args.seconds
    window = (time.perf_counter_ns() + int(0.5e9), time.perf_counter_ns() + int((0.5 + args.seconds) * 1e9))
    pool.tell(procs, f"go {start_at} {stop_at}")
    time.sleep(max(0.0, start_at - time.time()))
    cpu_before, loop_before = _cpu_seconds(daemon_pid), _cpu_seconds(daemon_pid, daemon_pid)
    threads_before = _threads_cpu(daemon_pid)
    time.sleep(max(0.0, stop_at - time.time()))
    cpu_after, loop_after = _cpu_seconds(daemon_pid), _cpu_seconds(daemon_pid, daemon_pid)
    threads_after = _threads_cpu(daemon_pid)
    reports = [json.loads(proc.stdout.readline()) for proc in procs]
    path_thread = "kvdepot-lane" if "kvdepot-lane" in threads_after else "loop"
    path_used = threads_after.get(path_thread, (0.0, 0))[0] - threads_before.get(path_thread, (0.0, 0))[0]
    every = [x for r in reports for kind in ("store", "load") for x in r["latencies"][kind]]
    jobs = len(every)
    block_bytes = _block_bytes(args)
    point = {
        "workers": workers, "blocks": blocks, "depth": depth, "jobs": jobs,
        "jobs_per_s": jobs / args.seconds,
        "p50_ms": statistics.median(every) * 1e3 if every else float("nan"),
        "p99_ms": _percentile(every, 0.99) * 1e3 if every else float("nan"),
        "worst_p99_ms": max((_percentile(r["latencies"]["store"] + r["latencies"]["load"], 0.99) * 1e3
                             for r in reports if r["latencies"]["store"] or r["latencies"]["load"]), default=0.0),
        "daemon_cpu_us_per_job": (cpu_after - cpu_before) / max(1, jobs) * 1e6,
        "daemon_cpu_share": (cpu_after - cpu_before) / args.seconds,
        # The event loop's thread alone (it serves the jobs on the Python lane).
        "loop_cpu_us_per_job": (loop_after - loop_before) / max(1, jobs) * 1e6,
        "loop_cpu_share": (loop_after - loop_before) / args.seconds,
        # The thread the job path runs on: the part of the daemon that does not
        # spread over cores (the rest: copy threads, sealing for the warm pool).
        # kvdepot-lane where the native lane serves, else the event loop.
        "path_thread": path_thread,
        "path_cpu_us_per_job": path_used / max(1, jobs) * 1e6,
        "path_cpu_share": path_used / args.seconds,
        # µs of CPU a job by daemon thread (the warm pool's sealing hashes every stored byte).
        "threads_us_per_job": {name: round((used - threads_before.get(name, (0.0, 0))[0]) / max(1, jobs) * 1e6, 1)
                               for name, (used, _) in sorted(threads_after.items())
                               if used - threads_before.get(name, (0.0, 0))[0] > 0},
        # Times a job each thread was put on a core (its wakes).
        "threads_runs_per_job": {name: round((runs - threads_before.get(name, (0.0, 0))[1]) / max(1, jobs), 2)
                                 for name, (_, runs) in sorted(threads_after.items())
                                 if runs > threads_before.get(name, (0.0, 0))[1]},
        "gb_per_s": jobs * blocks * block_bytes / args.seconds / 1e9,
        "failed": sum(r["failed"] for r in reports),
    }
    if args.stages:
        time.sleep(0.2)  # the last jobs' lines
        point["stages_us"] = _stages(args, window)
        for kind, steps in point["stages_us"].items():
            latencies = [x * 1e6 for r in reports for x in r["latencies"][kind]]
            if latencies and "daemon" in steps:
                steps["outside the daemon"] = [statistics.median(latencies) - steps["daemon"][0], None]
    return point


def _stages(args, window: tuple[int, int]) -> dict:
    """p50 and p99 (µs) of each step between the daemon's stamps, by kind, over
    the jobs it received in the window; "daemon": received to done_sent."""
    steps: dict[str, dict[str, list[float]]] = {"store": {}, "load": {}}
    with open(args.trace_path, "rb") as f:
        f.seek(args.trace_offset)
        for line in f:
            if not line.endswith(b"\n"):
                break  # a line still being written (a job after the window): skipped with the next point's
            args.trace_offset += len(line)
            record = json.loads(line)
            stamps = record["stamps"]
            if record["kind"] not in steps or not window[0] <= stamps.get("received", 0) <= window[1]:
                continue
            seen = [stage for stage in STAGES if stamps.get(stage)]
            for a, b in zip(seen, seen[1:]):
                steps[record["kind"]].setdefault(f"{a} -> {b}", []).append((stamps[b] - stamps[a]) / 1e3)
            if len(seen) > 1 and seen[0] == "received" and seen[-1] == "done_sent":
                steps[record["kind"]].setdefault("daemon", []).append((stamps["done_sent"] - stamps["received"]) / 1e3)
    return {kind: {name: [statistics.median(values), _percentile(values, 0.99)] for name, values in found.items()}
            for kind, found in steps.items() if found}


def _block_bytes(args) -> int:
    if args.transport == "cuda":
        from cuda_copy import BLOCK

        return BLOCK
    return args.shm_block_bytes


def parse_grid(text: str) -> list[tuple[int, int, int]]:
    """WORKERSxBLOCKSxDEPTH points, comma-separated; each number at least 1."""
    grid = []
    for point in text.split(","):
        parts = point.strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"--grid: {point!r} is not a point WORKERSxBLOCKSxDEPTH of whole numbers from 1 "
                             "(e.g. 8x4x4)")
        grid.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return grid


def check_node_args(args, grid: list[tuple[int, int, int]]) -> None:
    """What would fail only after the daemon and the workers started, refused first."""
    from kvdepot.settings import parse_size

    if args.seconds <= 0:
        raise SystemExit("--seconds must be more than 0")
    if args.load_sets < 1:
        raise SystemExit("--load-sets must be at least 1")
    if args.transport == "shm" and (args.shm_block_bytes < 256 or args.shm_block_bytes % 256):
        raise SystemExit(f"--shm-block-bytes {args.shm_block_bytes}: a block is 4 layers of K and V pages of 16 "
                         "tokens, so a multiple of 256 bytes")
    if args.transport == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: use --transport shm to measure the per-job path without one")
        if args.gpus < 1:
            raise SystemExit("--gpus must be at least 1")
    # The loads read what each worker stored before the window; stores of new
    # keys pass through the rest of the pool. If the load sets took more than
    # half of it, the stores would evict them and the loads find nothing.
    slots = parse_size(args.pool_size) // _block_bytes(args)
    for workers, blocks, _ in grid:
        held = workers * args.load_sets * blocks
        if held > slots // 2:
            raise SystemExit(f"point {workers}x{blocks}x*: the workers' load sets take {held} blocks "
                             f"({workers} x --load-sets {args.load_sets} x {blocks}), more than half of the pool's "
                             f"{slots} (--pool-size {args.pool_size}); raise --pool-size or lower --load-sets")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise SystemExit(f"{option} {path}: no folder {Path(path).resolve().parent}")


def node_main(args) -> int:
    try:
        grid = parse_grid(args.grid)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    check_node_args(args, grid)
    # Stores read the first half of a worker's cache, loads write the second.
    args.cache_blocks = max(args.cache_blocks, 2 * max(b for _, b, _ in grid))
    block_bytes = _block_bytes(args)
    if args.stages:
        trace_dir = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        atexit.register(shutil.rmtree, trace_dir, True)  # also when the daemon or a worker fails to start
        args.trace_path, args.trace_offset = os.path.join(trace_dir, "daemon.jsonl"), 0
        os.environ["KVDEPOT_TRACE_JOBS"] = args.trace_path  # the daemon inherits it
        Path(args.trace_path).touch()
    if args.transport == "cuda":
        import torch
        from kvdepotd import BenchDaemon

        args.gpus = min(args.gpus, torch.cuda.device_count())
        what = f"{args.gpus} x {torch.cuda.get_device_name()}"
        daemon = BenchDaemon(args.pool_size, block_bytes, extra=args.daemon_args)
    else:
        from kvdepotd import BenchDaemon

        what = "shared-memory transport, no GPU"
        daemon = BenchDaemon(args.pool_size, block_bytes, pin="off", extra=args.daemon_args)
    label = args.label or "this version"
    print(f"{label}: {what}, {os.cpu_count()} CPUs, {args.seconds:g} s a point, "
          f"{block_bytes >> 10} KiB blocks, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    print(f"{'workers':>7} {'blocks':>6} {'depth':>5} {'jobs/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'worst p99':>9} {'µs CPU/job':>10} {'path µs/job':>11} {'daemon CPU':>10} {'path CPU':>8} {'GB/s':>7}",
          flush=True)
    with daemon:
        daemon.wait_ready()
        daemon.wait_pool()
        pool = Workers(args, daemon.socket, max(w for w, _, _ in grid))
        try:
            points = [_run_and_print(args, pool, daemon.pid, *point) for point in grid]
        finally:
            pool.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"label": label, "device": what, "transport": args.transport,
                                               "gpus": args.gpus, "seconds": args.seconds,
                                               "date": time.strftime("%Y-%m-%d"), "points": points}, indent=1))
    return 0


def _run_and_print(args, pool: Workers, daemon_pid: int, workers: int, blocks: int, depth: int) -> dict:
    point = run_point(args, pool, daemon_pid, workers, blocks, depth)
    print(f"{workers:>7} {blocks:>6} {depth:>5} {point['jobs_per_s']:>9,.0f} {point['p50_ms']:>8.2f} "
          f"{point['p99_ms']:>8.2f} {point['worst_p99_ms']:>9.2f} {point['daemon_cpu_us_per_job']:>10.0f} "
          f"{point['path_cpu_us_per_job']:>11.0f} {point['daemon_cpu_share']:>10.0%} "
          f"{point['path_cpu_share']:>8.0%} {point['gb_per_s']:>7.1f}"
          + (f"  ({point['failed']} failed)" if point["failed"] else ""), flush=True)
    if args.threads:
        runs = point["threads_runs_per_job"]
        print("        µs CPU a job by thread (wakes a job): " + ", ".join(
            f"{name} {us:.0f} ({runs.get(name, 0):.1f})" for name, us in point["threads_us_per_job"].items()),
            flush=True)
    for kind, steps in point.get("stages_us", {}).items():
        print(f"        {kind}s, µs p50/p99: " + ", ".join(
            f"{name} {p50:.0f}" + (f"/{p99:.0f}" if p99 is not None else "") for name, (p50, p99) in steps.items()),
            flush=True)
    return point


def _check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None


def plot_main(args) -> int:
    _check_plotting()
    if not Path(args.plot).resolve().parent.is_dir():
        raise SystemExit(f"--plot {args.plot}: no folder {Path(args.plot).resolve().parent}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for path in args.files:
        try:
            run = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"{path}: cannot read it as JSON: {e}") from None
        if not isinstance(run, dict) or "points" not in run:
            raise SystemExit(f"{path}: not the JSON of a job_rate run (--json)")
        runs.append(run)
    shapes = Counter((p["blocks"], p["depth"]) for run in runs for p in run["points"])
    if not shapes:
        raise SystemExit(f"no points to draw in {', '.join(args.files)}")
    # The pair most points have, among those that fit what was asked.
    fitting = Counter({(b, d): n for (b, d), n in shapes.items()
                       if args.plot_blocks in (None, b) and args.plot_depth in (None, d)})
    blocks, depth = fitting.most_common(1)[0][0] if fitting else (args.plot_blocks, args.plot_depth)
    if (blocks, depth) not in shapes:
        blocks = "any" if blocks is None else blocks
        depth = "any" if depth is None else depth
        have = ", ".join(f"{b} blocks at depth {d}" for b, d in sorted(shapes))
        raise SystemExit(f"no points of {blocks}-block jobs at depth {depth} to draw; the runs have {have} "
                         "(--plot-blocks, --plot-depth)")
    left = sum(n for shape, n in shapes.items() if shape != (blocks, depth))
    if left:
        print(f"drawn: the points of {blocks}-block jobs at depth {depth}; {left} other point(s) left out "
              "(--plot-blocks, --plot-depth)")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    title = ""
    for run in runs:
        title = f"{run['device']}, {run['date']}"
        # In order of load (workers, then depth): the line follows the node as it gets busier.
        points = sorted((p for p in run["points"] if p["blocks"] == blocks and p["depth"] == depth),
                        key=lambda p: (p["workers"], p["depth"]))
        if not points:
            continue
        rates = [p["jobs_per_s"] for p in points]
        line = ax.plot(rates, [p["p50_ms"] for p in points], "o-", label=f"{run['label']}: p50")[0]
        ax.plot(rates, [p["p99_ms"] for p in points], "s--", color=line.get_color(), label=f"{run['label']}: p99")
        for p in points:
            ax.annotate(f"{p['workers']}w", (p["jobs_per_s"], p["p99_ms"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    ax.set_xlabel(f"jobs/s for the node ({blocks}-block jobs, {depth} in flight a worker)")
    ax.set_ylabel("submit to done, ms")
    ax.set_yscale("log")
    ax.set_title(f"Latency against load, one daemon ({title})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.plot}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("node", "worker"), default="node", help=argparse.SUPPRESS)
    parser.add_argument("--transport", choices=("cuda", "shm"), default="cuda")
    parser.add_argument("--grid", default=DEFAULT_GRID, help="points WORKERSxBLOCKSxDEPTH, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="the measured window of each point")
    parser.add_argument("--gpus", type=int, default=2, help="workers go round-robin over this many GPUs")
    parser.add_argument("--pool-size", default="8GiB")
    parser.add_argument("--shm-block-bytes", type=int, default=64 << 10)
    parser.add_argument("--cache-blocks", type=int, default=128, help="blocks of each worker's cache")
    parser.add_argument("--load-sets", type=int, default=8, help="jobs' worth of blocks each worker loads in turn")
    parser.add_argument("--compute-us", type=float, default=0,
                        help="CUDA: a kernel of this many µs before each store, which it waits for")
    parser.add_argument("--threads", action="store_true", help="also print the daemon's CPU and wakes a job by thread")
    parser.add_argument("--stages", action="store_true",
                        help="also print where a job's time goes in the daemon (job tracing on)")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None,
                        help="draw p50 and p99 against jobs/s into this PNG: of the JSON files given, and then run "
                             "nothing; or, given none, of the points this run measures")
    parser.add_argument("--plot-blocks", type=int, default=None,
                        help="the job size whose points are drawn (default: the one most points have)")
    parser.add_argument("--plot-depth", type=int, default=None,
                        help="the depth whose points are drawn (default: the one most points have)")
    parser.add_argument("files", nargs="*")
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, default=4, help=argparse.SUPPRESS)
    args, args.daemon_args = parser.parse_known_args()
    if args.plot and args.files:
        return plot_main(args)
    if args.files:  # the value of a daemon option given as "--name value" lands here
        parser.error(f"{' '.join(args.files)}: files are read only with --plot; give the daemon's options "
                     "as --name=value (e.g. --slot-size=64KiB)")
    if args.role == "worker":
        return worker_main(args)
    if args.plot:
        _check_plotting()  # before the run, not after minutes of it
        if not args.json:
            fd, args.json = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            atexit.register(os.unlink, args.json)
        node_main(args)
        args.files = [args.json]
        return plot_main(args)
    return node_main(args)


if __name__ == "__main__":
    sys.exit(main())
