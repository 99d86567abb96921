"""Exact-time dispatchers' heartbeats (``reminders_pipeline.sending.dispatch``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, delete, func, select, update

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger._common import insert_on_conflict
from reminders_pipeline.ledger.schema import dispatchers


def beat(
    conn: Connection,
    name: str,
    now: Instant,
    *,
    started_at: Instant,
    ends_at: Instant | None,
    sent: int,
    settled: int,
) -> None:
    """Record a dispatcher's heartbeat (inserted on its first beat)."""
    values = {
        "name": name,
        "started_at": started_at,
        "beat_at": now,
        "ends_at": ends_at,
        "sent": sent,
        "settled": settled,
    }
    ins = insert_on_conflict(conn)(dispatchers).values(**values)
    conn.execute(
        ins.on_conflict_do_update(
            index_elements=[dispatchers.c.name],
            set_={"beat_at": ins.excluded.beat_at, "sent": ins.excluded.sent, "settled": ins.excluded.settled},
        )
    )


def dispatcher_stopped(conn: Connection, name: str, now: Instant) -> None:
    conn.execute(update(dispatchers).where(dispatchers.c.name == name).values(stopped_at=now, beat_at=now))


def live_dispatchers(conn: Connection, beat_after: Instant) -> list[dict[str, Any]]:
    """Dispatchers that have beaten since ``beat_after`` and not stopped, newest beat first."""
    stmt = (
        select(dispatchers)
        .where(dispatchers.c.beat_at > beat_after, dispatchers.c.stopped_at.is_(None))
        .order_by(dispatchers.c.beat_at.desc())
    )
    return [dict(r) for r in conn.execute(stmt).mappings()]


def latest_beat(conn: Connection) -> Instant | None:
    """The newest heartbeat of any running dispatcher (None when none has ever beaten)."""
    latest: Instant | None = conn.scalar(
        select(func.max(dispatchers.c.beat_at)).where(dispatchers.c.stopped_at.is_(None))
    )
    return latest


def prune_dispatchers(conn: Connection, before: Instant) -> int:
    """Forget dispatchers whose last beat is older than ``before``."""
    return conn.execute(delete(dispatchers).where(dispatchers.c.beat_at < before)).rowcount
