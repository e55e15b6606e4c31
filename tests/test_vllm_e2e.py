"""End to end with real vLLM (CPU build): LLM() and the OpenAI server with KVDepotConnector.

Each vLLM run is a subprocess (tests/vllm_generate.py), one at a time. Greedy
output with the connector must be token for token the output without it, and
the daemon's counters show where the KV came from.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import kvcache
import pytest
import vllm_harness as h
from conftest import REPO, subprocess_env, wait_until
from prometheus_client.parser import text_string_to_metric_families
from vllm_generate import kvdepot_kv_transfer_config, make_prompts, openai_server_argv, vllm_env

from kvdepot.client import KVDepotClient

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GENERATE = str(REPO / "tests" / "vllm_generate.py")
# Blocks of the tiny model at vLLM's CPU block size (32 tokens): 2 layers x 32 KiB.
DAEMON_OPTIONS = {"pool_size": "64MiB", "slot_size": "64KiB"}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model():
    return h.make_tiny_model()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    # 4 prompts of 200 tokens, the first 64 shared: 6 whole blocks each.
    path.write_text(json.dumps(make_prompts(4, 200, seed=7, shared_prefix=64)))
    return path


def generate(model, prompts, workdir: Path, *options: str, timeout: float = 600, cwd: Path | None = None) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "out.json"
    argv = [sys.executable, GENERATE, "--model", model, "--prompts", str(prompts), "--out", str(out)]
    argv += ["--max-tokens", str(MAX_TOKENS), *options]
    env = vllm_env(workdir, base=subprocess_env())
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    (workdir / "vllm.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"vLLM run failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}"
    return json.loads(out.read_text())


def with_kvdepot(daemon) -> list[str]:
    return ["--kv-transfer-config", json.dumps(kvdepot_kv_transfer_config(socket=daemon.socket))]


def totals(daemon):
    with KVDepotClient(daemon.socket, name="test-stats") as client:
        return client.connect(10).stats().totals


@pytest.fixture(scope="module")
def baseline(model, prompts, tmp_path_factory):
    """The outputs without any connector."""
    return generate(model, prompts, tmp_path_factory.mktemp("baseline"))["rounds"][0]["outputs"]


def test_second_round_after_reset_loads_from_kvdepot(model, prompts, baseline, start_daemon, tmp_path):
    daemon = start_daemon(**DAEMON_OPTIONS)
    result = generate(model, prompts, tmp_path / "run", "--repeat-after-reset", *with_kvdepot(daemon))
    first, second = result["rounds"]
    assert first["outputs"] == baseline
    assert second["outputs"] == baseline
    # Round 2 found its prompts in kvdepot, not in vLLM's reset prefix cache:
    # 6 whole blocks of each 200-token prompt.
    assert second["num_cached_tokens"] == [192] * 4
    stats = totals(daemon)
    assert stats.loaded_blocks >= 4 * 6 - 2 * 3  # the shared 2 blocks may come from the GPU cache
    assert stats.hit_blocks > 0


def test_vllms_own_metrics_show_the_connectors_counters(model, prompts, start_daemon, tmp_path):
    daemon = start_daemon(**DAEMON_OPTIONS)
    metrics = tmp_path / "metrics.txt"
    result = generate(model, prompts, tmp_path / "run", "--repeat-after-reset", "--metrics-out", str(metrics),
                      *with_kvdepot(daemon))
    assert result["rounds"][1]["num_cached_tokens"] == [192] * 4
    samples = {
        sample.name.removeprefix("vllm:"): sample.value
        for family in text_string_to_metric_families(metrics.read_text())
        for sample in family.samples
        if sample.labels.get("engine") == "0"
    }
    counted = {name.removeprefix("kvdepot_"): v for name, v in samples.items() if name.startswith("kvdepot_")}
    block = 32
    # Each request is looked up once a round, past what vLLM's own prefix
    # cache holds, and each hit is loaded: what vLLM counted as tokens from
    # the connector is the connector's hit blocks. This CPU engine loads
    # synchronously (sync_loads): requests 2 to 4, scheduled in the step of
    # request 1's load, find their shared 2 blocks in vLLM's prefix cache at
    # once (loaded before that step's forward pass) and wait for nothing.
    assert counted["lookups_total"] == 8
    assert counted["lookup_hit_blocks_total"] * block == samples["external_prefix_cache_hits_total"] > 0
    queried = 8 * 6 - samples["prefix_cache_hits_total"] / block
    assert counted["lookup_hit_blocks_total"] + counted["lookup_miss_blocks_total"] == queried
    assert counted["load_jobs_total"] == 4 and counted["load_failures_total"] == 0
    assert counted["store_jobs_total"] >= 1 and counted["store_failures_total"] == 0
    assert counted["deferrals_total"] == 0
    # The daemon counted the same lookups, from the connector's reports, and loaded every hit.
    stats = totals(daemon)
    assert (stats.lookups, stats.hit_blocks, stats.miss_blocks) == (
        counted["lookups_total"], counted["lookup_hit_blocks_total"], counted["lookup_miss_blocks_total"]
    )
    assert stats.loaded_blocks == counted["lookup_hit_blocks_total"]


def test_a_new_engine_process_gets_the_blocks_of_one_that_exited(model, prompts, baseline, start_daemon, tmp_path):
    daemon = start_daemon(**DAEMON_OPTIONS)
    first = generate(model, prompts, tmp_path / "first", *with_kvdepot(daemon))
    assert first["rounds"][0]["outputs"] == baseline
    loaded_before = totals(daemon).loaded_blocks
    second = generate(model, prompts, tmp_path / "second", *with_kvdepot(daemon))
    assert second["rounds"][0]["outputs"] == baseline
    assert second["rounds"][0]["num_cached_tokens"] == [192] * 4
    assert totals(daemon).loaded_blocks > loaded_before


def dram_tier(daemon):
    with KVDepotClient(daemon.socket, name="test-stats") as client:
        [tier] = [t for t in client.connect(10).stats().tiers if t.name == "dram"]
        return tier


@pytest.mark.parametrize("restart", ["sigterm", "kill_9"])
def test_a_new_engine_process_gets_the_blocks_across_a_daemon_restart(
    model, prompts, baseline, start_daemon, tmp_path, restart
):
    daemon = start_daemon(**DAEMON_OPTIONS)
    first = generate(model, prompts, tmp_path / "first", *with_kvdepot(daemon))
    assert first["rounds"][0]["outputs"] == baseline
    stored = totals(daemon).stored_blocks
    assert stored == 2 + 4 * 4  # 6 whole blocks a prompt, the first 2 shared
    if restart == "sigterm":
        assert daemon.stop() == 0  # seals what is still being sealed
    else:
        # kill -9 keeps only sealed records; sealing follows the stores by a moment.
        wait_until(lambda: dram_tier(daemon).written_shards >= stored, what=f"{stored} records sealed")
        daemon.kill()
    daemon.start()
    assert f"adopted {stored} block(s) ({stored} slots)" in daemon.log()
    tier = dram_tier(daemon)
    assert tier.recovered_shards == stored and dict(tier.discarded) == {}
    second = generate(model, prompts, tmp_path / "second", *with_kvdepot(daemon))
    assert second["rounds"][0]["outputs"] == baseline
    assert second["rounds"][0]["num_cached_tokens"] == [192] * 4
    # The counters started at 0 with this daemon: what it loaded, it adopted.
    stats = totals(daemon)
    assert stats.hit_blocks > 0 and stats.stored_blocks == 0
    assert stats.loaded_blocks >= 4 * 6 - 2 * 3  # the shared 2 blocks may come from vLLM's own cache


def tier(daemon, name: str):
    with KVDepotClient(daemon.socket, name="test-stats") as client:
        [found] = [t for t in client.connect(10).stats().tiers if t.name == name]
        return found


# 32 slots of 64 KiB (one block of the tiny model each): room for a step's
# store job (24 blocks: each prompt's 6, the shared 2 among them) and the 18
# blocks the prompts store, which other blocks then push out to disk.
SMALL_POOL_SLOTS = 32


def ready_blocks_of_the_model(daemon, model: str) -> int:
    """Blocks of the model's namespace in DRAM (a namespace that holds none
    and no engine uses is gone from the stats)."""
    name = f"/{Path(model).name}@"
    with KVDepotClient(daemon.socket, name="test-stats") as client:
        return sum(ns.ready_blocks for ns in client.connect(10).stats().namespaces if name in ns.name)


def test_a_new_engine_process_gets_the_blocks_back_from_disk(model, prompts, baseline, start_daemon, tmp_path):
    daemon = start_daemon(
        pool_size=f"{SMALL_POOL_SLOTS * 64}KiB", slot_size="64KiB", disk_dir=str(tmp_path / "disk"), disk_size="64MiB"
    )
    first = generate(model, prompts, tmp_path / "first", *with_kvdepot(daemon))
    assert first["rounds"][0]["outputs"] == baseline
    stored = totals(daemon).stored_blocks
    assert stored == 2 + 4 * 4  # 6 whole blocks a prompt, the first 2 shared
    assert ready_blocks_of_the_model(daemon, model) == stored
    # Written behind to disk, every one; then a pool's worth of another
    # model's blocks evicts them all from DRAM.
    wait_until(lambda: tier(daemon, "disk").written_shards >= stored, what=f"{stored} blocks on disk")
    with KVDepotClient(daemon.socket, name="test-filler") as client:
        worker, _, _ = kvcache.attach_worker(client.connect(10), seed=1)
        keys = kvcache.prompt_keys(SMALL_POOL_SLOTS, prompt=99)
        job = client.submit_store(worker, 1, keys, list(range(SMALL_POOL_SLOTS)))
        assert client.wait([job], 30)[job].ok
    assert ready_blocks_of_the_model(daemon, model) == 0
    assert tier(daemon, "disk").shards >= stored
    second = generate(model, prompts, tmp_path / "second", *with_kvdepot(daemon))
    assert second["rounds"][0]["outputs"] == baseline
    # Every prompt's 6 whole blocks were served, promoted from disk while the
    # requests waited ("not yet"), none computed again.
    assert second["rounds"][0]["num_cached_tokens"] == [192] * 4
    with KVDepotClient(daemon.socket, name="test-stats") as client:
        stats = client.connect(10).stats()
    [disk] = [t for t in stats.tiers if t.name == "disk"]
    summary = f"disk {disk}totals {stats.totals}"
    assert disk.promotions >= stored and disk.failed_promotions == 0, summary
    # DRAM held none of them: every block loaded came up from disk, once.
    assert stats.totals.disk_hit_blocks == stored, summary
    assert stats.totals.failed_jobs == 0, summary


def test_a_run_whose_last_step_completes_a_block_leaves_it_stored_at_exit(model, prompts, start_daemon, tmp_path):
    # 200 prompt tokens and 25 generated: the last step computes token 224's
    # KV and completes block 7, whose store is still queued when the process
    # exits (the worker flushes it at shutdown, outside vLLM's steps).
    daemon = start_daemon(**DAEMON_OPTIONS)
    first = generate(model, prompts, tmp_path / "first", "--max-tokens", "25", *with_kvdepot(daemon))
    log = (tmp_path / "first" / "vllm.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    stats = totals(daemon)
    assert stats.failed_jobs == 0
    assert stats.stored_blocks == 2 + 4 * 5  # 7 whole blocks a sequence, the first 2 shared
    # A second process continues each conversation: all 7 blocks load.
    longer = tmp_path / "longer.json"
    prompt_list = json.loads(prompts.read_text())
    longer.write_text(json.dumps([p + out for p, out in zip(prompt_list, first["rounds"][0]["outputs"])]))
    second = generate(model, longer, tmp_path / "second", "--max-tokens", "1", *with_kvdepot(daemon))
    assert second["rounds"][0]["num_cached_tokens"] == [7 * 32] * 4


def test_killing_the_daemon_mid_run_changes_no_output(model, prompts, baseline, start_daemon, tmp_path):
    daemon = start_daemon(**DAEMON_OPTIONS)
    pid_file = tmp_path / "daemon.pid"
    pid_file.write_text(str(daemon.proc.pid))
    result = generate(
        model, prompts, tmp_path / "run", "--repeat-after-reset", "--kill-pid-file", str(pid_file),
        "--kill-after-requests", "5", *with_kvdepot(daemon),
    )  # fmt: skip
    assert result["killed_pid"] == daemon.proc.pid
    first, second = result["rounds"]
    assert first["outputs"] == baseline and second["outputs"] == baseline
    # Request 5 (round 2's first) was served from kvdepot; after the kill,
    # the others were computed.
    assert second["num_cached_tokens"][0] == 192
    assert daemon.proc.wait(10) != 0


def test_one_daemon_outage_reads_as_one_warning_in_vllms_format(model, prompts, baseline, start_daemon, tmp_path):
    daemon = start_daemon(**DAEMON_OPTIONS)
    workdir, pause = tmp_path / "run", tmp_path / "pause"
    workdir.mkdir()
    out = workdir / "out.json"
    argv = [sys.executable, GENERATE, "--model", model, "--prompts", str(prompts), "--out", str(out),
            "--max-tokens", str(MAX_TOKENS), "--pause-dir", str(pause), "--pause-after-requests", "2",
            *with_kvdepot(daemon)]
    # An in-process engine: the scheduler's and the worker's clients share one process.
    proc = subprocess.Popen(argv, env=vllm_env(workdir, base=subprocess_env()), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (pause / "paused-2").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach its pause"
            time.sleep(0.1)
        daemon.kill()
        time.sleep(1.0)  # both clients notice
        daemon.start()
        time.sleep(4.0)  # and reconnect (backoff at most 2 s)
        (pause / "resume-2").touch()
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    assert json.loads(out.read_text())["rounds"][0]["outputs"] == baseline
    lines = output.splitlines()
    vllm_format = re.compile(r"\(\S+ pid=\d+\) (INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+\] ")
    gone = [line for line in lines if "is not available" in line]
    back = [line for line in lines if "reconnected to kvdepotd" in line]
    policy = [line for line in lines if "kvdepot: kv_load_failure_policy" in line]
    assert len(gone) == 1 and len(back) == 1, "\n".join(gone + back)
    assert len(policy) == 1, output[-4000:]  # an INFO line: it appears at vLLM's default level
    for line in gone + back + policy:
        assert vllm_format.search(line), line
    assert "Locally cancelled" not in output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_serves_completions_through_the_connector(model, start_daemon, tmp_path):
    daemon = start_daemon(**DAEMON_OPTIONS)
    port = free_port()
    argv = openai_server_argv(model, port, kvdepot_kv_transfer_config(socket=daemon.socket))
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(argv, env=vllm_env(tmp_path, base=subprocess_env()), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        body = {"model": model, "prompt": make_prompts(1, 150, seed=3)[0], "max_tokens": 8, "temperature": 0}
        answers = []
        for _ in range(2):
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as r:
                assert r.status == 200
                answers.append(json.loads(r.read())["choices"][0]["text"])
        assert answers[0] == answers[1]
        # 150 tokens: 4 whole blocks of 32 went to kvdepot.
        deadline = time.monotonic() + 30
        while totals(daemon).stored_blocks < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert totals(daemon).stored_blocks >= 4
        # The connector's counters in the server's own /metrics, sent over from
        # the engine-core process: the first request missed its 4 blocks; the
        # second found them in vLLM's prefix cache, past which nothing was left to look up.
        deadline = time.monotonic() + 30
        while (counted := connector_metrics(port)).get("store_jobs_total", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert counted["lookups_total"] == 1 and counted["lookup_miss_blocks_total"] == 4
        assert counted["lookup_hit_blocks_total"] == 0 and counted["store_jobs_total"] >= 1
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def connector_metrics(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        sample.name.removeprefix("vllm:kvdepot_"): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("vllm:kvdepot_")
    }


def test_two_models_under_one_relative_path_share_nothing_and_one_model_under_two_paths_shares(
    model, prompts, baseline, start_daemon, tmp_path
):
    # What a fixed mount point like /models/model does: two models of the same
    # shape with other weights, each started as `--model model` from its own folder.
    a, b = tmp_path / "a", tmp_path / "b"
    h.make_tiny_model(a / "model")
    h.make_tiny_model(b / "model", seed=1)
    b_plain = generate("model", prompts, tmp_path / "b-plain", cwd=b)["rounds"][0]["outputs"]
    assert b_plain != baseline  # other weights, other tokens
    daemon = start_daemon(**DAEMON_OPTIONS)
    first = generate("model", prompts, tmp_path / "a-rel", *with_kvdepot(daemon), cwd=a)
    assert first["rounds"][0]["outputs"] == baseline
    # The same files by their absolute path: the blocks are shared.
    second = generate(str(a / "model"), prompts, tmp_path / "a-abs", *with_kvdepot(daemon), cwd=tmp_path)
    assert second["rounds"][0]["outputs"] == baseline
    assert second["rounds"][0]["num_cached_tokens"] == [192] * 4
    hits = totals(daemon).hit_blocks
    # The other model under the same relative path finds none of them.
    other = generate("model", prompts, tmp_path / "b-rel", *with_kvdepot(daemon), cwd=b)
    assert other["rounds"][0]["outputs"] == b_plain
    # At most the prompts' shared prefix, from vLLM's own cache in that process.
    assert all(n <= 64 for n in other["rounds"][0]["num_cached_tokens"])
    assert totals(daemon).hit_blocks == hits
    with KVDepotClient(daemon.socket, name="test-stats") as client:
        names = sorted(ns.name for ns in client.connect(10).stats().namespaces)
    assert len(names) == 2 and all(name.startswith(f"uid-{os.getuid()}/model@w") for name in names), names
