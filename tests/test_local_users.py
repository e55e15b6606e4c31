"""Another local user against the daemon's edges: the folders and names it uses
in places others can write (/tmp, /dev/shm), and the socket its clients trust.
The attacker runs as a second uid (nobody), the daemon and its client as root,
so these tests need root, as CI has."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import subprocess_env, wait_until
from kvcache import attach_worker, prompt_keys
from test_trust import NOBODY, as_uid, needs_second_uid

pytestmark = needs_second_uid


@pytest.fixture
def shared_tmp():
    """A folder like /tmp: anyone may create names in it (sticky, 1777)."""
    folder = Path(tempfile.mkdtemp(prefix="kvdepot-sticky-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def as_nobody(*command: str) -> None:
    subprocess.run([*as_uid(NOBODY), *command], check=True, cwd="/", timeout=30)


def daemon_args(listen: str, pool_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvdepot.server", "--listen", listen, "--pool-size", "4MiB", "--slot-size", "16KiB",
            "--pin", "off", "--pool-dir", str(pool_dir), *extra]


def run_daemon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, env=subprocess_env(), timeout=60, cwd="/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------ whose daemon


def test_the_daemon_refuses_a_socket_folder_another_user_made_first(shared_tmp, tmp_path):
    """/tmp/kvdepot-UID is a name anyone can take first: a daemon that served
    from it would share a folder with whoever made it."""
    squatted = shared_tmp / "kvdepot-0"
    as_nobody("mkdir", "-m", "0755", str(squatted))
    proc = run_daemon(*daemon_args(str(squatted / "kvdepot.sock"), tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert f"{squatted} belongs to uid {NOBODY}" in proc.stderr and "chown" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (squatted / "kvdepot.sock").exists()


def test_the_daemon_refuses_a_socket_folder_others_can_write(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    proc = run_daemon(*daemon_args(str(folder / "kvdepot.sock"), tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert "mode 777" in proc.stderr and "chmod go-w" in proc.stderr


def test_a_socket_in_a_folder_all_users_share_is_refused_without_advice_to_take_it_over(tmp_path):
    # As /tmp: every user may write to it, the sticky bit keeps their names
    # theirs. Making it the daemon user's alone would break every other user.
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    proc = run_daemon(*daemon_args(str(folder / "kvdepot.sock"), tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert "mode 1777" in proc.stderr and "Give --listen a path in a folder of your own" in proc.stderr
    assert "chmod" not in proc.stderr and "chown" not in proc.stderr


@pytest.fixture
def nobodys_daemon(shared_tmp):
    """A kvdepotd of nobody's, in a folder of nobody's: where a victim without
    XDG_RUNTIME_DIR looks for its own."""
    folder = shared_tmp / "kvdepot-squat"
    as_nobody("mkdir", "-m", "0755", str(folder))
    log_path = shared_tmp / "nobody.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*as_uid(NOBODY), *daemon_args(str(folder / "kvdepot.sock"), folder)],
            stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(), cwd="/",
        )
    try:
        wait_until(lambda: proc.poll() is not None or b"ready on" in log_path.read_bytes(), 30, what="nobody's daemon")
        assert proc.poll() is None, log_path.read_text()
        yield folder / "kvdepot.sock", log_path
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_client_sends_nothing_to_a_daemon_of_another_uid(nobodys_daemon):
    from kvdepot.client import KVDepotClient
    from kvdepot.errors import UntrustedDaemon

    path, _ = nobodys_daemon
    client = KVDepotClient(str(path), name="victim", backoff_max=0.2)
    try:
        with pytest.raises(UntrustedDaemon) as refused:
            client.connect(20)
    finally:
        client.close(1)
    message = str(refused.value)
    assert f"uid {NOBODY}" in message and f"daemon_uids=[{NOBODY}]" in message
    # Allowed by name, a client attaches; the refused one never had a session there.
    allowed = KVDepotClient(str(path), name="allowed", daemon_uids=[NOBODY])
    try:
        stats = allowed.connect(10).stats()
    finally:
        allowed.close(1)
    assert stats.sessions_ended == 0, stats


def test_a_client_does_not_connect_below_a_folder_another_user_can_swap(shared_tmp, start_daemon):
    """The socket's folder is root's, but the folder above it is nobody's, who
    could rename it aside and put a daemon of theirs at the same path between
    the client's check and its connection."""
    from kvdepot.client import KVDepotClient
    from kvdepot.errors import UntrustedDaemon

    above = shared_tmp / "nobodys"
    as_nobody("mkdir", "-m", "0755", str(above))
    folder = above / "kvdepot"
    folder.mkdir(mode=0o755)
    daemon = start_daemon(folder=folder)
    client = KVDepotClient(daemon.socket, name="victim", backoff_max=0.2)
    try:
        with pytest.raises(UntrustedDaemon,
                           match=f"{above}, a folder above the daemon's socket, belongs to uid {NOBODY}"):
            client.connect(20)
    finally:
        client.close(1)


