"""A real HTTP server for source feeds (and alert webhooks), run in a thread by the tests.

Each path answers with a scripted body, status, headers or delay; the server counts reads, keeps
request headers, honours ``If-None-Match`` when a route has an ETag, measures how many requests
were in flight at once, and records POSTed bodies (a webhook receiver).
"""

from __future__ import annotations

import gzip
import json
import ssl
import struct
import threading
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import trustme


@dataclass
class Route:
    status: int = 200
    body: bytes = b'{"items": []}'
    delay: float = 0.0
    content_type: str = "application/json"
    etag: str | None = None
    gzip: bool = False
    headers: dict[str, str] = field(default_factory=dict)


class _Server(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5: eight concurrent connects (the reader's per-host
    # bound) overflow it and the kernel retries the handshake a second later, so a healthy source
    # "times out" under a 1 s source timeout.
    request_queue_size = 128


class FeedServer:
    """``ca``: serve HTTPS with a certificate for ``localhost`` only, and name URLs by it."""

    def __init__(self, host: str = "127.0.0.1", ca: trustme.CA | None = None) -> None:
        self.routes: dict[str, Route] = {}
        self.hits: Counter = Counter()
        self.not_modified: Counter = Counter()
        self.request_headers: dict[str, list[dict[str, str]]] = defaultdict(list)
        self.arrivals: dict[str, list[float]] = defaultdict(list)  # time.monotonic() per request, per path
        self.posts: dict[str, list[Any]] = defaultdict(list)
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go in two writes: no 40 ms delayed-ACK stall

            def do_GET(self) -> None:  # noqa: N802
                with server._lock:
                    server.hits[self.path] += 1
                    server.request_headers[self.path].append(dict(self.headers))
                    server.arrivals[self.path].append(time.monotonic())
                    route = server.routes.get(self.path, Route(404, b"not found", content_type="text/plain"))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    if route.delay:
                        time.sleep(route.delay)
                    self._answer(route)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with server._lock:
                        server.in_flight -= 1

            def _answer(self, route: Route) -> None:
                if route.etag and self.headers.get("If-None-Match") == route.etag:
                    with server._lock:
                        server.not_modified[self.path] += 1
                    self.send_response(304)
                    self.send_header("ETag", route.etag)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = gzip.compress(route.body) if route.gzip else route.body
                self.send_response(route.status)
                self.send_header("Content-Type", route.content_type)
                self.send_header("Content-Length", str(len(body)))
                if route.etag:
                    self.send_header("ETag", route.etag)
                if route.gzip:
                    self.send_header("Content-Encoding", "gzip")
                for k, v in route.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length)
                try:
                    doc: Any = json.loads(raw)
                except ValueError:
                    doc = raw
                with server._lock:
                    server.posts[self.path].append(doc)
                    route = server.routes.get(self.path, Route(200, b"ok", content_type="text/plain"))
                self._answer(route)

            def log_message(self, *args: Any) -> None:
                return None

        self.httpd = _Server((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.tls = ca is not None
        if ca is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ca.issue_cert("localhost").configure_cert(context)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"https://localhost:{port}" if self.tls else f"http://{host}:{port}"

    def url(self, path: str) -> str:
        return self.base + path

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def wait_for_reads(self, path: str, count: int, timeout: float = 10.0) -> None:
        """Return once ``path`` has been requested ``count`` times in all (a read a ``delay`` holds
        has arrived, and answers as its route was then)."""
        deadline = time.monotonic() + timeout
        while self.hits[path] < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{path} was requested {self.hits[path]} times, not {count}")
            time.sleep(0.01)

    def items(self, path: str, items: list[dict[str, Any]], **route: Any) -> str:
        """Serve ``{"items": items}`` at ``path``; returns its URL."""
        return self.set(path, Route(body=json.dumps({"items": items}).encode(), **route))

    def calendar(self, path: str, ics: str | bytes, **route: Any) -> str:
        body = ics.encode() if isinstance(ics, str) else ics
        return self.set(path, Route(body=body, content_type="text/calendar; charset=utf-8", **route))

    def set(self, path: str, route: Route) -> str:
        with self._lock:
            self.routes[path] = route
        return self.url(path)

    def fail(self, path: str, status: int = 500) -> str:
        return self.set(path, Route(status, b"boom", content_type="text/plain"))

    def redirect(self, path: str, to: str) -> str:
        return self.set(path, Route(302, b"", content_type="text/plain", headers={"Location": to}))


def gzip_bomb(inflated_mib: int, layers: int = 2) -> bytes:
    """A body that inflates to ``inflated_mib`` MiB of zeros through ``layers`` stacked gzips.

    The inner layer is built from one full-flushed deflate block of a MiB of zeros repeated (every
    such block compresses to the same bytes), so making a gigabyte bomb takes no gigabyte of work.
    """
    mib = b"\0" * (1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = deflate.compress(mib) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(inflated_mib):
        crc = zlib.crc32(mib, crc)
    size = (inflated_mib << 20) & 0xFFFFFFFF
    body = (
        b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
        + block * inflated_mib
        + deflate.flush()
        + struct.pack("<II", crc, size)
    )
    for _ in range(layers - 1):
        body = gzip.compress(body, 9)
    return body
