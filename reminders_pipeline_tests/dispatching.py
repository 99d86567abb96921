"""Helpers for driving the exact-time dispatcher in tests: a driven clock, and a dispatcher running
in a thread of its own with the real clock."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.providers.base import SenderFactory
from reminders_pipeline.sending.dispatch import Dispatcher


class DrivenTimer:
    """Time that moves only when the dispatcher waits: a whole morning replays in milliseconds.

    Real work (claims, sends, settles) runs on real time first; only when nothing it waits for
    finishes does the clock jump to the dispatcher's deadline. ``waits`` records every jump.
    """

    def __init__(self, start: float | Instant) -> None:
        self.t = start.unix if isinstance(start, Instant) else start  # Unix seconds, to the microsecond
        self.waits: list[float] = []

    def now(self) -> Instant:
        return Instant.floor(self.t)

    async def wait(self, batches: set[asyncio.Future[Any]], signals: set[asyncio.Future[Any]], seconds: float) -> None:
        if batches:  # sends and settles take the real time they take; the clock stands still meanwhile
            await asyncio.wait(batches | signals, return_when=asyncio.FIRST_COMPLETED)
            return
        for _ in range(3):
            await asyncio.sleep(0)
        if seconds > 0 and not any(s.done() for s in signals):
            self.t += seconds
            self.waits.append(seconds)


class DispatcherThread:
    """A dispatcher on the real clock in its own thread and event loop, with its own engine."""

    def __init__(self, url: str, settings: Settings, factory: SenderFactory, name: str) -> None:
        self.db = Database(url)
        self.dispatcher = Dispatcher(self.db, settings, factory, name=name)
        self.summary: DrainResult | None = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        async def go() -> DrainResult:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._started.set()
            return await self.dispatcher.run(stop=self._stop)

        try:
            self.summary = asyncio.run(go())
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc
        finally:
            self._started.set()
            self.db.dispose()

    def start(self) -> DispatcherThread:
        self._thread.start()
        self._started.wait(10)
        return self

    def stop(self, timeout: float = 60) -> DrainResult:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"dispatcher {self.dispatcher.name} did not stop in {timeout}s"
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary
