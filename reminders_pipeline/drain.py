"""The drain half: fail abandoned claims, find due rows, claim each right before sending, settle.

At most once: a row is sent only by the drainer whose claim (a compare-and-swap) returned it, and
a claim left behind by a run that died mid-send is failed, never retried. A send that certainly
never reached APNs (``SendResult.retry``) goes back to pending instead, a bounded number of times;
a run of them halts the drain (an outage), as an APNs configuration fault does, and the halt is
written to the ledger so every batch and process of the same scope stops too. The steps are separate
functions so Dagster can run them as ops (``fail_abandoned`` -> ``find_due`` -> ``send_batch`` per
batch) while the CLI and HTTP route run them in one call (``drain``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError

from . import ledger
from .alerts import raise_alert
from .db import Database
from .notification import compose, record_of_send
from .policy import decide, quiet_end
from .quiet import first_line
from .sender import FENCE_EXPIRED, NOT_WRITTEN, Notification, Sender, SenderFactory, SendResult, fence_expired
from .settings import Settings
from .times import now_utc, shift, unix_from_iso

log = logging.getLogger(__name__)
T = TypeVar("T")

Clock = Callable[[], str]


@dataclass
class DrainSummary:
    now: str
    abandoned: int = 0
    due: int = 0
    claimed: int = 0
    outcomes: Counter = field(default_factory=Counter)
    details: Counter = field(default_factory=Counter)
    lateness_seconds: list[float] = field(default_factory=list)
    tokens_invalidated: int = 0
    voided_by_token: int = 0
    halted: str | None = None  # a configuration fault or an outage stopped claiming
    duration_seconds: float = 0.0
    returned_to_pending: int = 0  # certainly not delivered: pending again, one attempt more

    def merge(self, other: DrainSummary) -> DrainSummary:
        self.abandoned += other.abandoned
        self.claimed += other.claimed
        self.outcomes.update(other.outcomes)
        self.details.update(other.details)
        self.lateness_seconds.extend(other.lateness_seconds)
        self.tokens_invalidated += other.tokens_invalidated
        self.voided_by_token += other.voided_by_token
        self.halted = self.halted or other.halted
        self.returned_to_pending += other.returned_to_pending
        return self

    def lateness_percentiles(self) -> dict[str, float | None]:
        values = sorted(self.lateness_seconds)
        if not values:
            return {"p50": None, "p95": None, "p99": None, "max": None}

        def pct(p: float) -> float:
            return round(values[min(len(values) - 1, int(p * len(values)))], 3)

        return {"p50": pct(0.50), "p95": pct(0.95), "p99": pct(0.99), "max": round(values[-1], 3)}

    def as_dict(self) -> dict[str, Any]:
        return {
            "now": self.now,
            "abandoned": self.abandoned,
            "due": self.due,
            "claimed": self.claimed,
            "outcomes": dict(self.outcomes),
            "details": dict(self.details),
            "lateness_seconds": self.lateness_percentiles(),
            "tokens_invalidated": self.tokens_invalidated,
            "voided_by_token": self.voided_by_token,
            "halted": self.halted,
            "returned_to_pending": self.returned_to_pending,
            "duration_seconds": round(self.duration_seconds, 3),
        }


def clock_for(now: str | None) -> Clock:
    """A fixed clock for ``--now`` and tests, else the real one."""
    return (lambda: now) if now else now_utc


def new_claimer() -> str:
    return f"drain-{uuid.uuid4().hex[:16]}"


def default_sender_factory(settings: Settings) -> SenderFactory:
    """APNs when enabled (credentials checked now, before any claim); no sender at all in a dry run."""
    if not settings.enabled:

        def refuse() -> Sender:
            raise RuntimeError("REMINDERS_ENABLED is not 'true': a dry run never connects to APNs")

        return refuse
    from .apns import apns_sender_factory

    return apns_sender_factory(settings)


def fail_abandoned(db: Database, settings: Settings, now: str | None = None) -> int:
    now = now or now_utc()
    with db.write() as conn:
        n = ledger.fail_abandoned(conn, shift(now, -settings.abandon_after_seconds), now)
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


def find_due(db: Database, now: str | None = None, row_id: int | None = None, limit: int | None = None) -> list[int]:
    with db.read() as conn:
        return ledger.due_ids(conn, now or now_utc(), row_id=row_id, limit=limit)


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
    db: Database,
    settings: Settings,
    ids: Sequence[int],
    sender_factory: SenderFactory,
    *,
    now: str | None = None,
    claimer: str | None = None,
    halt_scope: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    stop: Stop | None = None,
) -> DrainSummary:
    return asyncio.run(
        send_batch_async(
            db,
            settings,
            ids,
            sender_factory,
            now=now,
            claimer=claimer,
            halt_scope=halt_scope,
            progress=progress,
            stop=stop,
        )
    )


async def send_batch_async(
    db: Database,
    settings: Settings,
    ids: Sequence[int],
    sender_factory: SenderFactory,
    *,
    now: str | None = None,
    claimer: str | None = None,
    clock: Clock | None = None,
    sender: Sender | None = None,
    stop: Stop | None = None,
    halt_scope: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    monotonic: Callable[[], float] = time.monotonic,
    outage: Outage | None = None,
) -> DrainSummary:
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
    summary = DrainSummary(now=clock())
    outage = outage or Outage(settings.apns_halt_after)
    halted_elsewhere = False
    slices_on_the_wire = -(-settings.apns_concurrency // settings.claim_batch_size) + 1
    owned = sender is None
    in_flight: set[asyncio.Task[_Settlement]] = set()
    returned: list[_Settlement] = []

    async def dispatch(rows: list[dict[str, Any]], plan: _Plan, send_by: float) -> _Settlement:
        started = (clock(), time.monotonic())
        results, fenced = await _send_fenced(sender, plan.to_send, send_by, monotonic) if plan.to_send else ([], [])  # type: ignore[arg-type]
        if fenced:
            plan = replace(plan, to_send=[n for n in plan.to_send if n.row_id not in fenced])
        done = _settlement(rows, plan, results, clock(), summary, started)
        done = _return_undelivered(done, rows, results, settings, outage, summary)
        done.returned.extend({"id": row_id, "outcome_detail": FENCE_EXPIRED} for row_id in fenced)
        return done

    async def collect(until: int) -> None:
        nonlocal in_flight
        while len(in_flight) > until:
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            returned.extend(t.result() for t in done)

    try:
        for n, i in enumerate(range(0, len(ids), settings.claim_batch_size)):
            await collect(_may_stay_on_the_wire(n, slices_on_the_wire))
            if summary.halted or (stop is not None and stop.is_set()):
                break
            claim_time, claimed_at = clock(), monotonic()

            def settle_and_claim(
                slice_ids: Sequence[int],
            ) -> tuple[list[tuple[int, int]], str | None, list[dict[str, Any]]]:
                with db.write() as conn:
                    written = _write_returned(conn, returned, claimer)
                    halted = ledger.halt_of(conn, scope)
                    return written, halted, [] if halted else ledger.claim(conn, slice_ids, claim_time, claimer)  # noqa: B023 - awaited in this iteration

            written, halted, rows = await waiting_off_the_loop(
                db, settle_and_claim, ids[i : i + settings.claim_batch_size]
            )
            _count_settlements(returned, written, summary)  # only once committed: a lost commit is retried below
            returned.clear()
            if halted and not summary.halted:
                summary.halted, halted_elsewhere = halted, True
                log.warning("stopped claiming: drain scope %s halted (%s)", scope, halted)
            if summary.halted:
                # A send on the wire may have found the fault while this claim ran in its thread
                # (SQLite): the rows just claimed were never sent, so they go back to pending.
                returned.append(
                    _Settlement(clock(), [], [], [{"id": r["id"], "outcome_detail": "halted"} for r in rows])
                )
                break
            summary.claimed += len(rows)
            if rows:
                plan = _decide_all(rows, claim_time, settings)
                summary.lateness_seconds.extend(plan.dry_run_lateness)
                if plan.to_send and sender is None:
                    sender = sender_factory()
                in_flight.add(asyncio.ensure_future(dispatch(rows, plan, fence_deadline(settings, claimed_at))))
            _report_progress(progress, min(i + settings.claim_batch_size, len(ids)), len(ids))
        await collect(0)
    finally:
        if in_flight:  # only after an error: let what is on the wire answer, then settle it
            done, _ = await asyncio.wait(in_flight)
            returned.extend(t.result() for t in done if not t.cancelled() and t.exception() is None)
        try:
            halt_found = summary.halted is not None and not halted_elsewhere
            if returned or halt_found:

                def settle_last() -> list[tuple[int, int]]:
                    with db.write() as conn:
                        written = _write_returned(conn, returned, claimer)
                        if halt_found:
                            ledger.record_halt(conn, scope, summary.halted, claimer, clock())  # type: ignore[arg-type]
                        return written

                try:
                    written = await waiting_off_the_loop(db, settle_last)
                except OperationalError as exc:  # the database went away or timed out: worth writing again
                    if returned:
                        raise SettlementsNotWritten(list(returned), exc) from exc
                    raise
                _count_settlements(returned, written, summary)
        finally:
            if owned and sender is not None:
                await sender.aclose()
    if summary.halted and not halted_elsewhere and not (summary.halted.startswith(APNS_UNREACHABLE) and outage.alerted):
        outage.alerted = summary.halted.startswith(APNS_UNREACHABLE)
        _alert_halt(settings, summary, claimer)
    return summary


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


async def waiting_off_the_loop(db: Database, transaction: Callable[..., T], *args: Any) -> T:
    """Run a transaction in a worker thread, where its waits cannot stall the sends on the wire.

    Every statement may wait: SQLite's write lock held by another process (a build, another
    drainer) for seconds, PostgreSQL's row locks taken to settle (``ledger.lock_rows``, the device
    locks of dead tokens) held by a build until it commits, a full pool, a slow network. On the
    event loop, any such wait would stop every APNs answer from being read, and sends that were
    delivered would be recorded ``timeout``. The claim itself skips rows held elsewhere (SKIP
    LOCKED) and takes them on a later pass. The thread hop costs well under a millisecond per slice.
    """
    if db.dialect == "sqlite" and db.engine.url.database in (
        None,
        "",
        ":memory:",
    ):  # in memory: one connection per thread
        return transaction(*args)
    return await asyncio.to_thread(transaction, *args)


def _alert_halt(settings: Settings, summary: DrainSummary, claimer: str) -> None:
    if summary.halted and summary.halted.startswith(APNS_UNREACHABLE):
        title = "APNs unreachable: drain stopped claiming"
        text = (
            f"{summary.halted}. Those rows are pending again (each send is bounded by REMINDERS_SEND_MAX_ATTEMPTS "
            "and MAX_LATENESS); rows not yet claimed stay pending for the next drain."
        )
    else:
        title = "APNs configuration fault: drain stopped claiming"
        text = (
            f"APNs answered {summary.halted}: the credentials, key id, team or topic are wrong, not the row. "
            "Rows not yet claimed stay pending for the next drain."
        )
    raise_alert(settings, title, text, claimer=claimer, failed=summary.outcomes.get("failed", 0))


APNS_UNREACHABLE = "apns_unreachable"


OUTAGE_WINDOW_SECONDS = 10.0  # certain non-delivery for this long, over two answers or more, is an outage


@dataclass
class Outage:
    """Whether APNs is out, judged across batches: sends in a row that certainly never reached
    APNs or that APNs could not process (500, 503), ``limit`` of them or for ``window`` seconds.
    A 429 is APNs throttling one device token: that token's backoff, no outage. One instance
    lives as long as its sender (a dispatcher's, a drain call's), so a stream of one-row batches
    trips it as a burst does; ``alerted`` keeps its alert to one per outage."""

    limit: int
    window: float = OUTAGE_WINDOW_SECONDS
    streak: int = 0
    since: float | None = None  # time.monotonic() of the streak's first answer
    last: str | None = None
    alerted: bool = False

    def count(self, results: list[SendResult], now: float | None = None) -> str | None:
        """The halt reason while the outage lasts, else None."""
        now = time.monotonic() if now is None else now
        for r in results:
            if _not_written(r):
                continue  # failed before the write for another reason than reaching APNs: says nothing of it
            if r.retry and r.status != 429:
                self.since = now if self.streak == 0 else self.since
                self.streak, self.last = self.streak + 1, r.reason
            else:
                if self.alerted:
                    log.warning("APNs answers again after %d sends not delivered", self.streak)
                self.streak, self.since, self.alerted = 0, None, False
        lasting = self.since is not None and self.streak >= 2 and now - self.since >= self.window
        if self.streak < self.limit and not lasting:
            return None
        return f"{APNS_UNREACHABLE}: {self.streak} sends in a row not delivered (last: {self.last})"


@dataclass
class _Plan:
    settlements: list[dict[str, Any]]
    to_send: list[Notification]
    records: dict[
        int, dict[str, str | None]
    ]  # per row id: what its settlement records of the alert (``record_of_send``)
    held: list[dict[str, Any]] = field(default_factory=list)  # back to pending until quiet hours end
    dry_run_lateness: list[float] = field(default_factory=list)  # a dry run's rows: how late they would have gone


@dataclass
class _Settlement:
    at: str
    rows: list[dict[str, Any]]
    dead_tokens: list[tuple[dict[str, Any], SendResult]]
    returned: list[dict[str, Any]] = field(default_factory=list)  # back to pending (ledger.return_to_pending)


def _decide_all(rows: list[dict[str, Any]], now: str, settings: Settings) -> _Plan:
    plan = _Plan([], [], {})
    for row in rows:
        decision = decide(row, now, settings)
        if decision == "held":
            end = quiet_end(row, now)
            plan.held.append({"id": row["id"], "outcome_detail": "quiet_hours", "not_before": end, "held_until": end})
            continue
        if decision in ("send", "disabled"):
            if not row["apns_token"] or row["token_invalid_at"]:
                plan.settlements.append({"id": row["id"], "outcome": "failed", "outcome_detail": "token_invalid"})
                continue
            try:
                note = compose(row, settings.interruption_level)
                plan.records[row["id"]] = record_of_send(row, note)
            except ValueError as exc:  # text that cannot be encoded fails its row, not the claimed slice
                plan.settlements.append(
                    {"id": row["id"], "outcome": "failed", "outcome_detail": f"invalid:{type(exc).__name__}"}
                )
                continue
            if decision == "send":
                plan.to_send.append(note)
                continue
            plan.dry_run_lateness.append(unix_from_iso(now) - unix_from_iso(row["send_after"]))
        plan.settlements.append({"id": row["id"], "outcome": decision, **plan.records.get(row["id"], {})})
    return plan


async def _send_fenced(
    sender: Sender, notes: list[Notification], send_by: float, monotonic: Callable[[], float]
) -> tuple[list[SendResult], set[int]]:
    """Send ``notes`` fenced by ``send_by``; returns the answers and the ids refused by the fence.

    Checked here once for every sender, and again by the sender itself at the moment the bytes
    leave (the APNs transport, ``RecordingSender``), so a pause anywhere before the write is caught.
    A fenced row certainly never reached APNs: it goes back to pending, guarded by our claim, so if
    the claim was failed as abandoned meanwhile the row is left as the other process settled it.
    """
    if monotonic() >= send_by:
        results = [fence_expired(n.row_id) for n in notes]
    else:
        results = await _send(sender, [n.fenced(send_by) for n in notes])
    fenced = {r.row_id for r in results if r.reason == FENCE_EXPIRED}
    if fenced:
        log.error(
            "%d claimed row(s) not sent: the claim's fence passed (a paused process?); pending again if still ours",
            len(fenced),
        )
    return [r for r in results if r.reason != FENCE_EXPIRED], fenced


async def _send(sender: Sender, notes: list[Notification]) -> list[SendResult]:
    try:
        return await sender.send_many(notes)
    except Exception as exc:  # a sender bug must still settle every claimed row (failed, not retried)
        log.exception("sender raised; %d claimed row(s) settle failed", len(notes))
        return [SendResult(n.row_id, False, reason=f"sender_error:{type(exc).__name__}") for n in notes]


def _answered_at(res: SendResult, done: str, started: tuple[str, float] | None) -> str:
    """When APNs answered this row, on the drain's clock: true lateness per row, not per slice."""
    if res.answered_at is None or started is None:
        return done
    return min(done, shift(started[0], max(0.0, res.answered_at - started[1])))  # a fixed clock stands still


