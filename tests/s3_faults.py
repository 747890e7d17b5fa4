"""A fault-injecting HTTP proxy for S3 on loopback, put between s3fs and the moto server.

Point a store at it with ``storage_options={"endpoint_url": proxy.url}``. Each request may
meet one fault, drawn from ``kinds`` at ``rate`` by a generator seeded with ``seed`` (the draw
is the n-th of the proxy's life, so a sequential client sees the same faults on every run):

- ``drop_request``  close the connection (with a reset) before forwarding anything
- ``drop_response`` forward, let the server apply the request, then reset instead of replying
- ``delay``         wait ``delay_s`` before forwarding
- ``500``           reply 500 InternalError without forwarding
- ``503``           reply 503 SlowDown (S3's throttling reply) without forwarding
- ``truncate``      forward, then send the headers and only half the body, and reset; a
                    reply without a body gets ``drop_response`` instead

:meth:`FaultProxy.force` queues exact faults for the next matching requests. The proxy counts
requests by operation (GET, PUT, HEAD, DELETE, POST, and LIST for a GET with ``list-type``).

:meth:`FaultProxy.hold` makes matching requests *late*: each is kept (not forwarded) and its
connection reset, so the client sees a request whose outcome it cannot know and gives up;
:meth:`FaultProxy.release` delivers a held request to the server afterwards, as a request
stuck in the network would arrive.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import sys
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("drop_request", "drop_response", "delay", "500", "503", "truncate")
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
}
_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
}


def operation(method: str, path: str) -> str:
    """The S3 operation class a request counts as: LIST for object listings."""
    query = urlsplit(path).query
    if method == "GET" and ("list-type=" in query or "delimiter=" in query):
        return "LIST"
    return method


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that timed out and left (a delayed request) is part of the game, not news.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class FaultProxy:
    """A threaded loopback proxy in front of ``upstream`` (``http://host:port``)."""

    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.0,
        kinds: tuple[str, ...] = KINDS,
        seed: int = 0,
        delay_s: float = 0.2,
    ) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rate = rate
        self.kinds = tuple(kinds)
        self.delay_s = delay_s
        self.methods: set[str] | None = None  # drawn faults only hit these methods; None: all
        # Forward without If-None-Match: a backend that ignores conditional writes.
        self.ignore_conditional = False
        # Called as on_fault(kind, method, path) when a fault is injected, under the proxy's
        # lock: a test may change rate, kinds or methods from it to script what follows.
        self.on_fault: Callable[[str, str, str], None] | None = None
        self.counts: Counter[str] = Counter()  # requests received, by operation
        self.faults: Counter[str] = Counter()  # faults injected, by kind
        self.log: list[tuple[str, str]] = []  # (operation, path) of every request received
        self._random = random.Random(seed)
        self._forced: list[tuple[str, str | None, str | None]] = []
        self._hold: tuple[str | None, str | None] | None = None
        # (method, path, headers, body) of every request held, in arrival order
        self.held: list[tuple[str, str, list[tuple[str, str]], bytes]] = []
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def force(self, kind: str, *, method: str | None = None, path_contains: str | None = None):
        """Inject ``kind`` into the next request of ``method`` whose path contains
        ``path_contains`` (either may be None for any), regardless of the rate."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {KINDS}")
        with self._lock:
            self._forced.append((kind, method, path_contains))

    def hold(self, *, method: str | None = None, path_contains: str | None = None) -> None:
        """From now on, keep every request of ``method`` whose path contains ``path_contains``
        instead of forwarding it, and reset its connection (see :meth:`release`)."""
        with self._lock:
            self._hold = (method, path_contains)

    def stop_holding(self) -> None:
        with self._lock:
            self._hold = None

    def release(self, index: int = 0) -> int:
        """Deliver the ``index``-th held request to the server now; returns its status."""
        method, path, headers, body = self.held[index]
        status, _, _ = _send(self.upstream, method, path, headers, body, self.ignore_conditional)
        return status

    def _holds(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> bool:
        with self._lock:
            if self._hold is None:
                return False
            want_method, want_path = self._hold
            if (want_method is None or want_method == method) and (
                want_path is None or want_path in path
            ):
                self.counts[operation(method, path)] += 1
                self.log.append((operation(method, path), path))
                self.held.append((method, path, headers, body))
                return True
            return False

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
            self.faults.clear()
            self.log.clear()

    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            self.counts[operation(method, path)] += 1
            self.log.append((operation(method, path), path))
            for i, (kind, want_method, want_path) in enumerate(self._forced):
                if (want_method is None or want_method == method) and (
                    want_path is None or want_path in path
                ):
                    del self._forced[i]
                    return self._injected(kind, method, path)
            roll = self._random.random()
            kind = self._random.choice(self.kinds) if self.kinds else None
            if kind is None or roll >= self.rate:
                return None
            if self.methods is not None and method not in self.methods:
                return None
            return self._injected(kind, method, path)

    def _injected(self, kind: str, method: str, path: str) -> str:
        self.faults[kind] += 1
        if self.on_fault is not None:
            self.on_fault(kind, method, path)
        return kind

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect
            disable_nagle_algorithm = True  # headers and body go out as separate writes

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reset(self) -> None:
                # SO_LINGER 0: close with RST, what a dropped connection looks like to a client.
                self.wfile.flush()
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                self.connection.close()

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                return _send(
                    proxy.upstream,
                    self.command,
                    self.path,
                    list(self.headers.items()),
                    body,
                    proxy.ignore_conditional,
                )

            def _reply(
                self, status: int, headers: list[tuple[str, str]], data: bytes, cut: bool = False
            ) -> None:
                self.send_response_only(status)
                length = None
                for key, value in headers:
                    low = key.lower()
                    if low in _HOP_BY_HOP:
                        continue
                    if low == "content-length":
                        length = value
                        if self.command != "HEAD":
                            continue
                    self.send_header(key, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                elif length is None:
                    self.send_header("Content-Length", "0")
                self.end_headers()
                if self.command == "HEAD":
                    return
                if cut:
                    self.wfile.write(data[: len(data) // 2])
                    self._reset()
                    return
                self.wfile.write(data)

            def _handle(self) -> None:
                body = self._body()
                if proxy._holds(self.command, self.path, list(self.headers.items()), body):
                    self._reset()
                    return
                fault = proxy._decide(self.command, self.path)
                if fault == "drop_request":
                    self._reset()
                    return
                if fault in _ERRORS:
                    status, code, message = _ERRORS[fault]
                    xml = (
                        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
                        f"{code}</Code><Message>{message}</Message>"
                        "<RequestId>dynstate-fault</RequestId></Error>"
                    ).encode()
                    headers = [("Content-Type", "application/xml")]
                    self._reply(status, headers, b"" if self.command == "HEAD" else xml)
                    return
                if fault == "delay":
                    threading.Event().wait(proxy.delay_s)
                status, headers, data = self._forward(body)
                if fault == "drop_response" or (fault == "truncate" and len(data) < 2):
                    self._reset()
                    return
                self._reply(status, headers, data, cut=fault == "truncate")

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _handle

        return Handler


def _send(
    upstream: tuple[str, int],
    method: str,
    path: str,
    headers: list[tuple[str, str]],
    body: bytes,
    ignore_conditional: bool,
) -> tuple[int, list[tuple[str, str]], bytes]:
    """Send one request to ``upstream`` as received (signed headers unchanged)."""
    conn = http.client.HTTPConnection(*upstream, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for key, value in headers:
            if ignore_conditional and key.lower() == "if-none-match":
                continue
            if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                conn.putheader(key, value)
        if body or method in ("PUT", "POST"):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, resp.getheaders(), data
    finally:
        conn.close()
