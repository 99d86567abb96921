"""The drain half: fail abandoned claims, find due rows, claim each right before sending, settle.

At most once: a row is sent only by the drainer whose claim (a compare-and-swap) returned it, and
a claim left behind by a run that died mid-send is failed, never retried. A send that certainly
never reached APNs (``SendResult.retry``) goes back to pending instead, a bounded number of times;
a run of them halts the drain (an outage, ``faults.py``), as an APNs configuration fault does, and
the halt is written to the ledger so every batch and process of the same scope stops too. The
steps are separate functions so Dagster can run them as ops (``fail_abandoned`` -> ``find_due`` ->
``send_batch`` per batch) while the CLI and HTTP route run them in one call (``drain``). What each
claimed row comes to, and the writing of it, is ``settlement.py``; the counts, ``summary.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from sqlalchemy.exc import OperationalError

from . import ledger
from .db import Database, waiting_off_the_loop
from .faults import APNS_UNREACHABLE, Outage, alert_halt, return_undelivered
from .sender import FENCE_EXPIRED, Sender, SenderFactory, SendResult, default_sender_factory, send_fenced
from .settings import Settings
from .settlement import (
    Settlement,
    SettlementsNotWritten,
    SlicePlan,
    count_settlements,
    decide_all,
    settle_and_claim,
    settle_last,
    settlement_of,
)
from .summary import DrainResult
from .times import Instant

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


def fence_deadline(settings: Settings, claimed_at: float) -> float:
    """When a claim taken at ``claimed_at`` (``time.monotonic()``, read before the claim's transaction)
    stops sending: no request of it may leave after this.

    No other process touches a claim younger than ``abandon_after_seconds`` (it is failed as
    abandoned only after that). A request written before this deadline is answered within the send
    timeout, and ``fence_margin_seconds`` covers clock skew between hosts and the settling commit,
    so the claim is settled by its owner before anyone may fail it. A process paused past the
    deadline (GC, SIGSTOP, a stalled VM) therefore never sends a row that may have been failed,
    re-armed and sent elsewhere meanwhile. A local clock, not a database round trip per send.
    """
    return claimed_at + settings.abandon_after_seconds - settings.send_timeout_seconds - settings.fence_margin_seconds


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
    outage: Outage | None = None,
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
    CLI or HTTP drain its claimer. A halt recorded under it by any process stops this batch before
    its next claim; a halt found here is recorded there, and alerted once. A halt is permanent for
    its scope, so a long-lived caller passes a new scope per pass (none: this call alone).
    ``outage``: the caller's judge of an APNs outage, kept across its batches (a dispatcher's);
    none: this call's own.
    ``monotonic``: the clock of each claim's fence (``fence_deadline``); a test advances its own
    (and the sender's) to simulate a process paused between claim and send.
    """
    clock = clock_for(now) if now or clock is None else clock
    claimer = claimer or new_claimer()
    scope = halt_scope or f"{claimer}:{uuid.uuid4().hex[:8]}"
    outage = outage or Outage(settings.apns_halt_after)
    batch = _Batch(db, settings, sender_factory, sender, clock, claimer, scope, outage, monotonic)
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
    outage: Outage
    monotonic: Callable[[], float]
    summary: DrainResult = field(init=False)
    halted_elsewhere: bool = False  # the halt was read from the ledger, not found here
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
        halted = self.summary.halted
        if halted and not self.halted_elsewhere and not (halted.startswith(APNS_UNREACHABLE) and self.outage.alerted):
            self.outage.alerted = halted.startswith(APNS_UNREACHABLE)
            alert_halt(self.settings, self.summary, self.claimer)
        return self.summary

    async def _claim_and_send(
        self, ids: Sequence[int], stop: Stop | None, progress: Callable[[int, int], None] | None
    ) -> None:
        size = self.settings.claim_batch_size
        for n, i in enumerate(range(0, len(ids), size)):
            await self._collect(_may_stay_on_the_wire(n, self.slices_on_the_wire))
            if self.summary.halted or (stop is not None and stop.is_set()):
                break
            if not await self._claim_slice(ids[i : i + size]):
                break
            _report_progress(progress, min(i + size, len(ids)), len(ids))
        await self._collect(0)

    async def _claim_slice(self, slice_ids: Sequence[int]) -> bool:
        """Write what has come back and claim the slice in one commit, then send it; False once halted."""
        claim_time, claimed_at = self.clock(), self.monotonic()
        written, halted, rows = await waiting_off_the_loop(
            self.db, settle_and_claim, self.db, self.returned, self.claimer, self.scope, slice_ids, claim_time
        )
        count_settlements(self.returned, written, self.summary)  # only once committed: a lost commit is retried
        self.returned.clear()
        if halted and not self.summary.halted:
            self.summary.halted, self.halted_elsewhere = halted, True
            log.warning("stopped claiming: drain scope %s halted (%s)", self.scope, halted)
        if self.summary.halted:
            # A send on the wire may have found the fault while this claim ran in its thread
            # (SQLite): the rows just claimed were never sent, so they go back to pending.
            self.returned.append(
                Settlement(self.clock(), [], [], [{"id": r["id"], "outcome_detail": "halted"} for r in rows])
            )
            return False
        self.summary.claimed += len(rows)
        if rows:
            plan = decide_all(rows, claim_time, self.settings)
            self.summary.lateness_seconds.extend(plan.dry_run_lateness)
            if plan.to_send and self.sender is None:
                self.sender = self.sender_factory()
            send_by = fence_deadline(self.settings, claimed_at)
            self.in_flight.add(asyncio.ensure_future(self._dispatch(rows, plan, send_by, self.sender)))
        return True

    async def _dispatch(
        self, rows: list[dict[str, Any]], plan: SlicePlan, send_by: float, sender: Sender | None
    ) -> Settlement:
        started = (self.clock(), time.monotonic())
        results: list[SendResult] = []
        fenced: set[int] = set()
        if plan.to_send and sender is not None:
            results, fenced = await send_fenced(sender, plan.to_send, send_by, self.monotonic)
        if fenced:
            plan = replace(plan, to_send=[n for n in plan.to_send if n.row_id not in fenced])
        done = settlement_of(rows, plan, results, self.clock(), self.summary, started)
        done = return_undelivered(done, rows, results, self.settings, self.outage, self.summary)
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
        """Write what is still unwritten, and the halt found here (not one read from the ledger)."""
        reason = None if self.halted_elsewhere else self.summary.halted
        if not self.returned and reason is None:
            return
        halt = None if reason is None else (self.scope, reason)
        try:
            written = await waiting_off_the_loop(
                self.db, settle_last, self.db, self.returned, self.claimer, halt, self.clock
            )
        except OperationalError as exc:  # the database went away or timed out: worth writing again
            if self.returned:
                raise SettlementsNotWritten(list(self.returned), exc) from exc
            raise
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
    sender_factory: SenderFactory | None = None,
    *,
    now: Instant | None = None,
    row_id: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    stop: Stop | None = None,
) -> DrainResult:
    """The whole drain in one call (CLI, HTTP): abandoned sweep, then every due row (or just ``row_id``).

    ``progress``: called with (due rows taken up so far, due rows) after each claim, for a terminal.
    ``stop``: once set (the HTTP server was told to stop), no further slice is claimed.
    """
    started = time.perf_counter()
    factory = sender_factory or default_sender_factory(settings)  # fails fast before any claim
    clock = clock_for(now)
    summary = DrainResult(now=clock())
    summary.abandoned = fail_abandoned(db, settings, clock())
    ids = find_due(db, clock(), row_id=row_id)
    summary.due = len(ids)
    claimer = new_claimer()
    summary.merge(
        send_batch(
            db, settings, ids, factory, now=now, claimer=claimer, halt_scope=claimer, progress=progress, stop=stop
        )
    )
    summary.duration_seconds = time.perf_counter() - started
    return summary