def _settlement(
    rows,
    plan: _Plan,
    results: list[SendResult],
    done: str,
    summary: DrainSummary,
    started: tuple[str, float] | None = None,
) -> _Settlement:  # type: ignore[no-untyped-def]
    by_id = {r["id"]: r for r in rows}
    out = _Settlement(done, list(plan.settlements), [], list(plan.held))
    answered = set()
    for res in results:
        answered.add(res.row_id)
        row = by_id[res.row_id]
        sent_at = _answered_at(res, done, started) if res.ok else None
        out.rows.append(
            {
                "id": res.row_id,
                "outcome": "sent" if res.ok else "failed",
                "outcome_detail": None if res.ok else (res.reason or f"http {res.status}"),
                **plan.records.get(res.row_id, {}),
                "apns_id": res.apns_id,
                "sent_at": sent_at,
            }
        )
        if sent_at is not None:
            summary.lateness_seconds.append(unix_from_iso(sent_at) - unix_from_iso(row["send_after"]))
        if res.token_invalid:
            out.dead_tokens.append((row, res))
        if res.config_fault and not summary.halted:
            summary.halted = res.reason or f"http {res.status}"
            log.error("APNs configuration fault (%s): stopped claiming; remaining rows stay pending", summary.halted)
    for note in plan.to_send:  # a sender that lost a result must not leave a row claimed
        if note.row_id not in answered:
            out.rows.append({"id": note.row_id, "outcome": "failed", "outcome_detail": "no_result"})
    return out


