"""Prefill a prompt, or load its KV cache from kvdepotd: which is faster, by how much,
and how close the load comes to the bus.

    python bench/prefill_vs_load.py [--tokens 1024,2048,4096,8192,16384,32768] [--json PATH]
    python bench/prefill_vs_load.py --tiny           # the whole flow on a CPU, tiny shapes
    python bench/prefill_vs_load.py --plot PATH.json [--out docs/prefill_vs_load.png]

For each prompt length, on one GPU:
1. Prefill: a model of Llama-3.1-8B's shape (bench/llama_shape.py: random bf16
   weights, 32 layers, GQA 32/8 heads, SwiGLU 14336) runs the prompt and writes
   every layer's K/V into a paged cache of vLLM's per-layer layout ([2, blocks,
   16, 8, 128] bf16 a layer, 16 tokens a block: 2 MiB a block). Median of
   --reps runs (fewer from 16k tokens), each ended by torch.cuda.synchronize.
2. Store: this process, registered as a CUDA worker of the real kvdepotd
   (started here), stores the prompt's blocks (submit to completion).
3. Load: a second process (spawned here; it never loads the model) with a
   freshly allocated cache of its own, registered as another worker, loads the
   same keys into its blocks: median of --load-reps loads, each submit to
   completion, its blocks zeroed before each. After every load, exact integer
   fingerprints of each page (sums of its 32-bit words, plain and weighted by
   position) must equal those of the prefill's cache: the copy is bit-exact.
4. The bus: the pinned H2D peak, best of --peak-reps 1 GiB pinned copies, before
   the prefills and again after the loads (best of all).

Reported per prompt: prefill ms, load ms, KV bytes, the ceiling ratio
prefill / (KV bytes / peak H2D) (how much faster a load at the bus's speed is
than the prefill), the achieved ratio prefill / load, and achieved / ceiling
(the load's share of the bus; issue 16's target is 0.9 or more).

--tiny runs the same code on the CPU: tiny shapes (bench/llama_shape.py TINY),
the shared-memory transport (the daemon copies for CPU workers), an unpinned
pool; the "peak" is then a host memcpy. Only the device and the shapes differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from kvdepotd import BenchDaemon  # noqa: E402
from llama_shape import LLAMA_8B, TINY, LlamaShape, selfcheck  # noqa: E402

from kvdepot.client import KVDepotClient  # noqa: E402

REPLY = "@@reply "


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def namespace(shape) -> dict:
    model = "bench-prefill-llama-8b" if shape == LLAMA_8B else "bench-prefill-tiny"
    return dict(model=model, kv_dtype="bfloat16", block_size=shape.block_size, layout="per_layer", tp_size=1)


def make_cache(shape, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """vLLM's per-layer layout: one [2, num_blocks, block_size, kv_heads, head_dim] tensor a layer."""
    return [torch.zeros(2, num_blocks, shape.block_size, shape.kv_heads, shape.head_dim, dtype=torch.bfloat16,
                        device=device) for _ in range(shape.layers)]


def fingerprints(cache: list[torch.Tensor], block_ids: list[int]) -> list[str]:
    """One digest a layer of the pages of `block_ids`: sha256 of each page's sum
    of its 32-bit words and of their sum weighted by position, computed on the
    device in int64 (exact). Any changed word, or a page copied to the wrong
    block, changes them; cheap enough on the GPU to check every load."""
    ids = torch.tensor(block_ids, device=cache[0].device)
    digests = []
    for layer in cache:
        words = layer.index_select(1, ids).contiguous().view(torch.int32).view(2, len(block_ids), -1).to(torch.int64)
        weights = torch.arange(1, words.shape[-1] + 1, device=words.device, dtype=torch.int64)
        sums = torch.stack([words.sum(-1), (words * weights).sum(-1)], dim=-1)
        digests.append(hashlib.sha256(sums.cpu().numpy().tobytes()).hexdigest())
    return digests


