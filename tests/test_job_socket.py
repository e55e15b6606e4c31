"""The job socket (proto: "job socket"): jobs run on it by default, its protocol
rules are enforced, a broken connection costs a reconnect and nothing else,
and where there is no job socket the gRPC calls still do the same work."""

from __future__ import annotations

import pytest
import torch
from conftest import wait_until
from kvcache import attach_worker, block_of, namespace, prompt_keys
from raw_client import LENGTH, RawJobSocket, RawSession
from test_daemon_lifecycle import free_port

from kvdepot import errors
from kvdepot.proto import kvdepot_pb2 as pb


def raw_session(daemon):
    """A session of our own that has not said hello yet."""
    session = RawSession(daemon.socket, hello=False)
    return session.channel, session.stream, session.id


def round_trip(client, worker, tensors, job_id: int, prompt: int) -> None:
    """Stores 4 blocks, loads them into 4 other blocks, and checks the bytes."""
    keys = prompt_keys(4, prompt=prompt)
    store = client.submit_store(worker, job_id, keys, [0, 1, 2, 3])
    assert client.wait([store], 10)[store].ok
    load = client.submit_load(worker, job_id + 1, keys, [100, 101, 102, 103])
    assert client.wait([load], 10)[load].ok
    for src, dst in ((0, 100), (1, 101), (2, 102), (3, 103)):
        for a, b in zip(block_of(tensors, "per_layer", src), block_of(tensors, "per_layer", dst)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_jobs_run_on_the_job_socket_by_default(daemon, client_factory):
    client = client_factory(daemon)
    assert client._connection.jobs.kind == "socket"
    worker, engine, tensors = attach_worker(client, seed=31)
    round_trip(client, worker, tensors, 1, prompt=310)
    assert client.lookup(engine, prompt_keys(4, prompt=310)).ready_blocks == 4
    totals = client.stats().totals
    assert (totals.stored_blocks, totals.loaded_blocks) == (4, 4)


def test_protocol_rules_are_enforced(daemon, client_factory):
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=32)
    path = daemon.socket + ".jobs"
    session_id = client._connection.session_id
    store = pb.SubmitStoreRequest(session_id=session_id, worker_id=worker.worker_id, job_id=77,
                                  keys=prompt_keys(1, prompt=320), block_ids=[5])

    # Hello must come first; an unknown session is refused; either way the connection ends.
    raw = RawJobSocket(path)
    raw.send(pb.JobFrame(request_id=3, submit_store=store))
    reply = raw.reply()
    assert reply.request_id == 3 and reply.refused.code == 9  # FAILED_PRECONDITION
    assert "first frame on a job socket must be hello" in reply.refused.message
    assert raw.closed_by_daemon()
    raw = RawJobSocket(path)
    raw.send(pb.JobFrame(hello=pb.JobSocketHello(session_id="nope")))
    reply = raw.reply()
    assert reply.refused.code == 5 and "unknown session" in reply.refused.message
    assert raw.closed_by_daemon()
    # A session has one job socket: the client's own holds it.
    raw = RawJobSocket(path)
    raw.send(pb.JobFrame(hello=pb.JobSocketHello(session_id=session_id)))
    assert "has a job socket connection already" in raw.reply().refused.message
    assert raw.closed_by_daemon()

    # A connection of another session cannot submit for this one.
    channel, stream, other_session = raw_session(daemon)
    raw = RawJobSocket(path)
    raw.send(pb.JobFrame(hello=pb.JobSocketHello(session_id=other_session)))
    assert raw.reply().HasField("ready")
    raw.send(pb.JobFrame(request_id=4, submit_store=store))
    reply = raw.reply()
    assert reply.request_id == 4 and reply.refused.code == 3  # INVALID_ARGUMENT
    assert "belongs to session" in reply.refused.message and other_session not in reply.refused.message
    # An empty frame is refused, and the connection stays usable.
    raw.send(pb.JobFrame(request_id=5))
    assert "empty JobFrame" in raw.reply().refused.message
    raw.send(pb.JobFrame(request_id=6, hello=pb.JobSocketHello(session_id=session_id)))
    assert "hello must be the first frame" in raw.reply().refused.message
    # Bytes that are no JobFrame, and a frame over the limit, close the connection.
    raw.sock.sendall(LENGTH.pack(3) + b"\xff\xff\xff")
    assert raw.closed_by_daemon()
    raw = RawJobSocket(path)
    raw.sock.sendall(LENGTH.pack(0xFFFFFFFF))
    assert raw.closed_by_daemon()
    raw.close()
    stream.cancel()
    channel.close()

    # None of it touched the daemon or the sessions.
    assert daemon.running
    round_trip(client, worker, tensors, 10, prompt=321)
    assert client.stats().totals.failed_jobs == 0


