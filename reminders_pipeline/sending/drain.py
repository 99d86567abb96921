"""The drain half: fail abandoned claims, find due rows, claim each right before sending, settle.

At most once: a row is sent only by the drainer whose claim (a compare-and-swap) returned it, and
a claim left behind by a run that died mid-send is failed, never retried. A send that certainly
never reached its provider goes back to pending instead, a bounded number of times; a run of them
halts that provider's rows alone (``faults.py``), in every batch and process of the scope. The
steps are separate functions so Dagster can run them as ops (``fail_abandoned`` -> ``find_due`` ->
``send_batch`` per batch) while the CLI and HTTP route run them in one call (``drain``). What a
claimed row comes to, and its write, is ``settlement.py``; the counts, ``run_summary.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.rows import ClaimedRow, ReturnedRow
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Provider
from reminders_pipeline.ledger.db import TRANSIENT_ERRORS, Database, waiting_off_the_loop
from reminders_pipeline.providers.base import (
    FENCE_EXPIRED,
    Sender,
    SenderFactory,
    SendResult,
    fence_deadline,
    send_fenced,
)
from reminders_pipeline.sending.faults import Outages, alert_halt, is_outage, return_undelivered
from reminders_pipeline.sending.settlement import (
    Settlement,
    SettlementsNotWritten,
    SlicePlan,
    count_settlements,
    decide_all,
    release_claims,
    settle_and_claim,
    settle_last,
    settlement_of,
)

log = logging.getLogger(__name__)

Clock = Callable[[], Instant]


def clock_for(now: Instant | None) -> Clock:
    """A fixed clock for ``--now`` and tests, else the real one."""
    return (lambda: now) if now else Instant.now


def new_claimer() -> str:
    return f"drain-{uuid.uuid4().hex[:16]}"


def fail_abandoned(db: Database, settings: Settings, now: Instant | None = None) -> int:
    now = now or Instant.now()
    with db.write() as conn:
        n = ledger.fail_abandoned(conn, now - settings.abandon_after_seconds, now)
    if n:
        log.warning(
            "failed %d abandoned claim(s) older than %ss; they will not be retried", n, settings.abandon_after_seconds
        )
    return n


def find_due(
    db: Database, now: Instant | None = None, row_id: int | None = None, limit: int | None = None
) -> list[int]:
    with db.read() as conn:
        return ledger.due_ids(conn, now or Instant.now(), row_id=row_id, limit=limit)


def batches_of(ids: Sequence[int], batch_size: int, max_batches: int) -> list[list[int]]:
    """Split due ids into at most ``max_batches`` batches of roughly ``batch_size`` (bounded fan-out)."""
    if not ids:
        return []
    count = min(max_batches, -(-len(ids) // batch_size))
    size = -(-len(ids) // count)
    return [list(ids[i : i + size]) for i in range(0, len(ids), size)]


class Stop(Protocol):
    """Asked before each claim: an ``asyncio.Event`` on the loop, a ``threading.Event`` across threads."""

    def is_set(self) -> bool: ...


def send_batch(
    db: Database, settings: Settings, ids: Sequence[int], sender_factory: SenderFactory, **options: Any
) -> DrainResult:
    """``send_batch_async`` on a loop of its own, for callers without one (a Dagster op, the CLI)."""
    return asyncio.run(send_batch_async(db, settings, ids, sender_factory, **options))


async def send_batch_async(
    db: Database,
    settings: Settings,
    ids: Sequence[int],
    sender_factory: SenderFactory,
    *,
    now: Instant | None = None,
    claimer: str | None = None,
    clock: Clock | None = None,
    sender: Sender | None = None,
    stop: Stop | None = None,
    halt_scope: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    monotonic: Callable[[], float] = time.monotonic,
    outages: Outages | None = None,
) -> DrainResult:
    """Claim, decide, send and settle ``ids`` in claim-sized slices, each claimed just before its send.

    Slices are pipelined: the next slice is claimed while earlier ones are on the wire, up to enough
    slices to fill ``apns_concurrency``. The first slice goes alone, so a configuration fault
    (wrong key, topic) stops the run after one slice instead of a window of them. Settlements that
    have come back are committed in the same transaction as the next claim: one commit per slice.

    ``clock`` replaces the real one (the dispatcher's, in tests a driven one; ``now`` fixes it).
    ``sender``: a long-lived sender the caller owns and closes (the dispatcher keeps its APNs
    connections warm between batches); otherwise one is made on first need and closed here.
    ``stop``: once set, no further slice is claimed; what is on the wire is answered and settled.
    ``halt_scope`` names what a halt stops: every batch of one Dagster run passes its run id, a
    CLI or HTTP drain its claimer. A halt is one provider's: recorded under the scope by any
    process, it stops the claiming of that provider's rows (the others' go on); one found here is
    recorded there and alerted once. A halt is permanent for its scope, so a long-lived caller
    passes a new scope per pass (none: this call alone).
    ``outages``: the caller's judge of each provider's outage, kept across its batches (a
    dispatcher's); none: this call's own.
    ``monotonic``: the clock of each claim's fence (``fence_deadline``); a test advances its own
    (and the sender's) to simulate a process paused between claim and send.
    """
    clock = clock_for(now) if now or clock is None else clock
    claimer = claimer or new_claimer()
    scope = halt_scope or f"{claimer}:{uuid.uuid4().hex[:8]}"
    outages = outages or Outages(settings.send_halt_after)
    batch = _Batch(db, settings, sender_factory, sender, clock, claimer, scope, outages, monotonic)
    return await batch.run(ids, stop, progress)


@dataclass
class _Batch:
    """One ``send_batch_async`` call: its slices on the wire and the settlements come back unwritten."""

    db: Database
    settings: Settings
    sender_factory: SenderFactory
    sender: Sender | None  # None: made on first need, and closed here
    clock: Clock
    claimer: str
    scope: str
    outages: Outages
    monotonic: Callable[[], float]
    summary: DrainResult = field(init=False)
    recorded: set[str] = field(default_factory=set)  # providers whose halt the ledger holds for the scope
    halted_elsewhere: set[str] = field(default_factory=set)  # halts read from the ledger, not found here
    in_flight: set[asyncio.Task[Settlement]] = field(default_factory=set)
    returned: list[Settlement] = field(default_factory=list)  # answered, not yet written

    def __post_init__(self) -> None:
        self.summary = DrainResult(now=self.clock())
        self.owned = self.sender is None
        self.slices_on_the_wire = -(-self.settings.apns_concurrency // self.settings.claim_batch_size) + 1

    async def run(
        self, ids: Sequence[int], stop: Stop | None, progress: Callable[[int, int], None] | None
    ) -> DrainResult:
        try:
            await self._claim_and_send(ids, stop, progress)
        finally:
            await self._finish()
        for provider, reason in sorted(self.summary.halts.items()):
            if provider in self.halted_elsewhere:
                continue
            outage = self.outages.of(provider)
            if is_outage(reason) and outage.alerted:
                continue  # one alert per outage, not one per batch that meets it
            outage.alerted = is_outage(reason)
            alert_halt(self.settings, provider, reason, self.claimer, self.summary)
        return self.summary

    async def _claim_and_send(
        self, ids: Sequence[int], stop: Stop | None, progress: Callable[[int, int], None] | None
    ) -> None:
        size = self.settings.claim_batch_size
        for n, i in enumerate(range(0, len(ids), size)):
            await self._collect(_may_stay_on_the_wire(n, self.slices_on_the_wire))
            if stop is not None and stop.is_set():
                break
            await self._claim_slice(ids[i : i + size])
            _report_progress(progress, min(i + size, len(ids)), len(ids))
        await self._collect(0)

    async def _claim_slice(self, slice_ids: Sequence[int]) -> None:
        """Write what has come back and the halts found since, and claim the slice in one commit
        (no row of a halted provider), then send it."""
        claim_time, claimed_at = self.clock(), self.monotonic()
        new_halts = {p: reason for p, reason in self.summary.halts.items() if p not in self.recorded}
        try:
            written, halts, rows = await waiting_off_the_loop(
                self.db, settle_and_claim, self.db, self.returned, self.claimer, self.scope, slice_ids, claim_time,
                new_halts,
            )  # fmt: skip
        except TRANSIENT_ERRORS:
            await self._release_unconfirmed(slice_ids)
            raise
        count_settlements(self.returned, written, self.summary)  # only once committed: a lost commit is retried
        self.returned.clear()
        self.recorded.update(new_halts)
        for provider, reason in halts.items():
            self.recorded.add(provider)
            if self.summary.halt(provider, reason):
                self.halted_elsewhere.add(provider)
                log.warning("stopped claiming %s rows: drain scope %s halted (%s)", provider, self.scope, reason)
        # A send on the wire may have found a provider's fault while this claim ran in its thread
        # (SQLite): that provider's rows just claimed were never sent, so they go back to pending.
        stopped = {r["id"] for r in rows if (r.get("provider") or Provider.APNS) in self.summary.halts}
        if stopped:
            self.returned.append(
                Settlement(self.clock(), [], [], [{"id": i, "outcome_detail": "halted"} for i in sorted(stopped)])
            )
            rows = [r for r in rows if r["id"] not in stopped]
        self.summary.claimed += len(rows)
        if rows:
            plan = decide_all(rows, claim_time, self.settings)
            self.summary.lateness_seconds.extend(plan.dry_run_lateness)
            if plan.to_send and self.sender is None:
                self.sender = self.sender_factory()
            send_by = fence_deadline(self.settings, claimed_at)
            self.in_flight.add(asyncio.ensure_future(self._dispatch(rows, plan, send_by, self.sender)))

    async def _release_unconfirmed(self, slice_ids: Sequence[int]) -> None:
        """A claim's commit failed, or went through and reported failure: the rows it claimed were
        never sent, so they are pending again now, not failed as abandoned later. The settlements
        of that commit are written again (``_settle_last``: a rewrite settles nothing twice)."""
        back: list[ReturnedRow] = [{"id": i, "outcome_detail": "claim_unconfirmed"} for i in slice_ids]
        try:
            await waiting_off_the_loop(self.db, release_claims, self.db, back, self.claimer, self.clock())
        except TRANSIENT_ERRORS as exc:  # still away: if the claim went through, those rows fail as abandoned
            log.error("could not give back an unconfirmed claim of %d row(s) (%s)", len(back), type(exc).__name__)

    async def _dispatch(
        self, rows: list[ClaimedRow], plan: SlicePlan, send_by: float, sender: Sender | None
    ) -> Settlement:
        started = (self.clock(), time.monotonic())
        results: list[SendResult] = []
        fenced: set[int] = set()
        if plan.to_send and sender is not None:
            results, fenced = await send_fenced(sender, plan.to_send, send_by, self.monotonic)
        if fenced:
            plan = replace(plan, to_send=[n for n in plan.to_send if n.row_id not in fenced])
        done = settlement_of(rows, plan, results, self.clock(), self.summary, started)
        done = return_undelivered(done, rows, results, self.settings, self.outages, self.summary)
        done.returned.extend({"id": row_id, "outcome_detail": FENCE_EXPIRED} for row_id in fenced)
        return done

    async def _collect(self, until: int) -> None:
        """Wait until at most ``until`` slices are on the wire; keep what they came to."""
        while len(self.in_flight) > until:
            done, self.in_flight = await asyncio.wait(self.in_flight, return_when=asyncio.FIRST_COMPLETED)
            self.returned.extend(t.result() for t in done)

    async def _finish(self) -> None:
        if self.in_flight:  # only after an error: let what is on the wire answer, then settle it
            done, _ = await asyncio.wait(self.in_flight)
            self.returned.extend(t.result() for t in done if not t.cancelled() and t.exception() is None)
        try:
            await self._settle_last()
        finally:
            if self.owned and self.sender is not None:
                await self.sender.aclose()

    async def _settle_last(self) -> None:
        """Write what is still unwritten, and the halts found here that the ledger lacks."""
        unrecorded = {p: reason for p, reason in self.summary.halts.items() if p not in self.recorded}
        if not self.returned and not unrecorded:
            return
        halts = (self.scope, unrecorded) if unrecorded else None
        try:
            written = await waiting_off_the_loop(
                self.db, settle_last, self.db, self.returned, self.claimer, halts, self.clock
            )
        except TRANSIENT_ERRORS as exc:  # the database is away for now: worth writing again
            if self.returned:
                raise SettlementsNotWritten(list(self.returned), exc) from exc
            raise
        self.recorded.update(unrecorded)
        count_settlements(self.returned, written, self.summary)


def _may_stay_on_the_wire(slice_number: int, slices_on_the_wire: int) -> int:
    """How many earlier slices may still be unanswered when slice ``slice_number`` is claimed.

    The first slice goes alone: its answers are in before the second is claimed, so a
    configuration fault (wrong key, topic) stops the run after one slice instead of a window.
    """
    return 0 if slice_number == 1 else slices_on_the_wire - 1


def _report_progress(progress: Callable[[int, int], None] | None, done: int, total: int) -> None:
    """After the slice is on its way: a failing progress display (a closed terminal) never strands a claim."""
    if progress is None:
        return
    try:
        progress(done, total)
    except Exception:  # noqa: BLE001 - progress is decoration
        log.warning("progress display failed; draining on", exc_info=True)


def drain(
    db: Database,
    settings: Settings,
    sender_factory: SenderFactory,
    *,
    now: Instant | None = None,
    row_id: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    stop: Stop | None = None,
) -> DrainResult:
    """The whole drain in one call (CLI, HTTP): abandoned sweep, then every due row (or just ``row_id``).

    ``progress``: called with (due rows taken up so far, due rows) after each claim, for a terminal.
    ``stop``: once set (the HTTP server was told to stop), no further slice is claimed.
    ``sender_factory``: the shell's (``providers.routing.checked_sender_factory``), made before
    anything is claimed so that missing credentials refuse the drain rather than fail its rows.
    """
    started = time.perf_counter()
    clock = clock_for(now)
    summary = DrainResult(now=clock())
    summary.abandoned = fail_abandoned(db, settings, clock())
    ids = find_due(db, clock(), row_id=row_id)
    summary.due = len(ids)
    claimer = new_claimer()
    summary.merge(
        send_batch(
            db,
            settings,
            ids,
            sender_factory,
            now=now,
            claimer=claimer,
            halt_scope=claimer,
            progress=progress,
            stop=stop,
        )
    )
    summary.duration_seconds = time.perf_counter() - started
    return summary
