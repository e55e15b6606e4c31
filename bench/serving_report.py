"""The serving benchmark's report (bench/serving_ttft.py): its results summarised per
workload and turn, printed as the tables of docs/benchmarks.md, and drawn as the plots
docs/serving_ttft_*.png. Pure functions of the results' JSON, so `serving_ttft.py
--from-json` can print and draw an earlier run again."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

CONFIGS = ("plain", "kvdepot", "restart")
WORKLOADS = ("chat", "system_prompt", "return")
LABELS = {"plain": "vLLM alone", "kvdepot": "vLLM + kvdepot", "restart": "vLLM + kvdepot, after an engine restart"}
COLORS = {"plain": "tab:gray", "kvdepot": "tab:blue", "restart": "tab:orange"}
# --disk-compare: the chat against a pool smaller than its working set, without and with the disk tier.
DISK_CONFIGS = ("plain", "dram", "disk")
DISK_LABELS = {"plain": "vLLM alone", "dram": "kvdepot, DRAM only", "disk": "kvdepot, DRAM + disk"}
DISK_COLORS = {"plain": "tab:gray", "dram": "tab:blue", "disk": "tab:green"}


def pct(values, q: float) -> float:
    from connector_overhead import pct as _pct

    return _pct(list(values), q)


def turn_of(name: str) -> int:
    return int(name.rsplit("-t", 1)[1])


def summarize(run: dict, workload: str) -> dict:
    data = run["workloads"][workload]
    reqs = data["requests"]
    ttft = [r["ttft_s"] * 1e3 for r in reqs]
    v, d = data["vllm"], data["daemon"]
    out_tokens = sum(len(r["output"]) for r in reqs)
    prompt_tokens = sum(r["prompt_tokens"] for r in reqs)
    row = {
        "requests": len(reqs),
        "ttft_p50_ms": pct(ttft, 0.5), "ttft_p90_ms": pct(ttft, 0.9), "ttft_mean_ms": statistics.fmean(ttft),
        "e2e_p50_ms": pct([r["e2e_s"] * 1e3 for r in reqs], 0.5),
        "wall_s": data["wall_s"],
        "requests_per_s": len(reqs) / data["wall_s"],
        "output_tokens_per_s": out_tokens / data["wall_s"],
        "prompt_tokens_per_s": prompt_tokens / data["wall_s"],
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r["num_cached_tokens"] for r in reqs),
        # vLLM's own prefix cache: of the prompt tokens it looked up, those it held.
        "vllm_hit_rate": v["prefix_cache_hits"] / v["prefix_cache_queries"] if v["prefix_cache_queries"] else 0.0,
        # Tokens the connector loaded, of those it was asked for (past vLLM's own hits).
        "connector_hit_rate": (v["external_prefix_cache_hits"] / v["external_prefix_cache_queries"]
                               if v["external_prefix_cache_queries"] else None),  # fmt: skip
        "vllm_counters": v,
        "daemon": d,
    }
    row["cached_share"] = row["cached_tokens"] / prompt_tokens
    if d and d.get("hit_blocks", 0) + d.get("miss_blocks", 0):
        row["daemon_hit_rate"] = d["hit_blocks"] / (d["hit_blocks"] + d["miss_blocks"])
    else:
        row["daemon_hit_rate"] = None
    return row


def by_turn(run: dict) -> list[dict]:
    turns: dict[int, list] = {}
    for r in run["workloads"]["chat"]["requests"]:
        turns.setdefault(turn_of(r["name"]), []).append(r)
    rows = []
    for t in sorted(turns):
        ttft = [r["ttft_s"] * 1e3 for r in turns[t]]
        rows.append({"turn": t, "n": len(ttft),
                     "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in turns[t]),
                     "cached_tokens_mean": statistics.fmean(r["num_cached_tokens"] for r in turns[t]),
                     "p50_ms": pct(ttft, 0.5), "p90_ms": pct(ttft, 0.9),
                     "mean_ms": statistics.fmean(ttft)})  # fmt: skip
    return rows


def system_split(run: dict) -> dict[str, list[float]]:
    """TTFT (ms) of each system prompt's first use, and of the uses after it."""
    seen, split = set(), {"first": [], "later": []}
    for r in run["workloads"]["system_prompt"]["requests"]:
        which = r["name"].rsplit("-p", 1)[1]
        split["later" if which in seen else "first"].append(r["ttft_s"] * 1e3)
        seen.add(which)
    return split


