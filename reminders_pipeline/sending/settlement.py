"""What each claimed row comes to, and writing it: the plan made before a slice's send, the
settlement made of APNs' answers, and the transactions that write settlements.

Every settlement is written by a function here, in one lock order: the devices of dead tokens
first, then every row in id order (``ledger.lock_devices``, ``ledger.lock_rows``), the order a
build keeps too, so a drain settling and a build writing the same rows queue instead of
deadlocking. Rewriting a settlement after an ambiguous commit settles nothing twice: only rows
still claimed by the claimer are written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Connection

from reminders_pipeline import ledger
from reminders_pipeline.config.log_throttle import first_line
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.notification import compose, record_of_send
from reminders_pipeline.domain.outcomes import NO_RESULT
from reminders_pipeline.domain.policy import decide, quiet_end
from reminders_pipeline.domain.rows import ClaimedRow, ReturnedRow, RowSettlement, SendRecord
from reminders_pipeline.domain.rules import rule_kind
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Notification, Provider
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.providers.base import SendResult

log = logging.getLogger(__name__)

NO_RECORD: SendRecord = {"payload": None, "sent_body": None, "sent_format": None}  # nothing was composed


@dataclass
class SlicePlan:
    """A claimed slice decided by the policy, before anything is sent."""

    settlements: list[RowSettlement]
    to_send: list[Notification]
    records: dict[int, SendRecord]  # per row id: what its settlement records of the alert (``record_of_send``)
    held: list[ReturnedRow] = field(default_factory=list)  # back to pending until quiet hours end
    dry_run_lateness: list[float] = field(default_factory=list)  # a dry run's rows: how late they would have gone
    kinds: dict[int, str] = field(default_factory=dict)  # per row id: its rule's kind (``rules.rule_kind``)
    providers: dict[int, str] = field(default_factory=dict)  # per row id: its device's provider

    def provider_of(self, row_id: int) -> str:
        return self.providers.get(row_id, Provider.APNS)


@dataclass
class Settlement:
    """A slice's outcomes, ready to write: settled rows, dead tokens, rows back to pending."""

    at: Instant
    rows: list[RowSettlement]
    dead_tokens: list[tuple[ClaimedRow, SendResult]]
    returned: list[ReturnedRow] = field(default_factory=list)  # back to pending (ledger.return_to_pending)
    kinds: dict[int, str] = field(default_factory=dict)  # per row id: its rule's kind, for the counts
    providers: dict[int, str] = field(default_factory=dict)  # per row id: its device's provider, for the counts
    refunds: dict[int, int] = field(default_factory=dict)  # row id -> attempts an outage spent: given back

    def provider_of(self, row_id: int) -> str:
        return self.providers.get(row_id, Provider.APNS)


def decide_all(rows: list[ClaimedRow], now: Instant, settings: Settings) -> SlicePlan:
    plan = SlicePlan([], [], {})
    for row in rows:
        plan.kinds[row["id"]] = rule_kind(row["rule"])
        plan.providers[row["id"]] = row.get("provider") or Provider.APNS
        if row.get("source_id") is not None and not row.get("subscribed"):  # dropped after a build read the device
            plan.settlements.append({"id": row["id"], "outcome": "voided", "outcome_detail": "source_removed"})
            continue
        if row.get("calendar_muted"):  # muted after a build read the device, which queued it again
            plan.settlements.append({"id": row["id"], "outcome": "voided", "outcome_detail": "muted"})
            continue
        decision = decide(row, now, settings)
        if decision == "held":
            end = quiet_end(row, now)
            plan.held.append({"id": row["id"], "outcome_detail": "quiet_hours", "not_before": end, "held_until": end})
            continue
        if decision in ("send", "disabled"):
            if not row["target"] or row["token_invalid_at"]:
                plan.settlements.append({"id": row["id"], "outcome": "failed", "outcome_detail": "token_invalid"})
                continue
            try:
                note = compose(row, row.get("interruption_level") or settings.interruption_level, now=now)
                plan.records[row["id"]] = record_of_send(row, note)
            except ValueError as exc:  # text that cannot be encoded fails its row, not the claimed slice
                plan.settlements.append(
                    {"id": row["id"], "outcome": "failed", "outcome_detail": f"invalid:{type(exc).__name__}"}
                )
                continue
            if decision == "send":
                plan.to_send.append(note)
                continue
            plan.dry_run_lateness.append(now - row["send_after"])
        record = plan.records.get(row["id"], NO_RECORD)
        plan.settlements.append(
            {"id": row["id"], "outcome": decision, "outcome_detail": None, **record, "apns_id": None, "sent_at": None}
        )
    return plan


