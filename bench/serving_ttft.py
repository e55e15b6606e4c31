"""Time to first token in real vLLM serving (CPU build): without kvdepot, with it, and after an engine restart.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/serving_ttft.py [--quick] [--conversations 12] [--turns 8]
        [--system-prompts 4] [--questions 32] [--concurrency 1] [--threads N] [--json PATH] [--plots DIR]
    HF_HUB_OFFLINE=1 .venv/bin/python bench/serving_ttft.py --disk-compare [--quick] [--conversations 10]
        [--turns 6] [--dram-share 0.33] [--disk-parent DIR] [--json PATH] [--plots DIR]
    .venv/bin/python bench/serving_ttft.py --from-json PATH [--plots DIR]   # tables and plots again

(`pip install -e ".[bench]"` for matplotlib, which draws the plots.)

Runs vLLM's `LLM` engine (CPU build, in-process, enforce_eager, float32) on a random-weight Llama
made offline (`vllm_harness.make_tiny_model` with a larger shape: by default hidden 1024, 4 layers,
16 heads, 4 KV heads, intermediate 2816, vocab 512), greedy, with vLLM's own prefix caching on, in
three engine processes one after the other, all against one real `kvdepotd`:

  plain:    no connector
  kvdepot:  KVDepotConnector to the daemon (its defaults: eager stores, decode blocks too), which
            starts empty
  restart:  a fresh engine process with KVDepotConnector against the same daemon, still holding
            what the previous engine stored; it replays the same requests

Each process serves these workloads, one after the other:

  chat:          `--conversations` conversations of `--turns` turns. A turn's prompt is the
                 conversation's history (every earlier prompt and the model's answer to it) and a
                 new user message; turns are interleaved across conversations (turn 0 of every
                 conversation, then turn 1 ...), so a conversation comes back after every other
                 one has had a turn.
  system-prompt: `--questions` short questions, each after one of `--system-prompts` long system
                 prompts, taken in turn (so each system prompt comes back after the others).
  return:        each conversation comes back once more, its whole history and a new message;
                 served by plain vLLM and after the restart only (the first kvdepot engine must not
                 store the new messages): users returning to an engine that was restarted.

The restart engine replays the chat and system-prompt requests exactly, so their new user messages
and questions are in the daemon too: for those two workloads it shows what a fresh engine gets
back from the daemon, a best case. `return` is the fair after-restart figure: history from the
daemon, the new message computed.

vLLM's own KV cache is sized (num_gpu_blocks_override) to hold the blocks of about
`--concurrency` + 0.5 of the longest requests, so neither a conversation's history nor a system
prompt is still in it when it comes back: that is the regime kvdepot is for, a working set larger
than the engine's cache. The daemon's pool holds the whole working set.

Time to first token (TTFT) of a request is measured in the benchmark's process, which is also the
engine's (VLLM_ENABLE_V1_MULTIPROCESSING=0): from just before `LLMEngine.add_request()` to the
return of the `LLMEngine.step()` whose output first carries a generated token. It includes
scheduling, the connector's lookup and load, the prefill and sampling; not HTTP or detokenising a
stream. vLLM's own `first_token_latency` of the request (its metrics, from arrival) is kept beside
it in the JSON. Requests are added one at a time up to `--concurrency` in flight (a closed loop:
a conversation's next turn is sent only once its previous answer is complete).

Fair threads: every engine process runs with OMP_NUM_THREADS=`--threads` (default: all cores but
one), and the benchmark checks that all three used the same number of torch threads. In the
multiprocess engine vLLM's CPU build binds threads itself and gives an engine with a
kv_transfer_config another thread count than one without, unless VLLM_CPU_NUM_OF_RESERVED_CPU
matches them; in this in-process engine (executor "uni") that binding does not run and torch takes every core. With
every core, the engine's OpenMP threads (which spin between kernels) starve the daemon, whose
copies the engine's steps wait for: on 2 cores that made the kvdepot configuration slower than plain
vLLM. One core free for the daemon is what a GPU server has; in the plain configuration it idles.

Outputs must be the same token ids in all three configurations, request by request; the benchmark
exits with an error naming the first request that differs. It prints markdown tables (TTFT p50 /
p90 per turn and overall, throughput, vLLM's prefix-cache and connector hit rates, the daemon's
hit rate), writes the JSON (`--json`) and the plots `serving_ttft_chat.png` and
`serving_ttft_system_prompt.png` (`--plots`, default docs/).

`--disk-compare`: the chat only (10 conversations of 6 turns unless given), in three engine
processes, each against its own daemon, which starts empty:

  plain:    no connector
  dram:     KVDepotConnector to a daemon whose pool holds `--dram-share` (default a third) of the
            chat's working set: the whole blocks of every conversation's final history, computed
            from the requests and the model's KV block size (the daemon's stored_bytes is in the
            JSON to check it against)
  disk:     the same, to a daemon with the same pool and a disk tier (`--disk-dir`, a temporary
            folder under `--disk-parent`, default the current folder: a real disk, not a tmpfs)
            of twice the working set

It prints TTFT p50 / p90 / mean by turn and overall, and the daemons' stats after each run (hits,
misses, disk hits, both tiers), which the JSON keeps (`daemon_stats`); the plot is
`serving_ttft_disk.png`. Outputs are checked as above. Pool folders and the disk tier's folder are
removed at the end. About 5 minutes on 2 cores.

`--quick`: the tests' tiny model shape (hidden 256, 2 layers), 3 conversations of 3 turns, 2
system prompts and 6 questions, shorter texts; about 1.5 minutes. Its vLLM cache holds much of
that small working set, so it is a smoke test, not a measurement. The default run takes about 9
minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

import engine_turns  # noqa: E402
import step_trace  # noqa: E402  (off unless KVDEPOT_STEP_TRACE is set)
from serving_report import (  # noqa: E402
    CONFIGS,
    DISK_CONFIGS,
    WORKLOADS,
    by_turn,
    draw,
    draw_disk,
    pct,
    print_disk_tables,
    print_tables,
    summarize,
    system_split,
)

BLOCK_SIZE = 32  # vLLM 0.32's CPU attention backend needs a multiple of 32
# vLLM's Prometheus counters (tokens) read around each workload.
VLLM_COUNTERS = (
    "prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries", "external_prefix_cache_hits",
    "prompt_tokens", "generation_tokens",
)  # fmt: skip

FULL = dict(hidden=1024, intermediate=2816, layers=4, heads=16, kv_heads=4,
            conversations=12, turns=8, first_message=(320, 448), message=(96, 224), answer=32,
            system_prompts=4, system_prompt=1536, questions=32, question=(32, 96), system_answer=16)  # fmt: skip
QUICK = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2,
             conversations=3, turns=3, first_message=(160, 224), message=(64, 128), answer=16,
             system_prompts=2, system_prompt=512, questions=6, question=(16, 48), system_answer=8)  # fmt: skip
# --disk-compare serves the chat only, and fewer conversations by default (about 5 minutes on 2 cores).
DISK_COMPARE = dict(conversations=10, turns=6)


def make_spec(shape: dict, vocab: int, seed: int) -> dict:
    """The requests every configuration serves, as token ids (ids below 3 are special tokens)."""
    rng = random.Random(seed)

    def text(bounds) -> list[int]:
        n = bounds if isinstance(bounds, int) else rng.randint(*bounds)
        return [rng.randrange(3, vocab) for _ in range(n)]

    conversations = [[text(shape["first_message"])] + [text(shape["message"]) for _ in range(shape["turns"] - 1)]
                     for _ in range(shape["conversations"])]  # fmt: skip
    system_prompts = [text(shape["system_prompt"]) for _ in range(shape["system_prompts"])]
    questions = [[i % len(system_prompts), text(shape["question"])] for i in range(shape["questions"])]
    returning = [text(shape["message"]) for _ in conversations]
    longest_chat = (shape["first_message"][1] + shape["turns"] * shape["message"][1]
                    + (shape["turns"] + 1) * shape["answer"])  # fmt: skip
    longest_system = shape["system_prompt"] + shape["question"][1] + shape["system_answer"]
    return {
        "chat": conversations,
        "chat_answer": shape["answer"],
        "return_messages": returning,
        "system_prompts": system_prompts,
        "questions": questions,
        "system_answer": shape["system_answer"],
        "longest": max(longest_chat, longest_system),
    }


# ---------------------------------------------------------------------------
# One engine process
# ---------------------------------------------------------------------------


def vllm_counters() -> dict[str, float]:
    from prometheus_client import REGISTRY

    found = dict.fromkeys(VLLM_COUNTERS, 0.0)
    for family in REGISTRY.collect():
        name = family.name.removeprefix("vllm:")
        if name in found:
            found[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return found


class Runner:
    """Feeds one engine requests, up to `concurrency` in flight, and times their first tokens.
    turns: where another engine takes turns with this one (bench/engine_turns.py), each request
    waits for its turn (one request in flight)."""

    def __init__(self, engine, concurrency: int, turns: engine_turns.EngineSide | None = None):
        if turns is not None and concurrency != 1:
            raise ValueError("engines take turns request by request: one request in flight")
        self.engine = engine
        self.concurrency = concurrency
        self.turns = turns

    def run(self, requests):
        """`requests`: an iterator of (name, prompt, max_tokens, done_callback) that may yield None
        while the next request waits for an answer still being generated."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        records = []
        in_flight: dict[str, dict] = {}
        source = iter(requests)
        exhausted = False
        waiting = None
        while True:
            while not exhausted and len(in_flight) < self.concurrency:
                if waiting is None:
                    waiting = next(source, StopIteration)
                    if waiting is StopIteration:
                        exhausted = True
                        break
                if waiting[1]() is None:  # its prompt needs an answer not complete yet
                    break
                name, prompt_fn, max_tokens, done = waiting
                prompt = prompt_fn()
                waiting = None
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                rec = {"name": name, "prompt_tokens": len(prompt), "done": done}
                if self.turns:
                    self.turns.before(name)
                rec["t_submit"] = time.perf_counter()
                step_trace.mark("add", name)
                req_id = self.engine.add_request(name, TokensPrompt(prompt_token_ids=prompt), params)
                in_flight[name] = rec
                if req_id != name:
                    in_flight[req_id] = rec
            if not in_flight:
                if exhausted:
                    return records
                raise RuntimeError("a request waits for an answer that nothing is generating")
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                rec = in_flight.get(out.request_id)
                if rec is None:
                    continue
                tokens = out.outputs[0].token_ids
                if "ttft_s" not in rec and len(tokens) > 0:
                    rec["ttft_s"] = now - rec["t_submit"]
                    step_trace.mark("first_token", rec["name"])
                if out.finished:
                    rec["e2e_s"] = now - rec["t_submit"]
                    rec["output"] = list(tokens)
                    rec["num_cached_tokens"] = out.num_cached_tokens
                    metrics = getattr(out, "metrics", None)
                    rec["vllm_ttft_s"] = getattr(metrics, "first_token_latency", None)
                    rec["t_done"] = now
                    for key in [k for k, v in in_flight.items() if v is rec]:
                        del in_flight[key]
                    rec.pop("done")(rec["output"])
                    records.append(rec)
                    if self.turns:
                        self.turns.after(rec["name"])


