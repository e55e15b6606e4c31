"""Trust between tenants, against the real daemon: identity comes from the
kernel (the job socket's SO_PEERCRED), each uid is a tenant of its own unless
the configuration says otherwise, and a tenant's blocks are invisible to every
other tenant. The attacker runs as a second uid (nobody), so these tests need
root, as CI has."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from conftest import subprocess_env, wait_until
from kvcache import attach_worker, block_of, prompt_keys
from raw_client import RawSession

HERE = Path(__file__).resolve().parent
NOBODY = 65534

needs_second_uid = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to run a second uid"
)


def as_uid(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def start_shared(start_daemon, folder: Path, **options):
    daemon = start_daemon(folder=folder, **options)
    # What an operator does with a group; here every uid may connect.
    for path in (daemon.socket, daemon.socket + ".jobs"):
        os.chmod(path, 0o666)
    return daemon


def probe(daemon, stored: int, unstored: int, victim_namespace: str) -> dict:
    result = subprocess.run(
        [*as_uid(NOBODY), sys.executable, str(HERE / "tenant_probe.py"), daemon.socket, str(stored),
         str(unstored), victim_namespace],
        capture_output=True, text=True, timeout=60, env=subprocess_env(), cwd="/",
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def store_and_check(client, worker, tensors, prompt: int) -> None:
    keys = prompt_keys(4, prompt=prompt)
    job = client.submit_store(worker, 1, keys, [0, 1, 2, 3])
    assert client.wait([job], 10)[job].ok


# The other uid registers a CPU worker of its own: its poisoned store must stay its own.
@needs_second_uid
def test_another_tenant_can_neither_read_probe_poison_nor_clear_a_tenants_blocks(
    open_folder, start_daemon, client_factory
):
    daemon = start_shared(start_daemon, open_folder)
    victim = client_factory(daemon, name="victim")
    worker, engine, tensors = attach_worker(victim, seed=40)
    store_and_check(victim, worker, tensors, prompt=400)

    got = probe(daemon, stored=400, unstored=401, victim_namespace=worker.namespace_name)

    assert (got["uid"], got["tenant"], got["admin"]) == (NOBODY, f"uid-{NOBODY}", False)
    assert got["namespace_name"] != worker.namespace_name
    assert got["victim_blocks_seen"] == 0, "another tenant's lookup found the victim's blocks"
    assert got["register_shared_memory_worker"] == "OK"
    assert got["stats_namespaces"] == [got["namespace_name"]]
    assert got["stats_clients"] == []
    assert got["anonymous_stats"] == [0, 0, 0]
    # The DRAM's KV bytes and sizes count the probe's own 4 blocks, not the
    # victim's: with the used slots everyone sees, those would tell the
    # victim's block size (its model's shape) and how much it holds.
    [[block_bytes, namespaces, used]] = got["block_sizes"]
    assert (namespaces, used) == (1, 4) and got["kv_bytes"] == 4 * block_bytes
    assert got["anonymous_kv"] == [0, 0]
    assert got["clear_victim_namespace"] == "NOT_FOUND"
    assert got["clear_all"] == "PERMISSION_DENIED"
    assert got["clear_all_without_session"] == "PERMISSION_DENIED"
    # The victim's blocks are all there, with their bytes; the poisoned prompt is not.
    assert victim.lookup(engine, prompt_keys(4, prompt=401)).ready_blocks == 0
    assert victim.lookup(engine, prompt_keys(4, prompt=400)).ready_blocks == 4
    job = victim.submit_load(worker, 2, prompt_keys(4, prompt=400), [10, 11, 12, 13])
    assert victim.wait([job], 10)[job].ok
    for i in range(4):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 10 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16))
    # Root is an admin: it sees both tenants (the other's namespace, while it has blocks).
    names = {ns.name for ns in victim.stats().namespaces}
    assert names == {worker.namespace_name, got["namespace_name"]}


@needs_second_uid
def test_another_tenant_cannot_bring_a_tenants_blocks_up_from_disk(open_folder, start_daemon, client_factory):
    """The victim's blocks are on disk only (evicted from a small pool): the other
    uid's lookup of the same keys in the same model's namespace finds nothing
    and starts no promotion; the victim still gets its blocks back, bit-exact."""
    daemon = start_shared(start_daemon, open_folder, disk_dir=str(open_folder / "disk"), disk_size="32MiB")
    victim = client_factory(daemon, name="victim")
    worker, engine, tensors = attach_worker(victim, seed=41)
    store_and_check(victim, worker, tensors, prompt=410)
    saved = [t.clone() for t in tensors]

    def written_to_disk(shards: int):
        # A block the disk writer has not reached when it is evicted is dropped, not
        # kept: each round waits for the writer so that prompt 410 goes to disk.
        [disk] = [t for t in victim.stats().tiers if t.name == "disk"]
        return disk.written_shards >= shards

    wait_until(lambda: written_to_disk(4), what="the victim's blocks written to disk")
    for round_ in range(3):  # 384 blocks through a pool of 256: prompt 410 leaves DRAM
        job = victim.submit_store(worker, 10 + round_, prompt_keys(128, prompt=420 + round_), list(range(128)))
        assert victim.wait([job], 10)[job].ok
        if round_ == 0:
            wait_until(lambda: written_to_disk(132), what="the first round written to disk")
    keys = prompt_keys(4, prompt=410)
    wait_until(lambda: keys[0] in engine.lower, what="the victim's blocks on disk only")

    got = probe(daemon, stored=410, unstored=411, victim_namespace=worker.namespace_name)

    assert got["victim_blocks_seen"] == 0
    [disk] = [t for t in victim.stats().tiers if t.name == "disk"]
    assert disk.promotions == 0, "another tenant's lookup promoted the victim's blocks"
    wait_until(lambda: victim.cached_lookup(engine, keys).ready_blocks == 4, what="the victim's blocks promoted")
    job = victim.submit_load(worker, 2, keys, [100, 101, 102, 103])
    assert victim.wait([job], 10)[job].ok
    for i in range(4):
        for src, dst in zip(block_of(saved, "per_layer", i), block_of(tensors, "per_layer", 100 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16))


@needs_second_uid
def test_tenants_the_configuration_puts_in_one_sharing_group_share_blocks(open_folder, start_daemon, client_factory):
    config = open_folder / "kvdepot.toml"
    config.write_text(
        '[[tenant]]\nname = "serving"\nuids = [0]\nshare = "fleet"\n\n'
        f'[[tenant]]\nname = "batch"\nuids = [{NOBODY}]\nshare = "fleet"\n'
    )
    daemon = start_shared(start_daemon, open_folder, config=str(config))
    victim = client_factory(daemon, name="serving")
    worker, engine, tensors = attach_worker(victim, seed=41)
    store_and_check(victim, worker, tensors, prompt=410)

    got = probe(daemon, stored=410, unstored=411, victim_namespace=worker.namespace_name)

    assert (got["tenant"], got["admin"]) == ("batch", False)
    assert got["namespace_name"] == worker.namespace_name and worker.namespace_name.startswith("fleet/")
    assert got["victim_blocks_seen"] == 4
    assert got["stats_clients"] == ["serving"]
    # One group, one namespace: clearing it by name is allowed; everything is not.
    assert got["clear_victim_namespace"] == "OK" and got["clear_all"] == "PERMISSION_DENIED"


@needs_second_uid
def test_a_session_acts_only_after_its_hello_and_only_for_the_process_that_said_it(open_folder, start_daemon):
    daemon = start_shared(start_daemon, open_folder)
    unproven = RawSession(daemon.socket, hello=False)
    with pytest.raises(grpc.RpcError) as info:
        unproven.stub.GetStats(__import__("kvdepot.proto.kvdepot_pb2", fromlist=["pb"]).GetStatsRequest(
            session_id=unproven.id))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has not said hello on the job socket" in info.value.details()
    unproven.close()

    # A session whose job socket closed: another process that learned its id
    # (a leak) cannot take it over with a hello of its own.
    owner = RawSession(daemon.socket)
    owner.jobs.close()
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from raw_client import RawJobSocket; "
        "r = RawJobSocket(sys.argv[2]).hello(sys.argv[3]); print(r.refused.code, r.refused.message)"
    )
    result = subprocess.run(
        [*as_uid(NOBODY), sys.executable, "-c", script, str(HERE), daemon.socket + ".jobs", owner.id],
        capture_output=True, text=True, timeout=60, env=subprocess_env(), cwd="/",
    )
    assert result.returncode == 0, result.stderr
    code, message = result.stdout.split(" ", 1)
    assert int(code) == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert "belongs to another process" in message
    owner.close()


@needs_second_uid
def test_the_pool_file_is_the_daemons_alone(open_folder, start_daemon, client_factory):
    daemon = start_shared(start_daemon, open_folder)
    [path] = daemon.folder.glob("*.pool")
    assert os.stat(path).st_mode & 0o777 == 0o600
    result = subprocess.run([*as_uid(NOBODY), "cat", path], capture_output=True, timeout=30)
    assert result.returncode != 0 and b"Permission denied" in result.stderr


def flood(daemon, blocks: int) -> dict:
    result = subprocess.run(
        [*as_uid(NOBODY), sys.executable, str(HERE / "tenant_flood.py"), daemon.socket, str(blocks)],
        capture_output=True, text=True, timeout=60, env=subprocess_env(), cwd="/",
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def small_pool_with_a_victim(start_daemon, open_folder, client_factory, seed: int, blocks: int, prompt: int):
    """A 32-slot pool, and root's client holding `blocks` blocks."""
    daemon = start_shared(start_daemon, open_folder, pool_size="512KiB")
    victim = client_factory(daemon, name="victim")
    worker, engine, tensors = attach_worker(victim, seed=seed)
    keys = prompt_keys(blocks, prompt=prompt)
    job = victim.submit_store(worker, 1, keys, list(range(blocks)))
    assert victim.wait([job], 10)[job].ok
    return daemon, victim, worker, engine, tensors, keys


