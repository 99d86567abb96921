"""Retention: deleting settled rows and history once nothing can want them again."""

from __future__ import annotations

from sqlalchemy import Connection, delete, select

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger._common import SETTLED
from reminders_pipeline.ledger.schema import notification_history
from reminders_pipeline.ledger.schema import notification_queue as q


def prune_settled(conn: Connection, before: Instant, limit: int, *, ended_before: Instant) -> int:
    """Delete up to ``limit`` rows settled before ``before`` whose event ended before ``ended_before``;
    call repeatedly to prune in batches.

    A row whose event has not ended may still be in its feed: deleted, the next build would insert
    it again as new and send it a second time. Once the event has ended no rule can want it again.
    """
    victims = (
        select(q.c.id)
        .where(q.c.status == SETTLED, q.c.settled_at < before, q.c.expires_at < ended_before)
        .order_by(q.c.settled_at)
        .limit(limit)
    )
    return conn.execute(delete(q).where(q.c.id.in_(victims.scalar_subquery()))).rowcount


def prune_history(conn: Connection, before: Instant, limit: int) -> int:
    """Delete up to ``limit`` history rows re-armed before ``before``."""
    h = notification_history
    victims = select(h.c.id).where(h.c.rearmed_at < before).order_by(h.c.rearmed_at).limit(limit)
    return conn.execute(delete(h).where(h.c.id.in_(victims.scalar_subquery()))).rowcount
