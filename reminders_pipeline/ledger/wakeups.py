"""The signals that wake exact-time dispatchers: a NOTIFY on PostgreSQL when pending rows arrive or
move earlier, and the earliest pending time a dispatcher sleeps until (on SQLite, which has no
NOTIFY, it polls up to that time)."""

from __future__ import annotations

from sqlalchemy import Connection, case, func, select

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger._common import PENDING
from reminders_pipeline.ledger.schema import notification_queue as q

DUE_CHANNEL = "reminders_due"


def announce_pending(conn: Connection, earliest_send_after: Instant) -> None:
    """Tell listening dispatchers that pending rows were inserted or moved (PostgreSQL NOTIFY).

    Delivered when this transaction commits, so a dispatcher that wakes finds the rows visible.
    The payload is the earliest ``send_after`` written; a listener re-reads the queue anyway. SQLite
    has no notifications: its dispatchers poll.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_notify(DUE_CHANNEL, earliest_send_after.stored)))


def next_send_after(conn: Connection, after: Instant | None = None) -> Instant | None:
    """When the earliest pending row comes due (later than ``after``, if given): its ``send_after``,
    or its ``not_before`` when that is later. One step down the partial due index for rows without
    a not-before, and a read of the few that have one (their own partial index)."""
    free = select(func.min(q.c.send_after)).where(q.c.status == PENDING, q.c.not_before.is_(None))
    due_at = case((q.c.not_before > q.c.send_after, q.c.not_before), else_=q.c.send_after)
    held = select(func.min(due_at)).where(q.c.status == PENDING, q.c.not_before.is_not(None))
    if after is not None:
        free, held = free.where(q.c.send_after > after), held.where(due_at > after)
    times = [t for t in conn.execute(select(free.scalar_subquery(), held.scalar_subquery())).one() if t is not None]
    return min(times, default=None)