def _return_undelivered(
    out: _Settlement,
    rows: list[dict[str, Any]],
    results: list[SendResult],
    settings: Settings,
    outage: Outage,
    summary: DrainSummary,
) -> _Settlement:
    """Rows whose send certainly was not delivered go back to pending, not due again before their
    backoff ends (``retry_not_before``): those APNs answered (429, 500, 503) and those that failed
    before their write for another reason (``NOT_WRITTEN``) while attempts remain, one attempt
    spent; those that never reached APNs (refused, TLS, no route) always, spending none, as only
    APNs' answers count against a row (the lateness policy still bounds them). The rest stay
    failed as ``_settlement`` wrote them. A long enough run of them, across batches, halts the drain."""
    attempts = {r["id"]: r.get("attempts") or 0 for r in rows}
    unreached = {r.row_id for r in results if r.retry and r.status is None and not _not_written(r)}
    again = unreached | {r.row_id for r in results if r.retry and attempts[r.row_id] + 1 < settings.send_max_attempts}
    if again:
        out.returned.extend(
            {"id": r["id"], "outcome_detail": r["outcome_detail"], "spent": r["id"] not in unreached,
             "not_before": retry_not_before(out.at, 1 if r["id"] in unreached else attempts[r["id"]] + 1, settings)}
            for r in out.rows if r["id"] in again
        )  # fmt: skip
        out.rows = [r for r in out.rows if r["id"] not in again]
    reason = outage.count(results, unix_from_iso(out.at))
    if reason and not summary.halted:
        summary.halted = reason
        if not outage.alerted:  # one line per outage, not one per batch that meets it
            log.error("APNs unreachable (%s): stopped claiming; remaining rows stay pending", reason)
    return out


