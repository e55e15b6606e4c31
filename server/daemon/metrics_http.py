"""The HTTP listener of /metrics, bounded: no one who can reach the port can
make the daemon hold threads or descriptors by opening connections.

prometheus_client's own server gives every connection a thread for as long as
the peer keeps it open, without a cap or a timeout. Here:

- at most `max_connections` connections are open at once, each served by a
  thread of its own, so threads are bounded by the same number;
- each read and write of a connection has `timeout` seconds;
- at the cap, the oldest connection that has not yet sent its request is
  closed to make room: a peer that holds connections idle loses them to a
  scraper that asks at once. With none such (every one is being answered) the
  new connection is closed at once.

Refusals and failed requests are logged at most once per interval: anyone who
can reach the port could flood the log otherwise. A scrape's snapshot is taken
on the event loop and its text made under the GIL, so scrapes are rendered one
at a time, and the open view's text is reused for PUBLIC_REUSE_S: scraping it
in a loop costs the daemon one rendering a second, however many scrape.

Who sees what: every scrape gets the node-wide series; the per-tenant ones
(namespace names, scopes and counts) only a scrape that sends the metrics token
or, over HTTPS, presents a client certificate the metrics client CAs signed.
"""

from __future__ import annotations

import hmac
import http.server
import logging
import socket
import socketserver
import ssl
import sys
import threading
import time
from dataclasses import dataclass

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from kvdepot.logsafe import RateLimitedLog, one_line

log = logging.getLogger("kvdepot.metrics")

# Seconds a rendering of the node-wide view answers later scrapes (Prometheus
# scrapes every 15 s or so; a scraper more often only sees the same numbers).
PUBLIC_REUSE_S = 1.0


@dataclass(frozen=True)
class MetricsLimits:
    max_connections: int
    timeout: float


@dataclass(frozen=True)
class Views:
    """What a scrape is shown: `public` without a credential, `full` with the
    token or a verified client certificate (None: neither is set up, and no
    scrape sees per-tenant series)."""

    public: Collector
    full: Collector | None = None
    token: str | None = None


class _Connection:
    __slots__ = ("sock", "since", "asked")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.since = time.monotonic()
        # Set once its whole request has arrived: from then it is not evicted.
        self.asked = False


class BoundedMetricsServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    # The kernel's queue of connections not yet accepted: the accepting thread
    # empties it at once, and a connection past the cap is closed there.
    request_queue_size = 64

    def __init__(self, host: str, port: int, views: Views, limits: MetricsLimits, tls: ssl.SSLContext | None = None):
        self.address_family = _family(host, port)
        self.views = views
        self.limits = limits
        self.tls = tls
        self._lock = threading.Lock()
        self._open: dict[socket.socket, _Connection] = {}
        self.refused = 0
        self.evicted = 0
        self._rate_limited = RateLimitedLog(log)
        self._render_lock = threading.Lock()
        # content type -> (when, text) of the node-wide view
        self._public_texts: dict[str, tuple[float, bytes]] = {}
        super().__init__((host, port), _Handler)

    # ------------------------------------------------ connections, bounded

    def get_request(self):
        sock, address = super().get_request()
        if self.tls is not None:
            # The handshake is the connection's own thread's (_Handler.setup),
            # under its timeout: this thread only accepts.
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def process_request(self, request, client_address) -> None:
        with self._lock:
            if len(self._open) >= self.limits.max_connections and not self._evict_idle():
                self.refused += 1
                admitted = False
            else:
                self._open[request] = _Connection(request)
                admitted = True
        if not admitted:
            self.shutdown_request(request)
            self._rate_limited.warning(
                "refused",
                "metrics: refused a connection from %s: %d connections are open and every one is being "
                "answered (--metrics-max-connections)",
                _peer(client_address), self.limits.max_connections,
            )
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._forget(request)
            self.shutdown_request(request)
            self._rate_limited.warning("thread", "metrics: could not start a thread for a connection", exc_info=True)

    def _evict_idle(self) -> bool:
        """Closes the oldest connection still waiting for its request (lock held)."""
        idle = [c for c in self._open.values() if not c.asked]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.since)
        del self._open[victim.sock]
        self.evicted += 1
        try:
            # Wakes its thread, whose read then ends; the thread closes it. The
            # plain socket's shutdown: a TLS socket's would drop its TLS state
            # under the thread that reads it.
            socket.socket.shutdown(victim.sock, socket.SHUT_RDWR)
        except OSError:
            pass
        self._rate_limited.warning(
            "evicted",
            "metrics: closed a connection that sent no request, to make room (%d open at most: "
            "--metrics-max-connections)",
            self.limits.max_connections,
        )
        return True

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request) -> None:
        with self._lock:
            self._open.pop(request, None)

    def mark_asked(self, request) -> None:
        with self._lock:
            connection = self._open.get(request)
            if connection is not None:
                connection.asked = True

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            # The peer's doing (a timeout, a reset, a failed TLS handshake, an
            # eviction): anyone can cause it, and the scraper reports its own.
            log.debug("metrics: a connection from %s failed: %s", _peer(client_address), one_line(error))
            return
        self._rate_limited.warning("error", "metrics: a request from %s failed", _peer(client_address),
                                   exc_info=True)

    # ------------------------------------------------ who sees what

    def view_for(self, authorization: str | None, certified: bool = False) -> Collector | None:
        """The registry to show; None for a wrong token (401). `certified`: the
        scrape presented a client certificate the metrics client CAs signed."""
        if authorization is None:
            return self.views.full if certified and self.views.full is not None else self.views.public
        token = self.views.token
        scheme, _, given = authorization.partition(" ")
        if (
            token is not None
            and scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(errors="replace"), token.encode())
        ):
            return self.views.full
        return None

    def render(self, view: Collector, accept: str | None) -> tuple[bytes, str]:
        """The text of `view` in the format the scraper accepts, and its content type."""
        encoder, content_type = choose_encoder(accept)
        with self._render_lock:
            now = time.monotonic()
            if view is self.views.public:
                when, text = self._public_texts.get(content_type, (None, b""))
                if when is not None and now - when < PUBLIC_REUSE_S:
                    return text, content_type
            text = encoder(view)
            if view is self.views.public:
                self._public_texts[content_type] = (now, text)
            return text, content_type

    def wrong_token(self, client_address) -> None:
        self._rate_limited.warning(
            "token", "metrics: a scrape from %s sent a wrong token (--metrics-token-file)", _peer(client_address)
        )


class _Handler(http.server.BaseHTTPRequestHandler):
    # One request a connection: a kept-alive connection would hold its thread.
    protocol_version = "HTTP/1.0"
    server: BoundedMetricsServer

    def setup(self) -> None:
        self.timeout = self.server.limits.timeout
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    def do_GET(self) -> None:
        self.server.mark_asked(self.request)
        # Not empty only for a certificate the client CAs verified.
        certified = isinstance(self.connection, ssl.SSLSocket) and bool(self.connection.getpeercert())
        view = self.server.view_for(self.headers.get("Authorization"), certified)
        if view is None:
            self.server.wrong_token(self.client_address)
            self._answer(401, b"wrong metrics token\n", "text/plain; charset=utf-8",
                         [("WWW-Authenticate", 'Bearer realm="kvdepot"')])
            return
        text, content_type = self.server.render(view, self.headers.get("Accept"))
        self._answer(200, text, content_type)

    def _answer(self, code: int, body: bytes, content_type: str, headers: list = ()) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        # Timeouts and malformed requests: anyone can make them, so debug only.
        log.debug("metrics: %s: %s", _peer(self.client_address), one_line(format % args))


def _family(host: str, port: int) -> socket.AddressFamily:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0]


def _peer(client_address) -> str:
    try:
        return f"{client_address[0]}:{client_address[1]}"
    except (TypeError, IndexError):
        return str(client_address)
