"""The remote tier's connection to a Valkey or Redis store: the URL, and the
few commands the tier sends, each under a timeout.

    valkey://host:port                   one server (redis:// is the same)
    valkeys://host:port                  the same over TLS (rediss://)
    valkey://host1:port1,host2:port2     a cluster, from these seed nodes
    valkey://host:port?cluster=1         a cluster from one seed node

The client is valkey-glide: its Rust core does the I/O, parsing and cluster
routing on its own threads, so the daemon's event loop spends little on a
2 MiB value, and it follows resharding (MOVED/ASK), failover and reconnection
itself. Its connection is lazy: the daemon starts while the store is away.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

SCHEMES = {"valkey": False, "redis": False, "valkeys": True, "rediss": True}
DEFAULT_PORT = 6379


class RemoteConfigError(ValueError):
    """A --remote URL or its files that cannot be used; the message says which part."""


@dataclass(frozen=True)
class RemoteSpec:
    nodes: tuple[tuple[str, int], ...]
    tls: bool
    cluster: bool
    user: str | None = None
    password: str | None = None
    ca_pem: bytes | None = None
    timeout_s: float = 0.5

    def describe(self) -> str:
        scheme = "valkeys" if self.tls else "valkey"
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}" + (" (cluster)" if self.cluster else "")


def remote_spec(tiers) -> RemoteSpec:
    """The store the daemon's configuration (its `tiers` group) names, its files read."""
    nodes, tls, cluster = parse_url(tiers.remote)
    password = _read(tiers.remote_password_file, "remote_password_file").decode().strip() \
        if tiers.remote_password_file else None
    ca_pem = _read(tiers.remote_ca_file, "remote_ca_file") if tiers.remote_ca_file else None
    if ca_pem is not None:
        if not tls:
            raise RemoteConfigError("remote_ca_file is for a TLS store: use valkeys:// or rediss://")
        _check_ca(tiers.remote_ca_file)
    try:
        import glide  # noqa: F401 - the client, only where --remote is used
    except ImportError:
        raise RemoteConfigError("remote: the valkey-glide package is not installed (pip install 'kvdepot[remote]')"
                                ) from None
    return RemoteSpec(nodes, tls, cluster, tiers.remote_user, password, ca_pem, tiers.remote_timeout)


