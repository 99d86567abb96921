"""The build's sweep over devices: which devices a run takes (the stalest first, by chunk), the
locks it holds while it plans them, the stamps it leaves (``reminders_built_at``, the plan key),
and how stale each chunk is, which the sensors and the schedule read.

Kept apart from registration (``devices``) because these statements serve the build and its
watchers, and each is tuned to the sweep's indexes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Text,
    and_,
    bindparam,
    func,
    or_,
    select,
    type_coerce,
    update,
)

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger._common import batches, unix_of
from reminders_pipeline.ledger.schema import IsoTime, devices


def set_chunks(conn: Connection, chunk_of: Mapping[str, int], now: Instant) -> int:
    """Rewrite stored chunks (after the chunk count changes); returns rows changed."""
    stmt = (
        update(devices)
        .where(devices.c.id == bindparam("b_id"), devices.c.chunk != bindparam("b_chunk"))
        .values(chunk=bindparam("b_chunk"), updated_at=now)
    )
    rows = [{"b_id": k, "b_chunk": v} for k, v in chunk_of.items()]
    return conn.execute(stmt, rows).rowcount if rows else 0


def select_build_devices(
    conn: Connection,
    *,
    device_ids: Sequence[str] | None = None,
    chunks: Sequence[int] | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Devices to build, stalest ``reminders_built_at`` first (never built first); dead tokens skipped."""
    stmt = (
        select(
            devices.c.id,
            devices.c.reminder_lead_seconds,
            devices.c.extra_rules,
            devices.c.last_tz_offset_seconds,
            devices.c.tz_name,
            devices.c.all_day_rules,
            devices.c.quiet_hours,
            devices.c.use_alarms,
            devices.c.attendees,
            devices.c.locale,  # an agenda's text is made at the build (``agenda``)
            devices.c.clock,
            devices.c.reminders_built_at,
            devices.c.chunk,
            devices.c.created_at,
            devices.c.registered_at,
        )
        .where(devices.c.token_invalid_at.is_(None))
        .order_by(devices.c.reminders_built_at.asc().nulls_first(), devices.c.id)
    )
    if device_ids is not None:
        stmt = stmt.where(devices.c.id.in_(list(device_ids)))
    if chunks is not None:
        stmt = stmt.where(devices.c.chunk.in_(list(chunks)))
    if limit is not None:
        stmt = stmt.limit(limit)
    return [dict(r) for r in conn.execute(stmt).mappings()]


def lock_devices(conn: Connection, device_ids: Iterable[str], not_built_after: Instant | None = None) -> set[str]:
    """Row-lock these devices in id order; returns the ids locked.

    Lock order rule: a transaction that writes devices and queue rows takes its device locks
    first, in id order (the build for its batch, the drain for dead tokens, device removal).
    Without it a build (queue rows, then ``stamp_built``) and a drain settling a 410 (device, then
    that device's pending rows) deadlock, and PostgreSQL aborts one of them.

    ``not_built_after``: the build's own ``now``. Devices a newer build has already written are
    left out: a build whose reads are older (it started earlier and stalled) must not write them
    back, or a cancelled item would return to pending. PostgreSQL re-checks the predicate on the
    latest row version after waiting for a lock, so the later of two overlapping builds sees the
    earlier one's stamp. SQLite serialises writers anyway.
    """
    locked: set[str] = set()
    for ids in batches(sorted(set(device_ids))):
        stmt = select(devices.c.id).where(devices.c.id.in_(ids)).order_by(devices.c.id).with_for_update()
        if not_built_after is not None:
            stmt = stmt.where(
                or_(devices.c.reminders_built_at.is_(None), devices.c.reminders_built_at <= not_built_after)
            )
        locked.update(conn.scalars(stmt))
    return locked


