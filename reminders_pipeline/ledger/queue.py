"""Queue rows as the plan writes them: upserts, re-arms with their history, a person's snooze (a
row of the item as the plan reads it), realigning pending rows, ending holds.

The upsert, the re-arm and its history copy are three statements over one rows source that must
agree on what "moved" means (``_MOVED``, ``REARM_BOUNDS``): they stay in this one module."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, case, literal, select, update

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger._common import PENDING, batches, insert_on_conflict, rows_json, rows_text
from reminders_pipeline.ledger.schema import devices, notification_history
from reminders_pipeline.ledger.schema import notification_queue as q
from reminders_pipeline.ledger.wakeups import announce_pending


def existing_rows(
    conn: Connection, device_ids: Sequence[str], item_ids: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Every queue row of these devices (any status), or only those of these items: the basis for
    insert/update counts and voiding."""
    out: list[dict[str, Any]] = []
    cols = (
        q.c.id,
        q.c.device_id,
        q.c.source_id,
        q.c.item_id,
        q.c.rule,
        q.c.status,
        q.c.outcome,
        q.c.outcome_detail,
        q.c.send_after,
        q.c.event_at,
        q.c.expires_at,
        q.c.title,
        q.c.body,
        q.c.item_at,
    )
    items = [None] if item_ids is None else list(batches(list(item_ids)))
    for ids in batches(list(device_ids)):
        for some in items:
            query = select(*cols).where(q.c.device_id.in_(ids))
            query = query if some is None else query.where(q.c.item_id.in_(some))
            out.extend(dict(r) for r in conn.execute(query).mappings())
    return out


UPSERT_COLUMNS = (
    "device_id",
    "source_id",
    "item_id",
    "rule",
    "send_after",
    "event_at",
    "expires_at",
    "title",
    "body",
    "item_at",
)


# Per row, the values a settled row's anchor (event_at, or expires_at for an @expiry rule) and its
# item's own time must reach or pass to count as "moved" (made in Python: no time is computed in SQL).
# wall_before/wall_after: the same for a row settled before item_at existed (migration 0009), whose
# anchor alone is known (``rearm_bounds``).
REARM_BOUNDS = ("by_expiry", "anchor_before", "anchor_after", "item_before", "item_after", "wall_before", "wall_after")

# UTC offsets run from UTC-12:00 to UTC+14:00, so a floating item's wall time lies that far around
# the instant any zone made of it.
EARLIEST_OFFSET_SECONDS, LATEST_OFFSET_SECONDS = -12 * 3600, 14 * 3600
_TYPES = {"source_id": "bigint", "by_expiry": "boolean"}


# The whole batch travels as one JSON parameter, unpacked by the database (json_to_recordset /
# json_each): one statement and one round trip per batch, several times faster than executemany.
_UPSERT_ROWS_SOURCE = {
    "postgresql": (
        "SELECT r.* FROM json_to_recordset(CAST(:rows AS json)) AS r("
        + ", ".join(f"{c} {_TYPES.get(c, 'text')}" for c in UPSERT_COLUMNS + REARM_BOUNDS)
        + ")"
    ),
    "sqlite": (
        "SELECT "
        + ", ".join(f"json_extract(value, '$.{c}') AS {c}" for c in UPSERT_COLUMNS + REARM_BOUNDS)
        + " FROM json_each(:rows) WHERE true"
    ),
}


# Comparing a nullable column (body, source_id) with NULL as a value: the standard spelling is
# PostgreSQL's; SQLite spells it IS NOT.
_NULL_SAFE_DIFFERENT = {"postgresql": "IS DISTINCT FROM", "sqlite": "IS NOT"}