def test_the_job_socket_sends_nothing_to_a_peer_of_another_uid(shared_tmp):
    """The job socket carries the hello and the worker's staging memory: its
    peer is checked on the connection itself, before the first byte."""
    from kvdepot.client.daemon_identity import trusted_uids
    from kvdepot.client.job_socket import JobSocket, hand_over
    from kvdepot.errors import UntrustedDaemon

    path = shared_tmp / "fake.jobs"
    received = shared_tmp / "received"
    listener = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_UNIX);s.bind(sys.argv[1]);s.listen(8)\n"
        "open(sys.argv[1]+'.up','w').close()\n"
        "while True:\n"
        " c,_=s.accept();c.settimeout(2)\n"
        " try: data=c.recv(100)\n"
        " except OSError: data=b''\n"
        " open(sys.argv[2],'ab').write(data);c.close()\n"
    )
    proc = subprocess.Popen([*as_uid(NOBODY), sys.executable, "-c", listener, str(path), str(received)], cwd="/")
    try:
        wait_until(lambda: Path(str(path) + ".up").exists() or proc.poll() is not None, 30, what="the listener")
        with pytest.raises(UntrustedDaemon, match=f"uid {NOBODY}"):
            JobSocket(str(path), "session", lambda reply: None, lambda reason: None, 2.0, trusted_uids())
        with pytest.raises(UntrustedDaemon, match=f"uid {NOBODY}"):
            hand_over(str(path), "session", 0, 2.0, trusted_uids())
        # Both connections were closed without a byte: the listener noted two empty reads.
        wait_until(received.exists, 10, what="the listener's note")
        assert received.read_bytes() == b""
    finally:
        proc.terminate()
        proc.wait(10)


# ------------------------------------------------------------ names in shared folders


@pytest.mark.parametrize("plant", ["symlink", "file"])
def test_a_name_planted_at_the_tcp_lock_is_refused_by_its_owner(shared_tmp, tmp_path, plant):
    """The TCP address lock has a name anyone can compute, in the pool's folder
    (/dev/shm by default): a link there must not make root truncate the file
    it points to, and a file of another user's must not speak for the daemon."""
    from kvdepot.server.daemon.startup import Address

    address = f"127.0.0.1:{free_port()}"
    lock = shared_tmp / (Address.of(address).pool_prefix + "tcp.lock")
    precious = tmp_path / "precious"
    precious.write_text("root's data\n")
    if plant == "symlink":
        as_nobody("ln", "-s", str(precious), str(lock))
    else:
        as_nobody("sh", "-c", f"echo 'pid 1 (call xyzzy-plugh to unlock)' > {lock}")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    proc = run_daemon(*daemon_args(address, shared_tmp, "--auth-token-file", str(token)))
    assert proc.returncode == 1, proc.stderr
    assert str(lock) in proc.stderr and f"uid {NOBODY}" in proc.stderr
    assert "xyzzy" not in proc.stderr and "Traceback" not in proc.stderr
    assert precious.read_text() == "root's data\n"