def plot(results: dict, folder: Path, title_suffix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    turns = None
    for config in CONFIGS:
        rows = results["by_turn"][config]
        turns = [r["turn"] for r in rows]
        ax.plot(turns, [r["p50_ms"] for r in rows], marker="o", color=COLORS[config], label=f"{LABELS[config]}, p50")
        ax.plot(turns, [r["p90_ms"] for r in rows], linestyle="--", color=COLORS[config], alpha=0.6,
                label="p90")  # fmt: skip
    tokens = [r["prompt_tokens_mean"] for r in results["by_turn"]["plain"]]
    ret = results["summary"]["return"]
    x_ret = turns[-1] + 1
    for config, row in ret.items():
        ax.plot([x_ret], [row["ttft_p50_ms"]], marker="*", markersize=11, linestyle="none", color=COLORS[config])
        ax.plot([x_ret], [row["ttft_p90_ms"]], marker="_", markersize=11, linestyle="none", color=COLORS[config])
    ax.axvline(x_ret - 0.5, color="black", linewidth=0.6, linestyle=":")
    ret_tokens = ret["plain"]["prompt_tokens"] / ret["plain"]["requests"]
    ax.set_xticks(turns + [x_ret], [f"{t + 1}\n{tok:.0f}" for t, tok in zip(turns, tokens)]
                  + [f"new msg.\nafter restart\n{ret_tokens:.0f}"])  # fmt: skip
    ax.set_xlabel("turn of the conversation / mean prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_ylim(0, 1.3 * max(ax.get_ylim()[1], 1))  # room for the legend above the lines
    ax.set_title(f"Multi-turn chat: TTFT by turn{title_suffix}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    path = _save(fig, folder / "serving_ttft_chat.png")
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    groups = ("first", "later")
    width = 0.26
    for i, config in enumerate(CONFIGS):
        split = results["system_split"][config]
        p50 = [pct(split[g], 0.5) for g in groups]
        p90 = [pct(split[g], 0.9) for g in groups]
        xs = [g + (i - 1) * width for g in range(len(groups))]
        ax.bar(xs, p50, width, color=COLORS[config], label=LABELS[config])
        ax.errorbar(xs, p50, yerr=[[0] * len(groups), [b - a for a, b in zip(p50, p90)]], fmt="none", ecolor="black",
                    capsize=3, linewidth=0.8)  # fmt: skip
    n_first = len(results["system_split"]["plain"]["first"])
    n_later = len(results["system_split"]["plain"]["later"])
    ax.set_xticks(range(len(groups)), [f"a system prompt's first request\nin the engine ({n_first})",
                                       f"the system prompt seen before\nin the engine ({n_later})"])  # fmt: skip
    ax.set_ylabel("time to first token (ms): p50, whisker to p90")
    ax.set_ylim(0, 1.3 * ax.get_ylim()[1])  # room for the legend
    ax.set_title(f"Long shared system prompts, short questions{title_suffix}", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper right")
    path = _save(fig, folder / "serving_ttft_system_prompt.png")
    written.append(path)
    return written


def fmt_rate(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def print_tables(results: dict) -> None:
    print("TTFT by turn of the multi-turn chat, ms (p50 / p90 over the conversations):\n")
    print("| turn | conversations | mean prompt tokens | " + " | ".join(LABELS[c] for c in CONFIGS) +
          " | mean tokens not computed (plain / kvdepot / restart) |")  # fmt: skip
    print("| --- " * (4 + len(CONFIGS)) + "|")
    rows = {c: results["by_turn"][c] for c in CONFIGS}
    for i, r in enumerate(rows["plain"]):
        cells = " | ".join(f"{rows[c][i]['p50_ms']:.0f} / {rows[c][i]['p90_ms']:.0f}" for c in CONFIGS)
        cached = " / ".join(f"{rows[c][i]['cached_tokens_mean']:.0f}" for c in CONFIGS)
        print(f"| {r['turn'] + 1} | {r['n']} | {r['prompt_tokens_mean']:.0f} | {cells} | {cached} |")
    print("\nSystem prompts, TTFT ms (p50 / p90):\n")
    print("| requests | " + " | ".join(LABELS[c] for c in CONFIGS) + " |")
    print("| --- " * (1 + len(CONFIGS)) + "|")
    for g, label in (("first", "a system prompt's first request in the engine"),
                     ("later", "a system prompt seen before")):
        cells = " | ".join(f"{pct(results['system_split'][c][g], 0.5):.0f} / "
                           f"{pct(results['system_split'][c][g], 0.9):.0f}" for c in CONFIGS)
        print(f"| {label} ({len(results['system_split']['plain'][g])}) | {cells} |")
    ret = results["summary"]["return"]
    print("\nEach conversation returns once more, with a new message (vLLM alone, and after the restart only):\n")
    print("| requests | mean prompt tokens | vLLM alone: TTFT p50 / p90 (ms) | "
          "after the restart: TTFT p50 / p90 (ms) | mean tokens not computed (plain / restart) |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| {ret['plain']['requests']} | {ret['plain']['prompt_tokens'] / ret['plain']['requests']:.0f} | "
          f"{ret['plain']['ttft_p50_ms']:.0f} / {ret['plain']['ttft_p90_ms']:.0f} | "
          f"{ret['restart']['ttft_p50_ms']:.0f} / {ret['restart']['ttft_p90_ms']:.0f} | "
          f"{ret['plain']['cached_tokens'] / ret['plain']['requests']:.0f} / "
          f"{ret['restart']['cached_tokens'] / ret['restart']['requests']:.0f} |")  # fmt: skip
    print("\nOverall:\n")
    print("| workload | configuration | requests | TTFT p50 (ms) | TTFT p90 (ms) | TTFT mean (ms) | requests/s | "
          "output tokens/s | prompt tokens/s | prompt tokens not computed | vLLM prefix-cache hits | "
          "connector hits | daemon block hits |")  # fmt: skip
    print("| --- " * 13 + "|")
    for workload in WORKLOADS:
        for c, s in results["summary"][workload].items():
            print(f"| {workload} | {LABELS[c]} | {s['requests']} | {s['ttft_p50_ms']:.0f} | {s['ttft_p90_ms']:.0f} | "
                  f"{s['ttft_mean_ms']:.0f} | {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} | "
                  f"{s['prompt_tokens_per_s']:.0f} | {fmt_rate(s['cached_share'])} | {fmt_rate(s['vllm_hit_rate'])} | "
                  f"{fmt_rate(s['connector_hit_rate'])} | {fmt_rate(s['daemon_hit_rate'])} |")  # fmt: skip


def draw(results: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    suffix = f" (vLLM CPU build, {results['machine']['cores']} cores)"
    for path in plot(results, folder, suffix):
        print(f"plot {path} ({path.stat().st_size >> 10} KiB)", file=sys.stderr)


# ---------------------------------------------------------------------------
# --disk-compare
# ---------------------------------------------------------------------------


def tier_row(stats: dict) -> dict:
    """The daemon's stats after a run, flattened: totals and each tier's counters."""
    row = dict(stats["totals"])
    for tier in stats["tiers"]:
        for k, v in tier.items():
            if k != "name":
                row[f"{tier['name']}_{k}"] = v
    return row


def print_disk_tables(results: dict) -> None:
    configs = [c for c in DISK_CONFIGS if c in results["by_turn"]]
    w = results["workload"]
    print(f"TTFT by turn of the multi-turn chat, ms (p50 / p90 / mean over the conversations); working set "
          f"{w['working_set_blocks']} blocks ({w['working_set_bytes'] / 2**20:.0f} MiB in slots), pool "
          f"{w['pool_bytes'] / 2**20:.0f} MiB ({w['pool_bytes'] / w['working_set_bytes']:.2f} of it), disk tier "
          f"{w['disk_bytes'] / 2**20:.0f} MiB:\n")  # fmt: skip
    print("| turn | conversations | mean prompt tokens | " + " | ".join(DISK_LABELS[c] for c in configs) +
          " | mean tokens not computed (" + " / ".join(configs) + ") |")  # fmt: skip
    print("| --- " * (4 + len(configs)) + "|")
    rows = {c: results["by_turn"][c] for c in configs}
    for i, r in enumerate(rows[configs[0]]):
        cells = " | ".join(f"{rows[c][i]['p50_ms']:.0f} / {rows[c][i]['p90_ms']:.0f} / {rows[c][i]['mean_ms']:.0f}"
                           for c in configs)  # fmt: skip
        cached = " / ".join(f"{rows[c][i]['cached_tokens_mean']:.0f}" for c in configs)
        print(f"| {r['turn'] + 1} | {r['n']} | {r['prompt_tokens_mean']:.0f} | {cells} | {cached} |")
    print("\nOverall:\n")
    print("| configuration | requests | TTFT p50 (ms) | TTFT p90 (ms) | TTFT mean (ms) | chat wall (s) | "
          "prompt tokens not computed | connector hits | daemon block hits |")  # fmt: skip
    print("| --- " * 9 + "|")
    for c in configs:
        s = results["summary"]["chat"][c]
        print(f"| {DISK_LABELS[c]} | {s['requests']} | {s['ttft_p50_ms']:.0f} | {s['ttft_p90_ms']:.0f} | "
              f"{s['ttft_mean_ms']:.0f} | {s['wall_s']:.0f} | {fmt_rate(s['cached_share'])} | "
              f"{fmt_rate(s['connector_hit_rate'])} | {fmt_rate(s['daemon_hit_rate'])} |")  # fmt: skip
    print("\nThe daemons after the run (totals over the engine's life, warm-up included; tiers now):\n")
    keys = (("hit_blocks", "hit blocks"), ("miss_blocks", "miss blocks"), ("disk_hit_blocks", "disk hit blocks"),
            ("stored_blocks", "stored blocks"), ("stored_bytes", "stored bytes"), ("evicted_blocks", "evicted blocks"),
            ("dram_shards", "dram shards"), ("dram_capacity_bytes", "dram capacity"),
            ("disk_shards", "disk shards"), ("disk_bytes", "disk bytes"),
            ("disk_written_shards", "disk written shards"),
            ("disk_promotions", "promotions"), ("disk_failed_promotions", "failed promotions"),
            ("disk_evicted_shards", "disk evicted shards"), ("disk_direct_io", "O_DIRECT"))  # fmt: skip
    daemons = {c: tier_row(results["daemon_stats"][c]) for c in configs if c in results["daemon_stats"]}
    print("| daemon | " + " | ".join(label for _, label in keys) + " |")
    print("| --- " * (1 + len(keys)) + "|")
    for c, row in daemons.items():
        print(f"| {DISK_LABELS[c]} | " + " | ".join(str(row.get(k, "-")) for k, _ in keys) + " |")


def draw_disk(results: dict, folder: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    configs = [c for c in DISK_CONFIGS if c in results["by_turn"]]
    w = results["workload"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for config in configs:
        rows = results["by_turn"][config]
        turns = [r["turn"] for r in rows]
        ax.plot(turns, [r["p50_ms"] for r in rows], marker="o", color=DISK_COLORS[config],
                label=f"{DISK_LABELS[config]}, p50")  # fmt: skip
        ax.plot(turns, [r["p90_ms"] for r in rows], linestyle="--", color=DISK_COLORS[config], alpha=0.6, label="p90")
    tokens = [r["prompt_tokens_mean"] for r in results["by_turn"][configs[0]]]
    ax.set_xticks(turns, [f"{t + 1}\n{tok:.0f}" for t, tok in zip(turns, tokens)])
    ax.set_xlabel("turn of the conversation / mean prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_ylim(0, 1.3 * max(ax.get_ylim()[1], 1))  # room for the legend above the lines
    ax.set_title(f"Multi-turn chat, working set {w['working_set_bytes'] / 2**20:.0f} MiB: pool "
                 f"{w['pool_bytes'] / 2**20:.0f} MiB, + disk {w['disk_bytes'] / 2**20:.0f} MiB\n"
                 f"(vLLM CPU build, {results['machine']['cores']} cores)", fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    path = _save(fig, folder / "serving_ttft_disk.png")
    print(f"plot {path} ({path.stat().st_size >> 10} KiB)", file=sys.stderr)
    return path


def _save(fig, path):
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

