"""What a local user can make the daemon hold or fault at its edges: the
staging memory it maps (a budget per user id and in all, each memfd cut to its
worker's rows), memory it could fault on (hugetlbfs), and gRPC connections
that never finish their handshake or never make a call. Each attack comes
from a process of its own, from a second uid where identity matters."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import subprocess
import sys
import time

import grpc
import pytest
from attacker import H2_PREFACE, answer_h2
from conftest import subprocess_env, wait_until
from kvcache import attach_worker, make_kv_cache, namespace
from raw_client import RawSession, cpu_worker_request
from test_limits_connections import ATTACKER, store_and_check
from test_staging import daemon_staging_maps, memfd, offer, refused
from test_trust import NOBODY, as_uid, needs_second_uid, start_shared

from kvdepot.layout import WorkerLayout

GIB = 1 << 30


def staging_mapped_bytes(daemon) -> list[int]:
    """The size of each staging mapping the daemon holds."""
    sizes = []
    with open(f"/proc/{daemon.proc.pid}/maps") as f:
        for line in f:
            if "memfd:" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                sizes.append(end - start)
    return sizes


def attack_as_nobody(*args: str) -> tuple[subprocess.Popen, dict]:
    """tests/attacker.py run as a second uid, and the report it holds on to."""
    attacker = subprocess.Popen(
        [*as_uid(NOBODY), sys.executable, ATTACKER, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=subprocess_env(), cwd="/",
    )
    line = attacker.stdout.readline()
    if not line:
        attacker.wait(30)
        raise AssertionError(f"the attacker failed: {attacker.stderr.read()}")
    return attacker, json.loads(line)


def let_go(attacker: subprocess.Popen) -> None:
    attacker.stdin.write("\n")
    attacker.stdin.close()
    attacker.wait(30)


def victim_stores(daemon, client_factory, seed: int) -> None:
    """A CPU worker of the test's own uid registers, stores and loads exact bytes."""
    client = client_factory(daemon, name="victim")
    worker, _, tensors = attach_worker(client, seed=seed)
    store_and_check(client, worker, tensors, 1, prompt=10 * seed)
    client.close()


@needs_second_uid
def test_sparse_memfds_of_one_uid_stop_at_its_budget_and_another_uids_worker_registers(
    open_folder, start_daemon, client_factory
):
    daemon = start_shared(start_daemon, open_folder, max_staging_bytes_per_uid="256GiB",
                          max_staging_bytes="320GiB")
    attacker, report = attack_as_nobody("sparse", daemon.socket, "16")
    try:
        # 4 of 64 GiB fill the uid's 256 GiB; the fifth is refused, naming the option.
        assert report["taken"] == 4, report
        assert "--max-staging-bytes-per-uid" in report["refusal"], report
        assert sum(staging_mapped_bytes(daemon)) == 256 * GIB
        # Another uid's CPU worker still registers, stores and loads exact bytes.
        victim_stores(daemon, client_factory, seed=61)
    finally:
        let_go(attacker)
    # The attacker's session ended: its budget is back, nothing stays mapped.
    wait_until(lambda: daemon_staging_maps(daemon) == 0, what="the attacker's memfds unmapped")
    assert daemon.running


def register_cpu_worker(session: RawSession, staging_id: int, seed: int):
    tensors, block_dim = make_kv_cache("per_layer", seed=seed)
    request, layouts = cpu_worker_request(session.id, namespace("per_layer"), tensors, block_dim, staging_id)
    session.stub.RegisterWorker(request)
    return WorkerLayout.of(layouts)


