"""What KVDepotConnector costs vLLM's scheduler inside a real engine, against no connector.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/engine_overhead.py [--steps 1000] [--running 64,128,256]
        [--rounds 2] [--connector kvdepot|null] [--connector-config JSON] [--calls] [--json [PATH]]

`bench/connector_overhead.py` drives vLLM's Scheduler with a stand-in for the model runner, so
nothing but the connector's worker hooks runs between two scheduler steps there, and the
no-connector baseline finds its caches warmer than any engine would leave them. This benchmark
runs the real thing: vLLM's `LLM` engine (CPU build, in-process, enforce_eager) with the tiny
random-weight model of the tests, whose forward pass runs between the steps as it would in
production. It times what the scheduler itself spends per step: `Scheduler.schedule()` plus
`Scheduler.update_from_output()` (which include the connector's scheduler side), wrapped on the
engine core's scheduler.

Per running-request count N, it starts one engine process per configuration and round, in the
order conn, plain, plain, conn, ... (so drift cancels), against one real `kvdepotd`:

  conn:  kv_transfer_config = KVDepotConnector {"socket": <the daemon>} (its defaults:
         eager stores, decode blocks stored too); with `--connector null`, the connector of
         `connector_overhead.py` that does nothing (what vLLM itself spends on having one)
  plain: no connector

Each engine keeps N requests unfinished, topping up as requests finish, with the request stream
of `connector_overhead.py` (shared prefixes, repeats, unique prompts; max_tokens 32-160, EOS
ignored), seeded per N so both configurations see the same requests. The first `--warmup` steps
of each process are not measured. Each engine's KV cache is 1 GiB (VLLM_CPU_KVCACHE_SPACE).

`--calls` also times each connector method the Scheduler calls, per step, and prints where the
connector's share of the step goes. The timers add their own cost to the connector
configuration, so quote the ratio of a run without `--calls`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

BLOCK_SIZE = 32  # vLLM 0.32's CPU attention backend needs a multiple of 32

# The connector's methods that vLLM's Scheduler calls (timed with --calls).
SCHEDULER_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "has_pending_push_work",
    "get_kv_connector_stats",
)


def run_engine(args) -> int:
    """One engine process: keeps N requests running, writes the per-step scheduler times."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    from connector_overhead import Workload
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_generate import kvdepot_kv_transfer_config

    kwargs = {}
    if args.config == "conn" and args.connector == "null":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "NullConnector", "kv_connector_module_path": "connector_overhead", "kv_role": "kv_both"
        }
    elif args.config == "conn":
        kwargs["kv_transfer_config"] = kvdepot_kv_transfer_config(
            socket=args.socket, **json.loads(args.connector_config)
        )
    llm = LLM(
        model=args.model,
        dtype="float32",  # bfloat16 kernels need AVX512-BF16
        seed=0,
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        enforce_eager=True,
        distributed_executor_backend="uni",
        tensor_parallel_size=1,
        max_num_seqs=args.running,
        max_num_batched_tokens=args.running + 512,
        **kwargs,
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    times: list[int] = []
    measuring = False
    pending = [0]
    calls_ns: dict[str, int] = {}
    calls_count: dict[str, int] = {}
    timing_calls = [False]  # on during the measured steps only

    def timed_call(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                if timing_calls[0]:
                    calls_ns[name] = calls_ns.get(name, 0) + time.perf_counter_ns() - start
                    calls_count[name] = calls_count.get(name, 0) + 1

        return wrapper

    if args.calls and scheduler.connector is not None:
        # On the instance: the Scheduler calls them through self.connector.
        for name in SCHEDULER_CALLS:
            method = getattr(scheduler.connector, name, None)
            if method is not None:
                setattr(scheduler.connector, name, timed_call(name, method))

    def timed(fn):
        def wrapper(*a, **kw):
            start = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                pending[0] += time.perf_counter_ns() - start

        return wrapper

    scheduler.schedule = timed(scheduler.schedule)
    scheduler.update_from_output = timed(scheduler.update_from_output)

    workload = Workload(args.seed)
    unfinished = 0
    steps = 0
    while steps < args.warmup + args.steps:
        while unfinished < args.running:
            req_id, prompt, max_tokens = workload.next()
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), params)
            unfinished += 1
        pending[0] = 0
        timing_calls[0] = measuring
        outputs = engine.step()
        unfinished -= sum(1 for out in outputs if out.finished)
        if measuring:
            times.append(pending[0])
        steps += 1
        measuring = steps >= args.warmup
    side = getattr(scheduler.connector, "_scheduler", None)
    counters = dict(getattr(side, "counters", {}) or {})
    Path(args.out).write_text(
        json.dumps({"sched_ns": times, "connector_counters": counters, "calls_ns": calls_ns, "calls": calls_count})
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000, help="measured steps per engine process (default 1000)")
    ap.add_argument("--warmup", type=int, default=200, help="unmeasured steps at the start of each process")
    ap.add_argument("--running", default="64,128,256", help="running-request counts N, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="engine processes per configuration and N")
    ap.add_argument("--connector", choices=("kvdepot", "null"), default="kvdepot",
                    help="null: connector_overhead.py's connector that does nothing (vLLM's own cost of one)")
    ap.add_argument("--connector-config", default="{}", metavar="JSON",
                    help="more kv_connector_extra_config for KVDepotConnector, e.g. '{\"mode\": \"lazy\"}'")
    ap.add_argument("--calls", action="store_true",
                    help="also time each connector method the Scheduler calls (adds the timers' cost)")
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH", help="also write JSON (to stdout with no PATH)")
    # One engine process (started by this script).
    ap.add_argument("--engine", choices=("conn", "plain"), dest="config", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.config:
        args.running = int(args.running)
        return run_engine(args)

    import vllm_harness as vh
    from bench_daemon import Daemon
    from connector_overhead import pct, write_json
    from vllm_generate import vllm_env

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    counts = [int(x) for x in args.running.split(",") if x.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="kvdepot-engine-bench-"))
    started = time.monotonic()
    results = []
    try:
        model = vh.make_tiny_model(scratch / "model")
        daemon = Daemon(scratch, "256MiB", "64KiB", "/dev/shm" if os.path.isdir("/dev/shm") else None)
        log(f"kvdepotd pid {daemon.proc.pid} on {daemon.socket}")
        try:
            for n in counts:
                samples = {"conn": [], "plain": []}
                counters: dict[str, int] = {}
                calls_ns: dict[str, int] = {}
                calls: dict[str, int] = {}
                order = [c for r in range(args.rounds)
                         for c in (("conn", "plain") if r % 2 == 0 else ("plain", "conn"))]
                for i, config in enumerate(order):
                    out = scratch / f"{config}-{n}-{i}.json"
                    cmd = [sys.executable, __file__, "--engine", config, "--running", str(n),
                           "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", str(model),
                           "--socket", daemon.socket, "--seed", str(n), "--connector", args.connector,
                           "--connector-config", args.connector_config, "--out", str(out)]
                    if args.calls:
                        cmd.append("--calls")
                    t0 = time.monotonic()
                    proc = subprocess.run(cmd, env=vllm_env(scratch / f"vllm-{config}-{n}-{i}"),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    if proc.returncode != 0:
                        raise SystemExit(f"engine process ({config}, N={n}) failed:\n{proc.stderr[-4000:]}")
                    doc = json.loads(out.read_text())
                    taken = doc["sched_ns"]
                    for name, value in doc["connector_counters"].items():
                        counters[name] = counters.get(name, 0) + value
                    for name, value in doc.get("calls_ns", {}).items():
                        calls_ns[name] = calls_ns.get(name, 0) + value
                        calls[name] = calls.get(name, 0) + doc["calls"][name]
                    samples[config] += taken
                    log(f"[N={n}] {config} process {i + 1}/{len(order)}: {len(taken)} steps, sched p50 "
                        f"{pct(taken, 0.5) / 1e3:.0f} us ({time.monotonic() - t0:.0f} s)")  # fmt: skip
                us = {c: [x / 1e3 for x in v] for c, v in samples.items()}
                row = {"running": n, "steps": len(us["conn"]), "connector_counters": counters}
                if args.calls:
                    # Per measured step of the connector configuration, whichever steps called them.
                    row["calls_us_per_step"] = {k: v / 1e3 / row["steps"] for k, v in calls_ns.items()}
                    row["calls_per_step"] = {k: v / row["steps"] for k, v in calls.items()}
                for c, v in us.items():
                    row[c] = {"p50_us": pct(v, 0.5), "mean_us": statistics.fmean(v), "p99_us": pct(v, 0.99)}
                row["ratio_p50"] = row["conn"]["p50_us"] / row["plain"]["p50_us"]
                row["ratio_mean"] = row["conn"]["mean_us"] / row["plain"]["mean_us"]
                results.append(row)
        finally:
            rc = daemon.stop()
            log(f"kvdepotd stopped (exit {rc})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    import torch
    import vllm

    wall = time.monotonic() - started
    print(f"vLLM {vllm.__version__} (CPU), torch {torch.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; "
          f"`{' '.join([Path(sys.executable).name] + sys.argv)}`; "
          f"{args.rounds} engine processes per configuration and N; total {wall:.0f} s\n")  # fmt: skip
    print("| running | measured steps / config | sched p50 no conn (us) | sched p50 conn (us) | **p50 ratio** | "
          "sched mean no conn | sched mean conn | **mean ratio** | sched p99 no conn / conn | "
          "hit tokens / loads / stores |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        c, p, cc = r["conn"], r["plain"], r["connector_counters"]
        print(f"| {r['running']} | {r['steps']} | {p['p50_us']:.0f} | {c['p50_us']:.0f} | **{r['ratio_p50']:.3f}** | "
              f"{p['mean_us']:.0f} | {c['mean_us']:.0f} | **{r['ratio_mean']:.3f}** | "
              f"{p['p99_us']:.0f} / {c['p99_us']:.0f} | "
              f"{cc.get('hit_tokens', '-')} / {cc.get('loads', 0)} / {cc.get('stores', 0)} |")  # fmt: skip
    if args.calls:
        print("\nConnector methods the Scheduler called, µs per measured step (timers included):\n")
        names = [n for n in SCHEDULER_CALLS if any(n in r["calls_us_per_step"] for r in results)]
        print("| running | " + " | ".join(f"`{n}`" for n in names) + " | total | total ÷ no-connector step (mean) |")
        print("| --- " * (len(names) + 3) + "|")
        for r in results:
            per_step = r["calls_us_per_step"]
            total = sum(per_step.values())
            cells = " | ".join(f"{per_step.get(n, 0):.1f} ({r['calls_per_step'].get(n, 0):.2f} calls)" for n in names)
            print(f"| {r['running']} | {cells} | {total:.1f} | {total / r['plain']['mean_us']:.3f} |")
    if args.json:
        write_json(args.json, {"results": results, "wall_s": wall})
    return 0


if __name__ == "__main__":
    sys.exit(main())