_UPSERT = """
INSERT INTO notification_queue AS q
    (device_id, source_id, item_id, rule, send_after, event_at, expires_at, title, body, item_at, status, created_at, updated_at)
SELECT r.device_id, r.source_id, r.item_id, r.rule, r.send_after, r.event_at, r.expires_at, r.title, r.body, r.item_at,
    'pending', :now, :now FROM ({rows}) AS r
    LEFT JOIN notification_queue AS held ON held.device_id = r.device_id AND held.item_id = r.item_id AND held.rule = r.rule
WHERE true  -- SQLite's upsert parse needs it
ORDER BY held.id  -- conflicts lock rows in id order, as a drain's settlement does (claims.lock_rows)
ON CONFLICT (device_id, item_id, rule) DO UPDATE SET
    source_id = excluded.source_id, send_after = excluded.send_after, event_at = excluded.event_at,
    expires_at = excluded.expires_at, title = excluded.title, body = excluded.body, item_at = excluded.item_at, status = 'pending',
    outcome = NULL, outcome_detail = CASE WHEN q.status = 'pending' THEN q.outcome_detail END,
    payload = NULL, sent_body = NULL, sent_format = NULL, apns_id = NULL, claimed_by = NULL,
    attempts = q.attempts,
    not_before = CASE WHEN q.status <> 'pending' THEN NULL
        WHEN q.held_until > :now AND q.not_before = q.held_until THEN NULL ELSE q.not_before END,
    held_until = CASE WHEN q.status <> 'pending' THEN NULL WHEN q.held_until > :now THEN :now ELSE q.held_until END,
    claimed_at = NULL, settled_at = NULL, sent_at = NULL, updated_at = excluded.updated_at
WHERE (q.status = 'pending' AND (q.send_after <> excluded.send_after OR q.event_at <> excluded.event_at
        OR q.expires_at <> excluded.expires_at OR q.title <> excluded.title
        OR q.body {distinct} excluded.body OR q.source_id {distinct} excluded.source_id
        OR q.item_at {distinct} excluded.item_at))
   OR (q.status = 'settled' AND q.outcome = 'voided')
RETURNING id
"""


# A settled (not voided) row whose item itself moved by at least the threshold: the re-arm below.
# Its anchor instant must have moved, and for a floating item its own wall time too: a zone change
# moves the instant, not the item. A row settled before item_at existed has only its anchor: its
# item moved only if no zone could have made that anchor of the new wall time (``rearm_bounds``).
# send_after is not compared: a quiet-hours hold or a zone moves it without the item moving.
# A snooze (``snoozed_from``) is never re-armed: it answers one request, and goes at most once.
_ANCHOR = "(CASE WHEN r.by_expiry THEN q.expires_at ELSE q.event_at END)"
_MOVED = f"""q.device_id = r.device_id AND q.item_id = r.item_id AND q.rule = r.rule
    AND q.status = 'settled' AND q.outcome <> 'voided' AND q.snoozed_from IS NULL
    AND ({_ANCHOR} <= r.anchor_before OR {_ANCHOR} >= r.anchor_after)
    AND (r.item_before IS NULL
        OR (q.item_at IS NOT NULL AND (q.item_at <= r.item_before OR q.item_at >= r.item_after))
        OR (q.item_at IS NULL AND ({_ANCHOR} <= r.wall_before OR {_ANCHOR} >= r.wall_after)))"""


_KEEP_HISTORY = (
    """
INSERT INTO notification_history
    (queue_id, device_id, item_id, rule, send_after, outcome, outcome_detail, payload, apns_id, sent_at, settled_at, rearmed_at)
SELECT q.id, q.device_id, q.item_id, q.rule, q.send_after, q.outcome, q.outcome_detail, q.payload, q.apns_id,
    q.sent_at, q.settled_at, :now
FROM notification_queue AS q, ({rows}) AS r WHERE """
    + _MOVED
    + """
ON CONFLICT (queue_id, settled_at) DO NOTHING
RETURNING queue_id
"""
)


# Only a settlement already in the history is re-armed (same settled_at): a row settled between
# the two statements waits for the next build instead of losing what it recorded.
_REARM = (
    """
UPDATE notification_queue AS q SET
    source_id = r.source_id, send_after = r.send_after, event_at = r.event_at, expires_at = r.expires_at,
    title = r.title, body = r.body, item_at = r.item_at, status = 'pending', outcome = NULL, outcome_detail = NULL, payload = NULL,
    sent_body = NULL, sent_format = NULL, apns_id = NULL, claimed_by = NULL, claimed_at = NULL, settled_at = NULL,
    sent_at = NULL, attempts = 0,
    not_before = NULL, held_until = NULL, updated_at = :now
FROM ({rows}) AS r
WHERE """
    + _MOVED
    + """
    AND EXISTS (SELECT 1 FROM notification_history AS h WHERE h.queue_id = q.id AND h.settled_at = q.settled_at)
RETURNING id
"""
)


