"""The plumbing the TLS push mocks share: a loop in a background thread, one TLS listener, its connections,
and what a mock saw and was told to answer.

A mock is its validation only. ``LoopServer`` gives it a trustme CA, a listener on a free port
served from its own event loop (so a synchronous test, an asyncio test and a benchmark script start
and stop it the same way), the set of open connections that ``open_connections``,
``connections_opened`` and ``drop_all_connections()`` read, the recorded ``requests``, ``reset()``
and ``stats()``; ``Scripts`` holds its scripted answers. ``AsgiServer`` serves an ASGI app over it
with hypercorn, HTTP/2 or HTTP/1.1 as ALPN chose: the Web Push and FCM mocks. The APNs mock speaks
raw ``h2`` on ``LoopServer`` (see its docstring for why).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, Self, TypeVar, cast

import trustme
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config
from hypercorn.typing import ASGIFramework
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

# How long stop() lets hypercorn close connections gracefully before it aborts them.
CLOSE_GRACE_SECONDS = 0.25


class Recorded(Protocol):
    """What a mock records of one request: at least the status it answered."""

    @property
    def status(self) -> int | None: ...


R = TypeVar("R", bound=Recorded)
A = TypeVar("A")  # what a mock is scripted to answer


@dataclass
class Scripts(Generic[A]):
    """A mock's scripted answers by key (a device token, a subscription), each for ``times`` requests
    or for good, and ``default`` for every other key. The caller holds the mock's lock."""

    default: A
    _by_key: dict[str, tuple[A, int | None]] = field(default_factory=dict)

    def set(self, key: str, answer: A, times: int | None = None) -> None:
        self._by_key[key] = (answer, times)

    def next(self, key: str) -> A:
        """The answer for one request to ``key``; a script used up is forgotten."""
        answer, times = self._by_key.get(key, (self.default, None))
        if times is not None:
            if times > 1:
                self._by_key[key] = (answer, times - 1)
            else:
                del self._by_key[key]
        return answer


class LoopServer(ABC, Generic[R]):
    """Listens with TLS on ``host`` at a free port, served from a loop in a thread of its own.

    ``start()`` → ``(host, port)``; ``stop()`` shuts the connections, the loop and the thread, and
    removes the workdir when the server made it. A context manager, too. ``alpn`` is what the TLS
    handshake offers. Each request the mock judged is recorded (``_record``) in ``requests``.
    """

    alpn: tuple[str, ...] = ("h2", "http/1.1")
    wait_seconds = 10.0  # how long wait_for_requests() waits unless told

    def __init__(self, workdir: str | Path | None, *, name: str, host: str = "127.0.0.1") -> None:
        self._name = name  # the thread's name, the prefix of a workdir made here, the CA file's name
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"{name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._ca = trustme.CA()
        self.ca_file = self.workdir / f"{name}-ca.pem"
        self._ca.cert_pem.write_to_path(str(self.ca_file))
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._transports: set[asyncio.BaseTransport] = set()  # server thread only
        self.host = host
        self.port = 0
        self._reset_state()

    @abstractmethod
    def _protocol(self) -> asyncio.Protocol:
        """A new connection's protocol (called on the server's loop); it reports ``_opened``/``_closed``."""

    @property
    def url(self) -> str:
        """``https://<host>:<port>``, an IPv6 host in brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"

    def start(self) -> tuple[str, int]:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
        self._thread.start()
        self._server = self._call(self._listen())
        self.port = self._server.sockets[0].getsockname()[1]
        return self.host, self.port

    def _call(self, coroutine: Any) -> Any:
        """Run ``coroutine`` on the server's loop and wait for its result."""
        assert self._loop is not None, "start the mock first"
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    async def _listen(self, port: int = 0) -> asyncio.base_events.Server:
        return await asyncio.get_running_loop().create_server(
            self._protocol, self.host, port, ssl=self._server_context()
        )

    def _server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ca.issue_cert(self.host, "localhost").configure_cert(ctx)
        ctx.set_alpn_protocols(list(self.alpn))
        return ctx

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        self._call(self._shutdown())
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(timeout=10)
        loop.close()
        self._loop = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._close_connections()
        await asyncio.sleep(0)  # let the closed transports' callbacks run before the loop stops

    async def _close_connections(self) -> None:
        """Shut every open connection; the listener is closed already, so no new one comes."""
        self._abort_all()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def refuse(self, mode: str | None) -> None:
        """Make new connections fail as a network or TLS fault would: ``"connect"`` refuses the TCP
        connection, ``"tls"`` accepts it but answers the handshake with bytes that are not TLS;
        ``None`` listens normally again. Open connections are aborted in both fault modes."""
        assert mode in ("connect", "tls", None)
        self._call(self._relisten(mode))

    async def _relisten(self, mode: str | None) -> None:
        assert self._server is not None
        self._server.close()
        if mode is not None:
            await self._close_connections()
        if mode == "tls":
            self._server = await asyncio.get_running_loop().create_server(_NotTls, self.host, self.port)
        elif mode is None:
            self._server = await self._listen(self.port)

    # -- connections -----------------------------------------------------------------------

    def _opened(self, transport: asyncio.BaseTransport) -> None:
        self._transports.add(transport)
        with self._lock:
            self.connections_opened += 1

    def _closed(self, transport: asyncio.BaseTransport) -> None:
        self._transports.discard(transport)

    def _abort_all(self) -> None:
        for transport in list(self._transports):
            transport.abort()  # type: ignore[attr-defined]

    @property
    def open_connections(self) -> int:
        return len(self._transports)

    def drop_all_connections(self) -> None:
        """Abort every open connection, as a network failure would."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._abort_all)

    # -- what the mock saw -----------------------------------------------------------------

    @property
    def requests(self) -> list[R]:
        with self._lock:
            return list(self._requests)

    def wait_for_requests(self, count: int, timeout: float | None = None) -> list[R]:
        """The recorded requests once there are ``count`` of them, or whatever there is at ``timeout``."""
        deadline = time.monotonic() + (self.wait_seconds if timeout is None else timeout)
        while len(self._requests) < count and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.requests

    def _record(self, record: R) -> None:
        with self._lock:
            self._requests.append(record)

    def reset(self) -> None:
        """Forget the recorded requests, the scripts and the counters. What the mock issued (keys,
        subscriptions, access tokens), its settings and its open connections stay."""
        with self._lock:
            self._reset_state()

    def _reset_state(self) -> None:
        """The state ``reset()`` forgets, made anew (with the lock held, or from __init__)."""
        self._requests: list[R] = []
        self.connections_opened = 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": len(self._requests),
                "statuses": dict(Counter(r.status for r in self._requests)),
                "connections_opened": self.connections_opened,
                "open_connections": self.open_connections,
                **self._more_stats(),
            }

    def _more_stats(self) -> dict[str, Any]:
        return {}


class _NotTls(asyncio.Protocol):
    """A listener that is not a TLS server: the client's handshake fails."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")  # type: ignore[attr-defined]
        transport.close()


