"""Greedy generation with real vLLM (CPU build) for the integration tests.

Run as a subprocess, one vLLM process at a time:

    python tests/vllm_generate.py --model DIR --prompts PROMPTS.json --out OUT.json \
        [--kv-transfer-config JSON] [--repeat-after-reset] [--max-tokens N] \
        [--block-size 32] [--one-at-a-time] [--compile] \
        [--kill-pid-file PATH --kill-after-requests N] \
        [--pause-dir DIR --pause-after-requests N] [--metrics-out METRICS.txt]

PROMPTS.json is a list of prompts, each a list of token ids (or {"prompts": [...]}).
Token ids keep the test free of tokenizer behaviour; `make_prompts()` builds a set.

OUT.json:

    {
      "rounds": [                      # round 1, then round 2 with --repeat-after-reset
        {"outputs": [[id, ...], ...],  # generated token ids, one list per prompt, in prompt order
         "num_cached_tokens": [n, ...],# per prompt: prompt tokens not computed (vLLM prefix
                                       # cache hits + tokens loaded by the KV connector)
         "wall_s": 1.2}
      ],
      "reset_prefix_cache": true,      # what llm.reset_prefix_cache() returned (None: not called)
      "killed_pid": 1234,              # with --kill-pid-file: the pid that got SIGKILL
      "startup_s": 6.5, "total_s": 9.0, "peak_rss_mb": 1600,
      "args": {...}
    }

Requests are numbered 1, 2, ... over both rounds (round 2 continues after round 1).
--kill-after-requests N / --pause-after-requests N imply --one-at-a-time: each prompt is
its own `llm.generate()` call, so "after request N" is a clean point between requests.
  * --kill-pid-file PATH: after request N, read a pid from PATH and SIGKILL it, then go on.
  * --pause-dir DIR: after request N, create DIR/paused-N and wait until DIR/resume-N
    exists (the test kills/restarts the daemon in between), then go on.
--metrics-out METRICS.txt turns vLLM's stats on and writes, at the end, its Prometheus
registry in the text format: what the OpenAI server's /metrics would show.

The round-2 reset calls `llm.reset_prefix_cache()` with its defaults, which in vLLM 0.32 are
`reset_running_requests=False, reset_connector=False`: only vLLM's own (CPU/GPU) prefix
cache is dropped; the connector's `reset_cache()` is NOT called, so the daemon keeps its
blocks and round 2 must be served from it.

`openai_server_argv()` is the OpenAI-compatible server command line documented in the
README (`kvdepot_kv_transfer_config()` gives its --kv-transfer-config); `vllm_env()` is
the environment every vLLM process in the tests should get.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import sys
import time
from pathlib import Path

# float32: the CPU platform resolves dtype="auto" to bfloat16, whose kernels die with SIGILL
# on the test machines (no AVX512-BF16); float32 greedy output is identical run to run.
DEFAULT_DTYPE = "float32"
DEFAULT_MAX_MODEL_LEN = 1024
DEFAULT_SEED = 0
# vLLM 0.32's CPU attention backend (CPU_ATTN) only takes block sizes that are multiples of 32:
# --block-size 16 fails at start-up with "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])".
DEFAULT_BLOCK_SIZE = 32


def vllm_env(workdir: str | os.PathLike, base: dict | None = None, kvcache_gib: int = 1) -> dict:
    """Environment for a vLLM process on a machine without a GPU.

    `workdir` gets vLLM's sockets (TMPDIR) and its compile cache (VLLM_CACHE_ROOT)."""
    env = dict(os.environ if base is None else base)
    workdir = Path(workdir)
    (workdir / "tmp").mkdir(parents=True, exist_ok=True)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(kvcache_gib),  # GiB; unset, vLLM takes ~18 GB of RAM
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # engine core in this process: connector hooks too
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TMPDIR=str(workdir / "tmp"),
        VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def kvdepot_kv_transfer_config(**extra_config) -> dict:
    """--kv-transfer-config for the kvdepot connector; `extra_config` becomes
    kv_connector_extra_config (the connector's own settings, e.g. the daemon's socket)."""
    return {
        "kv_connector": "KVDepotConnector",
        "kv_connector_module_path": "kvdepot.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": dict(extra_config),
    }


def openai_server_argv(
    model: str,
    port: int,
    kv_transfer_config: dict | str | None = None,
    *,
    python: str = sys.executable,
    host: str = "127.0.0.1",
    cpu_test: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    dtype: str = DEFAULT_DTYPE,
    extra: list[str] | None = None,
) -> list[str]:
    """The OpenAI server command line (the `vllm` console script of vllm-cpu crashes: use -m).

    cpu_test=False gives the plain form the README documents (model, port, connector);
    cpu_test=True adds what the tiny model on the CPU build needs (float32, a block size
    that is a multiple of 32, eager mode, a small max_model_len, a fixed seed).
    Run it with `vllm_env(...)`. NB: the API server always runs the engine core in a
    separate process (VLLM_ENABLE_V1_MULTIPROCESSING=0 does not change that), so the
    connector's scheduler and worker halves both live in that "EngineCore" child."""
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", host,
        "--port", str(port),
    ]
    if cpu_test:
        argv += [
            "--dtype", dtype,
            "--max-model-len", str(max_model_len),
            "--block-size", str(block_size),
            "--enable-prefix-caching",
            "--enforce-eager",
            "--seed", str(DEFAULT_SEED),
        ]
    if kv_transfer_config is not None:
        if not isinstance(kv_transfer_config, str):
            kv_transfer_config = json.dumps(kv_transfer_config)
        argv += ["--kv-transfer-config", kv_transfer_config]
    return argv + list(extra or [])


