"""What KVDepotConnector costs vLLM's scheduler and worker per engine step, against no connector.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/connector_overhead.py [--steps 2000] [--running 64,128,256]
        [--forward-ms MS] [--forward-read-mb MB] [--connector kvdepot|null|vllm-offloading]
        [--connector-config JSON] [--compute] [--json [PATH]]

`--connector null` runs a connector that does nothing instead, which measures what vLLM itself
spends on having a connector at all. `--connector vllm-offloading` runs vLLM's own CPU offloading
(`OffloadingConnector`, 1 GiB of CPU blocks) for comparison: all of its scheduler side and worker
bookkeeping, but its transfers, CUDA copies in vLLM, complete at once and move nothing here.

`bench/engine_overhead.py` measures the same ratio inside vLLM's real engine, with a forward pass
between the steps; see "The harness has no model" below for why the two differ.

Starts a real `kvdepotd` (256 MiB pool in /dev/shm, 64 KiB slots, unpinned) in a temp dir and drives vLLM's
REAL v1 `Scheduler` step by step through `tests/vllm_harness.py` (no model: the harness's
`WorkerSide` stands in for the model runner, owns real CPU KV tensors and calls the worker-role
connector hooks in the V1 runner's order). Two engines are built per running-request count N,
in the same process and with the same request stream:

  conn:  kv_transfer_config = KVDepotConnector {"socket": <the daemon>} (eager stores,
         decode blocks stored too: the connector's defaults)
  plain: kv_transfer_config = None (no connector at all)

Each keeps N requests unfinished (continuous decode; a new request arrives as one finishes).
Prompts: 40% share one of 16 four-block prefixes, 20% repeat an older prompt (likely evicted from
vLLM's own prefix cache by then, so it can hit in the daemon), 40% are unique; max_tokens is
uniform in [32, 160] and EOS is ignored. Both engines get the same KV-cache size and do the same
worker-side work (block-table updates, attention metadata, optional KV writes); only the connector
calls differ. After a warm-up of each, they run in alternating blocks (ABBA...) so drift cancels.

Measured per step:
  sched:  scheduler.schedule() + scheduler.update_from_output() (the scheduler's own work,
          including the scheduler-side connector), p50 and mean per config, ratio conn/plain.
  add:    scheduler.add_request() of the step's new arrivals (calls connector.on_new_request).
  hooks:  time inside the worker-side connector hooks handle_preemptions, start_load_kv,
          wait_for_save, get_transfer_results (-> get_finished), get_block_ids_with_load_errors,
          build_connector_worker_meta; p50/p99 in microseconds. "all hooks" adds the other calls
          (bind/clear metadata, per-layer wait_for_layer_load/save_kv_layer, stats, events).

With the shared-memory transport (CPU engines) the worker copies stored/loaded blocks in the
calling thread, so the hook time includes the KV copies themselves.

The harness has no model, so by default nothing between two scheduler calls evicts the
scheduler's data from the CPU caches, except the connector's own worker-side work: the
no-connector baseline runs with warmer caches than it would next to a real forward pass.
`--forward-read-mb MB` reads that much memory a step in both configurations (in place of
the weights a forward pass streams), to measure the ratio with caches as a model leaves them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import vllm_harness as vh  # noqa: E402
from bench_daemon import Daemon  # noqa: E402

# The worker hooks the brief asks for (get_finished is called through get_transfer_results).
WORKER_HOOKS = (
    "handle_preemptions",
    "start_load_kv",
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)
BLOCK_SIZE = 16


# ---------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------


class BenchWorker(vh.WorkerSide):
    """The harness's WorkerSide, timing each connector call and sleeping for a model forward.

    Built from a config without a connector, it does the same block-table,
    metadata and KV work and calls no hooks.
    """

    forward_s = 0.0
    # Memory a forward pass reads a step (None: none), both configurations alike.
    forward_read = None

    def __init__(self, vllm_config, kv_cache_config):
        self.hook_ns: dict[str, int] = defaultdict(int)
        super().__init__(vllm_config, kv_cache_config)

    def _call(self, name, *args, tag=None, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return getattr(self.connector, name)(*args, **kwargs)
        finally:
            self.hook_ns[name] += time.perf_counter_ns() - t0

    def execute_model(self, so, *, compute: bool = True):
        self.hook_log.clear()  # the harness appends one marker a step
        return super().execute_model(so, compute=compute)

    def _forward(self, so, order, attn_md, compute: bool) -> None:
        if self.forward_s:
            time.sleep(self.forward_s)  # the model's forward pass, GIL released
        if self.forward_read is not None:
            self.forward_read.sum()  # the weights it streams: one thread, like the step's own reads
        super()._forward(so, order, attn_md, compute)


class Workload:
    """The request stream; seeded, so both engines of one N get the same requests in order."""

    FAMILIES = 16
    FAMILY_TOKENS = 4 * BLOCK_SIZE

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        tok = lambda n: [self.rng.randrange(3, vh.TINY_MODEL_VOCAB) for _ in range(n)]  # noqa: E731
        self._tok = tok
        self.families = [tok(self.FAMILY_TOKENS) for _ in range(self.FAMILIES)]
        self.history: list[list[int]] = []
        self.count = 0

    def next(self) -> tuple[str, list[int], int]:
        r = self.rng.random()
        if r < 0.4:
            prompt = self.rng.choice(self.families) + self._tok(self.rng.randint(16, 64))
        elif r < 0.6 and len(self.history) > 400:
            # An older prompt: out of vLLM's prefix cache by now, maybe still in the daemon.
            prompt = list(self.history[self.rng.randrange(len(self.history) - 300, len(self.history) - 100)])
        else:
            prompt = self._tok(self.rng.randint(48, 128))
        self.history.append(prompt)
        if len(self.history) > 2000:
            del self.history[:1000]
        self.count += 1
        return f"req-{self.count}", prompt, self.rng.randint(32, 160)


class Engine:
    def __init__(
        self, name: str, vllm_config, num_blocks: int, running: int, compute: bool, seed: int,
        forward_ms: float = 0.0, forward_read_mb: int = 0,
    ):  # fmt: skip
        self.name = name
        self.running = running
        self.compute = compute
        self.kv_cache_config = vh.make_kv_cache_config(vllm_config, num_blocks=num_blocks)
        self.vllm_config = vllm_config
        self.scheduler = vh.make_scheduler(vllm_config, self.kv_cache_config)
        self.worker = BenchWorker(vllm_config, self.kv_cache_config)
        self.worker.forward_s = forward_ms / 1000
        if forward_read_mb:
            import numpy as np

            self.worker.forward_read = np.ones((forward_read_mb << 20) // 8, dtype=np.int64)
        self.workload = Workload(seed)
        self.steps = 0
        self.samples: dict[str, list[int]] = defaultdict(list)  # measured steps only
        self.totals = defaultdict(int)  # measured steps only
        self.measuring = False

    def top_up(self) -> int:
        t0 = time.perf_counter_ns()
        sched = self.scheduler
        while sched.get_num_unfinished_requests() < self.running:
            req_id, prompt, max_tokens = self.workload.next()
            sched.add_request(
                vh.make_request(req_id, prompt, max_tokens=max_tokens, ignore_eos=True, vllm_config=self.vllm_config)
            )
        return time.perf_counter_ns() - t0

    def step(self) -> None:
        add_ns = self.top_up()
        sched, worker = self.scheduler, self.worker
        worker.hook_ns.clear()
        t0 = time.perf_counter_ns()
        so = sched.schedule()
        t1 = time.perf_counter_ns()
        kv_out, order = worker.execute_model(so, compute=self.compute)
        mro = vh.model_output(worker, so, order, kv_out)
        t2 = time.perf_counter_ns()
        sched.update_from_output(so, mro)
        t3 = time.perf_counter_ns()
        self.steps += 1
        if not self.measuring:
            return
        s = self.samples
        s["sched"].append((t1 - t0) + (t3 - t2))
        s["schedule"].append(t1 - t0)
        s["update"].append(t3 - t2)
        s["add"].append(add_ns)
        s["worker_total"].append(t2 - t1)
        if worker.connector is not None:
            hooks = worker.hook_ns
            s["hooks"].append(sum(hooks.get(h, 0) for h in WORKER_HOOKS))
            s["all_hooks"].append(sum(hooks.values()))
            for h, ns in hooks.items():
                self.totals["hook:" + h] += ns
        meta = so.kv_connector_metadata
        if hasattr(meta, "store_jobs"):  # vLLM's OffloadingConnector: count its jobs here
            self.totals["offloading_loads"] += len(meta.load_jobs)
            self.totals["offloading_stores"] += len(meta.store_jobs)
        s["running"].append(len(sched.running))
        self.totals["tokens"] += so.total_num_scheduled_tokens
        self.totals["preempted"] += len(so.preempted_req_ids or ())
        self.totals["new_reqs"] += len(so.scheduled_new_reqs)

    def connector_counters(self) -> dict:
        conn = self.scheduler.connector
        side = getattr(conn, "_scheduler", None) if conn is not None else None
        if side is None and "offloading_stores" in self.totals:
            return {"loads": self.totals["offloading_loads"], "stores": self.totals["offloading_stores"]}
        return dict(getattr(side, "counters", {}) or {})

    def close(self) -> None:
        try:
            self.worker.close()
        finally:
            self.scheduler.shutdown()


# ---------------------------------------------------------------------------
# Statistics and output
# ---------------------------------------------------------------------------


def pct(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(values: list[int]) -> dict:
    us = [x / 1000 for x in values]
    if not us:
        return {}
    return {"p50_us": pct(us, 0.5), "mean_us": statistics.fmean(us), "p99_us": pct(us, 0.99), "max_us": max(us)}


def _null_connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        SupportsHMA,
    )

    class NullMetadata(KVConnectorMetadata):
        pass

    class NullConnector(KVConnectorBase_V1, SupportsHMA):
        """Finds nothing and moves nothing: vLLM's own cost of calling a connector."""

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            return NullMetadata()

        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass

        def request_finished_all_groups(self, request, block_ids):
            return False, None

    return NullConnector


