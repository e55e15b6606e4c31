"""What one client can make the daemon hold through its connections and its
notifications is bounded: a client that stops reading, opens connections it
never uses, or never reads its replies is refused or cut off, and the other
clients keep working with exact bytes. Every attack runs in a process of its
own (tests/attacker.py) against the real daemon."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from conftest import subprocess_env, wait_until
from kvcache import attach_worker, block_of, prompt_keys
from raw_client import RawSession

from kvdepot.proto import kvdepot_pb2 as pb

ATTACKER = str(Path(__file__).resolve().parent / "attacker.py")


class Attacker:
    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, ATTACKER, *map(str, args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())

    def report(self, timeout: float = 60) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the attacker failed: {self.proc.stderr.read()}"
        return json.loads(line)

    def go_on(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def store_and_check(client, worker, tensors, job_id: int, prompt: int, blocks: int = 8) -> None:
    """Stores blocks 0.., loads them into the upper half of the cache, and checks every byte."""
    keys = prompt_keys(blocks, prompt=prompt)
    job = client.submit_store(worker, job_id, keys, list(range(blocks)))
    assert client.wait([job], 30)[job].ok
    load = client.submit_load(worker, job_id + 1, keys, list(range(64, 64 + blocks)))
    assert client.wait([load], 30)[load].ok
    for i in range(blocks):
        for a, b in zip(block_of(tensors, "per_layer", i), block_of(tensors, "per_layer", 64 + i)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_session_that_stops_reading_its_stream_is_ended_and_the_daemon_does_not_grow(start_daemon, client_factory):
    daemon = start_daemon(max_queued_notification_keys=20000)
    client = client_factory(daemon, name="good")
    worker, engine, tensors = attach_worker(client, seed=41)
    stuck = Attacker("stuck-engine", daemon.socket, 16)
    stuck.report()
    try:
        assert "stuck" in {c.client_name for c in client.stats().clients}
        store_and_check(client, worker, tensors, 1, prompt=400)
        before = rss_bytes(daemon.proc.pid)
        # Every store changes keys of the stuck engines' namespace: 128 stored,
        # 128 ready, and as many evicted from the 256-slot pool, for each engine.
        for i in range(400):
            keys = prompt_keys(128, prompt=1000 + i)
            job = client.submit_store(worker, 10 + i, keys, list(range(128)))
            assert client.wait([job], 30)[job].ok
            # A client that reads its stream (given the CPU to, on a busy machine) keeps up with it.
            wait_until(lambda keys=keys: client.cached_lookup(engine, keys[-1:]).ready_blocks == 1,
                       what="the good client's copy of its keys")
        grown = rss_bytes(daemon.proc.pid) - before
        assert grown < 24 << 20, f"the daemon grew by {grown >> 20} MiB for a client that reads nothing"
        assert "stuck" not in {c.client_name for c in client.stats().clients}
        assert f"('stuck', tenant uid-{os.getuid()} (uid {os.getuid()} pid {stuck.proc.pid}" in daemon.log()
        assert "left more than 20000 keys of notifications unread" in daemon.log()
        # The client that reads its stream was never touched.
        assert client.stats().totals.failed_jobs == 0
        store_and_check(client, worker, tensors, 5000, prompt=401)
        # Once the stuck client reads again, its stream says why it was ended.
        stuck.proc.stdin.write("read\n")
        stuck.proc.stdin.flush()
        ended = stuck.report()
        assert ended["ended"] == "RESOURCE_EXHAUSTED", ended
        details = ended["details"]
        assert "kvdepotd ended this session" in details and "--max-queued-notification-keys" in details
    finally:
        stuck.stop()


@pytest.mark.parametrize("total, per_uid, option", [(50, 40, "(--max-job-connections-per-uid)"),
                                                    (40, 512, "(--max-job-connections)")])
def test_job_connections_beyond_the_limits_are_refused_and_a_new_client_still_works(
        start_daemon, client_factory, total, per_uid, option):
    daemon = start_daemon(max_job_connections=total, max_job_connections_per_uid=per_uid)
    idle = Attacker("idle", daemon.socket, 300)
    try:
        report = idle.report()
        # Those past the limit (all of this test's uid) were refused and closed, with the reason.
        assert report["refused"] == 300 - 40
        assert report["first_refusal"].startswith("8 ")  # RESOURCE_EXHAUSTED
        assert option in report["first_refusal"]
        # One line in the log for them all, not one per connection.
        assert daemon.log().count("refused a job socket connection") == 1
        # A new client of the same user cannot prove who it is while they hold the job
        # socket (another user's can, under the per-user limit: test_trust.py).
        from kvdepot.client import KVDepotClient

        newcomer = KVDepotClient(daemon.socket, name="newcomer")
        try:
            assert not newcomer.wait_connected(2)
        finally:
            newcomer.close()
    finally:
        idle.stop()
    # The idle connections are gone with their process: the next client gets the job socket again.
    later = client_factory(daemon, name="later")
    assert later._connection.jobs.kind == "socket"
    worker, engine, tensors = attach_worker(later, seed=43)
    store_and_check(later, worker, tensors, 1, prompt=411)


def test_a_connection_that_never_says_hello_is_closed_after_the_deadline(start_daemon):
    daemon = start_daemon(job_hello_timeout=1)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(daemon.socket + ".jobs")
    header = sock.recv(4, socket.MSG_WAITALL)
    reply = pb.JobReply()
    reply.ParseFromString(sock.recv(int.from_bytes(header, "little"), socket.MSG_WAITALL))
    assert reply.refused.code == 9 and "no hello within 1 s" in reply.refused.message
    assert sock.recv(1) == b""
    sock.close()
    # A stranger's frame before hello is small: a large one closes the connection at once.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(daemon.socket + ".jobs")
    sock.sendall((1 << 20).to_bytes(4, "little") + b"\0" * 65536)
    assert sock.recv(1) == b""
    sock.close()
    wait_until(lambda: "a frame of 1048576 bytes (the limit is 4096 before hello)" in daemon.log())


def test_replies_left_unread_do_not_grow_the_daemon_and_other_clients_run(start_daemon, client_factory):
    daemon = start_daemon()
    client = client_factory(daemon, name="good")
    worker, engine, tensors = attach_worker(client, seed=44)
    store_and_check(client, worker, tensors, 1, prompt=420)
    before = rss_bytes(daemon.proc.pid)
    flood = Attacker("flood", daemon.socket, 16)
    try:
        report = flood.report()
        # The daemon stopped reading long before 16 MiB of requests (about 280 MiB of replies).
        assert report["sent_mib"] < 4, report
        grown = rss_bytes(daemon.proc.pid) - before
        assert grown < 24 << 20, f"the daemon grew by {grown >> 20} MiB holding replies nobody reads"
        store_and_check(client, worker, tensors, 10, prompt=421)
    finally:
        flood.stop()
    store_and_check(client, worker, tensors, 20, prompt=422)


def test_frames_not_yet_whole_are_bounded_per_user_and_the_rest_refused_by_name(start_daemon, client_factory):
    from kvdepot.server.core.limits import Limits

    budget = Limits().max_job_frame_bytes_per_uid
    daemon = start_daemon()
    before = rss_bytes(daemon.proc.pid)
    # Frames that never end, 64 MiB each: 768 MiB held if nothing bounded them.
    attack = Attacker("partial", daemon.socket, "12:64")
    try:
        report = attack.report(timeout=120)
        held = budget // (64 << 20)
        assert report["held"] == held and report["refused"] == 12 - held, report
        code, message = report["first_refusal"].split(" ", 1)
        assert code == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]), report
        assert "--max-job-frame-bytes-per-uid" in message and "not yet whole" in message, message
        grown = rss_bytes(daemon.proc.pid) - before
        assert grown < budget + (64 << 20), f"the daemon grew by {grown >> 20} MiB"
        # With the user's budget full, its small frames still come in pieces (a
        # client sends a frame in two writes; a read ends in the middle of one).
        session = RawSession(daemon.socket, name="small frames")
        data = pb.JobFrame(request_id=7).SerializeToString() + b"\xc2\x3e\x80\x01" + b"\0" * 128  # field 1000
        session.jobs.sock.sendall(struct.pack("<I", len(data)) + data[:50])
        time.sleep(0.3)
        session.jobs.sock.sendall(data[50:])
        reply = session.jobs.reply()
        assert reply is not None and reply.request_id == 7, reply  # answered, not refused for the budget
        session.close()
    finally:
        attack.stop()
    # What they held is the user's again once their connections are gone.
    client = client_factory(daemon, name="after")
    worker, engine, tensors = attach_worker(client, seed=46)
    wait_until(lambda: rss_bytes(daemon.proc.pid) - before < 128 << 20, timeout=30)
    again = Attacker("partial", daemon.socket, f"{held}:64")
    try:
        assert again.report(timeout=120)["refused"] == 0
    finally:
        again.stop()
    store_and_check(client, worker, tensors, 1, prompt=440)


def test_a_big_frame_once_handled_gives_its_memory_back(start_daemon):
    daemon = start_daemon()
    before = rss_bytes(daemon.proc.pid)
    # Eight connections each send one whole frame of 40 MiB, which asks nothing, and stay open.
    attack = Attacker("whole", daemon.socket, "8:40")
    try:
        assert attack.report(timeout=120)["answers"] == ["refused"] * 8
        grown = rss_bytes(daemon.proc.pid) - before
        assert grown < 100 << 20, f"the daemon still holds {grown >> 20} MiB for frames it has answered"
    finally:
        attack.stop()


def test_many_connections_that_never_read_their_replies_hold_little_each(start_daemon):
    daemon = start_daemon()
    sessions = 40
    flood = Attacker("flood", daemon.socket, f"16:{sessions}")
    try:
        assert flood.report()["attached"] == sessions
        before = rss_bytes(daemon.proc.pid)
        flood.go_on()
        flood.report()
        # A connection's requests wait once its answers pass 256 KiB: a read's
        # worth of small requests (256 KiB) is not all answered first, which
        # held 1.6-1.9 MiB a connection; now its read room and answers, under 0.8.
        grown = (rss_bytes(daemon.proc.pid) - before) / sessions
        assert grown < 1.2 * 2**20, f"the daemon grew by {grown / 2**20:.2f} MiB a connection of unread replies"
    finally:
        flood.stop()


def test_job_connections_never_take_the_files_a_new_client_needs(start_daemon, client_factory):
    # A daemon that may open 256 files (a tight LimitNOFILE) keeps half of them from the job socket.
    launcher = str(Path(__file__).resolve().parent / "daemon_with_few_files.py")
    daemon = start_daemon(launcher=launcher, env={"KVDEPOT_TEST_NOFILE": "256"}, job_hello_timeout=2)
    assert "the job socket takes at most 128 connections, not 1024" in daemon.log()
    idle = Attacker("idle", daemon.socket, 300)
    try:
        assert idle.report()["refused"] == 300 - 128
        # The daemon still has files to answer with; the idle connections hold the job
        # socket only until their hello deadline, and then the newcomer proves who it is.
        client = client_factory(daemon, name="newcomer")
        worker, engine, tensors = attach_worker(client, seed=45)
        store_and_check(client, worker, tensors, 1, prompt=430)
    finally:
        idle.stop()


def test_one_grpc_connection_cannot_open_streams_without_bound(start_daemon):
    from kvdepot.server.daemon.grpc_cap import MAX_STREAMS_PER_CONNECTION

    daemon = start_daemon()
    before = rss_bytes(daemon.proc.pid)
    # Streams that need no session or token, held open with their headers alone.
    flood = Attacker("streams", daemon.socket, MAX_STREAMS_PER_CONNECTION + 3000)
    try:
        report = flood.report(timeout=120)
        assert report["max_concurrent_streams"] == MAX_STREAMS_PER_CONNECTION, report
        assert report["refused"] >= 3000, report
        assert rss_bytes(daemon.proc.pid) - before < 200 << 20
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:  # others are still served
            grpc.channel_ready_future(channel).result(timeout=30)
    finally:
        flood.stop()


def test_health_watch_streams_are_refused_for_unknown_names_and_bounded(start_daemon):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvdepot.server.daemon.health_service import MAX_WATCHES

    daemon = start_daemon()
    # A name no service has, a megabyte long: refused, not kept while the stream is open.
    big = Attacker("watch", daemon.socket, "200:1000000")
    try:
        report = big.report()
        assert report["open"] == 0 and report["codes"] == {"NOT_FOUND": 200}, report
        assert "reports the health of" in report["refusal"]
    finally:
        big.stop()
    many = Attacker("watch", daemon.socket, f"{MAX_WATCHES + 20}:0")
    try:
        report = many.report()
        assert report["open"] == MAX_WATCHES and report["codes"] == {"RESOURCE_EXHAUSTED": 20}, report
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        many.stop()
