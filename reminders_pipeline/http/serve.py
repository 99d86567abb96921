"""Run the HTTP app under uvicorn: ``reminders serve --host --port`` calls ``serve``.

One worker process: concurrency comes from the threadpool the core calls run in, and more capacity
means more instances behind a balancer. ``/metrics`` is read from the ledger at scrape time
(``http/metrics.py``), so every instance reports the same figures, whichever process drained.

``python -m reminders_pipeline.http.serve --host H --port P`` does the same without the CLI.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from reminders_pipeline.config.settings import Settings, SettingsError
from reminders_pipeline.http.app import create_app


def serve(host: str, port: int, settings: Settings, *, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; uvicorn finishes in-flight requests (a drain among them claims
    nothing more), then the engine is disposed."""
    if not settings.token:
        logging.getLogger(__name__).warning("REMINDERS_TOKEN is not set: every protected route answers 401")
    with stop_signals_end_cleanly():
        _run_uvicorn(host, port, settings, log_level)


@contextmanager
def stop_signals_end_cleanly() -> Iterator[None]:
    """A stop by SIGTERM or Ctrl-C returns normally (exit status 0) once uvicorn has shut down.

    uvicorn shuts down gracefully on SIGINT/SIGTERM and then raises the signal again for the
    handlers it found: by default a death by SIGTERM (status 143) or a KeyboardInterrupt ("Aborted!",
    status 1). A supervisor reads either as a crash; here the stop was asked for. Before uvicorn has
    installed its own handlers (and after it restored these), a stop signal exits 0 at once.
    """

    def stop(*_: object) -> None:
        raise SystemExit(0)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Server(uvicorn.Server):
    """uvicorn's server, which also tells the app's drains to stop claiming the moment a stop
    signal comes: uvicorn waits for requests in flight, and a drain would otherwise go on claiming
    every due row for as long as its request lasts."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event) -> None:
        super().__init__(config)
        self._stopping = stopping

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._stopping.set()
        super().handle_exit(sig, frame)


def _run_uvicorn(host: str, port: int, settings: Settings, log_level: str) -> None:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        workers=1,
        lifespan="on",
        proxy_headers=False,  # no client IP is used for anything; do not trust forwarded headers
        server_header=False,
        timeout_graceful_shutdown=30,
    )
    server = _Server(config, app.state.api.stopping)
    server.run()
    if not server.started:  # the port is taken, or the app failed its startup: as uvicorn.run exits
        sys.exit(STARTUP_FAILURE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m reminders_pipeline.http.serve", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    serve(args.host, args.port, settings, log_level=args.log_level)


if __name__ == "__main__":
    main()