@needs_second_uid
def test_one_tenants_big_store_does_not_evict_another_below_its_share(open_folder, start_daemon, client_factory):
    daemon, victim, worker, engine, tensors, keys = small_pool_with_a_victim(
        start_daemon, open_folder, client_factory, seed=42, blocks=12, prompt=420
    )

    # With two tenants, each may have half the pool in stores in flight: the flood
    # gets 16 slots, of the 20 free, and may evict none of the victim's blocks.
    got = flood(daemon, 30)
    assert got == {"stored": 16, "not_stored": 14}
    assert victim.lookup(engine, keys).ready_blocks == 12
    job = victim.submit_load(worker, 2, keys, list(range(20, 32)))
    assert victim.wait([job], 10)[job].ok
    for i in range(12):
        for src, dst in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 20 + i)):
            assert torch.equal(src.view(torch.int16), dst.view(torch.int16))
    assert victim.stats().totals.evicted_blocks == 0


@needs_second_uid
def test_one_tenants_stores_in_flight_cannot_take_every_free_slot(open_folder, start_held_daemon, client_factory):
    daemon, victim, worker, engine, tensors, first = small_pool_with_a_victim(
        start_held_daemon, open_folder, client_factory, seed=44, blocks=4, prompt=440
    )
    daemon.hold(1)  # the other tenant's store stays in flight
    holder = subprocess.Popen(
        [*as_uid(NOBODY), sys.executable, str(HERE / "tenant_flood.py"), daemon.socket, "30", "hold"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
        cwd="/",
    )
    try:
        # Its store pins half the pool, not the 28 free slots.
        assert json.loads(holder.stdout.readline()) == {"stored": 16, "not_stored": 14}
        more = prompt_keys(12, prompt=441)
        job = victim.submit_store(worker, 2, more, list(range(4, 16)))
        result = victim.wait([job], 10)[job]
        assert result.ok and victim.lookup(engine, first + more).ready_blocks == 16
    finally:
        holder.kill()
        holder.wait(10)


@needs_second_uid
def test_a_tenant_at_its_quota_evicts_only_its_own_blocks(open_folder, start_daemon, client_factory):
    config = open_folder / "kvdepot.toml"
    config.write_text(f'[[tenant]]\nname = "small"\nuids = [{NOBODY}]\nquota = "25%"\n')
    daemon = start_shared(start_daemon, open_folder, pool_size="512KiB", config=str(config))
    owner = client_factory(daemon, name="owner")
    worker, engine, tensors = attach_worker(owner, seed=43)
    # The flood may hold 8 of 32 slots, though 32 are free.
    assert flood(daemon, 12) == {"stored": 8, "not_stored": 4}
    names = {ns.name: ns.used_slots for ns in owner.stats().namespaces}
    assert [used for name, used in names.items() if name.startswith("small/")] == [8]


@pytest.mark.parametrize(
    "toml, message",
    [
        ('[[tenant]]\nname = "a"\nuidz = [1]\n', "unknown key(s) uidz"),
        ('[[tenant]]\nname = "a b"\n', "name must be 1-64 letters"),
        ('[[tenant]]\nname = "uid-5"\n', "neither start with 'uid-'"),
        ('[[tenant]]\nname = "a"\nuids = [1]\n[[tenant]]\nname = "b"\nuids = [1]\n', "uid 1 is in tenant a already"),
        ('[[tenant]]\nname = "a"\nquota = "lots"\n', "neither a percentage nor a size"),
        ('[[tenant]]\nname = "a"\nquota = "150%"\n', "at most 100%"),
        ('[[tenant]]\nname = "a"\ntoken_file = "/nonexistent"\n', "cannot read the auth token file"),
        ('tenant = 3\n', "must be an array of tables"),
        ('[[tenant]]\nname = "a"\nshare = "uid-0"\n', "is reserved"),
        ('[[tenant]]\nname = "a"\n[[tenant]]\nname = "b"\nshare = "a"\n', "another tenant's name"),
        ('[[tenant]]\nname = "a"\nuids = [true]\n', "must be a list of ids"),
    ],
)
def test_a_bad_tenant_table_is_refused_with_a_clear_message(tmp_path, toml, message):
    from kvdepot.server.daemon.config import ConfigError, load_config

    path = tmp_path / "kvdepot.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=".*") as info:
        load_config(["--config", str(path)], environ={})
    assert message in str(info.value)


@needs_second_uid
def test_one_users_job_connections_at_their_limit_do_not_lock_another_user_out(open_folder, start_daemon):
    from test_limits_connections import Attacker

    daemon = start_shared(start_daemon, open_folder, max_job_connections_per_uid=40)
    idle = Attacker("idle", daemon.socket, 100)  # root's: 40 held, the rest refused
    try:
        assert idle.report()["refused"] == 60
        script = (
            "import sys; sys.path.insert(0, sys.argv[1]); from raw_client import RawSession; "
            "s = RawSession(sys.argv[2]); print(s.ready.tenant)"
        )
        result = subprocess.run(
            [*as_uid(NOBODY), sys.executable, "-c", script, str(HERE), daemon.socket],
            capture_output=True, text=True, timeout=60, env=subprocess_env(), cwd="/",
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"uid-{NOBODY}"
    finally:
        idle.stop()


def test_a_session_that_never_says_hello_is_ended_at_the_hello_deadline(start_daemon, client_factory):
    daemon = start_daemon(job_hello_timeout=1)
    unproven = RawSession(daemon.socket, name="silent", hello=False)
    with pytest.raises(grpc.RpcError) as info:
        for _ in unproven.stream:
            pass
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "did not say hello on the job socket within 1 s" in info.value.details()
    unproven.close()
    client = client_factory(daemon)
    assert client.stats().clients == [] and client.stats().sessions_ended == 1


def test_a_long_client_name_is_refused_before_the_daemon_keeps_it(start_daemon):
    daemon = start_daemon()
    with pytest.raises(grpc.RpcError) as info:
        RawSession(daemon.socket, name="n" * (1 << 20), hello=False)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "client_name has 1048576 characters, more than --max-name-length" in info.value.details()


def test_sessions_are_bounded_per_user(start_daemon):
    daemon = start_daemon(max_sessions_per_uid=3)
    proven = [RawSession(daemon.socket) for _ in range(3)]
    with pytest.raises(RuntimeError, match="--max-sessions-per-uid 3"):
        RawSession(daemon.socket)
    for session in proven:
        session.close()


# Holds as many sessions as the daemon keeps unproven and never says hello
# (no identity is known before it), then reports how its oldest one ended.
SQUATTER = """
import sys
sys.path.insert(0, sys.argv[1])
import grpc
from raw_client import RawSession
held = [RawSession(sys.argv[2], hello=False) for _ in range(int(sys.argv[3]))]
print("held", flush=True)
try:
    for _ in held[0].stream:
        pass
except grpc.RpcError as e:
    print(e.code().name, e.details(), flush=True)
sys.stdin.read()
"""


def test_sessions_that_never_say_hello_cannot_lock_another_process_out(start_daemon, client_factory):
    daemon = start_daemon(max_unproven_sessions=4)
    squatter = subprocess.Popen(
        [sys.executable, "-c", SQUATTER, str(HERE), daemon.socket, "4"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env(),
    )
    try:
        assert squatter.stdout.readline() == "held\n"
        # This process attaches and says hello while the daemon holds its most
        # sessions waiting: the squatter's oldest makes room.
        session = RawSession(daemon.socket, name="engine")
        assert session.ready is not None
        ended = squatter.stdout.readline()
        assert ended.startswith("RESOURCE_EXHAUSTED"), ended
        assert "--max-unproven-sessions 4" in ended
        stats = client_factory(daemon).stats()
        assert [c.client_name for c in stats.clients] == ["engine"] and stats.sessions_ended == 1
        session.close()
    finally:
        squatter.kill()
        squatter.wait()


def test_one_tenant_cannot_take_every_namespace(start_daemon):
    from kvcache import namespace

    from kvdepot.proto import kvdepot_pb2 as pb

    daemon = start_daemon(max_namespaces_per_tenant=3)
    session = RawSession(daemon.socket)
    for model in ("a", "b", "c"):
        spec = pb.NamespaceSpec(**{**namespace("per_layer"), "model": model})
        session.stub.RegisterEngine(pb.RegisterEngineRequest(session_id=session.id, namespace=spec))
    spec = pb.NamespaceSpec(**{**namespace("per_layer"), "model": "d"})
    with pytest.raises(grpc.RpcError) as info:
        session.stub.RegisterEngine(pb.RegisterEngineRequest(session_id=session.id, namespace=spec))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"tenant uid-{os.getuid()} holds 3 namespaces" in info.value.details()
    session.close()
