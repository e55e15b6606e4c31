"""The metrics port against a local user of another uid: it shows no tenant's
namespaces or counts without the metrics token, and connections held idle
cost the daemon a bounded number of threads and descriptors."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env, wait_until
from kvcache import attach_worker, prompt_keys
from test_metrics import METRICS_TOKEN, metrics_token_file, metrics_url, scrape, tcp_ports, value
from test_trust import as_uid, needs_second_uid

ATTACKER = str(Path(__file__).with_name("metrics_attacker.py"))
NOBODY = 65534


def attacker(*args: str) -> list[str]:
    return [*as_uid(NOBODY), sys.executable, ATTACKER, *args]


def scrape_as_nobody(url: str, token: str | None = None) -> tuple[int, str]:
    proc = subprocess.run(attacker("scrape", url, *([token] if token else [])), capture_output=True, text=True,
                          env=subprocess_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    status, _, body = proc.stdout.partition("\n")
    return int(status), body


def store_some(client_factory, daemon) -> str:
    """A tenant's namespace with lookups and stores; its name."""
    client = client_factory(daemon)
    worker, engine, _ = attach_worker(client, seed=6)
    keys = prompt_keys(4, prompt=60)
    client.lookup(engine, keys)
    job = client.submit_store(worker, 1, keys, list(range(4)))
    assert client.wait([job], 10)[job].ok
    return engine.namespace_name


@needs_second_uid
def test_a_scrape_without_the_metrics_token_sees_no_tenant(start_daemon, client_factory, tmp_path):
    daemon = start_daemon(metrics_listen="127.0.0.1:0", metrics_token_file=metrics_token_file(tmp_path))
    url = metrics_url(daemon)
    name = store_some(client_factory, daemon)
    model = name.split("/", 1)[1].split(":", 1)[0]

    status, body = scrape_as_nobody(url)
    assert status == 200
    assert model not in body and "kvdepot_namespace_" not in body and f"uid-{os.getuid()}" not in body
    # The node-wide series stay.
    assert "kvdepot_stored_blocks_total 4.0" in body and "kvdepot_pool_capacity_bytes" in body
    assert "kvdepot_namespaces 1.0" in body

    status, body = scrape_as_nobody(url, "a-guess")
    assert status == 401 and model not in body
    wait_until(lambda: "sent a wrong token" in daemon.log(), what="the wrong token in the log")

    # The operator's Prometheus, with the token, sees each namespace.
    samples = scrape(url, METRICS_TOKEN)
    ns = {"namespace": name, "scope": f"uid-{os.getuid()}"}
    assert value(samples, "kvdepot_namespace_stored_blocks_total", **ns) == 4
    assert value(samples, "kvdepot_namespace_lookup_blocks_total", result="miss", **ns) == 4


@needs_second_uid
def test_without_a_metrics_token_no_scrape_sees_a_tenant(start_daemon, client_factory):
    daemon = start_daemon(metrics_listen="127.0.0.1:0")
    url = metrics_url(daemon)
    name = store_some(client_factory, daemon)
    status, body = scrape_as_nobody(url)
    assert status == 200 and "kvdepot_namespace_" not in body and name.split("/", 1)[1] not in body
    assert "kvdepot_stored_blocks_total 4.0" in body
    assert scrape_as_nobody(url, METRICS_TOKEN)[0] == 401
    assert "per-namespace series: off" in daemon.log()


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def connections_to(pid: int, port: int) -> int:
    """The process's established TCP connections on its local `port`."""
    return tcp_ports(pid, "01").count(port)


@needs_second_uid
def test_idle_connections_to_the_metrics_port_are_capped_and_a_scrape_still_answers(start_daemon):
    cap = 8
    daemon = start_daemon(metrics_listen="127.0.0.1:0", metrics_max_connections=cap, metrics_timeout=3)
    url = metrics_url(daemon)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    pid = daemon.proc.pid
    scrape(url)
    before = threads(pid)

    idle = subprocess.Popen(attacker("idle", "127.0.0.1", str(port), "300", str(cap)), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        # All but `cap` of the 300 are closed at once, not held.
        assert idle.stdout.readline().split()[0] == "closed"
        assert connections_to(pid, port) <= cap
        # The closed ones' threads end as soon as they wake.
        wait_until(lambda: threads(pid) <= before + cap, what="at most one thread per connection left open")
        # A scrape still answers: it takes the place of an idle one.
        assert value(scrape(url), "kvdepot_pool_slots") == 256
        assert "closed a connection that sent no request" in daemon.log()
        # The idle ones left are closed by the timeout, and their threads end.
        idle.stdin.write("go\n")
        idle.stdin.flush()
        assert idle.stdout.readline().strip() == "all closed"
    finally:
        idle.stdin.close()
        idle.wait(30)
    wait_until(lambda: threads(pid) <= before, what="the metrics threads to end")
    assert connections_to(pid, port) == 0


def test_over_https_a_client_certificate_shows_each_tenant_and_none_shows_none(start_daemon, client_factory, tmp_path):
    from tls_certs import CA

    ca = CA(tmp_path)
    server_cert, server_key = ca.issue("kvdepotd", server=True)
    scraper_cert, scraper_key = ca.issue("prometheus")
    daemon = start_daemon(metrics_listen="127.0.0.1:0", metrics_tls_cert_file=server_cert,
                          metrics_tls_key_file=server_key, metrics_tls_client_ca_file=ca.path)
    url = metrics_url(daemon)
    assert url.startswith("https://")
    name = store_some(client_factory, daemon)

    anonymous = ssl.create_default_context(cafile=str(ca.path))
    samples = scrape(url, tls=anonymous)
    assert not [n for n, _ in samples if n.startswith("kvdepot_namespace_")]
    assert value(samples, "kvdepot_stored_blocks_total") == 4

    prometheus = ssl.create_default_context(cafile=str(ca.path))
    prometheus.load_cert_chain(scraper_cert, scraper_key)
    ns = {"namespace": name, "scope": f"uid-{os.getuid()}"}
    assert value(scrape(url, tls=prometheus), "kvdepot_namespace_stored_blocks_total", **ns) == 4

    # A certificate of another CA is no credential: the handshake fails.
    stranger = ssl.create_default_context(cafile=str(ca.path))
    stranger.load_cert_chain(*CA(tmp_path, name="another CA").issue("stranger"))
    with pytest.raises(OSError):  # an SSL error, a reset or a URLError, by when it is seen
        scrape(url, tls=stranger)
    # Nor is plain HTTP answered.
    with pytest.raises(OSError):  # an SSL error, a reset or a URLError, by when it is seen
        scrape(url.replace("https://", "http://"))
    assert value(scrape(url, tls=prometheus), "kvdepot_namespace_stored_blocks_total", **ns) == 4