def chat_requests(spec: dict, history: list):
    """The chat turns in interleaved order; a turn's prompt exists once the previous answer does.
    `history` (one empty list per conversation) ends with each conversation's whole history."""
    conversations = spec["chat"]
    for turn in range(max(len(c) for c in conversations)):
        for c, messages in enumerate(conversations):
            if turn >= len(messages):
                continue
            taken: dict = {}

            def prompt(c=c, turn=turn, taken=taken):
                if "tokens" not in taken:
                    if history[c] is None:
                        return None
                    taken["tokens"] = history[c] + conversations[c][turn]
                    history[c] = None
                return taken["tokens"]

            def done(output, c=c, taken=taken):
                history[c] = taken["tokens"] + output

            yield f"chat-c{c:02d}-t{turn:02d}", prompt, spec["chat_answer"], done


def return_requests(spec: dict, history: list):
    """Each conversation comes back once more, with a message no engine has seen."""
    for c, message in enumerate(spec["return_messages"]):
        tokens = history[c] + message
        yield f"return-c{c:02d}", (lambda t=tokens: t), spec["chat_answer"], (lambda output: None)


def system_requests(spec: dict):
    for i, (which, question) in enumerate(spec["questions"]):
        tokens = spec["system_prompts"][which] + question
        yield f"sys-q{i:03d}-p{which}", (lambda t=tokens: t), spec["system_answer"], (lambda output: None)