def stamp_built(
    conn: Connection,
    device_ids: Sequence[str],
    now: Instant,
    plans: Mapping[str, tuple[str | None, Instant | None]] | None = None,
) -> None:
    """Each device built at ``now``; with ``plans``, also what its plan was made from and up to
    where (per id: ``(planned_key, planned_until)``, both None when the next build must plan in full)."""
    if plans is None:
        for ids in batches(list(device_ids)):
            conn.execute(update(devices).where(devices.c.id.in_(ids)).values(reminders_built_at=now))
        return
    if device_ids:
        stmt = (
            update(devices)
            .where(devices.c.id == bindparam("b_id"))
            .values(
                reminders_built_at=now,
                planned_key=bindparam("b_key"),
                planned_until=bindparam("b_until", type_=IsoTime()),
            )
        )
        conn.execute(stmt, [{"b_id": i, "b_key": plans[i][0], "b_until": plans[i][1]} for i in device_ids])


def plan_states(conn: Connection, device_ids: Sequence[str]) -> dict[str, tuple[str | None, Instant | None]]:
    """What each device's last plan was made from and how far it reached: read before a device is
    planned, and again once the build holds the write lock (an overlapping build or a void may have
    changed them since). A device removed meanwhile is absent."""
    out: dict[str, tuple[str | None, Instant | None]] = {}
    for ids in batches(list(device_ids)):
        stmt = select(devices.c.id, devices.c.planned_key, devices.c.planned_until).where(devices.c.id.in_(ids))
        out.update((i, (k, u)) for i, k, u in conn.execute(stmt))
    return out


def oldest_built(conn: Connection, chunks: Sequence[int] | None = None) -> tuple[int, Instant | None]:
    """(devices never built, oldest ``reminders_built_at`` among the rest), live tokens only."""
    live: ColumnElement[bool] = devices.c.token_invalid_at.is_(None)
    if chunks is not None:
        live = and_(live, devices.c.chunk.in_(list(chunks)))
    never = conn.scalar(select(func.count()).where(live, devices.c.reminders_built_at.is_(None)))
    oldest = conn.scalar(select(func.min(devices.c.reminders_built_at)).where(live))
    return int(never or 0), oldest


def stale_per_chunk(conn: Connection, now: Instant, floor_seconds: int, margin_seconds: int) -> dict[int, int]:
    """Live devices built longer ago than their budget, per chunk, in one statement: the budget is
    ``check.device_budget``'s, a device's lead less ``margin_seconds`` but never under
    ``floor_seconds``. Computed per row, so any number of distinct leads costs one statement."""
    stmt = (
        select(devices.c.chunk, func.count())
        .where(
            devices.c.token_invalid_at.is_(None),
            devices.c.reminders_built_at < Instant.from_unix(now.whole_seconds - floor_seconds),
            unix_of(conn, devices.c.reminders_built_at) + devices.c.reminder_lead_seconds - margin_seconds
            < now.whole_seconds,
        )
        .group_by(devices.c.chunk)
    )
    return {c: n for c, n in conn.execute(stmt)}


def never_built_chunks(conn: Connection) -> set[int]:
    """Chunks holding a live device that no build has visited yet."""
    stmt = (
        select(devices.c.chunk)
        .where(devices.c.token_invalid_at.is_(None), devices.c.reminders_built_at.is_(None))
        .distinct()
    )
    return set(conn.scalars(stmt))


def devices_per_chunk(conn: Connection) -> dict[int, int]:
    stmt = select(devices.c.chunk, func.count()).where(devices.c.token_invalid_at.is_(None)).group_by(devices.c.chunk)
    return {c: n for c, n in conn.execute(stmt)}


def stalest_chunks(conn: Connection, limit: int | None = None) -> list[int]:
    """Chunks ordered by their oldest build (never-built devices first)."""
    oldest = func.min(func.coalesce(type_coerce(devices.c.reminders_built_at, Text), ""))
    stmt = (
        select(devices.c.chunk)
        .where(devices.c.token_invalid_at.is_(None))
        .group_by(devices.c.chunk)
        .order_by(oldest, devices.c.chunk)
    )
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(conn.scalars(stmt))


def forget_plans(conn: Connection, device_ids: set[str]) -> None:
    """The next build of these devices plans in full: their rows changed outside a plan."""
    for ids in batches(sorted(device_ids)):
        conn.execute(update(devices).where(devices.c.id.in_(ids)).values(planned_key=None, planned_until=None))
