"""Where the time of a job alone goes: per-stage timestamps in the worker and in the daemon.

    python bench/job_trace.py [--sizes 16,64] [--jobs 40] [--pool-size 8GiB]

Starts the real `kvdepotd` with job tracing on (KVDEPOT_TRACE_JOBS, kvdepot/jobtrace.py), and from
this process as a CUDA worker (a Llama-3.1-8B rank in the per-layer layout, as bench/cuda_copy.py)
runs store and load jobs of each size one at a time, nothing else in flight. For each size and
direction it prints the median time of each stage since the worker's submit call:

  submit      the worker calls submit_store / submit_load
  sent        the request is written to the job socket (the call returns)
  received    the daemon's event loop has the whole frame
  begin       the request is checked and its slots reserved
  launch      the transport starts queuing the job's copies
  first_chunk the first staging chunk's kernel and transfer are queued
  queued      every copy of the job is queued on the GPU
  gpu_done    the completion thread sees the job's last copy end
  finish      the event loop commits the job
  done_sent   JobDone is written to the job socket
  done_read   the worker's reader thread has JobDone
  waited      wait() returns in the worker

and the job's total against the time its bytes take at the peak measured in the same run
(the best of several 1 GiB pinned copies each way), as a ratio: the fixed cost of a job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from kvdepotd import BenchDaemon  # noqa: E402

# cuda_copy and kvdepot are imported in the functions, once main() has set
# KVDEPOT_TRACE_JOBS: kvdepot/jobtrace.py reads it once, at import.

CLIENT_STAGES = ("submit", "sent")
DAEMON_STAGES = ("received", "begin", "launch", "first_chunk", "queued", "gpu_done", "finish", "done_sent")
LAST_STAGES = ("done_read", "waited")


def run_jobs(socket: str, sizes: list[int], count: int) -> tuple[str, list[tuple[str, int, int]]]:
    from cuda_copy import BLOCK_SIZE, make_cache

    from kvdepot import jobtrace
    from kvdepot.client import KVDepotClient

    largest = max(sizes)
    tensors, block_dim = make_cache("per_layer", 2 * largest)
    client = KVDepotClient(socket, name="bench-trace").connect(30)
    ns = dict(model="bench-trace", kv_dtype="bfloat16", block_size=BLOCK_SIZE, layout="per_layer", tp_size=1)
    worker = client.register_worker(ns, rank=0, tensors=tensors, block_dim=block_dim)
    session_id = client._session.connection.session_id
    ran, job_id = [], 0
    warmup = 5
    for n in sizes:
        loaded = [os.urandom(32) for _ in range(n)]
        job_id += 1
        client.submit_store(worker, job_id, loaded, list(range(n)))
        client.wait([job_id], timeout=60)
        for kind in ("store", "load"):
            for i in range(warmup + count):
                job_id += 1
                torch.cuda.synchronize()
                if kind == "store":
                    client.submit_store(worker, job_id, [os.urandom(32) for _ in range(n)], list(range(n)))
                else:
                    client.submit_load(worker, job_id, loaded, list(range(largest, largest + n)))
                result = client.wait([job_id], timeout=60)[job_id]
                jobtrace.client_stamp(session_id, job_id, "waited")
                if not result.ok or result.not_stored or result.already_stored:
                    raise SystemExit(f"{kind} job {job_id} did not copy every block: {result}")
                if i >= warmup:
                    ran.append((kind, n, job_id))
                time.sleep(0.002)  # the stream is idle again, as for a job alone
    client.close()
    return session_id, ran


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,64")
    parser.add_argument("--jobs", type=int, default=40, help="timed jobs per size and direction")
    parser.add_argument("--pool-size", default="8GiB")
    parser.add_argument("--json", default=None, help="also write the medians to this file")
    args, daemon_args = parser.parse_known_args()
    # The daemon's trace goes in a folder of this run's, made now (not for
    # --help) and removed at the end, however the run ends.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="kvdepot-job-trace-", dir=shm) as folder:
        os.environ["KVDEPOT_TRACE_JOBS"] = f"{folder}/daemon.jsonl"
        return measure(args, daemon_args)


def measure(args: argparse.Namespace, daemon_args: list[str]) -> int:
    from cuda_copy import BLOCK, peak

    from kvdepot import jobtrace

    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    ceiling = peak(5)
    print(f"peak (best of 5 pinned 1 GiB copies): D2H {ceiling['d2h']:.1f}  H2D {ceiling['h2d']:.1f} GB/s")

    with BenchDaemon(args.pool_size, BLOCK, extra=daemon_args) as daemon:
        daemon.wait_ready()
        daemon.wait_pool()
        session_id, ran = run_jobs(daemon.socket, sizes, args.jobs)
        time.sleep(0.2)
    daemon = {}
    with open(os.environ["KVDEPOT_TRACE_JOBS"]) as f:
        for line in f:
            record = json.loads(line)
            if record["session"] == jobtrace.session_tag(session_id):
                daemon[record["job"]] = record["stamps"]

    known = CLIENT_STAGES + DAEMON_STAGES + LAST_STAGES
    extra = sorted({stage for stamps in daemon.values() for stage in stamps} - set(known))
    stages = known + tuple(extra)  # a daemon patched with more stamps: shown, in order of time
    results = {}
    print("\nmedian µs since the submit call, one job at a time (per-layer layout):")
    print(f"{'stage':<12}" + "".join(f"{kind + ' ' + str(n):>12}" for n in sizes for kind in ("store", "load")))
    columns = {}
    for n in sizes:
        for kind in ("store", "load"):
            ids = [j for k, m, j in ran if k == kind and m == n]
            rows = []
            for job_id in ids:
                stamps = dict(jobtrace.client_stamps[(session_id, job_id)])
                stamps.update({k: v for k, v in daemon.get(job_id, {}).items() if v})
                rows.append({stage: (stamps[stage] - stamps["submit"]) / 1e3 for stage in stages if stage in stamps})
            columns[(kind, n)] = {stage: statistics.median(r[stage] for r in rows if stage in r)
                                  for stage in stages if any(stage in r for r in rows)}
    first = columns[("store", sizes[0])]
    for stage in sorted(stages, key=lambda s: first.get(s, float("inf"))):
        cells = [columns[(kind, n)].get(stage) for n in sizes for kind in ("store", "load")]
        print(f"{stage:<12}" + "".join(f"{c:>12.0f}" if c is not None else f"{'-':>12}" for c in cells))
    print()
    for n in sizes:
        for kind in ("store", "load"):
            total_us = columns[(kind, n)]["waited"]
            rate = n * BLOCK / (total_us / 1e6) / 1e9
            peak_rate = ceiling["d2h"] if kind == "store" else ceiling["h2d"]
            bytes_us = n * BLOCK / (peak_rate * 1e9) * 1e6
            print(f"{kind} {n:>4} blocks alone: {total_us / 1e3:.2f} ms submit to wait, {rate:.1f} GB/s = "
                  f"{rate / peak_rate:.2f} of the peak; {total_us - bytes_us:.0f} µs beyond its bytes at the peak")
            results[f"{kind}_{n}"] = {"stages_us": columns[(kind, n)], "gbps": rate, "ratio": rate / peak_rate}
    if args.json:
        Path(args.json).write_text(json.dumps({"peak": ceiling, "jobs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