def make_prompts(n: int = 4, length: int = 200, vocab: int = 500, seed: int = 0,
                 shared_prefix: int = 0, first_id: int = 3) -> list[list[int]]:
    """n prompts of `length` token ids in [first_id, vocab) (ids below first_id are the tiny
    model's special tokens; vllm_harness.make_tiny_model() has a 512-token vocab). The first `shared_prefix` tokens
    are the same in every prompt."""
    rng = random.Random(seed)
    prefix = [rng.randrange(first_id, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(first_id, vocab) for _ in range(length - shared_prefix)]
            for _ in range(n)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON: list of token-id lists")
    p.add_argument("--out", required=True)
    p.add_argument("--kv-transfer-config", default=None, help="JSON, as vLLM's --kv-transfer-config")
    p.add_argument("--repeat-after-reset", action="store_true",
                   help="round 2: reset vLLM's prefix cache (not the connector's), generate again")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per KV block; the CPU attention backend needs a multiple of 32; 0: vLLM's default")
    p.add_argument("--compile", action="store_true",
                   help="let vLLM torch.compile the model (default: enforce_eager, ~20 s faster start)")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument("--dtype", default=DEFAULT_DTYPE)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE if unset")
    p.add_argument("--one-at-a-time", action="store_true", help="one llm.generate() per prompt")
    p.add_argument("--kill-pid-file", default=None)
    p.add_argument("--kill-after-requests", type=int, default=None)
    p.add_argument("--pause-dir", default=None)
    p.add_argument("--pause-after-requests", type=int, default=None)
    p.add_argument("--pause-timeout", type=float, default=120.0)
    p.add_argument("--metrics-out", default=None, help="write vLLM's Prometheus metrics here at the end")
    a = p.parse_args(argv)
    if (a.kill_pid_file is None) != (a.kill_after_requests is None):
        p.error("--kill-pid-file and --kill-after-requests go together")
    if (a.pause_dir is None) != (a.pause_after_requests is None):
        p.error("--pause-dir and --pause-after-requests go together")
    if a.kill_after_requests is not None or a.pause_after_requests is not None:
        a.one_at_a_time = True
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    t0 = time.monotonic()
    # Before importing vllm: these are read at import / engine start.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(a.kvcache_gib))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

    with open(a.prompts) as f:
        prompts = json.load(f)
    if isinstance(prompts, dict):
        prompts = prompts["prompts"]
    prompts = [[int(t) for t in p] for p in prompts]

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if a.kv_transfer_config:
        kwargs["kv_transfer_config"] = json.loads(a.kv_transfer_config)
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        seed=a.seed,
        max_model_len=a.max_model_len,
        **({"block_size": a.block_size} if a.block_size else {}),
        enable_prefix_caching=True,
        enforce_eager=not a.compile,
        distributed_executor_backend="uni",
        tensor_parallel_size=1,
        disable_log_stats=a.metrics_out is None,
        **kwargs,
    )
    startup_s = time.monotonic() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True, seed=a.seed)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    result: dict = {"startup_s": round(startup_s, 2), "rounds": [], "reset_prefix_cache": None,
                    "killed_pid": None, "args": vars(a)}
    done = 0  # requests finished, over all rounds

    def after_request() -> None:
        nonlocal done
        done += 1
        if a.kill_after_requests == done:
            pid = int(Path(a.kill_pid_file).read_text().split()[0])
            print(f"vllm_generate: after request {done}: SIGKILL {pid}", file=sys.stderr, flush=True)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            result["killed_pid"] = pid
        if a.pause_after_requests == done:
            d = Path(a.pause_dir)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"paused-{done}").write_text(str(os.getpid()))
            print(f"vllm_generate: after request {done}: waiting for {d}/resume-{done}",
                  file=sys.stderr, flush=True)
            deadline = time.monotonic() + a.pause_timeout
            while not (d / f"resume-{done}").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {d}/resume-{done} after {a.pause_timeout} s")
                time.sleep(0.05)

    def run_round() -> dict:
        t = time.monotonic()
        if a.one_at_a_time:
            outs = []
            for inp in inputs:
                outs += llm.generate([inp], sp, use_tqdm=False)
                after_request()
        else:
            outs = llm.generate(inputs, sp, use_tqdm=False)
            for _ in outs:
                after_request()
        for o, p in zip(outs, prompts):
            assert list(o.prompt_token_ids) == p, "outputs out of prompt order"
        return {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
            "wall_s": round(time.monotonic() - t, 3),
        }

    result["rounds"].append(run_round())
    if a.repeat_after_reset:
        # Defaults spelled out: vLLM's prefix cache only, never the connector's.
        ok = llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False)
        result["reset_prefix_cache"] = bool(ok)
        if not ok:
            print("vllm_generate: reset_prefix_cache() returned False", file=sys.stderr)
        result["rounds"].append(run_round())

    if a.metrics_out:
        from prometheus_client import REGISTRY, generate_latest

        Path(a.metrics_out).write_bytes(generate_latest(REGISTRY))
    result["total_s"] = round(time.monotonic() - t0, 2)
    result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