def daemon_totals(socket: str | None) -> dict:
    if not socket:
        return {}
    from kvdepot.client import KVDepotClient

    with KVDepotClient(socket, name="serving-ttft-stats") as client:
        t = client.connect(10).stats().totals
        keys = ("lookups", "hit_blocks", "miss_blocks", "stored_blocks", "stored_bytes", "loaded_blocks",
                "evicted_blocks", "failed_jobs", "disk_hit_blocks")  # fmt: skip
        return {k: getattr(t, k) for k in keys}


def daemon_stats(socket: str) -> dict:
    """The daemon's totals and tiers (`kvdepot stats --json`'s fields of those names)."""
    from kvdepot.client import KVDepotClient
    from kvdepot.client.cli import message_to_dict

    with KVDepotClient(socket, name="serving-ttft-stats") as client:
        stats = client.connect(10).stats()
        return {"totals": message_to_dict(stats.totals), "tiers": [message_to_dict(t) for t in stats.tiers]}


def run_engine(args) -> int:
    spec = json.loads(Path(args.spec).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: TTFT seen here
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_generate import kvdepot_kv_transfer_config

    from kvdepot.connector.lookup import REPORT_INTERVAL_S

    kwargs = {}
    if args.config != "plain":
        # More of the connector's settings, from a benchmark that runs this one (bench/remote_ttft.py).
        extra = json.loads(os.environ.get("KVDEPOT_BENCH_CONNECTOR", "{}"))
        kwargs["kv_transfer_config"] = kvdepot_kv_transfer_config(socket=args.socket, **extra)
    step_trace.install()  # off unless KVDEPOT_STEP_TRACE names a file
    t0 = time.monotonic()
    llm = LLM(
        model=args.model,
        dtype="float32",  # bfloat16 kernels need AVX512-BF16 on the CPU build
        seed=0,
        max_model_len=spec["max_model_len"],
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        enforce_eager=True,
        distributed_executor_backend="uni",
        tensor_parallel_size=1,
        num_gpu_blocks_override=args.vllm_blocks or spec["vllm_blocks"],
        max_num_seqs=max(8, args.concurrency),
        # A whole prompt in one step: the prefill is what TTFT measures, not chunking.
        max_num_batched_tokens=spec["max_model_len"],
        disable_log_stats=False,  # vLLM's prefix-cache counters
        **kwargs,
    )
    startup_s = time.monotonic() - t0
    engine = llm.llm_engine

    # The first forward passes of a process pay one-time costs (allocations, oneDNN primitives):
    # warm up every configuration alike, on prompts of its own that no other process sends.
    rng = random.Random(f"warmup-{args.config}")
    for n in (64, spec["longest"] // 2, spec["longest"] - 16):
        prompt = [rng.randrange(3, 500) for _ in range(n)]
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False)  # fmt: skip

    if args.config != "plain":
        time.sleep(REPORT_INTERVAL_S + 0.5)  # the warm-up's lookups reported before the first workload's count
    step_trace.wrap_engine(engine)
    runner = Runner(engine, args.concurrency, engine_turns.EngineSide.from_env())
    result = {"config": args.config, "startup_s": startup_s, "torch_threads": torch.get_num_threads(),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "workloads": {}}  # fmt: skip
    history = [[] for _ in spec["chat"]]
    workloads = [("chat", chat_requests(spec, history)), ("system_prompt", system_requests(spec))]
    if args.config != "kvdepot":
        # Only after the restart: the first kvdepot engine must not store these new messages.
        workloads.append(("return", return_requests(spec, history)))
    if args.workloads:
        workloads = [w for w in workloads if w[0] in args.workloads.split(",")]
    for workload, requests in workloads:
        before_vllm, before_daemon = vllm_counters(), daemon_totals(args.socket)
        t = time.perf_counter()
        records = runner.run(requests)
        wall = time.perf_counter() - t
        if args.socket and args.config != "plain":
            # The connector reports its lookups to the daemon once a second; let the last ones land.
            time.sleep(REPORT_INTERVAL_S + 0.5)
        after_vllm, after_daemon = vllm_counters(), daemon_totals(args.socket)
        for rec in records:
            rec.pop("t_submit"), rec.pop("t_done")
        result["workloads"][workload] = {
            "wall_s": wall,
            "requests": records,
            "vllm": {k: after_vllm[k] - before_vllm[k] for k in VLLM_COUNTERS},
            "daemon": {k: after_daemon[k] - before_daemon[k] for k in after_daemon},
        }
    Path(args.out).write_text(json.dumps(result))
    step_trace.dump()
    return 0


# ---------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------


def block_bytes(shape: dict) -> int:
    head_dim = shape["hidden"] // shape["heads"]
    return shape["layers"] * 2 * shape["kv_heads"] * head_dim * BLOCK_SIZE * 4  # K and V, float32


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def serve(config: str, model: str, socket: str | None, spec_path: Path, scratch: Path, args,
          workloads: str | None = None, vllm_blocks: int = 0, env_extra: dict | None = None) -> dict:
    """Runs one engine process (`run_engine`) and returns its results."""
    return finish_engine(start_engine(config, model, socket, spec_path, scratch, args, workloads, vllm_blocks,
                                      env_extra))  # fmt: skip


def start_engine(config: str, model: str, socket: str | None, spec_path: Path, scratch: Path, args,
                 workloads: str | None = None, vllm_blocks: int = 0, env_extra: dict | None = None,
                 pass_fds: tuple = ()) -> dict:
    """Starts one engine process (`run_engine`); `finish_engine` waits for it."""
    from vllm_generate import vllm_env

    out = scratch / f"{config}.json"
    cmd = [sys.executable, __file__, "--engine", config, "--model", model, "--spec", str(spec_path),
           "--concurrency", str(args.concurrency), "--out", str(out)]  # fmt: skip
    if socket:
        cmd += ["--socket", socket]
    if workloads:
        cmd += ["--workloads", workloads]
    if vllm_blocks:
        cmd += ["--vllm-blocks", str(vllm_blocks)]
    env = vllm_env(scratch / f"vllm-{config}")
    env.update(env_extra or {})
    env["OMP_NUM_THREADS"] = str(args.threads)
    log_path = scratch / f"{config}.log"
    engine_log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=engine_log, stderr=subprocess.STDOUT, pass_fds=pass_fds)
    return {"config": config, "proc": proc, "out": out, "log_path": log_path, "log": engine_log,
            "started": time.monotonic()}  # fmt: skip


