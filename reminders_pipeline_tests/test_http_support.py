"""Serving the HTTP app for the tests: uvicorn on a free port in a thread, spoken to over real HTTP.

In-process (not a subprocess) so a test can hand the app a ``RecordingSender`` and watch the
engine's statements; ``test_http_serve.py`` runs the real ``serve`` entry point as a subprocess.
``conftest.py`` registers this module as a plugin (``pytest_plugins``), so its ``serve`` and ``served``
fixtures reach every test module without an import.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.notification import as_shown
from reminders_pipeline.http import create_app
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.providers.base import SenderFactory

SECRET = "test-secret-token"
APNS_TOKEN = "ab" * 32


class ServedApp:
    """One app behind uvicorn on 127.0.0.1:<free port>, until ``stop``."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServedApp:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()


@dataclass
class Served:
    """A served app and two clients: ``api`` sends the bearer token, ``anon`` sends none."""

    app: ServedApp
    api: httpx.Client
    anon: httpx.Client
    settings: Settings
    db: Database
    _closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.app.base_url

    def put_device(self, device_id: str = "dev-1", **body: Any) -> httpx.Response:
        body.setdefault("apns_token", APNS_TOKEN)
        return self.api.put(f"/v1/devices/{device_id}", json=body)

    def as_device(self, credential: str) -> httpx.Client:
        """A client holding only a device's own credential, as the widget does; closed after the test."""
        client = httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {credential}"})
        self._closers.append(client.close)
        return client

    def rows(self, **filters: Any) -> list[dict[str, Any]]:
        with self.db.read() as conn:
            return [as_shown(r) for r in ledger.list_queue(conn, **filters)]


def http_settings(settings: Settings, **changes: Any) -> Settings:
    """The fixture settings with a token, short source timeouts (a failed read must not stall a
    test) and ``now`` accepted over HTTP (the tests drive the clock)."""
    return settings.with_(**{"token": SECRET, "source_timeout_seconds": 2.0, "http_accept_now": True, **changes})


@pytest.fixture
def serve(db: Database) -> Iterator[Callable[..., Served]]:
    """``serve(settings, sender_factory=None, database=None)``: start an app; all are stopped after the test."""
    started: list[Served] = []

    def start(
        settings: Settings, sender_factory: SenderFactory | None = None, database: Database | None = None
    ) -> Served:
        database = database or db
        app = ServedApp(create_app(settings, db=database, sender_factory=sender_factory)).start()
        api = httpx.Client(base_url=app.base_url, timeout=60, headers={"Authorization": f"Bearer {SECRET}"})
        anon = httpx.Client(base_url=app.base_url, timeout=60)
        served = Served(app, api, anon, settings, database)
        started.append(served)
        return served

    yield start
    for s in started:
        for close in s._closers:
            close()
        s.api.close()
        s.anon.close()
        s.app.stop()


@pytest.fixture
def served(serve: Callable[..., Served], settings: Settings) -> Served:
    """The common case: a dry-run app (REMINDERS_ENABLED unset) with the token set."""
    return serve(http_settings(settings))


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The JSON error body every 4xx carries; fails the test if it is not one."""
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    assert isinstance(body.get("error"), str) and isinstance(body.get("detail"), str), body
    return body