def parsed_json(body: bytes) -> Any:
    """``body`` as JSON, or None when it is empty or not JSON."""
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Reply:
    """What an ``AsgiServer`` answers one request, ``delay`` seconds after it was complete."""

    status: int
    headers: Sequence[tuple[str, str]] = ()
    body: bytes = b""
    delay: float = 0.0


def _hypercorn_config() -> Config:
    """hypercorn set to keep a client's connection as long as the client does, as the services do."""
    config = Config()
    config.include_server_header = False
    config.keep_alive_timeout = 24 * 3600
    config.keep_alive_max_requests = sys.maxsize
    return config


class AsgiServer(LoopServer[R]):
    """A ``LoopServer`` that hands each connection to hypercorn, which serves ``_respond`` over
    HTTP/2 (h2's default windows and 100 streams, received data acknowledged as it is read, answer
    bodies waiting for the client's credit) or HTTP/1.1 (keep-alive, one request at a time).
    Stopping is hypercorn's graceful shutdown (idle connections close, a busy HTTP/2 one gets GOAWAY
    once its last stream ends), then an abort of what lingers; an answer still owed is never sent."""

    def __init__(self, workdir: str | Path | None, *, name: str, host: str = "127.0.0.1") -> None:
        super().__init__(workdir, name=name, host=host)
        self._config = _hypercorn_config()
        self._app = ASGIWrapper(cast(ASGIFramework, self._asgi))  # Starlette's Scope is hypercorn's, untyped
        self._tasks: set[asyncio.Task[None]] = set()
        self._context = WorkerContext(None)
        self._stopping = asyncio.Event()

    @abstractmethod
    async def _respond(self, request: Request, protocol: str) -> Reply:
        """Judge one request (``protocol`` "h2" or "http/1.1"), record it, and say what to answer."""

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._unless_stopped(self._answer(scope, receive, send))

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        reply = await self._respond(Request(scope, receive), "h2" if scope["http_version"] == "2" else "http/1.1")
        await asyncio.sleep(reply.delay)
        await Response(reply.body, reply.status, headers=dict(reply.headers))(scope, receive, send)

    async def _unless_stopped(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` until it is done or stop() has aborted the connections. A request whose
        body never came, a delayed answer, or an answer waiting for flow-control credit from a
        client that stopped reading then ends here: hypercorn would wait for them forever."""
        working = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({working, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            working.cancel()  # nothing when it is done
        if working.done() and not working.cancelled():
            working.result()  # an error in the mock reaches hypercorn's log

    async def _listen(self, port: int = 0) -> asyncio.base_events.Server:
        # Fresh per start(): both events are one-shot.
        self._context = WorkerContext(None)
        self._stopping = asyncio.Event()
        return await super()._listen(port)

    def _protocol(self) -> asyncio.Protocol:
        return _TrackedStream(self)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            loop = asyncio.get_running_loop()
            await TCPServer(self._app, loop, self._config, self._context, {}, reader, writer)
        finally:
            self._tasks.discard(task)

    async def _close_connections(self) -> None:
        await self._context.terminated.set()  # also ends the idle waits of connections already dropped
        deadline = time.monotonic() + CLOSE_GRACE_SECONDS
        while self._transports and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._abort_all()
        self._stopping.set()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1)


class _TrackedStream(asyncio.StreamReaderProtocol):
    """hypercorn's stream for one connection, reported open and closed as the transport is: hypercorn
    itself may hold a lost connection's task until its keep-alive wait ends."""

    def __init__(self, server: AsgiServer[Any]) -> None:
        super().__init__(asyncio.StreamReader(), server._serve)
        self._server = server
        self._tracked: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._tracked = transport
        self._server._opened(transport)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._tracked is not None:
            self._server._closed(self._tracked)
        super().connection_lost(exc)


def request_target(request: Request) -> str:
    """The request's path as sent, with its query: what an HTTP/2 ``:path`` carries."""
    raw_path: bytes = request.scope.get("raw_path") or request.scope["path"].encode()
    query: bytes = request.scope.get("query_string", b"")
    return raw_path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
