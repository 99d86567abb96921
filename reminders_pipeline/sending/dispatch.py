"""The exact-time path: each row is sent at its own ``send_after``, not at the next drain tick.

The cron drain bounds lateness by its cadence plus scheduler slack: a "5 minutes before" reminder
for a 10:00 meeting would wait for the 10:05 tick and settle ``event_started``. The dispatcher is one
loop with one job (the pattern of Oban's Stager and River's scheduler):

1. read the earliest pending ``send_after`` (one step down the partial due index);
2. sleep until then, or until a build announces new or earlier rows (PostgreSQL ``NOTIFY``), or
   until the poll backstop (SQLite's only wake-up);
3. hand the due rows to the drain's own send path, which claims each slice with the same
   compare-and-swap right before sending it, applies the same policy and settles it.

It never sends early: the claim itself requires ``send_after <= now``. It takes no lock of its own:
dispatchers and the cron drain may run at once, and the claim decides who sends. A claim left by a
dispatcher that died is failed as abandoned (by the next drain or dispatcher), never resent.
Dagster (``defs/dispatch.py``) and ``reminders dispatch`` only start and stop it.

What the loop knows of halted providers and their probes is ``provider_halts``; the rest of the
ways it recovers (a database outage, settlements kept through one, rows held back, what it has
already read) is state of the loop itself, read and written between its passes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reminders_pipeline import ledger
from reminders_pipeline.config.log_throttle import QuietFailures
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Notification
from reminders_pipeline.ledger.db import Database, waiting_off_the_loop
from reminders_pipeline.providers.base import Sender, SenderFactory, SendResult
from reminders_pipeline.sending.drain import fail_abandoned, send_batch_async
from reminders_pipeline.sending.faults import Outages
from reminders_pipeline.sending.provider_halts import RETRY_SECONDS, ProviderHalts
from reminders_pipeline.sending.settlement import SettlementsNotWritten, settled_ids, write_settlement

log = logging.getLogger(__name__)

LATENESS_KEPT = 100_000  # a dispatcher that runs for weeks keeps the latest lateness figures only
ABANDON_SWEEP_SECONDS = 60
FULL_READ_SECONDS = 30.0  # read every due row at least this often: a LISTEN connection may die silently
FAILED_RETRY_SECONDS = 1.0  # after a batch or a kept settlement's write failed: try again this soon, not a poll later


class Timer:
    """The real clock. Tests drive a timer of their own (same two methods) to replay any morning."""

    def now(self) -> Instant:
        """Rounded down to the millisecond: a row due at it is due by the real clock too."""
        return Instant.now()

    async def wait(self, batches: set[asyncio.Future[Any]], signals: set[asyncio.Future[Any]], seconds: float) -> None:
        """Return after ``seconds``, or as soon as a batch in flight ends or a signal (stop, NOTIFY) comes."""
        await asyncio.wait(batches | signals, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)


class LazySender:
    """The sender made on the first real send and kept for the dispatcher's life (warm APNs
    connections across batches). A dry run never makes one: its rows settle ``disabled``."""

    def __init__(self, factory: SenderFactory) -> None:
        self._factory = factory
        self._sender: Sender | None = None

    async def send_many(self, notifications: Sequence[Notification]) -> list[SendResult]:
        if self._sender is None:
            self._sender = self._factory()
        return await self._sender.send_many(notifications)

    async def aclose(self) -> None:
        if self._sender is not None:
            await self._sender.aclose()
            self._sender = None


@dataclass
class Dispatcher:
    db: Database
    settings: Settings
    sender_factory: SenderFactory
    name: str = field(default_factory=lambda: f"dispatch-{uuid.uuid4().hex[:12]}")
    timer: Timer = field(default_factory=Timer)
    on_batch: Callable[[DrainResult], None] | None = None  # one call per settled batch (logging)

    def __post_init__(self) -> None:
        self.summary = DrainResult(now=self.timer.now())
        self._sender = LazySender(self.sender_factory)
        self._batches: dict[asyncio.Task[DrainResult], Sequence[int]] = {}
        self._in_flight: set[int] = set()
        self._held: dict[int, Instant] = {}  # row id -> not before: rows a batch could not claim or send
        self._seen = Instant(0)  # the clock of the last read: every row due by then is in flight or done
        self._rescan = True  # the next read is of every due row, not only those due since ``_seen``
        self._full_read_at = Instant(0)
        self._not_before = Instant(0)  # no dispatch at all before this: a failed batch's backoff
        self._outages = Outages(self.settings.send_halt_after)  # across batches: one-row batches trip it too
        self._halts = ProviderHalts(self.name)  # halted providers: their rows wait, one probe at a time
        self._probes: dict[asyncio.Task[DrainResult], str] = {}
        self._reads = QuietFailures(log, f"dispatcher {self.name}: reading the queue")
        self._chores = QuietFailures(log, f"dispatcher {self.name}: heartbeat or abandoned sweep")
        self._batch_errors = QuietFailures(log, f"dispatcher {self.name}: a batch")
        self._kept: list[Any] = []  # settlements a batch could not write (``SettlementsNotWritten``)
        self._kept_writes = QuietFailures(
            log, f"dispatcher {self.name}: writing settlements kept through a database failure"
        )
        self._next_beat = self._next_sweep = Instant(0)
        self._started = self.summary.now
        self._until: Instant | None = None
        self._stop: asyncio.Event | None = None
        self._began = time.perf_counter()

    def clock(self) -> Instant:
        return self.timer.now()

    async def run(self, *, until: Instant | None = None, stop: asyncio.Event | None = None) -> DrainResult:
        """Dispatch until ``until`` or ``stop``; in-flight sends finish and settle."""
        stop = stop or asyncio.Event()
        self._stop = stop
        self._until = until
        log.info("dispatcher %s started (until %s)", self.name, until or "stopped")
        async with self.db.notifications(ledger.DUE_CHANNEL) as heard:
            try:
                while not stop.is_set():
                    now = self.timer.now()
                    if until is not None and now >= until:
                        break
                    await self._write_kept(now)
                    await self._housekeeping(now)
                    if heard is None or heard.is_set():
                        self._rescan = True  # SQLite has no NOTIFY to say that a row came back or moved
                    if heard is not None:
                        heard.clear()  # before the read: a NOTIFY after it wakes the wait below
                    wake_at = await self._dispatch_due(now)
                    if self._kept:
                        wake_at = min(wake_at, now + FAILED_RETRY_SECONDS)
                    await self._wait(wake_at, heard, stop)
            finally:
                await self._finish()
        return self.summary

    async def _dispatch_due(self, now: Instant) -> Instant:
        """Start a batch for the due rows not already in flight, none of a halted provider, and a
        one-row probe of each halted provider whose time to try again has come; return when to
        look again.

        The reads run off the loop (``waiting_off_the_loop``): this loop reads the providers'
        answers, and a read can wait too (a table lock, a full pool, the network)."""
        poll_at = now + self.settings.dispatch_poll_seconds
        if now < self._not_before:
            return min(self._not_before, poll_at)
        held = len(self._held)
        self._held = {i: t for i, t in self._held.items() if t > now}
        if len(self._held) < held:
            self._rescan = True
        # A copy: batches end on the loop meanwhile. A row whose settlement is kept is not claimed
        # again by us before it is written: the late write would meet our new claim.
        busy = self._in_flight | set(self._held) | {i for s in self._kept for i in settled_ids(s)}
        full = self._rescan or now >= self._full_read_at
        after, clock = None if full else self._seen, self.clock()
        skip, probes = self._halts.skipped(), self._halts.due_probes(now)
        self._rescan = False  # set again meanwhile by a batch that ends during the read
        try:
            ready, later = await waiting_off_the_loop(self.db, self._read_due, clock, busy, after, skip)
            probe_rows = await waiting_off_the_loop(self.db, self._read_probes, clock, busy, probes)
        except Exception as exc:  # noqa: BLE001 - a database outage must not end the loop; the poll retries
            self._reads.failed(exc, now)
            self._rescan = self._rescan or full
            return poll_at
        self._reads.succeeded(now)
        self._seen = clock
        if full:
            self._full_read_at = now + FULL_READ_SECONDS
        self._start_probes(probes, probe_rows, now)
        if ready:
            self._start_batch(ready)
            return now
        # Nothing to start (none due, or every due row is in a batch of ours or held back): wake for
        # the next row to come due, or a halted provider's next probe; a batch ending or a hold
        # expiring wakes us too.
        probe_times = self._halts.next_probe_times()
        return min([poll_at, *self._held.values(), *probe_times] + ([later] if later else []))

    def _read_due(
        self, clock: Instant, busy: set[int], after: Instant | None = None, skip: frozenset[str] = frozenset()
    ) -> tuple[list[int], Instant | None]:
        """The due rows not in ``busy`` and of no provider in ``skip``, or else the next
        ``send_after`` to wake for.

        ``after``: read only rows that came due since then. Every row due by then was read and
        started, and a row that comes back to pending or moves earlier is announced (NOTIFY),
        which makes the next read a full one; so while a burst of 20,000 rows is on the wire each
        poll is one step down an index instead of a read of every row still waiting its turn.
        Both reads are bounded by ``clock``, which the caller then counts as seen."""
        with self.db.read() as conn:
            earliest = ledger.next_send_after(conn, after=after)
            if earliest is None or earliest > clock:
                return [], earliest
            due = ledger.due_ids(conn, clock, after=after, skip_providers=skip)
            ready = [i for i in due if i not in busy]
            return (ready, None) if ready else ([], ledger.next_send_after(conn, after=clock))

    def _read_probes(self, clock: Instant, busy: set[int], providers: list[str]) -> dict[str, int]:
        """One due row of each of ``providers`` (halted ones) not in ``busy``: its probe."""
        if not providers:
            return {}
        with self.db.read() as conn:
            return self._halts.probe_rows(conn, clock, busy, providers)

    def _start_probes(self, providers: list[str], rows: dict[str, int], now: Instant) -> None:
        """A halted provider is tried again with one of its rows, not every one due by then."""
        for provider in providers:
            if self._halts.probe_started(provider, rows.get(provider), now):
                self._probes[self._start_batch([rows[provider]])] = provider

    def _start_batch(self, ids: list[int]) -> asyncio.Task[DrainResult]:
        batch = send_batch_async(
            self.db,
            self.settings,
            ids,
            self.sender_factory,
            claimer=self.name,
            clock=self.clock,
            sender=self._sender,
            stop=self._stop,
            outages=self._outages,
        )
        task = asyncio.ensure_future(batch)
        self.summary.due += len(ids)
        self._batches[task] = ids
        self._in_flight.update(ids)
        task.add_done_callback(self._batch_done)
        return task

    def _batch_done(self, task: asyncio.Task[DrainResult]) -> None:
        ids = self._batches.pop(task)
        self._in_flight.difference_update(ids)
        probe = self._probes.pop(task, None)
        self._halts.probe_ended(probe)
        now = self.timer.now()
        if task.cancelled() or task.exception() is not None or task.result().halts:
            self._rescan = True  # rows it did not reach are still due, and no longer in flight
        if task.cancelled():
            return
        if task.exception() is not None:
            if isinstance(task.exception(), SettlementsNotWritten):
                self._kept.extend(task.exception().settlements)  # type: ignore[union-attr]
            self._batch_errors.failed(task.exception(), now)  # type: ignore[arg-type]
            self._not_before = now + min(self.settings.dispatch_poll_seconds, FAILED_RETRY_SECONDS)
            return
        self._batch_errors.succeeded(now)
        done = task.result()
        self.summary.merge(done)
        del self.summary.lateness_seconds[:-LATENESS_KEPT]
        for provider, reason in done.halts.items():
            self._halts.note_halt(provider, reason, now)
        if self._halts.note_answers(done, probe, now):
            self._rescan = True
        if not done.halts:
            self._hold_unfinished(done, ids, now)
        if self.on_batch is not None and done.claimed:
            self.on_batch(done)

    def _hold_unfinished(self, done: DrainResult, ids: Sequence[int], now: Instant) -> None:
        """Rows of a batch another claimer held: look again shortly. Rows given back to pending
        carry their own ``not_before`` (a retry's backoff, a quiet-hours hold), which the due
        predicate and ``next_send_after`` honour; settled ones never come back as due."""
        if done.claimed < len(ids):
            self._held.update((i, now + RETRY_SECONDS) for i in ids)

    async def _wait(self, wake_at: Instant, heard: asyncio.Event | None, stop: asyncio.Event) -> None:
        waiters = [asyncio.ensure_future(stop.wait())]
        if heard is not None:
            waiters.append(asyncio.ensure_future(heard.wait()))
        deadline = wake_at if self._until is None else min(wake_at, self._until)
        deadline = min(deadline, self._next_beat)
        try:
            await self.timer.wait(set(self._batches), set(waiters), deadline - self.timer.now())
        finally:
            for w in waiters:
                w.cancel()

    async def _write_kept(self, now: Instant, last: bool = False) -> None:
        """Write the settlements a batch could not, once the database answers, each in its own
        transaction: their rows are still ours until the abandon threshold, and each rewrite
        settles only rows still claimed by us. Past that threshold another process's abandoned
        sweep has failed them, so they are dropped; so are those left when the dispatcher stops."""
        expired = now - self.settings.abandon_after_seconds
        for settlement in list(self._kept):
            if settlement.at < expired:
                self._drop_kept(settlement, "past the abandon threshold")
                continue
            try:
                await waiting_off_the_loop(self.db, write_settlement, self.db, settlement, self.name, self.summary)
            except Exception as exc:  # noqa: BLE001 - kept for the next pass
                self._kept_writes.failed(exc, now)
                if last:
                    for left in list(self._kept):
                        self._drop_kept(left, "the dispatcher stopped before the database answered")
                return
            self._kept.remove(settlement)
            self._kept_writes.succeeded(now)
            self._rescan = True

    def _drop_kept(self, settlement: Any, why: str) -> None:
        self._kept.remove(settlement)
        log.error(
            "dispatcher %s: %s: rows %s not settled by it; they fail as abandoned (their reminders may have gone)",
            self.name, why, settled_ids(settlement),
        )  # fmt: skip

    async def _housekeeping(self, now: Instant) -> None:
        """Heartbeat for /metrics and the checks; fail claims a dead dispatcher or drain left. Both
        are writes: on SQLite they wait for the write lock off the loop that reads APNs' answers."""
        if now < min(self._next_sweep, self._next_beat):
            return  # nothing due: says nothing of whether the database is back
        try:
            if now >= self._next_sweep:
                self.summary.abandoned += await waiting_off_the_loop(
                    self.db, fail_abandoned, self.db, self.settings, now
                )
                self._next_sweep = now + ABANDON_SWEEP_SECONDS
            if now >= self._next_beat:
                await waiting_off_the_loop(self.db, self._beat, now)
                self._next_beat = now + self.settings.dispatch_heartbeat_seconds
        except Exception as exc:  # noqa: BLE001 - bookkeeping never stops dispatching
            self._chores.failed(exc, now)
            retry_at = now + self.settings.dispatch_heartbeat_seconds  # not on every poll: the database is down
            self._next_beat, self._next_sweep = retry_at, max(self._next_sweep, retry_at)
            return
        self._chores.succeeded(now)

    def _beat(self, now: Instant) -> None:
        sent = self.summary.outcomes.get("sent", 0)
        with self.db.write() as conn:
            ledger.beat(
                conn, self.name, now,
                started_at=self._started, ends_at=self._until, sent=sent, settled=sum(self.summary.outcomes.values()),
            )  # fmt: skip

    def _stopped(self, now: Instant) -> None:
        with self.db.write() as conn:
            ledger.dispatcher_stopped(conn, self.name, now)

    async def _finish(self) -> None:
        if self._batches:
            await asyncio.wait(list(self._batches))
        await self._write_kept(self.timer.now(), last=True)
        await self._sender.aclose()
        self.summary.duration_seconds = time.perf_counter() - self._began
        try:
            await waiting_off_the_loop(self.db, self._stopped, self.timer.now())
        except Exception:  # noqa: BLE001 - a stale heartbeat says the same
            log.exception("dispatcher %s: could not record its stop", self.name)
        log.info("dispatcher %s stopped: %s", self.name, self.summary.as_dict())


def batch_line(summary: DrainResult) -> str:
    """One log line per batch: rows, outcomes, lateness."""
    late = summary.lateness_percentiles()
    lateness = "" if late["max"] is None else f", lateness p50 {late['p50']}s max {late['max']}s"
    return f"batch: {summary.claimed} rows, outcomes {dict(summary.outcomes)}{lateness}"


def run_in_foreground(
    db: Database, settings: Settings, sender_factory: SenderFactory, *, seconds: float | None = None
) -> DrainResult:
    """``reminders dispatch``: until SIGTERM or Ctrl-C (or ``seconds``); both stop it cleanly, in-flight
    sends answered and settled first."""

    async def main() -> DrainResult:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        until = None if seconds is None else Instant.now() + seconds
        return await Dispatcher(db, settings, sender_factory, on_batch=lambda s: log.info(batch_line(s))).run(
            until=until, stop=stop
        )

    return asyncio.run(main())