def finish_engine(engine: dict) -> dict:
    """Waits for an engine process `start_engine` started and returns its results."""
    config, log_path = engine["config"], engine["log_path"]
    returncode = engine["proc"].wait()
    engine["log"].close()
    if returncode != 0:
        raise SystemExit(f"engine process ({config}) failed:\n{log_path.read_text()[-5000:]}")
    run = json.loads(engine["out"].read_text())
    chat = run["workloads"]["chat"]["requests"]
    log(f"{config}: {time.monotonic() - engine['started']:.0f} s (start-up {run['startup_s']:.0f} s), "
        f"{run['torch_threads']} torch threads; chat TTFT p50 "
        f"{pct([r['ttft_s'] * 1e3 for r in chat], 0.5):.0f} ms")  # fmt: skip
    return run


def check_outputs(runs: dict) -> int:
    """The same token ids, request by request, in every configuration; else exits.
    Plain vLLM serves every workload; the others a part of them."""
    base = {w: {r["name"]: r["output"] for r in d["requests"]} for w, d in runs["plain"]["workloads"].items()}
    checked = 0
    for config, run in runs.items():
        for workload, data in run["workloads"].items():
            got = {r["name"]: r["output"] for r in data["requests"]}
            if got.keys() != base[workload].keys():
                raise SystemExit(f"FAIL: {config} served other {workload} requests than plain vLLM")
            for name in sorted(got):
                if got[name] != base[workload][name]:
                    raise SystemExit(f"FAIL: outputs differ: {workload} request {name}, {config} against plain vLLM:\n"
                                     f"  plain:   {base[workload][name]}\n  {config}: {got[name]}")  # fmt: skip
                checked += 1
    return checked

