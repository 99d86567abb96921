"""What a person's Snooze and Done on a sent alert write: one snooze row per snoozed alert, and
the item's other pending reminders settled ``acknowledged``."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection, and_, func, or_, select, text

from reminders_pipeline.domain.outcomes import MAY_HAVE_GONE, TRANSPORT
from reminders_pipeline.ledger._common import CLAIMED
from reminders_pipeline.ledger.schema import device_sources, devices
from reminders_pipeline.ledger.schema import notification_queue as q

# A row whose alert may be on the phone though it is not settled ``sent``: claimed (the provider's
# answer has not reached the sender yet), or failed for a reason ``domain/outcomes.py`` lists as
# one after which the request may have left. A row pending, held, voided, or failed certainly
# unsent (``not-sent:…``) sent nothing.
_MAY_HAVE_GONE = or_(
    q.c.status == CLAIMED,
    and_(
        q.c.outcome == "failed",
        or_(q.c.outcome_detail.in_(MAY_HAVE_GONE), q.c.outcome_detail.like(f"{TRANSPORT}%")),
    ),
)

# The acted-on row; its device (registered at all, the token's key, its zone and addresses); its
# calendar subscription (still there, muted).
_ACTED_ON = (
    *(q.c[c] for c in ("id", "device_id", "source_id", "item_id", "outcome", "expires_at", "title", "body")),
    q.c.event_at,
    _MAY_HAVE_GONE.label("may_have_gone"),
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


def held_as_read(conn: Connection, source_id: int, own_id: str, series: str, starts_at: int) -> bool:
    """Whether the source's last read, lacking item ``own_id`` (of ``series``, ``items.series_key``),
    still holds it may be there."""
    params = {"source_id": source_id, "own_id": own_id, "series": series, "starts_at": starts_at}
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
