"""What a hit costs in real vLLM (CPU build): kvdepot with a small vLLM cache against vLLM alone
with a cache that holds everything (issue 27, item 4: "a hit costs what its bytes cost").

    HF_HUB_OFFLINE=1 .venv/bin/python bench/hit_ttft.py [--conversations 8] [--turns 4]
        [--vllm-blocks 160] [--plain-blocks 2048] [--rounds 1] [--trace] [--json PATH] [--keep-scratch]

The chat workload of bench/serving_ttft.py (its full model shape), served by:

  plain:   vLLM alone, its cache `--plain-blocks` (far more than the chat's working set: every
           returning turn is a GPU prefix-cache hit);
  kvdepot: KVDepotConnector (its defaults) against a fresh daemon, vLLM's cache `--vllm-blocks`
           (smaller than the working set: returning turns load their history from the daemon).

Both get the same cached tokens when every history is in the daemon; what differs is where they
come from. The two engine processes are up at once and take turns request by request
(bench/engine_turns.py: one serves a request while the other waits, who goes first alternating),
so that both see the host alike; `--apart` runs them one after the other instead. `--rounds N`
repeats it N times (a fresh daemon each round). Prints
TTFT p50 by turn, the p50 of turns 2 on, the per-request ratio kvdepot / plain (median and mean
over turns 2 on), cached tokens, and checks the outputs are the same token ids. `--trace` runs the
engines with bench/step_trace.py and prints, per request with a hit, the engine steps from its
lookup to its prefill and where the time went.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

import engine_turns  # noqa: E402
import serving_ttft as st  # noqa: E402
from serving_report import pct, turn_of  # noqa: E402


def trace_report(events: list, label: str) -> dict:
    """Per request with a hit: steps from the first lookup to the prefill, and the step's parts."""
    add, first, lookups, scheduled, steps = {}, {}, {}, {}, {}
    hook = {}

    def base(req_id: str) -> str:  # vLLM appends "-<8 hex>" to the name it was given
        return req_id.rsplit("-", 1)[0]

    for name, step, t0, t1, detail in events:
        if name == "step":
            steps[step] = (t0, t1)
        elif name == "add":
            add[detail] = (step, t0)
        elif name == "first_token":
            first[detail] = (step, t0)
        elif name == "get_num_new_matched_tokens":
            lookups.setdefault(base(detail[0]), []).append((step, detail[2], detail[3]))
        elif name == "build_connector_meta":
            for req, n in detail["scheduled"].items():
                if n > 1:
                    scheduled.setdefault(base(req), step)
        hook.setdefault(step, []).append((name, t1 - t0, detail))
    rows = []
    for req, looks in lookups.items():
        if req not in first or not req.startswith("chat") or turn_of(req) == 0:
            continue
        hit = [lk for lk in looks if lk[1]]
        if not hit:
            continue
        s_look, s_run = looks[0][0], scheduled.get(req)
        if s_run is None:
            continue
        between = range(s_look, s_run)
        parts: dict[str, float] = {}
        for s in range(s_look, s_run + 1):
            for name, dt, _ in hook.get(s, ()):
                parts[name] = parts.get(name, 0.0) + dt
        rows.append({
            "req": req, "hit_tokens": hit[0][1], "async": hit[0][2], "lookups": len(looks),
            "steps_waited": s_run - s_look,
            "ttft_ms": (first[req][1] - add[req][1]) * 1e3,
            "wait_steps_ms": sum(steps[s][1] - steps[s][0] for s in between if s in steps) * 1e3,
            "prefill_step_ms": (steps[s_run][1] - steps[s_run][0]) * 1e3 if s_run in steps else None,
            "parts_ms": {k: v * 1e3 for k, v in parts.items()},
        })  # fmt: skip
    if rows:
        print(f"\n{label}: {len(rows)} requests with a hit; steps from lookup to prefill: "
              f"{sorted({r['steps_waited'] for r in rows})}; p50 ms: ttft "
              f"{pct([r['ttft_ms'] for r in rows], .5):.1f}, steps before the prefill "
              f"{pct([r['wait_steps_ms'] for r in rows], .5):.1f}, prefill step "
              f"{pct([r['prefill_step_ms'] or 0 for r in rows], .5):.1f}")  # fmt: skip
        names = sorted({k for r in rows for k in r["parts_ms"]})
        for k in names:
            print(f"  {k}: p50 {pct([r['parts_ms'].get(k, 0) for r in rows], .5):.2f} ms "
                  f"(lookup step to prefill step, summed)")  # fmt: skip
    return {"rows": rows}