# ---------------------------------------------------------------------------
# --disk-compare: a working set larger than the daemon's DRAM, with and without the disk tier
# ---------------------------------------------------------------------------


def chat_only(conversations: int, turns: int, seed: int, scratch: Path) -> tuple[dict, dict, str, Path]:
    """(shape, spec, model dir, spec file) of the chat alone at FULL's shape, for the benchmarks
    that serve only it (hit_ttft.py, remote_ttft.py); the caller sets spec["vllm_blocks"] before
    writing the spec file."""
    import vllm_harness as vh

    shape = dict(FULL, conversations=conversations, turns=turns)
    spec = make_spec(shape, vh.TINY_MODEL_VOCAB, seed)
    spec["system_prompts"], spec["questions"] = [], []
    longest_blocks = -(-spec["longest"] // BLOCK_SIZE)
    spec["max_model_len"] = BLOCK_SIZE * (longest_blocks + 1)
    spec["longest_blocks"] = longest_blocks
    positions = max(4096, spec["max_model_len"])
    model_dir = Path(tempfile.gettempdir()) / ("kvdepot-bench-llama-{hidden}-{intermediate}-{layers}-{heads}-{kv_heads}"
                                               "-{positions}".format(**shape, positions=positions))  # fmt: skip
    model = vh.make_tiny_model(model_dir, hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                               num_layers=shape["layers"], num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                               max_position_embeddings=positions)  # fmt: skip
    return shape, spec, model, scratch / "spec.json"


def chat_blocks(spec: dict) -> int:
    """The chat's working set in the daemon: the whole blocks of every conversation's final history
    (all its prompts and answers; an earlier turn's blocks are a prefix of it)."""
    return sum((sum(map(len, c)) + len(c) * spec["chat_answer"]) // BLOCK_SIZE for c in spec["chat"])


def disk_compare(args, shape: dict, spec: dict, model: str, spec_path: Path, scratch: Path, started: float) -> int:
    """The chat in vLLM alone, then against a fresh daemon whose pool holds `--dram-share` of the
    chat's working set (dram), then against another such daemon with a disk tier that holds all of
    it twice over (disk)."""
    from bench_daemon import Daemon

    slot = 1 << (block_bytes(shape) - 1).bit_length()
    ws_blocks = chat_blocks(spec)
    pool_bytes = max(1, round(ws_blocks * args.dram_share)) * slot
    disk_bytes = -(-max(64 << 20, 2 * ws_blocks * slot) // (1 << 20)) << 20
    disk_dir = Path(tempfile.mkdtemp(prefix=".kvdepot-bench-disk-", dir=args.disk_parent)).resolve()
    log(f"chat working set {ws_blocks} blocks ({ws_blocks * slot / 2**20:.0f} MiB in {slot >> 10} KiB slots); pool "
        f"{pool_bytes / 2**20:.1f} MiB; disk tier {disk_bytes >> 20} MiB in {disk_dir}")  # fmt: skip
    runs, stats = {}, {}
    try:
        runs["plain"] = serve("plain", model, None, spec_path, scratch, args, "chat")
        for config in ("dram", "disk"):
            folder = scratch / f"daemon-{config}"
            folder.mkdir()
            extra = ("--disk-dir", str(disk_dir), "--disk-size", f"{disk_bytes >> 20}MiB") if config == "disk" else ()
            daemon = Daemon(folder, f"{pool_bytes >> 10}KiB", f"{slot >> 10}KiB",
                            "/dev/shm" if os.path.isdir("/dev/shm") else None, extra)  # fmt: skip
            log(f"kvdepotd ({config}) pid {daemon.proc.pid} on {daemon.socket}")
            try:
                runs[config] = serve(config, model, daemon.socket, spec_path, scratch, args, "chat")
                stats[config] = daemon_stats(daemon.socket)
            finally:
                rc = daemon.stop()
                log(f"kvdepotd ({config}) stopped (exit {rc})")
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)

    results, threads, checked, wall = common_results(runs, DISK_CONFIGS, shape, started)
    results |= {
        "workload": {k: shape[k] for k in ("conversations", "turns", "first_message", "message", "answer")}
        | {"concurrency": args.concurrency, "vllm_blocks": spec["vllm_blocks"], "max_model_len": spec["max_model_len"],
           "working_set_blocks": ws_blocks, "working_set_bytes": ws_blocks * slot, "slot_bytes": slot,
           "dram_share": args.dram_share, "pool_bytes": pool_bytes, "disk_bytes": disk_bytes,
           "disk_dir": str(disk_dir)},  # fmt: skip
        "summary": {"chat": {c: summarize(runs[c], "chat") for c in DISK_CONFIGS}},
        "daemon_stats": stats,
    }
    print_setting(results, threads, spec, checked, wall)
    print_disk_tables(results)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    log(f"results in {args.json}")
    if args.plots != "none":
        draw_disk(results, Path(args.plots))
    return 0


def common_results(runs: dict, configs, shape: dict, started: float) -> tuple[dict, dict, int, float]:
    """What every mode's results hold, once the engines' thread counts agree and
    their outputs match: (results, thread counts, requests checked, wall seconds)."""
    import torch
    import vllm
    import vllm_harness as vh

    threads = {c: runs[c]["torch_threads"] for c in configs}
    if len(set(threads.values())) != 1:
        raise SystemExit(f"FAIL: the engines ran with different torch thread counts: {threads}")
    checked = check_outputs(runs)
    wall = time.monotonic() - started
    results = {
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__,
                    "torch_threads": threads["plain"]},  # fmt: skip
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "model": {k: shape[k] for k in ("hidden", "intermediate", "layers", "heads", "kv_heads")}
        | {"vocab": vh.TINY_MODEL_VOCAB, "dtype": "float32", "block_size": BLOCK_SIZE,
           "block_bytes": block_bytes(shape)},  # fmt: skip
        "outputs_identical": checked,
        "startup_s": {c: runs[c]["startup_s"] for c in configs},
        "by_turn": {c: by_turn(runs[c]) for c in configs},
        "wall_s": wall,
        "runs": runs,
    }
    return results, threads, checked, wall


def print_setting(results: dict, threads: dict, spec: dict, checked: int, wall: float) -> None:
    import torch
    import vllm

    m = results["model"]
    print(f"vLLM {vllm.__version__} (CPU), torch {torch.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} cores ({threads['plain']} torch thread per engine), {results['date']}; "
          f"`{results['command']}`; total {wall:.0f} s")  # fmt: skip
    print(f"Model: random-weight Llama, hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads, "
          f"{m['kv_heads']} KV heads, intermediate {m['intermediate']}, float32, block {BLOCK_SIZE} tokens "
          f"({m['block_bytes'] >> 10} KiB of KV); vLLM cache {spec['vllm_blocks']} blocks; outputs identical in "
          f"all three configurations ({checked} requests checked).\n")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny model and a few requests (about 2 minutes)")
    ap.add_argument("--conversations", type=int, help="chat conversations (default 12; --quick 3)")
    ap.add_argument("--turns", type=int, help="turns per conversation (default 8; --quick 3)")
    ap.add_argument("--system-prompts", type=int, help="distinct long system prompts (default 4; --quick 2)")
    ap.add_argument("--questions", type=int, help="questions after the system prompts (default 32; --quick 6)")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default 1)")
    ap.add_argument("--vllm-blocks", type=int, default=0,
                    help="vLLM's KV cache in blocks (default: the longest request's blocks x (concurrency + 0.5))")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="OpenMP threads of every engine (default: all cores but one, which is the daemon's)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the requests' token ids")
    ap.add_argument("--disk-compare", action="store_true",
                    help="the chat only (default 10 conversations of 6 turns), against a pool smaller than its working "
                    "set: without the disk tier, and with it (see below)")  # fmt: skip
    ap.add_argument("--dram-share", type=float, default=1 / 3,
                    help="--disk-compare: the pool's size, a share of the chat's working set (default 1/3)")
    ap.add_argument("--disk-parent", default=".", metavar="DIR",
                    help="--disk-compare: where the disk tier's temporary folder goes (default: the current folder; "
                    "a real disk, not a tmpfs)")  # fmt: skip
    ap.add_argument("--from-json", metavar="PATH",
                    help="only print the tables and draw the plots of an earlier run's JSON")
    ap.add_argument("--keep-scratch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="PATH",
                    help="results (default ./serving_ttft.json; --disk-compare ./serving_ttft_disk.json)")
    ap.add_argument("--plots", default=str(REPO / "docs"), metavar="DIR", help="where the PNGs go (default docs/); "
                    "'none' for none")  # fmt: skip
    # One engine process (started by this script).
    ap.add_argument("--engine", choices=sorted(set(CONFIGS) | set(DISK_CONFIGS)), dest="config", help=argparse.SUPPRESS)
    ap.add_argument("--workloads", help=argparse.SUPPRESS)  # comma-separated: only these
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.json = args.json or ("serving_ttft_disk.json" if args.disk_compare else "serving_ttft.json")
    if args.config:
        return run_engine(args)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        disk = "daemon_stats" in results  # a --disk-compare run
        (print_disk_tables if disk else print_tables)(results)
        if args.plots != "none":
            (draw_disk if disk else draw)(results, Path(args.plots))
        return 0

    import vllm_harness as vh
    from bench_daemon import Daemon

    shape = dict(QUICK if args.quick else FULL)
    if args.disk_compare and not args.quick:
        shape.update(DISK_COMPARE)
    for key in ("conversations", "turns", "system_prompts", "questions"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    spec = make_spec(shape, vh.TINY_MODEL_VOCAB, args.seed)
    longest_blocks = -(-spec["longest"] // BLOCK_SIZE)
    spec["max_model_len"] = BLOCK_SIZE * (longest_blocks + 1)
    spec["vllm_blocks"] = args.vllm_blocks or int(longest_blocks * (args.concurrency + 0.5)) + 1  # +1: the null block
    slot = 1 << (block_bytes(shape) - 1).bit_length()
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="kvdepot-serving-bench-"))
    positions = max(4096, spec["max_model_len"])
    model_dir = Path(tempfile.gettempdir()) / ("kvdepot-bench-llama-{hidden}-{intermediate}-{layers}-{heads}-{kv_heads}"
                                               "-{positions}".format(**shape, positions=positions))  # fmt: skip
    runs = {}
    try:
        t = time.monotonic()
        model = vh.make_tiny_model(model_dir, hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                                   num_layers=shape["layers"], num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                                   max_position_embeddings=positions)  # fmt: skip
        log(f"model {model} ({time.monotonic() - t:.0f} s); vLLM cache {spec['vllm_blocks']} blocks of "
            f"{block_bytes(shape) >> 10} KiB, longest request {spec['longest']} tokens")  # fmt: skip
        spec_path = scratch / "spec.json"
        spec_path.write_text(json.dumps(spec))
        os.environ["KVDEPOT_METRICS_LISTEN"] = "none"
        if args.disk_compare:
            return disk_compare(args, shape, spec, model, spec_path, scratch, started)
        # Room for every block the workloads store, many times over: the daemon never evicts here.
        pool_mib = max(256, 4 * (len(spec["chat"]) * spec["longest"] + 2 * sum(map(len, spec["system_prompts"])))
                       * slot // BLOCK_SIZE >> 20)  # fmt: skip
        daemon = Daemon(scratch, f"{pool_mib}MiB", f"{slot >> 10}KiB",
                        "/dev/shm" if os.path.isdir("/dev/shm") else None)  # fmt: skip
        log(f"kvdepotd pid {daemon.proc.pid} on {daemon.socket}, pool {pool_mib} MiB of {slot >> 10} KiB slots")
        try:
            for config in CONFIGS:
                runs[config] = serve(config, model, daemon.socket, spec_path, scratch, args)
        finally:
            rc = daemon.stop()
            log(f"kvdepotd stopped (exit {rc})")
    finally:
        if args.keep_scratch:
            log(f"engine logs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    results, threads, checked, wall = common_results(runs, CONFIGS, shape, started)
    results |= {
        "workload": {k: v for k, v in shape.items()
                     if k not in ("hidden", "intermediate", "layers", "heads", "kv_heads")}
        | {"concurrency": args.concurrency, "vllm_blocks": spec["vllm_blocks"], "max_model_len": spec["max_model_len"],
           "daemon_pool_mib": pool_mib, "daemon_slot_kib": slot >> 10},  # fmt: skip
        "summary": {w: {c: summarize(runs[c], w) for c in CONFIGS if w in runs[c]["workloads"]} for w in WORKLOADS},
        "system_split": {c: system_split(runs[c]) for c in CONFIGS},
    }
    print_setting(results, threads, spec, checked, wall)
    print_tables(results)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    log(f"results in {args.json}")
    if args.plots != "none":
        draw(results, Path(args.plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
