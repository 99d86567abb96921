"""The lifecycle the TLS push mocks share: their own event loop in a background thread, one listener.

A mock subclasses ``LoopServer``, makes its trustme CA as ``_ca``, and says how a connection is
served (``_protocol``) and how open ones are shut (``_close_connections``); the rest is here, so a
synchronous test, an asyncio test and a benchmark script can all start and stop one the same way.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import tempfile
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Self

import trustme


class LoopServer(ABC):
    """Listens with TLS on ``127.0.0.1`` at a free port, served from a loop in a thread of its own.

    ``start()`` → ``(host, port)``; ``stop()`` shuts the connections, the loop and the thread, and
    removes the workdir when the server made it. A context manager, too.
    """

    _ca: trustme.CA  # the subclass's CA: it issues the server's certificate, clients trust its ca_file

    def __init__(self, workdir: str | Path | None, *, name: str) -> None:
        self._name = name  # the thread's name, and the prefix of a workdir made here
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"{name}-"))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self.host = "127.0.0.1"
        self.port = 0

    @abstractmethod
    def _protocol(self) -> asyncio.Protocol:
        """A new connection's protocol (called on the server's loop)."""

    @abstractmethod
    async def _close_connections(self) -> None:
        """Shut every open connection; the listener is closed already, so no new one comes."""

    def start(self) -> tuple[str, int]:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), loop).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.host, self.port

    async def _listen(self) -> asyncio.base_events.Server:
        return await asyncio.get_running_loop().create_server(self._protocol, self.host, 0, ssl=self._server_context())

    def _server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ca.issue_cert(self.host, "localhost").configure_cert(ctx)
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        return ctx

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
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

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
