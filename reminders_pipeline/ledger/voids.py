"""Voiding pending rows: what undoes a plan when its item left the feed, its device's token died,
or its calendar was dropped. A voided row is settled ``voided`` with the reason in
``outcome_detail``, never deleted, so ``reminders queue list`` shows why no alert went out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import Connection, and_, exists, select, update

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger._common import PENDING, batches
from reminders_pipeline.ledger.schema import device_sources, sources
from reminders_pipeline.ledger.schema import notification_queue as q
from reminders_pipeline.ledger.sweep import forget_plans


def void_rows(conn: Connection, ids: Sequence[int], detail: str, now: Instant) -> int:
    """Settle pending rows ``voided``: the item left the feed, its rule or source went away, ...

    Their devices' next build plans in full (``forget_plans``): a row voided by anything but a
    plan may have to come back. Callers hold those devices' locks (``lock_devices``' order)."""
    n = 0
    for batch in batches(sorted(ids)):
        device_ids = list(
            conn.scalars(
                update(q)
                .where(q.c.id.in_(batch), q.c.status == PENDING)
                .values(status="settled", outcome="voided", outcome_detail=detail, settled_at=now, updated_at=now)
                .returning(q.c.device_id)
            )
        )
        n += len(device_ids)
        forget_plans(conn, set(device_ids))
    return n


def void_pending_of_device(conn: Connection, device_id: str, detail: str, now: Instant) -> int:
    """Void a device's pending rows (its token died, it was removed); its next build plans in full."""
    forget_plans(conn, {device_id})
    return conn.execute(
        update(q)
        .where(q.c.device_id == device_id, q.c.status == PENDING)
        .values(status="settled", outcome="voided", outcome_detail=detail, settled_at=now, updated_at=now)
    ).rowcount


def void_pending_of_urls(conn: Connection, device_id: str, urls: Iterable[str], detail: str, now: Instant) -> int:
    """Void a device's pending rows of the sources at these URLs (the device muted them)."""
    wanted = sorted(set(urls))
    if not wanted:
        return 0
    of_urls = select(sources.c.id).where(sources.c.url.in_(wanted))
    return conn.execute(
        update(q)
        .where(q.c.device_id == device_id, q.c.source_id.in_(of_urls), q.c.status == PENDING)
        .values(status="settled", outcome="voided", outcome_detail=detail, settled_at=now, updated_at=now)
    ).rowcount


def unsubscribed_pending(conn: Connection, device_id: str) -> list[int]:
    """The device's pending rows of sources it does not subscribe to (any more), in id order: a
    registration that dropped a calendar voids them (``void_rows``). Rows of no source (agendas)
    are not among them."""
    subscribed = exists().where(
        and_(device_sources.c.device_id == q.c.device_id, device_sources.c.source_id == q.c.source_id)
    )
    stmt = select(q.c.id).where(
        q.c.device_id == device_id, q.c.status == PENDING, q.c.source_id.is_not(None), ~subscribed
    )
    return list(conn.scalars(stmt.order_by(q.c.id)))