def test_a_request_answered_on_the_job_socket_as_the_call_would(daemon, client_factory):
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=33)
    channel, stream, session_id = raw_session(daemon)
    raw = RawJobSocket(daemon.socket + ".jobs")
    raw.send(pb.JobFrame(hello=pb.JobSocketHello(session_id=session_id)))
    assert raw.reply().HasField("ready")
    keys = prompt_keys(2, prompt=330)
    raw.send(pb.JobFrame(request_id=1, submit_load=pb.SubmitLoadRequest(
        session_id=session_id, worker_id=worker.worker_id, job_id=1, keys=keys, block_ids=[0, 1])))
    reply = raw.reply()
    # The worker is the first client's: unknown in this session, as SubmitLoad would say.
    assert reply.request_id == 1 and reply.refused.code == 5
    assert f"unknown worker {worker.worker_id}" in reply.refused.message
    # Ending the session (its Attach stream) closes its job socket too.
    stream.cancel()
    assert raw.closed_by_daemon()
    raw.close()
    channel.close()


def test_a_job_socket_the_daemon_closes_costs_a_reconnect_and_nothing_else(daemon, client_factory):
    client = client_factory(daemon)
    worker, engine, tensors = attach_worker(client, seed=34)
    round_trip(client, worker, tensors, 1, prompt=340)
    first_session = client._connection.session_id
    # A frame that does not parse: the daemon closes this client's job socket.
    client._connection.jobs.socket._sock.sendall(LENGTH.pack(2) + b"\xff\xff")
    wait_until(lambda: client.reconnects == 1 and client.connected, what="the client to reconnect")
    assert client._connection.session_id != first_session
    wait_until(lambda: worker.registered, what="the worker to be registered again")
    round_trip(client, worker, tensors, 10, prompt=341)
    assert "closing a job socket connection that sent a frame that is not a JobFrame" in daemon.log()


def test_without_a_job_socket_a_cpu_worker_is_refused_with_the_reason(start_daemon, tmp_path):
    """Over TCP there is no job socket, and a CPU worker's staging memory can
    only travel on one: GPU workers run their jobs through the gRPC calls."""
    from kvdepot.client import KVDepotClient

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(listen=address, auth_token_file=str(token_file))
    client = KVDepotClient(address, auth_token="s3cret").connect(10)
    try:
        assert client._connection.jobs.kind == "grpc"
        with pytest.raises(errors.FailedPrecondition, match="needs the daemon's job socket"):
            attach_worker(client, seed=35)
        engine = client.register_engine(namespace("per_layer"))
        assert client.lookup(engine, prompt_keys(1, prompt=351)).available
    finally:
        client.close()
    assert daemon.running


def test_a_client_that_cannot_open_the_job_socket_does_not_use_the_session_and_says_why(daemon, caplog):
    """As when a container mounts only the gRPC socket file: the daemon learns a
    unix client's identity from the job socket, so without it nothing works,
    and the client says why instead of failing every call."""
    import os

    from kvdepot.client import KVDepotClient

    os.unlink(daemon.socket + ".jobs")
    client = KVDepotClient(daemon.socket, name="no-job-socket")
    try:
        assert not client.wait_connected(3)
        wait_until(lambda: "job socket" in caplog.text, what="the client's warning")
        assert "cannot be used" in caplog.text
    finally:
        client.close()