def _answered_at(res: SendResult, done: Instant, started: tuple[Instant, float] | None) -> Instant:
    """When APNs answered this row, on the drain's clock: true lateness per row, not per slice."""
    if res.answered_at is None or started is None:
        return done
    return min(done, started[0] + max(0.0, res.answered_at - started[1]))  # a fixed clock stands still


def settlement_of(
    rows: list[ClaimedRow],
    plan: SlicePlan,
    results: list[SendResult],
    done: Instant,
    summary: DrainResult,
    started: tuple[Instant, float] | None = None,
) -> Settlement:
    """The settlement of a sent slice: ``plan``'s own settlements, then one row per answer in ``results``
    (those missing fail ``no_result``). Counts lateness and halts on a configuration fault in ``summary``."""
    by_id = {r["id"]: r for r in rows}
    out = Settlement(done, list(plan.settlements), [], list(plan.held), plan.kinds, plan.providers)
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
                **plan.records.get(res.row_id, NO_RECORD),
                "apns_id": res.provider_message_id,
                "sent_at": sent_at,
            }
        )
        if sent_at is not None:
            summary.lateness_seconds.append(sent_at - row["send_after"])
        if res.token_invalid:
            out.dead_tokens.append((row, res))
        provider = plan.provider_of(res.row_id)
        if res.config_fault and summary.halt(provider, res.reason or f"http {res.status}"):
            log.error(
                "%s configuration fault (%s): stopped claiming its rows; they stay pending",
                provider, summary.halts[provider],
            )  # fmt: skip
    for note in plan.to_send:  # a sender that lost a result must not leave a row claimed
        if note.row_id not in answered:
            out.rows.append({"id": note.row_id, "outcome": "failed", "outcome_detail": NO_RESULT})
    return out


class SettlementsNotWritten(RuntimeError):
    """A batch's answers came back but the database failed under their settlements. Their rows stay
    claimed; a long-lived caller (the dispatcher) keeps ``settlements`` and writes each with
    ``write_settlement`` once the database answers, so a short outage loses no outcome. If the
    abandoned sweep fails the rows first, the late write settles nothing."""

    def __init__(self, settlements: list[Settlement], cause: BaseException) -> None:
        super().__init__(
            f"{len(settlements)} settlement(s) kept to write again ({type(cause).__name__}: {first_line(cause)})"
        )
        self.settlements = settlements


def settled_ids(settlement: Settlement) -> list[int]:
    """The rows a settlement writes, settled or returned to pending."""
    return [row["id"] for row in (*settlement.rows, *settlement.returned)]


def settle_and_claim(
    db: Database,
    returned: Sequence[Settlement],
    claimer: str,
    scope: str,
    ids: Sequence[int],
    claim_time: Instant,
    halts: dict[str, str] | None = None,
) -> tuple[list[tuple[int, int]], dict[str, str], list[ClaimedRow]]:
    """One commit per slice: the settlements that have come back, the halts found since the last
    commit (``halts``: provider -> reason), then the next claim, which skips the rows of every
    provider halted in ``scope`` (by any process). Returns what each settlement wrote, the scope's
    halts when the claim left some ids unclaimed, and the claimed rows."""
    with db.write() as conn:
        written = _write_returned(conn, returned, claimer)
        _record_halts(conn, scope, halts, claimer, claim_time)
        rows = ledger.claim(conn, ids, claim_time, claimer, unless_halted=scope)
        found = ledger.halts_of(conn, scope) if len(rows) < len(ids) else {}
        return written, found, rows


