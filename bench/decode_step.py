"""A decode step of a Llama-3.1-8B-shaped model, and the connector's share of it.

    python bench/decode_step.py [--running 64,256] [--context 1024] [--mode graph|eager|both] [--json PATH]
    python bench/decode_step.py --tiny          # the same code on a CPU, tiny shapes, eager

For each number of running requests N: one decode step of N requests (one new
token each), each with --context tokens of context (default 1024), on one GPU.
The model is bench/llama_shape.py's (random bf16 weights of Llama-3.1-8B's
shape). A step is the whole forward pass: embedding, 32 layers (RMSNorm, QKV,
RoPE, the new token's K/V written into the cache, attention of the one query
token over the context via scaled_dot_product_attention, SwiGLU MLP) and the
logits of all N tokens. Sampling is left out.

The KV cache is contiguous per request ([N, 8, context + 1, 128] bf16 a layer
for K and for V), not paged: plain torch has no paged attention kernel. Decode
attention reads the same bytes either way (N x context x 128 KiB a step), so the
step's time is what vLLM's paged kernels would take, within their efficiency.
The step is captured in a CUDA graph and replayed (as vLLM runs decode);
--mode eager runs it op by op instead, --mode both reports both. Each replay is
timed on its own with CUDA events; the median of --steps replays is reported.

The connector's cost per step cannot be measured on a machine without vLLM, so
it is an input (--connector-us N:µs,...). Its defaults are the figures of
docs/benchmarks.md, "The connector's own calls inside the engine, and the floor"
(bench/engine_overhead.py --calls, vLLM 0.32.0 CPU build, 2 cores, 2026-11-26):
all of kvdepot's scheduler-side calls took 72.2 µs a step at N=64 and 194.9 µs
at N=256. Reported: share = connector µs / step µs (issue 16's target: under 1%).
The connector's calls run on the CPU in the scheduler, between steps: they add
to every step unless the engine schedules while the GPU runs (vLLM's async
scheduling); the share assumes they add.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from llama_shape import LLAMA_8B, TINY, LlamaShape, selfcheck  # noqa: E402

CONNECTOR_US = "64:72.2,256:194.9"


class Timer:
    """Per-step times: CUDA events on the GPU (no sync between steps), the host clock on the CPU."""

    def __init__(self, device: torch.device, steps: int):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(steps)]
        self.host = []

    def time(self, step, i: int) -> None:
        if self.cuda:
            start, end = self.events[i]
            start.record()
            step()
            end.record()
        else:
            start = time.perf_counter()
            step()
            self.host.append(1e3 * (time.perf_counter() - start))

    def ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in self.events]
        return self.host


def capture(device: torch.device, step):
    """A CUDA graph of `step`, warmed up on a side stream first as torch asks."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def measure(model: LlamaShape, n: int, context: int, mode: str, steps: int, warmup: int) -> dict:
    s, device = model.shape, model.device

    def kv() -> list[torch.Tensor]:
        # Random like a real cache, so that finite logits at the end say the step computed something sane.
        return [torch.randn(n, s.kv_heads, context + 1, s.head_dim, device=device, dtype=model.dtype)
                for _ in range(s.layers)]

    k_cache, v_cache = kv(), kv()
    tokens = torch.randint(0, s.vocab, (n,), device=device)
    out = {}

    def step():
        out["logits"] = model.decode(tokens, context, k_cache, v_cache)

    run = step
    if mode == "graph":
        graph = capture(device, step)
        run = graph.replay
    for _ in range(warmup):
        run()
    timer = Timer(device, steps)
    for i in range(steps):
        timer.time(run, i)
    times = timer.ms()
    finite = bool(torch.isfinite(out["logits"]).all())
    return dict(step_ms=statistics.median(times), p10_ms=sorted(times)[len(times) // 10],
                p90_ms=sorted(times)[len(times) * 9 // 10], steps=len(times), logits_finite=finite)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default=None, help="running requests N (default 64,256; --tiny 4,16)")
    parser.add_argument("--context", type=int, default=None,
                        help="tokens of context a request (default 1024; --tiny 64)")
    parser.add_argument("--mode", choices=["graph", "eager", "both"], default=None,
                        help="CUDA graph replays (default), eager, or both (--tiny: eager)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps an N and mode")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--connector-us", default=CONNECTOR_US,
                        help=f"the connector's µs a step, N:µs,... (default {CONNECTOR_US}: docs/benchmarks.md)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, eager")
    args = parser.parse_args()

    shape = TINY if args.tiny else LLAMA_8B
    device = torch.device("cpu" if args.tiny else "cuda")
    running = [int(n) for n in (args.running or ("4,16" if args.tiny else "64,256")).split(",")]
    context = args.context or (64 if args.tiny else 1024)
    mode = args.mode or ("eager" if args.tiny else "graph")
    if device.type == "cpu" and mode != "eager":
        raise SystemExit("--mode graph needs CUDA")
    modes = ["graph", "eager"] if mode == "both" else [mode]
    connector = {int(n): float(us) for n, us in (item.split(":") for item in args.connector_us.split(",") if item)}

    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (--tiny)'}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; context {context} tokens a request", flush=True)
    # Strict on the CPU, where it is exact; on the GPU other kernels round otherwise, and
    # the one run there should still give its timings.
    cosine = selfcheck(device, strict=device.type == "cpu")
    print(f"self-check (tiny model, prefill against decode): cosine {cosine:.5f}"
          f"{'' if cosine > 0.999 else ' WARNING: below 0.999, the model code may be wrong'}", flush=True)
    model = LlamaShape(shape, device, torch.bfloat16)
    print(f"model {model.param_bytes() / 1e9:.2f} GB", flush=True)

    rows = []
    for n in running:
        kv_bytes = n * (context + 1) * shape.kv_bytes_per_token
        for m in modes:
            try:
                r = measure(model, n, context, m, args.steps, args.warmup)
            except RuntimeError as e:
                if m != "graph":
                    raise
                # One try on the GPU machine: a failed capture still leaves the eager numbers.
                print(f"N={n}: CUDA graph capture failed ({e}); measuring eager instead", flush=True)
                m = "eager (graph failed)"
                r = measure(model, n, context, "eager", args.steps, args.warmup)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the last N's cache and graph pool, before the next
            us = connector.get(n)
            r.update(running=n, mode=m, context=context, kv_bytes=kv_bytes, connector_us=us,
                     share=None if us is None else us / (1e3 * r["step_ms"]),
                     tokens_per_s=n / (r["step_ms"] / 1e3))
            rows.append(r)
            print(f"N={n} {m}: step {r['step_ms']:.3f} ms (p10 {r['p10_ms']:.3f}, p90 {r['p90_ms']:.3f}), "
                  f"KV read {kv_bytes / 2**30:.2f} GiB, logits finite {r['logits_finite']}", flush=True)

    print()
    print(f"Decode step, {'Llama-3.1-8B shape' if not args.tiny else 'tiny shape'}, context {context} tokens a "
          f"request, median of {args.steps} steps; connector µs from --connector-us")
    print()
    print("| running N | mode | step ms | p10 / p90 ms | KV a step | tokens/s | connector µs | connector share |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        share = "" if r["share"] is None else f"**{100 * r['share']:.2f}%**"
        us = "" if r["connector_us"] is None else f"{r['connector_us']:.1f}"
        print(f"| {r['running']} | {r['mode']} | {r['step_ms']:.3f} | {r['p10_ms']:.3f} / {r['p90_ms']:.3f} | "
              f"{r['kv_bytes'] / 2**30:.2f} GiB | {r['tokens_per_s']:.0f} | {us} | {share} |")
    if args.json:
        report = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (--tiny)",
                      torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      model="tiny" if args.tiny else "llama-3.1-8b shape", selfcheck_cosine=cosine, context=context,
                      connector_us_source="docs/benchmarks.md, bench/engine_overhead.py --calls (vLLM 0.32.0 CPU)",
                      rows=rows)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