def _instant_offloading_connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.base import TransferResult

    class InstantTransfers:
        """Stands in for the offloading worker's CUDA copies: every transfer is
        done at once and reported at the next get_finished. No bytes move."""

        def __init__(self):
            self._done: list[int] = []

        def submit_store(self, job_id, src_spec, dst_spec) -> bool:
            self._done.append(job_id)
            return True

        def submit_load(self, job_id, src_spec, dst_spec) -> bool:
            self._done.append(job_id)
            return True

        def get_finished(self):
            done, self._done = self._done, []
            return [TransferResult(job_id, True) for job_id in done]

        def wait(self, job_ids) -> None:
            pass

        def shutdown(self) -> None:
            pass

    class InstantOffloadingConnector(OffloadingConnector):
        """vLLM's own OffloadingConnector, all of its scheduler side and worker
        bookkeeping, with transfers that cost nothing (its copies need CUDA)."""

        def register_kv_caches(self, kv_caches):
            self.connector_worker.worker = InstantTransfers()

    return InstantOffloadingConnector


def __getattr__(name):
    # vLLM imports kv_connector_module_path "connector_overhead" and reads the class.
    if name == "NullConnector":
        return _null_connector_class()
    if name == "InstantOffloadingConnector":
        return _instant_offloading_connector_class()
    raise AttributeError(name)