def _not_written(result: SendResult) -> bool:
    return (result.reason or "").startswith(NOT_WRITTEN + ":")


def retry_not_before(
    now: str, attempt: int, settings: Settings, uniform: Callable[[float, float], float] = random.uniform
) -> str:
    """When a row may go again after its ``attempt``-th send certainly did not deliver: exponential
    backoff (``REMINDERS_SEND_RETRY_BASE_SECONDS`` doubling per attempt, at most
    ``REMINDERS_SEND_RETRY_MAX_SECONDS``) with jitter down to half, so rows throttled together do
    not all come back together, and a second dispatcher or the cron drain waits as well."""
    delay = min(settings.send_retry_max_seconds, settings.send_retry_base_seconds * 2 ** (attempt - 1))
    return shift(now, uniform(delay / 2, delay))


class SettlementsNotWritten(RuntimeError):
    """A batch's answers came back but the database failed under their settlements. Their rows stay
    claimed; a long-lived caller (the dispatcher) keeps ``settlements`` and writes each with
    ``write_settlement`` once the database answers, so a short outage loses no outcome. If the
    abandoned sweep fails the rows first, the late write settles nothing."""

    def __init__(self, settlements: list[_Settlement], cause: BaseException) -> None:
        super().__init__(
            f"{len(settlements)} settlement(s) kept to write again ({type(cause).__name__}: {first_line(cause)})"
        )
        self.settlements = settlements


