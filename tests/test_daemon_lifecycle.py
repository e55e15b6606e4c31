"""Start-up, refusal, configuration and shutdown of the real daemon process."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import subprocess_env, wait_until
from kvcache import make_kv_cache, namespace, prompt_keys

from kvdepot import errors


def run_daemon(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvdepot.server", *args],
        capture_output=True, text=True, env=subprocess_env(), timeout=timeout,
    )


def test_a_second_daemon_on_a_served_socket_refuses_to_start(daemon, tmp_path):
    proc = run_daemon("--listen", daemon.socket, "--pool-size", "4MiB", "--pin", "off", "--pool-dir", str(tmp_path))
    assert proc.returncode == 1
    assert f"another kvdepotd (pid {daemon.proc.pid}) is already serving unix:{daemon.socket}" in proc.stderr
    assert daemon.running
    assert list(tmp_path.glob("*.pool")) == []


def test_a_stale_socket_file_does_not_stop_a_new_daemon(start_daemon, tmp_path):
    folder = tmp_path / "stale"
    folder.mkdir()
    # What a crashed daemon leaves: a socket file nobody listens on.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(folder / "kvdepot.sock"))
    s.close()
    daemon = start_daemon(folder=folder)
    assert "removing the stale socket" in daemon.log()


def test_sigterm_drains_jobs_in_flight_then_exits_0(start_held_daemon, client_factory):
    daemon = start_held_daemon()
    daemon.hold()
    client = client_factory(daemon)
    tensors, block_dim = make_kv_cache("per_layer", seed=11)
    worker = client.register_worker(namespace("per_layer"), rank=0, tensors=tensors, block_dim=block_dim)
    client.submit_store(worker, 1, prompt_keys(4, prompt=50), [0, 1, 2, 3])
    # A submit returns once the job is on the socket; SIGTERM is sent once the daemon holds it.
    wait_until(lambda: client.stats().pinned_slots == 4, what="the store in flight")
    daemon.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining 1 job(s)" in daemon.log(), what="the daemon draining")
    time.sleep(0.5)
    assert daemon.running, "the daemon exited with a job in flight"
    # New jobs are refused while draining; the client reports them failed.
    refused = client.submit_store(worker, 2, prompt_keys(2, prompt=51), [5, 6])
    result = client.wait([refused], 10)[refused]
    assert not result.ok and "shutting down" in result.error
    daemon.release()
    assert client.wait([1], 10)[1].ok
    assert daemon.proc.wait(20) == 0
    assert not (daemon.folder / "kvdepot.sock").exists()
    # The pool stays, the daemon's user's alone, for the next daemon to adopt.
    [pool] = daemon.folder.glob("*.pool")
    assert pool.stat().st_mode & 0o777 == 0o600


def test_sigterm_gives_up_on_a_stuck_job_after_the_drain_timeout(start_held_daemon, client_factory):
    daemon = start_held_daemon(drain_timeout=1)
    daemon.hold()
    client = client_factory(daemon)
    tensors, block_dim = make_kv_cache("per_layer", seed=12)
    worker = client.register_worker(namespace("per_layer"), rank=0, tensors=tensors, block_dim=block_dim)
    client.submit_store(worker, 1, prompt_keys(2, prompt=52), [0, 1])
    wait_until(lambda: client.stats().pinned_slots == 2, what="the store in flight")
    assert daemon.stop(timeout=20) == 0
    assert "still in flight after 1 s" in daemon.log()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pool-size", "lots"], "'lots' is not a size"),
        (["--pool-size", "1KiB", "--slot-size", "2MiB"], "smaller than one slot"),
        (["--eviction", "fifo"], "invalid choice: 'fifo'"),
        (["--listen", "127.0.0.1:0"], "refusing to serve TCP"),
        (["--pool-size", "100TiB"], "fits nowhere"),
        # Refused before anything the size of the pool is made (it used to take seconds and gigabytes first).
        (["--pool-size", "100TiB", "--pool-dir", "DIR"], "lower --pool-size, or give a --pool-dir with room"),
        (["--auth-token-file", "/nonexistent/token"], "cannot read the auth token file /nonexistent/token"),
        (["--auth-token-file", "EMPTY"], "is empty"),
        (["--copy-chunk-bytes", "1000"], "copy_chunk_bytes must be a power of two"),
        (["--copy-chunk-bytes", "64KiB"], "copy_chunk_bytes must be a power of two from 64 to 32768"),
        (["--copy-mode", "pio"], "invalid choice: 'pio'"),
        (["--pin", "auto", "--staging-bytes", "1KiB"], "staging_bytes (1024) must hold at least one pool slot"),
        (["--listen", "0.0.0.0:0", "--auth-token-file", "TOKEN"], "without TLS: tokens would travel in clear"),
        (["--tls-cert-file", "TOKEN"], "tls_cert_file and tls_key_file go together"),
        (["--admin-uids", "root"], "admin_uids must be uids"),
        # nan passes every range check and inf overflows the timers: both used to get through.
        (["--job-hello-timeout", "nan"], "nan is not a valid job_hello_timeout: it must be a finite number"),
        (["--grpc-idle-timeout", "inf"], "inf is not a valid grpc_idle_timeout: it must be a finite number"),
        (["--grpc-handshake-timeout", "1e30"], "grpc_handshake_timeout must be more than 0 seconds and at most"),
        (["--metrics-timeout", "nan"], "is not a valid metrics_timeout: it must be a finite number"),
        (["--drain-timeout", "nan"], "is not a valid drain_timeout: it must be a finite number"),
        (["--max-job-frame-bytes-per-uid", "16MiB"], "max_job_frame_bytes_per_uid must be at least 64MiB"),
        (["--max-job-frame-bytes-per-uid", "20000000TiB"], "max_job_frame_bytes_per_uid must be at least 64MiB"),
        (["--max-unread-job-replies", "2048TiB"], "max_unread_job_replies must be at least 1MiB and at most 1TiB"),
        # It used to be taken, and every TLS handshake with the store then failed, reported as a timeout.
        (["--remote", "valkeys://127.0.0.1:6380", "--remote-ca-file", "TOKEN"],
         "TOKEN holds no PEM CA certificate (NO_CERTIFICATE_OR_CRL_FOUND)"),
        (["--remote", "valkeys://127.0.0.1:6380", "--remote-ca-file", "EMPTY"],
         "EMPTY holds no PEM CA certificate (NO_CERTIFICATE_OR_CRL_FOUND)"),
    ],
)
def test_bad_configuration_is_refused_with_a_clear_message(tmp_path, args, message):
    (tmp_path / "EMPTY").write_text("\n")
    (tmp_path / "TOKEN").write_text("s3cret\n")
    args = [str(tmp_path / a) if a in ("EMPTY", "TOKEN") else str(tmp_path) if a == "DIR" else a for a in args]
    proc = run_daemon("--pin", "off", *(["--listen", str(tmp_path / "s.sock")] if "--listen" not in args else []),
                      *args)
    assert proc.returncode in (1, 2)
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_configuration_from_toml_and_environment(tmp_path):
    from kvdepot.server.daemon.config import load_config

    config_file = tmp_path / "kvdepot.toml"
    config_file.write_text('pool_size = "2GiB"\neviction = "arc"\nslot_size = "1MiB"\n')
    env = {"KVDEPOT_POOL_SIZE": "3GiB", "KVDEPOT_LISTEN": "/tmp/x.sock"}
    config = load_config(["--config", str(config_file), "--slot-size", "512KiB"], environ=env)
    assert config.pool.size == 3 << 30  # environment over file
    assert config.pool.slot_size == 512 << 10  # flag over file
    assert config.pool.eviction == "arc"  # file over default
    assert config.network.listen == "/tmp/x.sock"
    # The CUDA transport's tuning goes through the same three layers.
    config_file.write_text('copy_mode = "kernel"\nstaging_bytes = "64MiB"\nspin_bytes = 0\n')
    config = load_config(["--config", str(config_file), "--spin-bytes", "1MiB"],
                         environ={"KVDEPOT_STAGING_BYTES": "96MiB", "KVDEPOT_PIN_CHUNK_BYTES": "4MiB"})
    assert config.copy.mode == "kernel"
    assert (config.copy.staging_bytes, config.copy.spin_bytes, config.pool.pin_chunk_bytes) == (
        96 << 20, 1 << 20, 4 << 20
    )
    assert config.copy.chunk_bytes == 16384 and config.copy.programs == 0  # defaults
    # An empty variable counts as unset; staging is only checked where it is used.
    config = load_config(["--pin", "off", "--slot-size", "512MiB", "--pool-size", "1GiB"],
                         environ={"KVDEPOT_STAGING_BYTES": "", "KVDEPOT_SPIN_BYTES": ""})
    assert (config.copy.staging_bytes, config.copy.spin_bytes) == (128 << 20, 64 << 20)
    config_file.write_text('pool_sise = "2GiB"\n')
    with pytest.raises(ValueError, match="unknown option\\(s\\) pool_sise"):
        load_config(["--config", str(config_file)], environ={})
    # A value of the wrong kind is named with where it came from and what it must be.
    with pytest.raises(ValueError) as info:
        load_config([], environ={"KVDEPOT_DRAIN_TIMEOUT": "abc"})
    assert str(info.value) == "KVDEPOT_DRAIN_TIMEOUT: 'abc' is not a valid drain_timeout: it must be a number"


def test_help_explains_every_option():
    proc = run_daemon("--help")
    assert proc.returncode == 0
    for flag in ("--listen", "--pool-size", "--slot-size", "--pool-dir", "--eviction", "--pin",
                 "--auth-token-file", "--drain-timeout", "--log-format", "KVDEPOT_POOL_SIZE", "--copy-mode",
                 "--staging-bytes", "--spin-bytes", "--copy-chunk-bytes", "--copy-programs", "--pin-chunk-bytes"):
        assert flag in proc.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_needs_the_auth_token(start_daemon, tmp_path, client_factory):
    from kvdepot.client import KVDepotClient
    from kvdepot.client.cli import OperatorClient

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    address = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(listen=address, auth_token_file=str(token_file))
    with pytest.raises(errors.Unauthenticated):
        OperatorClient(address, auth_token="wrong").stats()
    assert OperatorClient(address).health() == "SERVING"  # probes need no token
    client = KVDepotClient(address, auth_token="s3cret")
    try:
        client.connect(10)
        assert client.stats().daemon_instance
    finally:
        client.close()
    # And a second daemon cannot take the same port.
    proc = run_daemon("--listen", address, "--auth-token-file", str(token_file), "--pin", "off",
                      "--pool-size", "4MiB", "--pool-dir", str(tmp_path))
    assert proc.returncode == 1 and f"cannot listen on {address}" in proc.stderr
    assert daemon.running


def test_defaults_alone_give_a_working_daemon_that_tells_systemd_it_is_ready(tmp_path):
    """What `make run` does: no flags at all. The socket goes in the runtime dir."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(60)
    env = subprocess_env(XDG_RUNTIME_DIR=str(tmp_path), NOTIFY_SOCKET=str(tmp_path / "notify"))
    env.pop("KVDEPOT_SOCKET", None)
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot.server"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (message := notify.recv(1024)).startswith(b"READY=1"):
            assert message.startswith(b"STATUS=")  # start-up progress comes first
        sock = tmp_path / "kvdepot" / "kvdepot.sock"
        assert sock.is_socket()
        health = subprocess.run([sys.executable, "-m", "kvdepot.client.cli", "health"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert health.stdout.strip() == "SERVING", health.stderr
        stats = subprocess.run([sys.executable, "-m", "kvdepot.client.cli", "stats", "--json"], env=env,
                               capture_output=True, text=True, timeout=60)
        import json

        pool = json.loads(stats.stdout)["pool"]
        assert pool["num_slots"] * pool["slot_bytes"] == 1 << 30
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert notify.recv(1024).startswith(b"STOPPING=1")
        pool_file = re.search(r"pool ready in [0-9.]+ s: .* at (\S+\.pool)", proc.stderr.read()).group(1)
        # The pool stays, its user's alone, for the next daemon on the address.
        assert not sock.exists() and os.stat(pool_file).st_mode & 0o777 == 0o600
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()
        # A GiB of /dev/shm (or wherever it went): a test leaves none behind.
        target = f"unix:{tmp_path / 'kvdepot' / 'kvdepot.sock'}"
        prefix = "kvdepot-" + hashlib.sha256(target.encode()).hexdigest()[:12]
        for folder in ("/dev/shm", str(tmp_path / "kvdepot"), "/tmp"):
            for left in glob.glob(f"{folder}/{prefix}-*"):
                os.unlink(left)


def test_a_client_of_another_protocol_version_is_refused_with_a_reason(daemon):
    import grpc

    from kvdepot.defaults import PROTOCOL_VERSION
    from kvdepot.proto import kvdepot_pb2 as pb
    from kvdepot.proto import kvdepot_pb2_grpc as pb_grpc

    # 0 is what a client that does not set the field sends.
    for other in (0, PROTOCOL_VERSION + 1):
        with grpc.insecure_channel("unix:" + daemon.socket) as channel:
            stream = pb_grpc.KVDepotStub(channel).Attach(pb.AttachRequest(client_name="other", protocol_version=other))
            with pytest.raises(grpc.RpcError) as info:
                next(stream)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"speaks protocol version {PROTOCOL_VERSION}, the client {other}" in info.value.details()


def test_the_cli_reports_a_bad_token_file_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvdepot.client.cli", "--auth-token-file", str(tmp_path / "none"),
                           "health"], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert proc.returncode == 2
    assert "cannot read the auth token file" in proc.stderr and "Traceback" not in proc.stderr