def run_one(n: int, args, socket: str, log) -> dict:
    max_batched = n + args.prefill_tokens
    num_blocks = args.blocks_per_request * n + 64
    common = dict(max_num_seqs=n, max_num_batched_tokens=max_batched, max_model_len=1024, num_gpu_blocks=num_blocks)
    log(f"[N={n}] building configs ({num_blocks} KV blocks, {max_batched} tokens a step)")
    extra = {**json.loads(args.connector_config), "socket": socket}
    if args.connector == "null":
        # What vLLM itself spends on having any connector: this file's NullConnector.
        conn_cfg = vh.make_vllm_config("connector_overhead", "NullConnector", {}, block_size=BLOCK_SIZE, **common)
    elif args.connector == "vllm-offloading":
        # vLLM's own CPU offloading, for comparison (1 GiB of CPU blocks).
        conn_cfg = vh.make_vllm_config(
            "connector_overhead", "InstantOffloadingConnector", {"cpu_bytes_to_use": 1 << 30},
            block_size=BLOCK_SIZE, **common,
        )
    else:
        conn_cfg = vh.make_vllm_config("kvdepot.connector", "KVDepotConnector", extra, block_size=BLOCK_SIZE, **common)
    plain_cfg = vh.make_vllm_config(None, None, block_size=BLOCK_SIZE, **common)
    engines = {
        name: Engine(name, cfg, num_blocks, n, args.compute, seed=n, forward_ms=args.forward_ms,
                     forward_read_mb=args.forward_read_mb)
        for name, cfg in (("conn", conn_cfg), ("plain", plain_cfg))
    }
    try:
        started = time.monotonic()
        for e in engines.values():
            for _ in range(args.warmup):
                e.step()
            log(f"[N={n}] {e.name}: warmed up ({args.warmup} steps, {len(e.scheduler.running)} running)")
        for e in engines.values():
            e.measuring = True
        order = ["conn", "plain"]
        done = {k: 0 for k in engines}
        last_report = 0
        rnd = 0
        while min(done.values()) < args.steps:
            for name in order if rnd % 2 == 0 else order[::-1]:  # ABBA...
                e = engines[name]
                todo = min(args.block, args.steps - done[name])
                gc.collect()
                for _ in range(todo):
                    e.step()
                done[name] += todo
            rnd += 1
            if min(done.values()) - last_report >= args.progress or min(done.values()) >= args.steps:
                last_report = min(done.values())
                c, p = engines["conn"].samples["sched"], engines["plain"].samples["sched"]
                log(
                    f"[N={n}] {last_report}/{args.steps} steps each, {time.monotonic() - started:.0f} s; "
                    f"sched p50 conn {pct(c, 0.5) / 1e3:.0f} us, plain {pct(p, 0.5) / 1e3:.0f} us; "
                    f"hooks p50 {pct(engines['conn'].samples['hooks'], 0.5) / 1e3:.0f} us"
                )
        out = {"running": n, "steps": args.steps, "num_blocks": num_blocks, "max_num_batched_tokens": max_batched}
        for name, e in engines.items():
            s = e.samples
            out[name] = {
                "sched": summarize(s["sched"]),
                "schedule": summarize(s["schedule"]),
                "update_from_output": summarize(s["update"]),
                "add_request": summarize(s["add"]),
                "worker_step": summarize(s["worker_total"]),
                "mean_running": statistics.fmean(s["running"]),
                "tokens": e.totals["tokens"],
                "preempted": e.totals["preempted"],
                "new_requests": e.totals["new_reqs"],
            }
            if name == "conn":
                out[name]["hooks"] = summarize(s["hooks"])
                out[name]["all_hooks"] = summarize(s["all_hooks"])
                out[name]["hook_mean_us"] = {
                    k.removeprefix("hook:"): v / len(s["sched"]) / 1e3
                    for k, v in e.totals.items() if k.startswith("hook:")
                }
                out[name]["connector_counters"] = e.connector_counters()
        c, p = out["conn"], out["plain"]
        out["ratio_p50"] = c["sched"]["p50_us"] / p["sched"]["p50_us"]
        out["ratio_mean"] = c["sched"]["mean_us"] / p["sched"]["mean_us"]
        sa = lambda d: d["sched"]["mean_us"] + d["add_request"]["mean_us"]  # noqa: E731
        out["ratio_mean_with_add"] = sa(c) / sa(p)
        out["wall_s"] = time.monotonic() - started
        return out
    finally:
        for e in engines.values():
            e.close()


