"""What systemd hears from the daemon ($NOTIFY_SOCKET, sd_notify's datagrams):
start-up progress for `systemctl status`, and READY=1 only once calls are answered."""

from __future__ import annotations

import socket
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def receive(sock: socket.socket, until: str, timeout: float = 60.0) -> list[dict[str, str]]:
    """The datagrams up to and including the first that sets `until`, each as its KEY=VALUE lines."""
    messages = []
    deadline = time.monotonic() + timeout
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = sock.recv(4096)
        messages.append(dict(line.split("=", 1) for line in data.decode().splitlines()))
        if until in messages[-1]:
            return messages


def test_systemd_hears_progress_then_ready_once_calls_are_answered(start_daemon, tmp_path):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    daemon = start_daemon(wait=False, env={"NOTIFY_SOCKET": str(tmp_path / "notify")}, pool_size="64MiB")

    messages = receive(notify, until="READY")
    # Right away, as systemd's clients would: no retry, no waiting for the channel.
    with grpc.insecure_channel("unix:" + daemon.socket) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvdepot.v1.KVDepot"), timeout=5, wait_for_ready=False
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING

    *before, ready = messages
    assert ready == {"READY": "1", "STATUS": f"serving on unix:{daemon.socket}"}
    statuses = [m["STATUS"] for m in before]
    assert statuses[0] == "bringing the pool up: 0.0 of 64.0 MiB (0%)"
    assert statuses[-1] == "bringing the pool up: 64.0 of 64.0 MiB (100%)"
    assert all(set(m) == {"STATUS"} for m in before)

    assert daemon.stop() == 0
    [stopping] = receive(notify, until="STOPPING")
    assert stopping == {"STOPPING": "1", "STATUS": "stopping: draining 0 job(s)"}
    notify.close()