@pytest.mark.parametrize("lane", ["native", "python"])
def test_quiet_submits_cost_one_message_each_way(start_daemon, lane):
    """A client that asks for quiet submits gets no answer for a submit the
    daemon takes: the job's JobDone is the one message back, and says a store's
    counts; a submit it refuses is answered, named by its job id. Either lane."""
    from kvcache import make_kv_cache

    daemon = start_daemon(lane=lane)
    session = RawSession(daemon.socket, hello=False)
    raw = RawJobSocket(daemon.socket + ".jobs")
    raw.send(pb.JobFrame(hello=pb.JobSocketHello(session_id=session.id, quiet_submits=True)))
    assert raw.reply().ready.quiet_submits
    tensors, block_dim = make_kv_cache("per_layer", seed=34)
    registered, _ = session.register_cpu_worker(namespace("per_layer"), tensors, block_dim)
    keys = prompt_keys(3, prompt=340)

    def store(job_id: int, ks, block_ids) -> pb.JobReply:
        raw.send(pb.JobFrame(request_id=job_id, submit_store=pb.SubmitStoreRequest(
            session_id=session.id, worker_id=registered.worker_id, job_id=job_id, keys=ks, block_ids=block_ids)))
        return raw.reply()

    first = store(7, keys[:2], [0, 1])
    assert first.WhichOneof("kind") == "job_done" and first.job_done.job_id == 7 and first.job_done.ok
    assert (first.job_done.already_stored, first.job_done.not_stored) == (0, 0)
    second = store(8, keys, [0, 1, 2])
    assert second.WhichOneof("kind") == "job_done" and second.job_done.job_id == 8
    assert (second.job_done.ok, second.job_done.already_stored) == (True, 2)
    refused = store(9, keys, [0, 1])  # one block id short
    assert refused.WhichOneof("kind") == "refused" and refused.request_id == 9
    assert "3 keys but 2 block ids" in refused.refused.message
    raw.close()
    session.close()


@pytest.mark.parametrize("lane", ["native", "python"])
def test_frames_split_across_reads_and_packed_many_to_a_read_are_each_answered_in_order(start_daemon, lane):
    """A client's bytes reach the daemon however its writes were cut: hundreds
    of frames in one write (more than one read takes), frames cut anywhere,
    down to single bytes. Each is answered, in order, and the connection
    stays usable. Either lane."""
    import random

    daemon = start_daemon(lane=lane)
    session = RawSession(daemon.socket)
    keys = prompt_keys(16, prompt=350)

    def frame(request_id: int) -> bytes:
        data = pb.JobFrame(request_id=request_id, submit_load=pb.SubmitLoadRequest(
            session_id=session.id, worker_id=999, job_id=request_id, keys=keys, block_ids=list(range(16)))
        ).SerializeToString()
        return LENGTH.pack(len(data)) + data

    frames = b"".join(frame(i) for i in range(1, 1501))
    assert len(frames) > 3 * (256 << 10)  # more than the native lane's read of 256 KiB, and not a multiple of it
    cut = random.Random(35)
    at = len(frames) // 2
    session.jobs.sock.sendall(frames[:at])
    while at < len(frames):
        size = cut.choice([1, 1, 3, 7, 333, 4099, 70000])
        session.jobs.sock.sendall(frames[at:at + size])
        at += size
    for i in range(1, 1501):
        reply = session.jobs.reply()
        assert reply is not None and reply.request_id == i, f"reply {i}: {reply}"
        assert reply.refused.code == 5 and "unknown worker 999" in reply.refused.message
    session.jobs.send(pb.JobFrame(request_id=5000, submit_load=pb.SubmitLoadRequest(
        session_id=session.id, worker_id=999, job_id=5000, keys=keys[:1], block_ids=[0])))
    assert session.jobs.reply().request_id == 5000
    session.close()