def peak_h2d(device: torch.device, reps: int, nbytes: int) -> float:
    """Best rate (GB/s) of `reps` copies of `nbytes` from pinned host memory to the
    device; on the CPU a plain memcpy between two host buffers."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    target.copy_(host)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        target.copy_(host, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - start)
    del host, target
    return nbytes / best / 1e9


# ------------------------------------------------------------ the loading process


def loader(args) -> int:
    """The second process: a worker with a cache of its own and no model. Reads
    one JSON request a line on stdin, answers one line on stdout after REPLY."""
    shape = TINY if args.tiny else LLAMA_8B
    device = torch.device("cpu" if args.tiny else "cuda")
    cache = make_cache(shape, args.num_blocks, device)
    client = KVDepotClient(args.socket, name="bench-loader").connect(60)
    ns = namespace(shape)
    worker = client.register_worker(ns, rank=0, tensors=cache, block_dim=1)
    engine = client.register_engine(ns)
    job = 0

    def reply(**fields) -> None:
        print(REPLY + json.dumps(fields), flush=True)

    reply(ready=True, pid=os.getpid())
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        keys = [bytes.fromhex(k) for k in request["keys"]]
        block_ids = request["block_ids"]
        ready = client.lookup(engine, keys).ready_blocks
        times, exact = [], []
        # One load more than timed: the first also opens what the daemon opens lazily.
        ids = torch.tensor(block_ids, device=device)
        for rep in range(request["reps"] + 1):
            for layer in cache:
                layer.index_fill_(1, ids, 0)
            sync(device)
            job += 1
            start = time.perf_counter()
            client.submit_load(worker, job, keys, block_ids)
            result = client.wait([job], timeout=120)[job]
            elapsed = time.perf_counter() - start
            if not result.ok:
                reply(error=f"load failed: {result.error}")
                break
            sync(device)
            exact.append(fingerprints(cache, block_ids) == request["fingerprints"])
            if rep:
                times.append(elapsed)
        else:
            reply(ready_blocks=ready, times=times, exact=exact)
    client.close()
    return 0


class Loader:
    def __init__(self, args, socket: str, num_blocks: int):
        command = [sys.executable, str(Path(__file__).resolve()), "--loader", "--socket", socket,
                   "--num-blocks", str(num_blocks)] + (["--tiny"] if args.tiny else [])
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                answer = json.loads(line[len(REPLY):])
                if "error" in answer:
                    raise RuntimeError(f"loader: {answer['error']}")
                return answer
        raise RuntimeError(f"the loading process ended (exit status {self.proc.wait()})")

    def load(self, keys, block_ids, digests, reps: int) -> dict:
        request = dict(keys=[k.hex() for k in keys], block_ids=block_ids, fingerprints=digests, reps=reps)
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()


# ------------------------------------------------------------ the run


def run(args) -> dict:
    shape = TINY if args.tiny else LLAMA_8B
    device = torch.device("cpu" if args.tiny else "cuda")
    token_counts = [int(t) for t in args.tokens.split(",")]
    if any(t % shape.block_size for t in token_counts):
        raise SystemExit(f"--tokens: each a multiple of {shape.block_size} (whole blocks)")
    num_blocks = max(token_counts) // shape.block_size
    needed = sum(token_counts) // shape.block_size * shape.block_bytes
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (--tiny)'}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, copy mode "
          f"{os.environ.get('KVDEPOT_COPY_MODE', 'dma')}; every prompt's blocks: {needed / 2**30:.2f} GiB "
          f"(--pool-size {args.pool_size})", flush=True)

    # The daemon pins its pool while the model is built.
    daemon = BenchDaemon(args.pool_size, shape.block_bytes, pin="off" if args.tiny else "on", pool_dir=args.pool_dir,
                         extra=["--metrics-listen", "none"])
    socket = daemon.socket
    loader_proc = None
    with daemon:
        try:
            # Strict on the CPU, where it is exact; on the GPU other kernels round otherwise, and
            # the one run there should still give its timings.
            cosine = selfcheck(device, strict=device.type == "cpu")
            print(f"self-check (tiny model, prefill against decode): cosine {cosine:.5f}"
                  f"{'' if cosine > 0.999 else ' WARNING: below 0.999, the model code may be wrong'}", flush=True)
            model = LlamaShape(shape, device, torch.bfloat16, mlp_chunk=args.mlp_chunk)
            cache = make_cache(shape, num_blocks, device)
            print(f"model {model.param_bytes() / 1e9:.2f} GB, paged KV cache {num_blocks} blocks "
                  f"({num_blocks * shape.block_bytes / 2**30:.2f} GiB)", flush=True)
            peak_bytes = (1 << 30) if not args.tiny else (64 << 20)
            peaks = [peak_h2d(device, args.peak_reps, peak_bytes)]
            print(f"peak H2D, best of {args.peak_reps} x {peak_bytes >> 20} MiB: {peaks[0]:.1f} GB/s", flush=True)

            daemon.wait_ready()
            loader_proc = Loader(args, socket, num_blocks)
            client = KVDepotClient(socket, name="bench-prefill").connect(60)
            worker = client.register_worker(namespace(shape), rank=0, tensors=cache, block_dim=1)
            loader_proc.reply()  # registered

            generator = torch.Generator().manual_seed(0)
            rows, job = [], 0
            for n in token_counts:
                blocks = n // shape.block_size
                block_ids = list(range(blocks))
                tokens = torch.randint(0, shape.vocab, (n,), generator=generator).to(device)
                slots = torch.arange(n, device=device)  # blocks 0.. in order, as in a fresh engine

                out = {}

                def prefill(out=out, tokens=tokens, slots=slots):  # this iteration's, bound now
                    out["logits"] = model.prefill(tokens, cache, slots)
                    sync(device)

                prefill()  # warm-up: kernels' first launches, the allocator's growth
                reps = args.reps if n < 16384 else max(1, args.reps // 2 + 1)
                prefill_times = []
                for _ in range(reps):
                    start = time.perf_counter()
                    prefill()
                    prefill_times.append(time.perf_counter() - start)
                digests = fingerprints(cache, block_ids)

                keys = [os.urandom(32) for _ in block_ids]  # fresh: a store of stored keys copies nothing
                job += 1
                start = time.perf_counter()
                client.submit_store(worker, job, keys, block_ids)
                result = client.wait([job], timeout=120)[job]
                store_s = time.perf_counter() - start
                if not result.ok or result.not_stored or result.already_stored:
                    raise RuntimeError(f"store of {blocks} blocks: ok={result.ok} error={result.error!r} "
                                       f"not stored {result.not_stored}, already stored {result.already_stored}")

                loaded = loader_proc.load(keys, block_ids, digests, args.load_reps)
                row = dict(tokens=n, blocks=blocks, kv_bytes=blocks * shape.block_bytes,
                           prefill_ms=1e3 * statistics.median(prefill_times),
                           prefill_runs_ms=[1e3 * t for t in prefill_times], store_ms=1e3 * store_s,
                           load_ms=1e3 * statistics.median(loaded["times"]),
                           load_runs_ms=[1e3 * t for t in loaded["times"]],
                           logits_finite=bool(torch.isfinite(out["logits"]).all()),
                           ready_blocks=loaded["ready_blocks"], bit_exact=all(loaded["exact"]),
                           loads_checked=len(loaded["exact"]))
                rows.append(row)
                print(f"{n:>6} tokens: prefill {row['prefill_ms']:.1f} ms, store {row['store_ms']:.1f} ms, "
                      f"load {row['load_ms']:.2f} ms, bit-exact {row['bit_exact']} "
                      f"({row['loads_checked']} loads checked), ready in lookup {row['ready_blocks']}/{blocks}, "
                      f"logits finite {row['logits_finite']}",
                      flush=True)

            client.close()
            loader_proc.close()
            model = None  # its 16 GB, before the second peak measurement
            if device.type == "cuda":
                torch.cuda.empty_cache()
            peaks.append(peak_h2d(device, args.peak_reps, peak_bytes))
            print(f"peak H2D again after the loads: {peaks[1]:.1f} GB/s", flush=True)
        finally:
            if loader_proc is not None and loader_proc.proc.poll() is None:
                loader_proc.proc.kill()

    peak = max(peaks)
    for row in rows:
        ideal_s = row["kv_bytes"] / (peak * 1e9)
        row["ideal_load_ms"] = 1e3 * ideal_s
        row["ceiling_ratio"] = row["prefill_ms"] / row["ideal_load_ms"]
        row["achieved_ratio"] = row["prefill_ms"] / row["load_ms"]
        row["achieved_over_ceiling"] = row["achieved_ratio"] / row["ceiling_ratio"]
    return dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (--tiny)",
                torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                model="tiny" if args.tiny else "llama-3.1-8b shape", selfcheck_cosine=cosine, peak_h2d_gbps=peak,
                peak_h2d_runs_gbps=peaks,
                copy_mode=os.environ.get("KVDEPOT_COPY_MODE", "dma"), rows=rows)


def size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def table(report: dict) -> str:
    lines = [f"{report['device']}, torch {report['torch']}, {report['date']}; peak H2D {report['peak_h2d_gbps']:.1f} "
             "GB/s (best of the runs before and after)", "",
             "| tokens | KV bytes | prefill ms | load ms | ceiling ratio | achieved ratio | achieved / ceiling | "
             "bit-exact |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        lines.append(f"| {r['tokens']} | {size(r['kv_bytes'])} | {r['prefill_ms']:.1f} | {r['load_ms']:.2f} | "
                     f"{r['ceiling_ratio']:.1f} | {r['achieved_ratio']:.1f} | **{r['achieved_over_ceiling']:.2f}** | "
                     f"{'yes' if r['bit_exact'] else 'NO'} |")
    return "\n".join(lines)


def plot(path: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(path).read_text())
    rows = report["rows"]
    tokens = [r["tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(tokens, [r["prefill_ms"] for r in rows], "o-", label="prefill")
    left.plot(tokens, [r["load_ms"] for r in rows], "s-", label="load from kvdepotd")
    left.plot(tokens, [r["ideal_load_ms"] for r in rows], ":", color="gray",
              label=f"load at the H2D peak ({report['peak_h2d_gbps']:.1f} GB/s)")
    left.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms", title="Time to a prompt's KV cache")
    right.plot(tokens, [r["ceiling_ratio"] for r in rows], ":", color="gray", label="ceiling: prefill / (bytes / peak)")
    right.plot(tokens, [r["achieved_ratio"] for r in rows], "s-", label="achieved: prefill / load")
    right.set(xscale="log", ylim=(0, None), xlabel="prompt tokens", ylabel="times faster than prefill",
              title="Load against prefill")
    for ax in (left, right):
        ax.set_xticks(tokens, [f"{t // 1024}k" if t >= 1024 else str(t) for t in tokens])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['model']}, {report['device']}, torch {report['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=None, help="prompt lengths (default 1024,...,32768; --tiny 64,...,512)")
    parser.add_argument("--reps", type=int, default=5, help="timed prefills a prompt (about half from 16k tokens)")
    parser.add_argument("--load-reps", type=int, default=7, help="timed loads a prompt")
    parser.add_argument("--peak-reps", type=int, default=10, help="1 GiB pinned copies in each peak measurement")
    parser.add_argument("--mlp-chunk", type=int, default=8192, help="tokens of one MLP chunk in the prefill")
    parser.add_argument("--pool-size", default=None, help="the daemon's pool (default 12GiB; --tiny 64MiB)")
    parser.add_argument("--pool-dir", default=None, help="the daemon's --pool-dir (default: a folder in /dev/shm)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes on the CPU, through the shared-memory transport")
    parser.add_argument("--plot", metavar="JSON", help="only draw --out from a --json file of an earlier run")
    parser.add_argument("--out", default=str(REPO / "docs" / "prefill_vs_load.png"), help="--plot's picture")
    parser.add_argument("--loader", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--num-blocks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.out)
        return 0
    if args.loader:
        return loader(args)
    args.tokens = args.tokens or ("64,128,256,512" if args.tiny else "1024,2048,4096,8192,16384,32768")
    args.pool_size = args.pool_size or ("64MiB" if args.tiny else "12GiB")
    report = run(args)
    print()
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(r["bit_exact"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
