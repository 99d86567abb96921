"""Reads for people and for /metrics. The metrics reads are bounded: each reads an index range
bounded by a row limit or by recent activity (the window's latest settled rows, the due backlog,
claims in flight), never by the table, so a scrape of a queue of a million rows takes
milliseconds (bench/bench_metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, literal, select

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger._common import CLAIMED, PENDING, SETTLED
from reminders_pipeline.ledger.schema import devices, dispatchers, notification_history
from reminders_pipeline.ledger.schema import notification_queue as q

QUEUE_COLUMNS = [c.name for c in q.c]


def list_queue(
    conn: Connection,
    *,
    device_id: str | None = None,
    status: str | None = None,
    outcome: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Queue rows as stored, by ``send_after``: a settled row may keep only its alert body
    (``sent_body``), and people see the payload it sent through ``notification.as_shown``."""
    stmt = select(q).order_by(q.c.send_after, q.c.id)
    if device_id is not None:
        stmt = stmt.where(q.c.device_id == device_id)
    if status is not None:
        stmt = stmt.where(q.c.status == status)
    if outcome is not None:
        stmt = stmt.where(q.c.outcome == outcome)
    if limit is not None:
        stmt = stmt.limit(limit)
    return [dict(r) for r in conn.execute(stmt).mappings()]


def ping(conn: Connection) -> None:
    """One primary-key lookup on the queue: the database answers and the schema is there."""
    conn.execute(select(q.c.id).where(q.c.id == 0)).first()


def get_row(conn: Connection, row_id: int) -> dict[str, Any] | None:
    """One queue row as stored (``list_queue``)."""
    r = conn.execute(select(q).where(q.c.id == row_id)).mappings().first()
    return dict(r) if r else None


def oldest_due_pending(conn: Connection, now: Instant) -> Instant | None:
    oldest: Instant | None = conn.scalar(
        select(func.min(q.c.send_after)).where(q.c.status == PENDING, q.c.send_after <= now)
    )
    return oldest


def history_of(conn: Connection, queue_id: int) -> list[dict[str, Any]]:
    """What a queue row recorded before each re-arm, oldest first."""
    h = notification_history
    stmt = select(h).where(h.c.queue_id == queue_id).order_by(h.c.settled_at, h.c.id)
    return [dict(r) for r in conn.execute(stmt).mappings()]


COUNT_CAP = 100_000


def latest_settled(
    conn: Connection, since: Instant, now: Instant, limit: int
) -> list[tuple[Instant, str, str | None, Instant, Instant | None, str]]:
    """(settled_at, outcome, outcome_detail, send_after, sent_at, provider) of the latest ``limit``
    rows settled in ``(since, now]``, newest first: a backward range on the partial settled_at
    index, bounded by ``limit`` whatever the window holds, each with its device's provider (``apns``
    once the device is gone). Lateness is computed by the caller, never in SQL."""
    provider = func.coalesce(devices.c.provider, literal("apns"))
    stmt = (
        select(q.c.settled_at, q.c.outcome, q.c.outcome_detail, q.c.send_after, q.c.sent_at, provider)
        .select_from(q.outerjoin(devices, devices.c.id == q.c.device_id))
        .where(q.c.status == SETTLED, q.c.settled_at > since, q.c.settled_at <= now)
        .order_by(q.c.settled_at.desc())
        .limit(limit)
    )
    return list(conn.execute(stmt).all())  # one fetchall, not a fetch per row


def built_after(conn: Connection, now: Instant) -> int:
    """Live devices whose ``reminders_built_at`` is later than ``now``: builds skip them until then."""
    stmt = select(func.count()).where(devices.c.token_invalid_at.is_(None), devices.c.reminders_built_at > now)
    return int(conn.scalar(stmt) or 0)


def _capped_count(where: Any, cap: int) -> Any:
    """``count(*)`` of the rows matching ``where``, stopping at ``cap``: a bounded walk of an index range."""
    return select(func.count()).select_from(select(literal(1)).where(*where).limit(cap).subquery()).scalar_subquery()


@dataclass(frozen=True)
class QueueGauges:
    """The queue's present state for /metrics; counts of rows stop at ``COUNT_CAP``."""

    due_pending: int
    oldest_due_send_after: Instant | None
    claimed: int
    never_built: int
    oldest_built_at: Instant | None
    built_in_future: int
    settled_in_future: int
    latest_beat: Instant | None
    live_dispatchers: int


def queue_gauges(conn: Connection, now: Instant, beat_after: Instant) -> QueueGauges:
    """One statement of scalar subqueries, each a probe or a short range of one index."""
    live = devices.c.token_invalid_at.is_(None)
    running = dispatchers.c.stopped_at.is_(None)
    stmt = select(
        _capped_count([q.c.status == PENDING, q.c.send_after <= now], COUNT_CAP),
        select(func.min(q.c.send_after)).where(q.c.status == PENDING, q.c.send_after <= now).scalar_subquery(),
        _capped_count([q.c.status == CLAIMED], COUNT_CAP),
        select(func.count()).where(live, devices.c.reminders_built_at.is_(None)).scalar_subquery(),
        select(func.min(devices.c.reminders_built_at)).where(live).scalar_subquery(),
        select(func.count()).where(live, devices.c.reminders_built_at > now).scalar_subquery(),
        _capped_count([q.c.status == SETTLED, q.c.settled_at > now], COUNT_CAP),
        select(func.max(dispatchers.c.beat_at)).where(running, dispatchers.c.beat_at > beat_after).scalar_subquery(),
        select(func.count()).where(running, dispatchers.c.beat_at > beat_after).scalar_subquery(),
    )
    due, oldest_due, claimed, never, oldest, future, settled_future, beat, live_n = conn.execute(stmt).one()
    return QueueGauges(
        int(due), oldest_due, int(claimed), int(never), oldest, int(future), int(settled_future), beat, int(live_n)
    )