def upsert_rows(
    conn: Connection,
    rows: Sequence[Mapping[str, Any]],
    now: Instant,
    batch: int = 2000,
    *,
    rearm_threshold_seconds: int = 300,
    by_expiry: Callable[[str], bool],
    payload_of: Callable[[Mapping[str, Any]], str | None],
) -> set[int]:
    """Insert or refresh one row per (device, item, rule); returns the ids actually written.

    A pending row is rewritten only when something about the item changed (an unchanged item writes
    nothing); a quiet-hours hold of it ends now (``end_holds``), and the drain decides afresh, while
    a retry's backoff stays. A voided row comes back to pending (its item returned) with the
    attempts it spent: a feed that flaps an item buys it no fresh attempts. A row that was settled in any
    other way is history: it comes back only if its item itself moved by at least
    ``rearm_threshold_seconds`` (``rearm_anchor``): the item was rescheduled and the new time
    deserves its own reminder, while a feed jittering by a second, a quiet-hours hold or a zone
    change does not; what it recorded (apns id, sent_at, outcome) is first copied to
    ``notification_history``. A settled snooze is never re-armed. A claimed row is in flight and
    is not touched. ``item_at`` is
    optional (None: the item is fixed in time).

    What rules and payloads mean is the caller's, not the ledger's: ``by_expiry(rule)`` says
    whether a rule's re-arm compares the item's end (``rules.expiry_anchored``; by default no rule
    does), and ``payload_of(row)`` renders what a re-armed row sent, for its history
    (``notification.sent_payload``; needed only when a row kept just its alert body).
    """
    dialect = conn.dialect.name
    source = _UPSERT_ROWS_SOURCE[dialect]
    upsert = rows_text(_UPSERT.format(rows=source, distinct=_NULL_SAFE_DIFFERENT[dialect]))
    keep, rearm = rows_text(_KEEP_HISTORY.format(rows=source)), rows_text(_REARM.format(rows=source))
    written: set[int] = set()
    for part in batches(list(rows), batch):
        wanted = [_upsert_row(r, rearm_threshold_seconds, by_expiry(r["rule"])) for r in part]
        params = {"rows": rows_json(wanted), "now": now}
        kept = list(conn.scalars(keep, params))
        if kept:
            _render_history_payloads(conn, kept, payload_of)
            written.update(row[0] for row in conn.execute(rearm, params))
        written.update(row[0] for row in conn.execute(upsert, params))
    if written:
        announce_pending(conn, min(r["send_after"] for r in rows))
    return written


def _render_history_payloads(
    conn: Connection, queue_ids: Sequence[int], payload_of: Callable[[Mapping[str, Any]], str | None]
) -> None:
    """History keeps the whole payload: once re-armed, the queue row no longer re-renders what it
    sent (its title and times change). Called before the re-arm, while the rows still do."""
    h = notification_history
    stmt = select(q).where(q.c.id.in_(sorted(queue_ids)), q.c.payload.is_(None), q.c.sent_body.is_not(None))
    rendered = [
        {"b_id": r["id"], "b_settled": r["settled_at"], "b_payload": payload_of(dict(r))}
        for r in conn.execute(stmt).mappings()
    ]
    if rendered:
        conn.execute(
            update(h)
            .where(h.c.queue_id == bindparam("b_id"), h.c.settled_at == bindparam("b_settled"), h.c.payload.is_(None))
            .values(payload=bindparam("b_payload")),
            rendered,
        )