def write_settlement(db: Database, settlement: _Settlement, claimer: str, summary: DrainSummary) -> None:
    """Write one settlement a batch could not (``SettlementsNotWritten``) and count it in ``summary``."""
    with db.write() as conn:
        written = _write_returned(conn, [settlement], claimer)
    _count_settlements([settlement], written, summary)


def settled_ids(settlement: _Settlement) -> list[int]:
    """The rows a settlement writes, settled or returned to pending."""
    return [row["id"] for row in (*settlement.rows, *settlement.returned)]


def _write_returned(conn: Connection, returned: Sequence[_Settlement], claimer: str) -> list[tuple[int, int]]:
    """Write the settlements that have come back: dead devices locked first, then every row in id
    order (the lock order the build keeps too, see ``ledger.lock_rows``)."""
    _lock_dead_devices(conn, returned)
    ledger.lock_rows(conn, [row["id"] for s in returned for row in (*s.rows, *s.returned)])
    return [_write_settlement(conn, done, claimer) for done in returned]


def _lock_dead_devices(conn: Connection, settlements: Sequence[_Settlement]) -> None:
    """Devices first, in id order (see ``ledger.lock_devices``): a concurrent build cannot deadlock us."""
    dead = [row["device_id"] for s in settlements for row, _ in s.dead_tokens]
    if dead:
        ledger.lock_devices(conn, dead)