def _read(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise RemoteConfigError(f"{option}: cannot read {path}: {e.strerror}") from None


def _check_ca(path: str) -> None:
    """Read as the TLS library will: a file of no certificate would fail every
    handshake later, each reported only as a store that does not answer."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except (ssl.SSLError, ValueError) as e:
        reason = getattr(e, "reason", None) or (e.args[-1] if e.args else type(e).__name__)
        raise RemoteConfigError(f"remote_ca_file: {path} holds no PEM CA certificate ({reason})") from None


def parse_url(url: str) -> tuple[tuple[tuple[str, int], ...], bool, bool]:
    """(nodes, tls, cluster) of a --remote URL; a password never goes in it (--remote-password-file)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise RemoteConfigError(f"remote: {url!r} must start with one of {', '.join(s + '://' for s in SCHEMES)}")
    netloc = parts.netloc
    if "@" in netloc:
        raise RemoteConfigError("remote: put the user in --remote-user and the password in --remote-password-file, "
                                "not in the URL (it would show in ps and in the log)")
    nodes = tuple(_node(hostport, url) for hostport in netloc.split(","))
    if parts.path not in ("", "/"):
        raise RemoteConfigError(f"remote: {url!r} has a path; the remote tier uses database 0")
    query = parse_qs(parts.query)
    unknown = set(query) - {"cluster"}
    if unknown:
        raise RemoteConfigError(f"remote: unknown URL parameter(s) {', '.join(sorted(unknown))}; known: cluster")
    flag = query.get("cluster", ["0"])[-1].lower()
    if flag not in ("0", "1", "yes", "no", "true", "false"):
        raise RemoteConfigError(f"remote: cluster={flag} must be 1 or 0")
    cluster = len(nodes) > 1 or flag in ("1", "yes", "true")
    return nodes, SCHEMES[parts.scheme], cluster


def _node(hostport: str, url: str) -> tuple[str, int]:
    """host:port or [v6-address]:port; the port 6379 when left out."""
    if hostport.startswith("["):
        host, closed, rest = hostport[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise RemoteConfigError(f"remote: {hostport!r} in {url!r} is not [address]:port")
        port = rest[1:]
    else:
        host, _, port = hostport.partition(":")
    if not host:
        raise RemoteConfigError(f"remote: {hostport!r} in {url!r} names no host")
    try:
        number = int(port) if port else DEFAULT_PORT
    except ValueError:
        raise RemoteConfigError(f"remote: the port of {hostport!r} is not a number") from None
    if not 0 < number < 65536:
        raise RemoteConfigError(f"remote: port {number} is out of range")
    return host, number


class RemoteStore:
    """The store, as the remote tier uses it. Every call ends within the
    timeout: a TimeoutError or a RemoteUnavailable the tier counts against the
    store, never an exception an engine sees."""

    def __init__(self, spec: RemoteSpec):
        self.spec = spec
        self._client = None
        self._connecting: asyncio.Task | None = None

    async def _connect(self):
        from glide import (
            AdvancedGlideClientConfiguration,
            AdvancedGlideClusterClientConfiguration,
            BackoffStrategy,
            GlideClient,
            GlideClientConfiguration,
            GlideClusterClient,
            GlideClusterClientConfiguration,
            Logger,
            LogLevel,
            NodeAddress,
            ServerCredentials,
            TlsAdvancedConfiguration,
        )

        # glide logs every failed connection attempt (one a request while a
        # store refuses): the tier's breaker says it once instead.
        Logger.set_logger_config(LogLevel.OFF)
        spec = self.spec
        credentials = ServerCredentials(password=spec.password, username=spec.user) if spec.password else None
        tls = TlsAdvancedConfiguration(root_pem_cacerts=spec.ca_pem) if spec.tls and spec.ca_pem else None
        timeout_ms = max(1, int(spec.timeout_s * 1000))
        common = dict(
            addresses=[NodeAddress(h, p) for h, p in spec.nodes],
            use_tls=spec.tls,
            credentials=credentials,
            request_timeout=timeout_ms,
            reconnect_strategy=BackoffStrategy(num_of_retries=8, factor=50, exponent_base=2),
            client_name="kvdepotd",
            lazy_connect=True,
        )
        if spec.cluster:
            advanced = AdvancedGlideClusterClientConfiguration(connection_timeout=timeout_ms, tls_config=tls)
            return await GlideClusterClient.create(GlideClusterClientConfiguration(**common, advanced_config=advanced))
        advanced = AdvancedGlideClientConfiguration(connection_timeout=timeout_ms, tls_config=tls)
        return await GlideClient.create(GlideClientConfiguration(**common, advanced_config=advanced))

    async def client(self):
        """The one glide client, made by the first call that needs it (calls
        at once wait for the same one: each would be a client left open)."""
        if self._client is None:
            if self._connecting is None:
                self._connecting = asyncio.ensure_future(self._connect())
            connecting = self._connecting
            try:
                client = await asyncio.wait_for(asyncio.shield(connecting), self.spec.timeout_s * 4)
            except BaseException:
                if connecting.done() and self._connecting is connecting:
                    self._connecting = None  # failed: the next call tries again
                raise
            if self._client is None:
                self._client = client
        return self._client

    async def ping(self) -> None:
        """Connects (the client is lazy) and checks the store answers."""
        client = await self.client()
        await self._bounded(client.ping())

    async def lengths(self, keys: list[bytes]) -> list[int]:
        """STRLEN of each key (0: absent; -1: a key of another type, which anyone
        who can write the store can make), pipelined. One such key is that
        block's miss, not the whole batch's failure (nor the breaker's)."""
        client = await self.client()
        replies = await self._bounded(asyncio.gather(*(client.strlen(k) for k in keys), return_exceptions=True))
        sizes = []
        for reply in replies:
            if isinstance(reply, BaseException):
                if not self.replied(reply, "WRONGTYPE"):
                    raise reply
                reply = -1
            sizes.append(reply)
        return sizes

    async def get(self, keys: list[bytes], sizes: list[int]) -> list[bytes | None]:
        """The first `sizes[i]` bytes of each key's value (GETRANGE: a value the
        store or another client made larger since is not read whole, so what
        one reply can make the daemon hold is bounded by what it expects)."""
        client = await self.client()
        replies = await self._bounded(asyncio.gather(*(client.getrange(k, 0, n - 1) for k, n in zip(keys, sizes))))
        return [reply or None for reply in replies]

    async def put(self, key: bytes, value) -> bool:
        """SET NX: a value another node wrote first stays (it holds the same block)."""
        from glide import ConditionalChange

        client = await self.client()
        answer = await self._bounded(client.set(key, value, conditional_set=ConditionalChange.ONLY_IF_DOES_NOT_EXIST))
        return answer is not None

    async def diagnose(self, error: BaseException) -> str:
        """What keeps the daemon from the store, in words. glide reports a
        refused connection, a name that does not resolve and a failed TLS
        handshake alike (a request that timed out): a plain connection to
        the first node, TLS as configured, tells them apart."""
        said = f"{type(error).__name__}: {error}".strip() if str(error) else type(error).__name__
        (host, port), wait = self.spec.nodes[0], self.spec.timeout_s * 4
        context = None
        if self.spec.tls:
            context = ssl.create_default_context(cadata=self.spec.ca_pem.decode()) if self.spec.ca_pem \
                else ssl.create_default_context()
        try:
            connecting = asyncio.open_connection(host, port, ssl=context, server_hostname=host if context else None)
            _, writer = await asyncio.wait_for(connecting, wait)
        except socket.gaierror as e:
            return f"{self.spec.describe()}: {host} does not resolve ({e.strerror})"
        except ssl.SSLError as e:
            return f"{self.spec.describe()}: the TLS handshake with {host}:{port} failed ({e.reason or e})"
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11, two before
            return f"{self.spec.describe()}: {host}:{port} did not accept a connection within {wait:g} s"
        except OSError as e:
            return f"{self.spec.describe()}: {host}:{port}: {e.strerror or e}"
        writer.close()
        # Then the store's own words (a wrong password, an ACL) are in glide's.
        return f"{self.spec.describe()}: {host}:{port} accepts connections, but the store did not answer ({said})"

    @staticmethod
    def replied(error: BaseException, *codes: str) -> bool:
        """Whether `error` is the server's error reply of one of `codes` to the
        command, not a timeout, a lost connection or one that could not be
        made (glide reports a failed connect or login as a RequestError too)."""
        try:
            from glide import ConnectionError as Lost
            from glide import RequestError
            from glide import TimeoutError as Late
        except ImportError:
            return False
        if not isinstance(error, RequestError) or isinstance(error, (Lost, Late)):
            return False
        return any(code in str(error) for code in codes)

    @classmethod
    def refused(cls, error: BaseException) -> bool:
        """Whether the server refused a write while it answers (out of memory
        under noeviction, an ACL without SET, a read-only replica)."""
        return cls.replied(error, "OOM", "NOPERM", "READONLY")

    async def _bounded(self, awaitable):
        # glide times each request out itself; this bounds a gather of many
        # and the wait for a connection.
        return await asyncio.wait_for(awaitable, self.spec.timeout_s * 4)

    async def close(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self.spec.timeout_s * 4)
            except Exception:  # noqa: BLE001 - closing a client whose store is gone
                pass