def markdown(results: list[dict]) -> str:
    lines = [
        "| running | steps / config | sched p50 no conn (us) | sched p50 conn (us) | **p50 ratio** | "
        "sched mean no conn | sched mean conn | **mean ratio** | worker hooks p50 / p99 (us) | "
        "hit tokens / loads / stores | preempted (conn / no conn) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        c, p = r["conn"], r["plain"]
        cc = c["connector_counters"]
        lines.append(
            f"| {r['running']} | {r['steps']} | {p['sched']['p50_us']:.0f} | {c['sched']['p50_us']:.0f} | "
            f"**{r['ratio_p50']:.3f}** | {p['sched']['mean_us']:.0f} | {c['sched']['mean_us']:.0f} | "
            f"**{r['ratio_mean']:.3f}** | {c['hooks']['p50_us']:.0f} / {c['hooks']['p99_us']:.0f} | "
            f"{cc.get('hit_tokens', '-')} / {cc.get('loads', 0)} / {cc.get('stores', 0)} | "
            f"{c['preempted']} / {p['preempted']} |"
        )
    return "\n".join(lines)


def hook_table(results: list[dict]) -> str:
    names = sorted({h for r in results for h in r["conn"]["hook_mean_us"]})
    lines = ["| worker hook, mean us a step | " + " | ".join(f"N={r['running']}" for r in results) + " |",
             "| --- |" + " --- |" * len(results)]  # fmt: skip
    for h in names:
        lines.append(f"| `{h}` | " + " | ".join(f"{r['conn']['hook_mean_us'].get(h, 0):.1f}" for r in results) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="measured steps per configuration and N (default 2000)")
    ap.add_argument("--running", default="64,128,256", help="running-request counts N, comma-separated")
    ap.add_argument("--warmup", type=int, default=300, help="unmeasured steps per configuration first")
    ap.add_argument("--block", type=int, default=100, help="steps per alternation block (ABBA...)")
    ap.add_argument("--progress", type=int, default=200, help="report progress on stderr every this many steps")
    ap.add_argument("--prefill-tokens", type=int, default=512, help="max_num_batched_tokens = N + this")
    ap.add_argument("--blocks-per-request", type=int, default=14, help="KV blocks = this * N + 64")
    ap.add_argument("--compute", action="store_true", help="write KV for every scheduled token (slow; off: hooks only)")
    ap.add_argument("--forward-ms", type=float, default=0.0,
                    help="sleep this long a step in place of the model's forward pass (GIL released, as on a GPU)")
    ap.add_argument("--forward-read-mb", type=int, default=0,
                    help="read this many MiB a step in place of the weights a forward pass reads (both configs)")
    ap.add_argument("--pool-size", default="256MiB")
    ap.add_argument("--slot-size", default="64KiB")
    ap.add_argument("--pool-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the daemon's pool file goes (a temp folder is made inside; default /dev/shm)")
    ap.add_argument("--connector", choices=("kvdepot", "null", "vllm-offloading"), default="kvdepot",
                    help="null: a connector that does nothing, to measure vLLM's own cost of having one; "
                    "vllm-offloading: vLLM's own OffloadingConnector with transfers that cost nothing")
    ap.add_argument("--connector-config", default="{}", metavar="JSON",
                    help='more kv_connector_extra_config for KVDepotConnector, e.g. \'{"mode": "lazy"}\'')
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH", help="also write JSON (to stdout with no PATH)")
    args = ap.parse_args()
    counts = [int(x) for x in args.running.split(",") if x.strip()]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    scratch = Path(tempfile.mkdtemp(prefix="kvdepot-bench-"))
    daemon = Daemon(scratch, args.pool_size, args.slot_size, args.pool_dir)
    log(f"kvdepotd pid {daemon.proc.pid} on {daemon.socket}")
    results = []
    t_start = time.monotonic()
    try:
        for n in counts:
            results.append(run_one(n, args, daemon.socket, log))
    finally:
        rc = daemon.stop()
        log(f"kvdepotd stopped (exit {rc})")
        shutil.rmtree(scratch, ignore_errors=True)

    import torch
    import vllm

    info = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "compute": args.compute,
        "forward_ms": args.forward_ms,
        "forward_read_mb": args.forward_read_mb,
        "connector_config": json.loads(args.connector_config),
        "warmup": args.warmup,
        "block": args.block,
        "wall_s": time.monotonic() - t_start,
    }
    print(f"vLLM {info['vllm']} (CPU), torch {info['torch']}, Python {info['python']}, {info['cores']} cores, "
          f"{info['date']}; `{info['command']}`; KV writes {'on' if args.compute else 'off'}; forward "
          f"{args.forward_ms:g} ms, reads {args.forward_read_mb} MiB; total {info['wall_s']:.0f} s\n")
    print(markdown(results))
    print()
    print(hook_table(results))
    for r in results:
        c, p = r["conn"], r["plain"]
        print(
            f"\nN={r['running']}: schedule() p50 {c['schedule']['p50_us']:.0f} vs {p['schedule']['p50_us']:.0f} us, "
            f"update_from_output() p50 {c['update_from_output']['p50_us']:.0f} vs "
            f"{p['update_from_output']['p50_us']:.0f} us, "
            f"add_request mean {c['add_request']['mean_us']:.0f} vs {p['add_request']['mean_us']:.0f} us "
            f"(sched+add mean ratio {r['ratio_mean_with_add']:.3f}); sched p99 {c['sched']['p99_us']:.0f} vs "
            f"{p['sched']['p99_us']:.0f} us; all connector calls p50/p99 {c['all_hooks']['p50_us']:.0f}/"
            f"{c['all_hooks']['p99_us']:.0f} us; mean running {c['mean_running']:.1f} vs {p['mean_running']:.1f}; "
            f"tokens {c['tokens']} vs {p['tokens']}; counters {c['connector_counters']}"
        )
    if args.json:
        write_json(args.json, {"info": info, "results": results})
    return 0


def write_json(where: str, doc: dict) -> None:
    """--json: to standard output for "-", else to that file."""
    text = json.dumps(doc, indent=2)
    if where == "-":
        print(text)
    else:
        Path(where).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
