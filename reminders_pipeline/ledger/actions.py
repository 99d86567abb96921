"""What a person's Snooze and Done on a sent alert write: one snooze row per snoozed alert, and
the item's other pending reminders settled ``acknowledged``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, and_, func, literal, select, text, update

from ..feed import series_key
from ..schema import device_sources, devices
from ..schema import notification_queue as q
from ..times import Instant
from ._common import PENDING, insert_on_conflict
from .claims import lock_rows
from .queue import announce_pending

# The acted-on row; its device (registered at all, the token's key, its zone and addresses); its
# calendar subscription (still there, muted).
_ACTED_ON = (
    *(q.c[c] for c in ("id", "device_id", "source_id", "item_id", "outcome", "expires_at", "title", "body")),
    q.c.event_at,
    devices.c.id.is_not(None).label("registered"),
    devices.c.credential_hash,
    devices.c.tz_name,
    devices.c.last_tz_offset_seconds,
    devices.c.attendees,
    device_sources.c.muted.label("calendar_muted"),
    device_sources.c.device_id.is_not(None).label("subscribed"),
)


def acted_on(conn: Connection, row_id: int) -> dict[str, Any] | None:
    """The row an action names, with what deciding the action needs of its device and calendar."""
    subscription = and_(device_sources.c.device_id == q.c.device_id, device_sources.c.source_id == q.c.source_id)
    query = select(*_ACTED_ON).outerjoin(devices, devices.c.id == q.c.device_id).outerjoin(device_sources, subscription)
    found = conn.execute(query.where(q.c.id == row_id)).mappings().first()
    return dict(found) if found else None


# One item of a calendar as last read, found by its own id among the cached parse's items (or
# those the item cap set aside) by the database's JSON functions: the cache is neither sent
# over the connection nor parsed whole. The cache stores each item as a list, its id first
# (``feed.Item.to_json``).
_ITEM_AS_READ = {
    "postgresql": """
SELECT CAST(i.value AS text) FROM sources AS s,
    json_array_elements(CAST(s.feed_cache AS json) -> CAST(:part AS text)) AS i(value)
WHERE s.id = :source_id AND i.value ->> 0 = :own_id
LIMIT 1
""",
    "sqlite": """
SELECT i.value FROM sources AS s, json_each(s.feed_cache, '$.' || :part) AS i
WHERE s.id = :source_id AND json_extract(i.value, '$[0]') = :own_id
LIMIT 1
""",
}


def item_as_read(conn: Connection, source_id: int, own_id: str) -> list[Any] | None:
    """The item ``own_id`` of the source's cached parse (``sources.feed_cache``) in its cached form,
    kept or set aside by the item cap; None when the last read has no such item."""
    stmt = text(_ITEM_AS_READ[conn.dialect.name])
    for part in ("items", "aside"):
        found = conn.scalar(stmt, {"part": part, "source_id": source_id, "own_id": own_id})
        if found is not None:
            return list(json.loads(found))
    return None


# Whether the cached parse says an item it lacks may still be in the source (``feed.ParsedFeed.holds``):
# cut by the item cap, of a series the build dropped alone, or past where counting stopped. Read by
# the database's JSON functions, as ``_ITEM_AS_READ``.
_HOLDS_AS_READ = {
    "postgresql": """
SELECT 1 FROM sources AS s WHERE s.id = :source_id AND (
    EXISTS (SELECT 1 FROM json_array_elements_text(CAST(s.feed_cache AS json) -> 'cut_ids') AS c(v)
            WHERE c.v = :own_id)
    OR EXISTS (SELECT 1 FROM json_array_elements_text(CAST(s.feed_cache AS json) -> 'partial_series') AS p(v)
               WHERE p.v = :series)
    OR CAST(CAST(s.feed_cache AS json) ->> 'cut_from' AS bigint) <= :starts_at)
""",
    "sqlite": """
SELECT 1 FROM sources AS s WHERE s.id = :source_id AND (
    EXISTS (SELECT 1 FROM json_each(s.feed_cache, '$.cut_ids') WHERE value = :own_id)
    OR EXISTS (SELECT 1 FROM json_each(s.feed_cache, '$.partial_series') WHERE value = :series)
    OR json_extract(s.feed_cache, '$.cut_from') <= :starts_at)