def settle_last(
    db: Database,
    returned: Sequence[Settlement],
    claimer: str,
    halts: tuple[str, dict[str, str]] | None,
    clock: Callable[[], Instant],
) -> list[tuple[int, int]]:
    """A batch's last write: what is still unwritten, and the halts it found and has not recorded
    (``halts``: its scope and provider -> reason, recorded at ``clock()``) so every batch and
    process of that scope skips those providers' rows too."""
    with db.write() as conn:
        written = _write_returned(conn, returned, claimer)
        if halts is not None:
            _record_halts(conn, halts[0], halts[1], claimer, clock())
        return written


def _record_halts(conn: Connection, scope: str, halts: dict[str, str] | None, claimer: str, now: Instant) -> None:
    for provider, reason in sorted((halts or {}).items()):
        ledger.record_halt(conn, scope, provider, reason, claimer, now)


def release_claims(db: Database, rows: Sequence[ReturnedRow], claimer: str, now: Instant) -> int:
    """Give back to pending whichever of ``rows`` are still claimed by ``claimer`` (none was sent)."""
    with db.write() as conn:
        return ledger.return_to_pending(conn, rows, claimer, now)


def write_settlement(db: Database, settlement: Settlement, claimer: str, summary: DrainResult) -> None:
    """Write one settlement a batch could not (``SettlementsNotWritten``) and count it in ``summary``."""
    with db.write() as conn:
        written = _write_returned(conn, [settlement], claimer)
    count_settlements([settlement], written, summary)


def _write_returned(conn: Connection, returned: Sequence[Settlement], claimer: str) -> list[tuple[int, int]]:
    """Write the settlements that have come back: dead devices locked first, then every row in id
    order (the lock order the build keeps too, see ``ledger.lock_rows``)."""
    _lock_dead_devices(conn, returned)
    ledger.lock_rows(conn, [row["id"] for s in returned for row in (*s.rows, *s.returned)])
    return [_write_settlement(conn, done, claimer) for done in returned]


def _lock_dead_devices(conn: Connection, settlements: Sequence[Settlement]) -> None:
    """Devices first, in id order (see ``ledger.lock_devices``): a concurrent build cannot deadlock us."""
    dead = [row["device_id"] for s in settlements for row, _ in s.dead_tokens]
    if dead:
        ledger.lock_devices(conn, dead)


def _write_settlement(conn: Connection, s: Settlement, claimer: str) -> tuple[int, int]:
    """Write one settlement; returns (rows voided by dead tokens, tokens invalidated). Idempotent:
    rewriting it after an ambiguous commit settles nothing twice (only the claimer's claimed rows)."""
    settled = ledger.settle(conn, s.rows, claimer, s.at)
    ledger.return_to_pending(conn, s.returned, claimer, s.at)
    ledger.refund_attempts(conn, s.refunds, s.at)
    voided = invalidated = 0
    for row, res in s.dead_tokens:
        voided += ledger.mark_token_invalid(
            conn,
            row["device_id"],
            row["target"],
            res.token_invalid_at or s.at,
            res.reason or "invalid",
            s.at,
            since=res.token_invalid_at or row["claimed_at"],
        )
        invalidated += 1
    if settled != len(s.rows):
        log.error("settled %d of %d claimed rows; the rest were failed as abandoned meanwhile", settled, len(s.rows))
    return voided, invalidated


def count_settlements(settlements: Sequence[Settlement], written: list[tuple[int, int]], summary: DrainResult) -> None:
    """Count written settlements in ``summary``: only once committed, so a lost commit is counted
    when it is written again, not twice."""
    for s, (voided, invalidated) in zip(settlements, written):
        summary.voided_by_token += voided
        summary.tokens_invalidated += invalidated
        for r in s.rows:
            summary.outcomes[r["outcome"]] += 1
            summary.kinds[f"{s.kinds.get(r['id'], 'lead')}:{r['outcome']}"] += 1
            summary.providers[f"{s.provider_of(r['id'])}:{r['outcome']}"] += 1
            if r.get("outcome_detail"):
                summary.details[f"{r['outcome']}:{r['outcome_detail']}"] += 1
        summary.returned_to_pending += len(s.returned)
        for back in s.returned:
            summary.details[f"pending:{back.get('outcome_detail')}"] += 1