def test_a_registered_worker_keeps_only_its_rows_mapped_and_its_budget(start_daemon):
    daemon = start_daemon(max_staging_bytes_per_uid="100GiB")
    session = RawSession(daemon.socket, name="oversized")
    big = memfd(64 * GIB, fcntl.F_SEAL_SHRINK)
    second = memfd(64 * GIB, fcntl.F_SEAL_SHRINK)
    try:
        taken = offer(session, [big])
        assert taken.HasField("staging_taken"), taken
        # 128 GiB would pass the uid's 100 GiB while the first is mapped whole.
        refused(offer(session, [second]), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-staging-bytes-per-uid")
        layout = register_cpu_worker(session, taken.staging_taken.staging_id, seed=62)
        needed = layout.num_blocks * layout.block_bytes
        assert staging_mapped_bytes(daemon) == [-(-needed // mmap.PAGESIZE) * mmap.PAGESIZE]
        # The rest of the memfd went back to the uid's budget.
        assert offer(session, [second]).HasField("staging_taken")
    finally:
        os.close(big)
        os.close(second)
        session.close()
    wait_until(lambda: daemon_staging_maps(daemon) == 0, what="the session's staging unmapped")


def test_the_daemons_staging_budget_holds_whatever_the_uids(start_daemon):
    daemon = start_daemon(max_staging_bytes="100GiB")
    session = RawSession(daemon.socket, name="oversized")
    fds = [memfd(64 * GIB, fcntl.F_SEAL_SHRINK) for _ in range(2)]
    try:
        assert offer(session, [fds[0]]).HasField("staging_taken")
        refused(offer(session, [fds[1]]), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-staging-bytes (")
    finally:
        for fd in fds:
            os.close(fd)
        session.close()
    wait_until(lambda: daemon_staging_maps(daemon) == 0, what="the session's staging unmapped")


def hugetlb_memfd() -> int:
    try:
        fd = os.memfd_create("huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError) as e:
        pytest.skip(f"this kernel makes no hugetlbfs memfd: {e}")
    try:
        os.ftruncate(fd, 2 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except OSError as e:
        os.close(fd)
        pytest.skip(f"this kernel cannot size or seal a hugetlbfs memfd: {e}")
    return fd


def test_a_hugetlbfs_memfd_is_refused_with_the_reason(daemon):
    # A memfd on hugetlbfs is made without any huge page reserved (HugePages_Total
    # may be 0): the daemon refuses it before it maps anything.
    session = RawSession(daemon.socket, name="huge")
    fd = hugetlb_memfd()
    try:
        refused(offer(session, [fd]), grpc.StatusCode.INVALID_ARGUMENT, "hugetlbfs (MFD_HUGETLB)")
    finally:
        os.close(fd)
        session.close()
    assert daemon_staging_maps(daemon) == 0
    assert daemon.running


def closed_by_daemon(sock: socket.socket, within: float, http2: bool) -> bool:
    """Whether the daemon closes the connection within `within` seconds; as an
    HTTP/2 client that answers every SETTINGS and PING, when `http2`."""
    if http2:
        sock.sendall(H2_PREFACE)
    sock.settimeout(0.2)
    pending = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
            if not data:
                return True
            pending = answer_h2(sock, pending + data)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def test_grpc_connections_that_never_finish_the_handshake_or_never_call_are_closed(start_daemon, client_factory):
    daemon = start_daemon(grpc_handshake_timeout=1, grpc_idle_timeout=1)
    silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(20)]
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for sock in [*silent, idle]:
            sock.connect(daemon.socket)
        # Without the timeouts the first are held 120 s (gRPC's own handshake
        # deadline), the last for good: it answers the daemon's keepalive pings.
        assert closed_by_daemon(idle, 20, http2=True)
        assert all(closed_by_daemon(sock, 10, http2=False) for sock in silent)
    finally:
        for sock in [*silent, idle]:
            sock.close()
    # An engine's client, whose Attach stream keeps its connection busy, works on.
    victim_stores(daemon, client_factory, seed=63)


@needs_second_uid
def test_one_uids_idle_grpc_connections_are_cut_to_its_cap_and_another_uid_attaches_and_stores(
    open_folder, start_daemon, client_factory
):
    daemon = start_shared(start_daemon, open_folder, max_grpc_connections_per_uid=20)
    attacker, report = attack_as_nobody("grpc-idle", daemon.socket, "200:20")
    try:
        # Without the cap all 200 stay open (they answer the keepalive pings).
        assert report["open"] == 20, report
        victim_stores(daemon, client_factory, seed=64)
    finally:
        let_go(attacker)
    logged = [line for line in daemon.log_path.read_text().splitlines() if "--max-grpc-connections-per-uid" in line]
    assert logged and f"uid {NOBODY} held" in logged[0], logged
    assert daemon.running