def serve_round(args, configs: list[str], envs: dict, daemon, model: str, spec_path: Path,
                scratch: Path) -> dict[str, dict]:
    """One round: each configuration's engine process, apart or taking turns; their results."""

    def engine(config: str, pass_fds: tuple = (), env: dict | None = None) -> dict:
        plain = config == "plain"
        return st.start_engine(config, model, None if plain else daemon.socket, spec_path, scratch, args, "chat",
                               vllm_blocks=args.plain_blocks if plain else args.vllm_blocks,
                               env_extra={**envs[config], **(env or {})}, pass_fds=pass_fds)  # fmt: skip

    if args.apart:
        return {config: st.finish_engine(engine(config)) for config in configs}
    sides = {config: engine_turns.BenchSide() for config in configs}
    started = {}
    try:
        for config in configs:
            started[config] = engine(config, sides[config].pass_fds, sides[config].env)
            sides[config].started()
        turns = engine_turns.take_turns(sides)
        print(f"round: {turns} requests each, the engines taking turns", file=sys.stderr, flush=True)
        return {config: st.finish_engine(started[config]) for config in configs}
    finally:
        for config, side in sides.items():
            side.close()
            proc = started.get(config, {}).get("proc")
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--vllm-blocks", type=int, default=160, help="kvdepot engine's vLLM cache (blocks)")
    ap.add_argument("--plain-blocks", type=int, default=2048, help="vLLM alone's cache (blocks): unlimited")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default="plain,kvdepot")
    ap.add_argument("--trace", action="store_true", help="per-step trace of the engines (bench/step_trace.py)")
    ap.add_argument("--apart", action="store_true",
                    help="run the engines one after the other, not both at once taking turns request by request")
    ap.add_argument("--json", default=None, help="also write the figures and traces to this file")
    ap.add_argument("--keep-scratch", action="store_true", help="keep the run's folder (model, traces, logs)")
    args = ap.parse_args()
    args.concurrency = 1
    for name, least in (("rounds", 1), ("conversations", 1), ("turns", 2), ("vllm_blocks", 1), ("plain_blocks", 1),
                        ("threads", 1)):
        if getattr(args, name) < least:
            ap.error(f"--{name.replace('_', '-')} must be at least {least}")
    configs = args.configs.split(",")
    if not configs or len(set(configs)) != len(configs) or not set(configs) <= {"plain", "kvdepot"}:
        ap.error(f"--configs {args.configs}: plain, kvdepot or both, comma-separated")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json {args.json}: no folder {Path(args.json).resolve().parent}")

    scratch = Path(tempfile.mkdtemp(prefix="kvdepot-hit-ttft-"))
    try:
        return run(args, configs, scratch)
    finally:
        if args.keep_scratch:
            print(f"kept {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def run(args, configs: list[str], scratch: Path) -> int:
    from bench_daemon import Daemon

    shape, spec, model, spec_path = st.chat_only(args.conversations, args.turns, args.seed, scratch)
    spec["vllm_blocks"] = args.vllm_blocks
    slot = 1 << (st.block_bytes(shape) - 1).bit_length()
    spec_path.write_text(json.dumps(spec))
    os.environ["KVDEPOT_METRICS_LISTEN"] = "none"
    runs: dict[str, list] = {c: [] for c in configs}
    traces: dict[str, list] = {c: [] for c in configs}
    started = time.monotonic()
    for r in range(args.rounds):
        envs, daemon = {}, None
        for config in configs:
            env = {}
            if args.trace:
                env["KVDEPOT_STEP_TRACE"] = str(scratch / f"trace-{config}-{r}.json")
                # Per-stage job stamps: the daemon's (its file) and the worker's (step_trace.dump).
                env["KVDEPOT_TRACE_JOBS"] = os.environ["KVDEPOT_TRACE_JOBS"] = str(scratch / f"jobs-{config}-{r}.jsonl")
            envs[config] = env
            if config == "kvdepot":
                folder = scratch / f"daemon-{r}"
                folder.mkdir()
                daemon = Daemon(folder, "512MiB", f"{slot >> 10}KiB", "/dev/shm" if os.path.isdir("/dev/shm") else None)
            os.environ.pop("KVDEPOT_TRACE_JOBS", None)
        try:
            for config, run in serve_round(args, configs, envs, daemon, model, spec_path, scratch).items():
                runs[config].append(run)
        finally:
            if daemon is not None:
                daemon.stop()
        if args.trace:
            for config in configs:
                traces[config].append(json.loads(Path(envs[config]["KVDEPOT_STEP_TRACE"]).read_text()))

    # Outputs: the same token ids, request by request, in every run.
    base = {q["name"]: q["output"] for q in runs[configs[0]][0]["workloads"]["chat"]["requests"]}
    for config in configs:
        for run in runs[config]:
            got = {q["name"]: q["output"] for q in run["workloads"]["chat"]["requests"]}
            if got != base:
                raise SystemExit(f"FAIL: {config} outputs differ from {configs[0]}'s")
    print(f"shape {shape['hidden']}x{shape['layers']}, {args.conversations} conversations x {args.turns} turns; "
          f"vLLM cache {args.vllm_blocks} (kvdepot) / {args.plain_blocks} (plain) blocks; {args.threads} thread(s); "
          f"outputs identical ({len(base)} requests x {sum(map(len, runs.values()))} runs); "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    summary = {}
    for config in configs:
        for i, run in enumerate(runs[config]):
            reqs = run["workloads"]["chat"]["requests"]
            later = [q for q in reqs if turn_of(q["name"]) > 0]
            by_turn = {}
            for q in reqs:
                by_turn.setdefault(turn_of(q["name"]) + 1, []).append(q["ttft_s"] * 1e3)
            row = {"p50_later_ms": pct([q["ttft_s"] * 1e3 for q in later], .5),
                   "by_turn_p50_ms": {t: pct(v, .5) for t, v in sorted(by_turn.items())},
                   "cached_tokens": sum(q["num_cached_tokens"] for q in reqs),
                   "ttft": {q["name"]: q["ttft_s"] for q in reqs}}  # fmt: skip
            summary.setdefault(config, []).append(row)
            turns = " ".join(f"t{t}:{v:.0f}" for t, v in row["by_turn_p50_ms"].items())
            print(f"{config} run {i}: p50 turns 2+ {row['p50_later_ms']:.0f} ms; by turn {turns}; "
                  f"cached tokens {row['cached_tokens']}")  # fmt: skip
    if "plain" in summary and "kvdepot" in summary:
        for i in range(args.rounds):
            p, k = summary["plain"][i], summary["kvdepot"][i]
            ratios = [k["ttft"][n] / p["ttft"][n] for n in p["ttft"] if turn_of(n) > 0]
            print(f"round {i}: kvdepot / plain p50 turns 2+: {k['p50_later_ms'] / p['p50_later_ms']:.3f}; "
                  f"per request median {statistics.median(ratios):.3f}, mean {statistics.fmean(ratios):.3f}")
    reports = {}
    for config in configs:
        for i, events in enumerate(traces[config]):
            reports[f"{config}-{i}"] = trace_report(events, f"{config} run {i}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "runs": runs,
                                               "trace": reports}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