def test_directories_planted_at_the_catalogs_names_do_not_stop_it(shared_tmp, start_daemon, client_factory):
    """The catalog and its temporary file sit beside the pool, in a folder
    others can write: names planted there must not cost the next daemon the
    blocks it would adopt."""
    daemon = start_daemon(pool_dir=str(shared_tmp))
    client = client_factory(daemon, backoff_max=0.5)
    [pool] = shared_tmp.glob("*.pool")
    catalog = str(pool)[: -len(".pool")] + ".namespaces.json"
    for name in (catalog, f"{catalog}.{daemon.proc.pid}.tmp"):
        subprocess.run([*as_uid(NOBODY), "mkdir", name], cwd="/", timeout=30, capture_output=True)
    worker, engine, tensors = attach_worker(client, seed=3)
    keys = prompt_keys(8, prompt=3)
    job = client.submit_store(worker, 1, keys, list(range(len(keys))))
    assert client.wait([job], 10)[job].ok
    wait_until(lambda: [t for t in client.stats().tiers if t.name == "dram"][0].written_shards >= 8, what="sealed")
    assert [t for t in client.stats().tiers if t.name == "dram"][0].write_errors == 0
    assert daemon.stop() == 0
    daemon.start()
    assert client.wait_connected(15)
    [tier] = [t for t in client.stats().tiers if t.name == "dram"]
    assert tier.recovered_shards == 8, daemon.log()


def test_a_disk_folder_swapped_while_the_daemon_runs_gets_no_segment(shared_tmp, start_daemon, client_factory):
    """Whoever can write a folder above the disk tier's can rename it aside and
    put a folder of theirs at its path: the daemon keeps writing every tenant's
    segments into the folder it opened."""
    from test_disk_tier_daemon import disk, fill_round

    above = shared_tmp / "nobodys"
    as_nobody("mkdir", "-m", "0755", str(above))
    folder = above / "disk"
    # 8 MiB: segments of 1 MiB, so each round of blocks starts new ones.
    daemon = start_daemon(disk_dir=str(folder), disk_size="8MiB")
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=1)
    fill_round(client, worker, tensors, 0, 1)
    wait_until(lambda: disk(client.stats()).written_shards >= 128, what="the first round on disk")
    as_nobody("sh", "-c", f"mv {folder} {above}/moved && mkdir -m 0777 {folder}")
    for round_ in (1, 2):
        fill_round(client, worker, tensors, round_, 1 + round_)
        shards = 128 * (round_ + 1)
        wait_until(lambda: disk(client.stats()).written_shards >= shards, what=f"round {round_} on disk")  # noqa: B023
    assert sorted(os.listdir(folder)) == []
    assert any(name.startswith("seg-") for name in os.listdir(above / "moved"))
    assert disk(client.stats()).write_errors == 0


def test_a_catalog_the_daemon_cannot_write_is_an_error_it_reports(shared_tmp, caplog):
    """A directory of another user's in the catalog's way: the catalog is not
    written, and that is logged as an error naming the owner and counted."""
    from kvdepot.server.tiers.catalog import Catalog

    path = shared_tmp / "kvdepot-0123-abc.namespaces.json"
    as_nobody("mkdir", str(path))
    catalog = Catalog(str(path))
    identity = ("uid-0", "model", "rev", "bf16", 16, "per_layer", 1, 0, "", 1)
    with caplog.at_level("ERROR", logger="kvdepot.tiers"):
        catalog.note(identity, {0: ("sig",)})
    assert catalog.write_errors == 1
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert f"a directory of uid {NOBODY}" in record.getMessage() and "--pool-dir" in record.getMessage()
    assert sorted(p.name for p in shared_tmp.iterdir()) == [path.name]  # no temporary file left behind


def test_the_kvdepot_command_names_the_uid_it_refused_and_talks_once_allowed(nobodys_daemon):
    path, _ = nobodys_daemon
    command = [sys.executable, "-m", "kvdepot.client.cli", "--socket", str(path)]
    refused = subprocess.run([*command, "health"], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert refused.returncode == 2 and f"uid {NOBODY}" in refused.stderr and "--daemon-uids" in refused.stderr
    allowed = subprocess.run([*command, "--daemon-uids", str(NOBODY), "health"], capture_output=True, text=True,
                             env=subprocess_env(), timeout=60)
    assert allowed.returncode == 0 and "SERVING" in allowed.stdout, allowed.stderr


def test_the_daemon_refuses_a_socket_folder_reached_through_another_users_link(shared_tmp, tmp_path):
    """A link another user made may point at a folder of the daemon's today and
    at one of theirs tomorrow, where clients following the path would go."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    link = shared_tmp / "kvdepot-0"
    as_nobody("ln", "-s", str(mine), str(link))
    proc = run_daemon(*daemon_args(str(link / "kvdepot.sock"), tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert f"{link} is a symbolic link of uid {NOBODY}" in proc.stderr
    assert not (mine / "kvdepot.sock").exists()