def _write_settlement(conn: Connection, s: _Settlement, claimer: str) -> tuple[int, int]:
    """Write one settlement; returns (rows voided by dead tokens, tokens invalidated). Idempotent:
    rewriting it after an ambiguous commit settles nothing twice (only the claimer's claimed rows)."""
    settled = ledger.settle(conn, s.rows, claimer, s.at)
    ledger.return_to_pending(conn, s.returned, claimer, s.at)
    voided = invalidated = 0
    for row, res in s.dead_tokens:
        voided += ledger.mark_token_invalid(
            conn,
            row["device_id"],
            row["apns_token"],
            res.token_invalid_at or s.at,
            res.reason or "invalid",
            s.at,
            since=res.token_invalid_at or row["claimed_at"],
        )
        invalidated += 1
    if settled != len(s.rows):
        log.error("settled %d of %d claimed rows; the rest were failed as abandoned meanwhile", settled, len(s.rows))
    return voided, invalidated


def _count_settlements(settlements: list[_Settlement], written: list[tuple[int, int]], summary: DrainSummary) -> None:
    for s, (voided, invalidated) in zip(settlements, written):
        summary.voided_by_token += voided
        summary.tokens_invalidated += invalidated
        for r in s.rows:
            summary.outcomes[r["outcome"]] += 1
            if r.get("outcome_detail"):
                summary.details[f"{r['outcome']}:{r['outcome_detail']}"] += 1
        summary.returned_to_pending += len(s.returned)
        for r in s.returned:
            summary.details[f"pending:{r['outcome_detail']}"] += 1


def drain(
    db: Database,
    settings: Settings,
    sender_factory: SenderFactory | None = None,
    *,
    now: str | None = None,
    row_id: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    stop: Stop | None = None,
) -> DrainSummary:
    """The whole drain in one call (CLI, HTTP): abandoned sweep, then every due row (or just ``row_id``).

    ``progress``: called with (due rows taken up so far, due rows) after each claim, for a terminal.
    ``stop``: once set (the HTTP server was told to stop), no further slice is claimed.
    """
    started = time.perf_counter()
    factory = sender_factory or default_sender_factory(settings)  # fails fast before any claim
    clock = clock_for(now)
    summary = DrainSummary(now=clock())
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