def rearm_anchor(row: Mapping[str, Any], by_expiry: bool) -> Instant:
    """The instant a settled row's re-arm compares: the end for a rule anchored there (``by_expiry``),
    else the start (a day rule's day, a lead rule's start)."""
    anchor: Instant = row["expires_at"] if by_expiry else row["event_at"]
    return anchor


def rearm_bounds(row: Mapping[str, Any], threshold: int, by_expiry: bool) -> dict[str, Any]:
    """What a settled row must reach or pass, against the wanted ``row``, to count as moved
    (``REARM_BOUNDS``; ``queued.item_moved`` compares the same values).

    ``wall_before``/``wall_after`` serve a row settled before migration 0009, whose ``item_at`` is
    NULL: its anchor is the old wall time read in an unknown zone, so it lies up to 14 hours before
    and 12 hours after the new wall time without the item moving at all.
    """
    anchor, item_at = rearm_anchor(row, by_expiry), row.get("item_at")
    out: dict[str, Any] = {"by_expiry": by_expiry}
    out["anchor_before"], out["anchor_after"] = anchor - threshold, anchor + threshold
    if not item_at:
        return {**out, "item_before": None, "item_after": None, "wall_before": None, "wall_after": None}
    out["item_before"], out["item_after"] = item_at - threshold, item_at + threshold
    out["wall_before"] = item_at - (LATEST_OFFSET_SECONDS + threshold)
    out["wall_after"] = item_at + (threshold - EARLIEST_OFFSET_SECONDS)
    return out


def _upsert_row(row: Mapping[str, Any], threshold: int, by_expiry: bool) -> dict[str, Any]:
    return {**{c: row.get(c) for c in UPSERT_COLUMNS}, **rearm_bounds(row, threshold, by_expiry)}


_REALIGN = """
UPDATE notification_queue AS q SET
    source_id = r.source_id, send_after = r.send_after, event_at = r.event_at, expires_at = r.expires_at,
    title = r.title, body = r.body, item_at = r.item_at, updated_at = :now
FROM ({rows}) AS r
WHERE q.device_id = r.device_id AND q.item_id = r.item_id AND q.rule = r.rule AND q.status = 'pending'
RETURNING id
"""


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
    if made is None:
        return None
    # The device's next build plans in full, so the snooze is planned as its rules' rows are.
    device = select(q.c.device_id).where(q.c.id == origin_id).scalar_subquery()
    conn.execute(update(devices).where(devices.c.id == device).values(planned_key=None, planned_until=None))
    announce_pending(conn, send_after)
    return int(made)


def realign_pending(conn: Connection, rows: Sequence[Mapping[str, Any]], now: Instant) -> set[int]:
    """Rewrite still-pending rows as their items now read (the build's ``stale_pending_rows``);
    returns the ids written. Only pending rows: a claimed row is in flight, a settled one history,
    and nothing here brings a row back to pending."""
    if not rows:
        return set()
    stmt = rows_text(_REALIGN.format(rows=_UPSERT_ROWS_SOURCE[conn.dialect.name]))
    written: set[int] = set()
    for part in batches(list(rows), 2000):
        payload = rows_json({c: r.get(c) for c in UPSERT_COLUMNS} for r in part)
        written.update(row[0] for row in conn.execute(stmt, {"rows": payload, "now": now}))
    if written:
        announce_pending(conn, min(r["send_after"] for r in rows))
    return written


def end_holds(conn: Connection, device_id: str, now: Instant) -> int:
    """End the quiet-hours holds of a device's pending rows now; returns rows changed.

    A hold is the drain's decision for the device's zone and quiet hours at the time: once those
    change it no longer stands. Each row comes due at once and lateness counts from now, so the next
    claim sends it or, still inside the new quiet hours, holds it again to their end. A retry's
    backoff (a ``not_before`` that is not the hold) stays.
    """
    ended = conn.execute(
        update(q)
        .where(q.c.device_id == device_id, q.c.status == PENDING, q.c.held_until > now)
        .values(
            not_before=case((q.c.not_before == q.c.held_until, None), else_=q.c.not_before),
            held_until=now,
            updated_at=now,
        )
    ).rowcount
    if ended:
        announce_pending(conn, now)
    return ended
