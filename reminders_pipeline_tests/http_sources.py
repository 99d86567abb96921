"""A real HTTP server for source feeds, run in a thread by the tests.

Each path answers with a scripted JSON document, status, raw body or delay, and counts its reads,
so tests can prove a shared source is read once and that failures leave rows alone.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Route:
    status: int = 200
    body: bytes = b'{"items": []}'
    delay: float = 0.0
    content_type: str = "application/json"


class FeedServer:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.hits: Counter = Counter()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                with server._lock:
                    server.hits[self.path] += 1
                    route = server.routes.get(self.path, Route(404, b"not found", content_type="text/plain"))
                if route.delay:
                    time.sleep(route.delay)
                try:
                    self.send_response(route.status)
                    self.send_header("Content-Type", route.content_type)
                    self.send_header("Content-Length", str(len(route.body)))
                    self.end_headers()
                    self.wfile.write(route.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: Any) -> None:
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, path: str) -> str:
        return self.base + path

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def items(self, path: str, items: list[dict[str, Any]]) -> str:
        """Serve ``{"items": items}`` at ``path``; returns its URL."""
        return self.set(path, Route(body=json.dumps({"items": items}).encode()))

    def set(self, path: str, route: Route) -> str:
        with self._lock:
            self.routes[path] = route
        return self.url(path)

    def fail(self, path: str, status: int = 500) -> str:
        return self.set(path, Route(status, b"boom", content_type="text/plain"))