""",
}


def held_as_read(conn: Connection, source_id: int, own_id: str, starts_at: int) -> bool:
    """Whether the source's last read, lacking item ``own_id``, still holds it may be there."""
    params = {"source_id": source_id, "own_id": own_id, "series": series_key(own_id), "starts_at": starts_at}
    return conn.scalar(text(_HOLDS_AS_READ[conn.dialect.name]), params) is not None


def snooze_of(conn: Connection, origin_id: int) -> dict[str, Any] | None:
    """The snooze already made of this row, if any."""
    query = select(q.c.id, q.c.rule, q.c.send_after, q.c.status, q.c.outcome).where(q.c.snoozed_from == origin_id)
    found = conn.execute(query).mappings().first()
    return dict(found) if found else None


def count_snoozes(conn: Connection, device_id: str, item_id: str) -> int:
    query = select(func.count()).where(
        q.c.device_id == device_id, q.c.item_id == item_id, q.c.snoozed_from.is_not(None)
    )
    return int(conn.scalar(query) or 0)


def insert_snooze(
    conn: Connection, origin_id: int, rule: str, send_after: Instant, item: Mapping[str, Any], now: Instant
) -> int | None:
    """A pending row of the origin's device and item under ``rule``, due at ``send_after``, with the
    item as ``item`` gives it (``event_at``, ``expires_at``, ``title``, ``body``); None when another
    request made this row's snooze, or took ``rule``, first (unique on ``snoozed_from`` and on
    device, item and rule)."""
    copied = select(
        q.c.device_id,
        q.c.source_id,
        q.c.item_id,
        literal(rule).label("rule"),
        literal(send_after, q.c.send_after.type).label("send_after"),
        literal(item["event_at"], q.c.event_at.type).label("event_at"),
        literal(item["expires_at"], q.c.expires_at.type).label("expires_at"),
        literal(item["title"], q.c.title.type).label("title"),
        literal(item["body"], q.c.body.type).label("body"),
        literal("pending").label("status"),
        literal(now, q.c.created_at.type).label("created_at"),
        literal(now, q.c.updated_at.type).label("updated_at"),
        q.c.id.label("snoozed_from"),
    ).where(q.c.id == origin_id)
    columns = [c.name for c in copied.selected_columns]
    stmt = insert_on_conflict(conn)(q).from_select(columns, copied).on_conflict_do_nothing().returning(q.c.id)
    made = conn.scalar(stmt)
    if made is not None:
        announce_pending(conn, send_after)
    return None if made is None else int(made)


def acknowledge(
    conn: Connection, device_id: str, item_id: str, event_between: tuple[Instant, Instant], now: Instant
) -> int:
    """Settle the item's pending reminders on this device whose event starts within
    ``event_between`` ``acknowledged``; a claimed one is in flight and goes. Returns how many.
    A snooze of it voided while its item was away (``REVIVABLE_VOIDS``), which a build would bring
    back with the item, is acknowledged too (not counted): Done ends it as well. Locked in id order
    first, as a build and a drain lock the rows they write (``lock_rows``), so none of them
    deadlocks with another."""
    occurrence = (
        q.c.device_id == device_id,
        q.c.item_id == item_id,
        q.c.event_at >= event_between[0],
        q.c.event_at <= event_between[1],
    )
    pending = (*occurrence, q.c.status == PENDING)
    revivable = (
        *occurrence,
        q.c.snoozed_from.is_not(None),
        q.c.outcome == "voided",
        q.c.outcome_detail.in_(sorted(REVIVABLE_VOIDS)),
    )
    ids = list(conn.scalars(select(q.c.id).where(*pending).order_by(q.c.id)))
    voided = list(conn.scalars(select(q.c.id).where(*revivable).order_by(q.c.id)))
    lock_rows(conn, [*ids, *voided])
    done = {"outcome": "acknowledged", "outcome_detail": "done", "settled_at": now, "updated_at": now}
    if voided:
        conn.execute(update(q).where(q.c.id.in_(voided), *revivable).values(**done))
    if not ids:
        return 0
    stmt = update(q).where(q.c.id.in_(ids), *pending).values(status="settled", **done)
    return int(conn.execute(stmt).rowcount or 0)


# The voids an item's return undoes: a build brings such a row back with its item (``plan``).
REVIVABLE_VOIDS = frozenset({"left_feed", "empty_day"})
