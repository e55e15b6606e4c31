"""A local user against the metrics port, from a process of its own (no
kvdepot import: any user can run it). Each command prints one line.

  scrape URL [TOKEN]         GET the URL (with the token, if given): the status, then the body
  idle HOST PORT N CAP       open N connections and send nothing; say how many the daemon
                             closed once at least N - CAP are ("closed K"), or "timeout K"
                             after 30 s; then, after a line on stdin, wait until the daemon
                             has closed every one ("all closed", or "timeout K")
"""

from __future__ import annotations

import select
import socket
import sys
import time
import urllib.error
import urllib.request

DEADLINE_S = 30.0


def scrape(url: str, token: str | None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            status, body = response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode()
    print(status)
    print(body, flush=True)


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def wait_closed(open_socks: list, wanted: int) -> int:
    """Closed connections counted until `wanted` are closed or the deadline."""
    closed, deadline = 0, time.monotonic() + DEADLINE_S
    while closed < wanted and time.monotonic() < deadline:
        readable, _, _ = select.select(open_socks, [], [], 0.2)
        for sock in readable:
            if closed_by_peer(sock):
                open_socks.remove(sock)
                sock.close()
                closed += 1
    return closed


def idle(host: str, port: int, count: int, cap: int) -> None:
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(count)]
    closed = wait_closed(socks, count - cap)
    print(f"closed {closed}" if closed >= count - cap else f"timeout {closed}", flush=True)
    sys.stdin.readline()
    left = len(socks)
    closed = wait_closed(socks, left)
    print("all closed" if closed == left else f"timeout {closed}", flush=True)


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "scrape":
        scrape(args[0], args[1] if len(args) > 1 else None)
    elif command == "idle":
        idle(args[0], int(args[1]), int(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main()
