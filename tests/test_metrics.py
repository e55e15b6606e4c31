"""The daemon's Prometheus /metrics report exactly what a known sequence of jobs did."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.request

from conftest import subprocess_env, wait_until
from kvcache import attach_worker, make_kv_cache, namespace, prompt_keys
from prometheus_client.parser import text_string_to_metric_families

import kvdepot

BLOCK_BYTES = 16 * 1024


def metrics_url(daemon) -> str:
    return re.search(r"serving Prometheus metrics at (\S+)", daemon.log()).group(1)


# The token of the daemons that show per-namespace series (metrics_token_file).
METRICS_TOKEN = "metrics-s3cret"


def scrape(url: str, token: str | None = None, tls=None) -> dict:
    """{(sample name, frozenset of its labels): value}; `tls`: an ssl.SSLContext for https."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10, context=tls) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    return samples[name, frozenset(labels.items())]


def metrics_token_file(folder) -> str:
    path = folder / "metrics-token"
    path.write_text(METRICS_TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


def test_metrics_count_exactly_what_happened(start_held_daemon, client_factory, tmp_path):
    daemon = start_held_daemon(pool_size="128KiB", metrics_listen="127.0.0.1:0",  # 8 slots
                               metrics_token_file=metrics_token_file(tmp_path))
    url = metrics_url(daemon)
    client = client_factory(daemon, name="metrics-test")
    worker, engine, _ = attach_worker(client, seed=6)
    keys = prompt_keys(10, prompt=30)

    assert client.lookup(engine, keys).ready_blocks == 0          # 10 queried, 10 misses
    job = client.submit_store(worker, 1, keys[:6], list(range(6)))  # 6 stored
    assert client.wait([job], 10)[job].ok
    job = client.submit_store(worker, 2, keys[4:10], list(range(4, 10)))  # 2 already, 4 stored, 2 evicted
    assert client.wait([job], 10)[job].ok
    assert client.lookup(engine, keys).ready_blocks == 0          # keys[0:2] evicted: 10 misses
    assert client.lookup(engine, keys[2:]).ready_blocks == 8      # 8 queried, 8 hits
    job = client.submit_load(worker, 3, keys[2:5], [40, 41, 42])  # 3 loaded
    assert client.wait([job], 10)[job].ok

    m = scrape(url, METRICS_TOKEN)
    ns = {"namespace": engine.namespace_name, "scope": f"uid-{os.getuid()}"}
    hits = value(m, "kvdepot_lookup_blocks_total", result="hit")
    misses = value(m, "kvdepot_lookup_blocks_total", result="miss")
    assert (hits, misses) == (8, 20) and hits + misses == 10 + 10 + 8
    expected = {
        "lookups_total": 3,
        "stored_blocks_total": 10,
        "stored_bytes_total": 10 * BLOCK_BYTES,
        "loaded_blocks_total": 3,
        "loaded_bytes_total": 3 * BLOCK_BYTES,
        "evicted_blocks_total": 2,
    }
    for name, count in expected.items():
        assert value(m, "kvdepot_" + name) == count, name
        assert value(m, "kvdepot_namespace_" + name, **ns) == count, name
    assert value(m, "kvdepot_namespace_lookup_blocks_total", result="hit", **ns) == 8
    assert value(m, "kvdepot_namespace_lookup_blocks_total", result="miss", **ns) == 20
    assert value(m, "kvdepot_job_duration_seconds_count", kind="store") == 2
    assert value(m, "kvdepot_job_duration_seconds_count", kind="load") == 1
    assert value(m, "kvdepot_job_duration_seconds_bucket", kind="load", le="+Inf") == 1
    assert 0 < value(m, "kvdepot_job_duration_seconds_sum", kind="store") < 10
    assert all(v == 0 for (name, _), v in m.items() if name == "kvdepot_failed_jobs_total")
    assert value(m, "kvdepot_pool_capacity_bytes") == 8 * BLOCK_BYTES
    assert value(m, "kvdepot_pool_used_bytes") == 8 * BLOCK_BYTES
    assert value(m, "kvdepot_namespace_used_bytes", **ns) == 8 * BLOCK_BYTES
    assert value(m, "kvdepot_namespace_ready_blocks", **ns) == 8
    assert value(m, "kvdepot_pinned_slots") == 0
    assert value(m, "kvdepot_sessions") == 1 and value(m, "kvdepot_namespaces") == 1
    assert value(m, "kvdepot_open_ipc_mappings") == 0  # shared memory: nothing opened
    info = {"version": kvdepot.__version__, "instance": client.stats().daemon_instance, "eviction_policy": "lru"}
    assert value(m, "kvdepot_info", **info) == 1
    assert value(m, "kvdepot_metrics_snapshot_failures_total") == 0

    # A second client starts a store (its copy held in the daemon) and goes
    # away before the copy ends: the job fails, and its slots go back.
    leaver = client_factory(daemon, name="leaver")
    tensors, block_dim = make_kv_cache("per_layer", seed=9)
    other_worker = leaver.register_worker(namespace("per_layer"), rank=0, tensors=tensors, block_dim=block_dim)
    daemon.hold(1000)
    leaver.submit_store(other_worker, 1000, prompt_keys(2, prompt=31), [0, 1])  # evicts 2 more
    m = wait_until(lambda: scrape_when(url, "kvdepot_pinned_slots", 2), what="the leaver's store in flight")
    assert value(m, "kvdepot_pinned_slots") == 2 and value(m, "kvdepot_jobs_in_flight") == 1
    assert value(m, "kvdepot_sessions") == 2
    leaver.close(timeout=0)  # its store is held in flight: end the session now
    wait_until(lambda: sessions_ended(url, 1), what="the leaver's session to end")
    daemon.release(1000)
    m = wait_until(lambda: scrape_when(url, "kvdepot_jobs_in_flight", 0), what="the leaver's store to end")
    assert value(m, "kvdepot_failed_jobs_total", kind="store", reason="client_gone") == 1
    assert sum(v for (name, _), v in m.items() if name == "kvdepot_failed_jobs_total") == 1
    assert value(m, "kvdepot_namespace_failed_jobs_total", **ns) == 1
    assert value(m, "kvdepot_job_duration_seconds_count", kind="store") == 2  # failed jobs are not timed
    assert value(m, "kvdepot_sessions_ended_total") == 1
    assert value(m, "kvdepot_pinned_slots") == 0
    assert value(m, "kvdepot_evicted_blocks_total") == 4
    assert value(m, "kvdepot_namespace_ready_blocks", **ns) == 6
    assert value(m, "kvdepot_namespace_used_bytes", **ns) == 6 * BLOCK_BYTES
    assert value(m, "kvdepot_pool_used_bytes") == 6 * BLOCK_BYTES


def scrape_when(url: str, name: str, wanted: float) -> dict | None:
    """A scrape in which `name` is `wanted`, or None."""
    samples = scrape(url, METRICS_TOKEN)
    return samples if value(samples, name) == wanted else None


def sessions_ended(url: str, count: int) -> dict | None:
    """A scrape that shows `count` ended sessions, or None."""
    samples = scrape(url, METRICS_TOKEN)
    return samples if value(samples, "kvdepot_sessions_ended_total") == count else None


def tcp_ports(pid: int, state: str) -> list[int]:
    """Local ports of the process `pid`'s TCP sockets in `state` ("0A" listening, "01" established),
    by their socket inodes in /proc/net/tcp*; a port once per socket."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == state and fields[9] in inodes:
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def listening_tcp_ports(pid: int) -> set[int]:
    return set(tcp_ports(pid, "0A"))


def test_metrics_listen_none_serves_nothing(start_daemon):
    served = start_daemon(metrics_listen="127.0.0.1:0")
    port = int(metrics_url(served).rsplit(":", 1)[1].split("/")[0])
    assert listening_tcp_ports(served.proc.pid) == {port}  # what the check below would see
    daemon = start_daemon(metrics_listen="none")
    assert listening_tcp_ports(daemon.proc.pid) == set()
    assert "Prometheus" not in daemon.log()


def test_a_taken_metrics_port_stops_the_daemon_with_a_clear_message(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "kvdepot.server", "--listen", str(tmp_path / "s.sock"), "--pool-size", "4MiB",
             "--pin", "off", "--pool-dir", str(tmp_path), "--metrics-listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, env=subprocess_env(), timeout=60,
        )
    assert proc.returncode == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in proc.stderr and "--metrics-listen" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.glob("*.pool")) == [] and not (tmp_path / "s.sock").exists()


def test_a_metrics_address_without_a_port_is_a_configuration_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.server", "--listen", str(tmp_path / "s.sock"), "--metrics-listen", "9400"],
        capture_output=True, text=True, env=subprocess_env(), timeout=60,
    )
    assert proc.returncode == 2
    assert "metrics_listen: '9400' is not HOST:PORT" in proc.stderr
