"""Every SQL statement the project runs against the ledger, built in one place.

Shells (Dagster, HTTP, CLI) and the core's orchestration modules call these functions with a
connection from ``Database.write()``/``read()``; nothing else writes SQL. No statement computes a
time: every stored time arrives as a bound parameter made by ``reminders_pipeline.times``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any, Iterable, Mapping, Sequence

from sqlalchemy import BigInteger, Connection, and_, any_, bindparam, case, delete, func, literal, literal_column, null, or_, select, text, update
from sqlalchemy.dialects import postgresql, sqlite

from .schema import device_sources, devices, dispatchers, drain_halts, notification_history, notification_queue as q, sources
from .times import shift

# Literal, not bound: the partial indexes are defined on these exact predicates.
PENDING = literal_column("'pending'")
CLAIMED = literal_column("'claimed'")
SETTLED = literal_column("'settled'")

# Sized under SQLite's 32,766 bound-parameter limit with room for the other parameters.
IN_LIST_MAX = 10_000


def _batches(seq: Sequence[Any], size: int = IN_LIST_MAX) -> Iterable[Sequence[Any]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


def _insert(conn: Connection):  # type: ignore[no-untyped-def]
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


# ---------------------------------------------------------------- devices and sources


@dataclass(frozen=True)
class DeviceRecord:
    id: str
    apns_token: str
    reminder_lead_seconds: int
    extra_rules: tuple[str, ...]
    source_urls: tuple[str, ...]
    chunk: int
    last_tz_offset_seconds: int | None
    reminders_built_at: str | None
    token_invalid_at: str | None
    token_invalid_reason: str | None
    created_at: str
    updated_at: str
    has_credential: bool = False  # the device's own credential exists (its hash only is stored)
    tz_name: str | None = None  # IANA zone; floating and all-day times resolve in it when set
    all_day_rules: tuple[str, ...] = ("day:0@09:00",)
    quiet_hours: str | None = None
    use_alarms: bool = False

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["extra_rules"], d["source_urls"] = list(self.extra_rules), list(self.source_urls)
        d["all_day_rules"] = list(self.all_day_rules)
        return d


def set_device_credential(conn: Connection, device_id: str, credential_hash: str, *, only_if_missing: bool = False) -> bool:
    """Store a device's credential hash; ``only_if_missing`` keeps an existing one (two racing
    first registrations: one issues, the other is told nothing was issued)."""
    stmt = update(devices).where(devices.c.id == device_id).values(credential_hash=credential_hash)
    if only_if_missing:
        stmt = stmt.where(devices.c.credential_hash.is_(None))
    return conn.execute(stmt).rowcount == 1


def device_credential_hash(conn: Connection, device_id: str) -> str | None:
    return conn.execute(select(devices.c.credential_hash).where(devices.c.id == device_id)).scalar_one_or_none()


def upsert_device(conn: Connection, values: Mapping[str, Any], now: str) -> None:
    """Create or replace a device's registration. A newly registered token clears the invalid marker."""
    ins = _insert(conn)(devices).values(**values, created_at=now, updated_at=now)
    token_changed = devices.c.apns_token.is_distinct_from(ins.excluded.apns_token)
    stmt = ins.on_conflict_do_update(
        index_elements=[devices.c.id],
        set_={
            "apns_token": ins.excluded.apns_token,
            "reminder_lead_seconds": ins.excluded.reminder_lead_seconds,
            "extra_rules": ins.excluded.extra_rules,
            "all_day_rules": ins.excluded.all_day_rules,
            "quiet_hours": ins.excluded.quiet_hours,
            "use_alarms": ins.excluded.use_alarms,
            "tz_name": func.coalesce(ins.excluded.tz_name, devices.c.tz_name),  # omitted: the widget's last
            "chunk": ins.excluded.chunk,
            "updated_at": ins.excluded.updated_at,
            "token_invalid_at": _case_keep(token_changed, None, devices.c.token_invalid_at),
            "token_invalid_reason": _case_keep(token_changed, None, devices.c.token_invalid_reason),
        },
    )
    conn.execute(stmt)


def _case_keep(cond, new, old):  # type: ignore[no-untyped-def]
    return case((cond, null() if new is None else new), else_=old)


def set_subscriptions(conn: Connection, device_id: str, urls: Sequence[str], now: str) -> None:
    """Make the device subscribe to exactly ``urls``, creating sources on first use."""
    if urls:
        ins = _insert(conn)(sources)
        conn.execute(ins.on_conflict_do_nothing(index_elements=[sources.c.url]), [{"url": u, "created_at": now} for u in urls])
    wanted = select(sources.c.id).where(sources.c.url.in_(list(urls))) if urls else None
    drop = delete(device_sources).where(device_sources.c.device_id == device_id)
    if wanted is not None:
        drop = drop.where(device_sources.c.source_id.not_in(wanted))
    conn.execute(drop)
    if urls:
        ins = _insert(conn)(device_sources).from_select(
            ["device_id", "source_id"],
            select(literal(device_id).label("device_id"), sources.c.id).where(sources.c.url.in_(list(urls))),
        )
        conn.execute(ins.on_conflict_do_nothing())


def set_chunks(conn: Connection, chunk_of: Mapping[str, int], now: str) -> int:
    """Rewrite stored chunks (after the chunk count changes); returns rows changed."""
    stmt = (
        update(devices)
        .where(devices.c.id == bindparam("b_id"), devices.c.chunk != bindparam("b_chunk"))
        .values(chunk=bindparam("b_chunk"), updated_at=now)
    )
    rows = [{"b_id": k, "b_chunk": v} for k, v in chunk_of.items()]
    return conn.execute(stmt, rows).rowcount if rows else 0


def _device_records(conn: Connection, where: Any = None) -> list[DeviceRecord]:
    stmt = select(devices).order_by(devices.c.id)
    if where is not None:
        stmt = stmt.where(where)
    rows = conn.execute(stmt).mappings().all()
    urls: dict[str, list[str]] = {r["id"]: [] for r in rows}
    if rows:
        for ids in _batches(list(urls)):
            sub = (
                select(device_sources.c.device_id, sources.c.url)
                .join(sources, sources.c.id == device_sources.c.source_id)
                .where(device_sources.c.device_id.in_(ids))
                .order_by(sources.c.url)
            )
            for dev, url in conn.execute(sub):
                urls[dev].append(url)
    return [
        DeviceRecord(
            id=r["id"],
            apns_token=r["apns_token"],
            reminder_lead_seconds=r["reminder_lead_seconds"],
            extra_rules=tuple(r["extra_rules"].split()),
            source_urls=tuple(urls[r["id"]]),
            chunk=r["chunk"],
            last_tz_offset_seconds=r["last_tz_offset_seconds"],
            reminders_built_at=r["reminders_built_at"],
            token_invalid_at=r["token_invalid_at"],
            token_invalid_reason=r["token_invalid_reason"],
            created_at=r["created_at"],
            updated_at=r["updated_at"],
            has_credential=r["credential_hash"] is not None,
            tz_name=r["tz_name"],
            all_day_rules=tuple(r["all_day_rules"].split()),
            quiet_hours=r["quiet_hours"],
            use_alarms=bool(r["use_alarms"]),
        )
        for r in rows
    ]


def get_device(conn: Connection, device_id: str) -> DeviceRecord | None:
    found = _device_records(conn, devices.c.id == device_id)
    return found[0] if found else None


def list_devices(conn: Connection) -> list[DeviceRecord]:
    return _device_records(conn)


def delete_device(conn: Connection, device_id: str, now: str) -> int | None:
    """Void the device's pending rows and delete it. Returns rows voided, or None if it did not exist."""
    if conn.execute(select(devices.c.id).where(devices.c.id == device_id).with_for_update()).first() is None:
        return None
    voided = void_pending_of_device(conn, device_id, "device_removed", now)
    conn.execute(delete(devices).where(devices.c.id == device_id))
    return voided


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
            devices.c.reminders_built_at,
            devices.c.chunk,
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


def subscriptions(conn: Connection, device_ids: Sequence[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {d: [] for d in device_ids}
    for ids in _batches(list(device_ids)):
        stmt = select(device_sources.c.device_id, device_sources.c.source_id).where(device_sources.c.device_id.in_(ids))
        for dev, src in conn.execute(stmt):
            out[dev].append(src)
    return out


def sources_by_id(conn: Connection, source_ids: Iterable[int]) -> dict[int, dict[str, Any]]:
    ids = sorted(set(source_ids))
    out: dict[int, dict[str, Any]] = {}
    for batch in _batches(ids):
        for r in conn.execute(select(sources).where(sources.c.id.in_(batch))).mappings():
            out[r["id"]] = dict(r)
    return out


def list_sources(conn: Connection) -> list[dict[str, Any]]:
    subs = (
        select(device_sources.c.source_id, func.count().label("n"))
        .group_by(device_sources.c.source_id)
        .subquery()
    )
    stmt = (
        select(sources, func.coalesce(subs.c.n, 0).label("subscribers"))
        .outerjoin(subs, subs.c.source_id == sources.c.id)
        .order_by(sources.c.id)
    )
    return [dict(r) for r in conn.execute(stmt).mappings()]


def record_source_success(conn: Connection, results: Sequence[Mapping[str, Any]], now: str) -> None:
    """``results``: ``{"id", "items", "rejected", "etag", "last_modified", "feed_cache", "cache_until"}``
    per source read successfully. ``feed_cache`` None (a 304) keeps the cached feed as it is."""
    if not results:
        return
    stmt = (
        update(sources)
        .where(sources.c.id == bindparam("b_id"))
        .values(
            last_read_at=now,
            last_success_at=now,
            consecutive_failures=0,
            failing_since=None,
            alerted_at=None,
            last_error=None,
            last_item_count=bindparam("b_items"),
            last_rejected_count=bindparam("b_rejected"),
            etag=bindparam("b_etag"),
            last_modified=bindparam("b_last_modified"),
            feed_cache=func.coalesce(bindparam("b_feed_cache"), sources.c.feed_cache),
            cache_until=func.coalesce(bindparam("b_cache_until"), sources.c.cache_until),
        )
    )
    conn.execute(
        stmt,
        [
            {
                "b_id": r["id"],
                "b_items": r["items"],
                "b_rejected": r["rejected"],
                "b_etag": r.get("etag"),
                "b_last_modified": r.get("last_modified"),
                "b_feed_cache": r.get("feed_cache"),
                "b_cache_until": r.get("cache_until"),
            }
            for r in results
        ],
    )


def record_source_failure(conn: Connection, failures: Sequence[Mapping[str, Any]], now: str) -> None:
    """``failures``: ``{"id", "error"}`` per source whose read failed. Its rows are left alone."""
    if not failures:
        return
    stmt = (
        update(sources)
        .where(sources.c.id == bindparam("b_id"))
        .values(
            last_read_at=now,
            last_error_at=now,
            last_error=bindparam("b_error"),
            consecutive_failures=sources.c.consecutive_failures + 1,
            failing_since=func.coalesce(sources.c.failing_since, now),
        )
    )
    conn.execute(stmt, [{"b_id": f["id"], "b_error": f["error"]} for f in failures])


def claim_source_alerts(conn: Connection, failing_before: str, now: str) -> list[dict[str, Any]]:
    """Sources failing since before ``failing_before`` and not yet alerted; marks them alerted (once per streak)."""
    due = select(sources.c.id).where(sources.c.failing_since < failing_before, sources.c.alerted_at.is_(None))
    rows = conn.execute(
        update(sources)
        .where(sources.c.id.in_(due.scalar_subquery()))
        .values(alerted_at=now)
        .returning(sources.c.id, sources.c.url, sources.c.failing_since, sources.c.last_error, sources.c.consecutive_failures)
    ).mappings()
    return [dict(r) for r in rows]


def lock_devices(conn: Connection, device_ids: Iterable[str], not_built_after: str | None = None) -> set[str]:
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
    for ids in _batches(sorted(set(device_ids))):
        stmt = select(devices.c.id).where(devices.c.id.in_(ids)).order_by(devices.c.id).with_for_update()
        if not_built_after is not None:
            stmt = stmt.where(or_(devices.c.reminders_built_at.is_(None), devices.c.reminders_built_at <= not_built_after))
        locked.update(conn.scalars(stmt))
    return locked


def stamp_built(conn: Connection, device_ids: Sequence[str], now: str) -> None:
    for ids in _batches(list(device_ids)):
        conn.execute(update(devices).where(devices.c.id.in_(ids)).values(reminders_built_at=now))


def store_tz_offset(conn: Connection, device_id: str, offset_seconds: int) -> bool:
    """Conditional: writes only when the offset differs, so an unchanged feed read stays a read."""
    stmt = (
        update(devices)
        .where(devices.c.id == device_id, devices.c.last_tz_offset_seconds.is_distinct_from(offset_seconds))
        .values(last_tz_offset_seconds=offset_seconds)
    )
    return conn.execute(stmt).rowcount == 1


def store_tz_name(conn: Connection, device_id: str, tz_name: str) -> bool:
    """Conditional like ``store_tz_offset``: a widget sending the same zone on every read writes nothing."""
    stmt = update(devices).where(devices.c.id == device_id, devices.c.tz_name.is_distinct_from(tz_name)).values(tz_name=tz_name)
    return conn.execute(stmt).rowcount == 1


def mark_token_invalid(conn: Connection, device_id: str, token: str, at: str, reason: str, now: str) -> int:
    """APNs said this token is dead: mark it (if it is still the registered one) and void its pending rows."""
    marked = conn.execute(
        update(devices)
        .where(devices.c.id == device_id, devices.c.apns_token == token, devices.c.token_invalid_at.is_(None))
        .values(token_invalid_at=at, token_invalid_reason=reason, updated_at=now)
    ).rowcount
    if not marked:
        return 0
    return void_pending_of_device(conn, device_id, "unregistered" if reason == "Unregistered" else "token_invalid", now)


# ---------------------------------------------------------------- building the queue


def existing_rows(conn: Connection, device_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Every queue row of these devices (any status): the basis for insert/update counts and voiding."""
    out: list[dict[str, Any]] = []
    cols = (
        q.c.id, q.c.device_id, q.c.source_id, q.c.item_id, q.c.rule, q.c.status, q.c.outcome,
        q.c.send_after, q.c.event_at, q.c.expires_at, q.c.title, q.c.body,
    )
    for ids in _batches(list(device_ids)):
        out.extend(dict(r) for r in conn.execute(select(*cols).where(q.c.device_id.in_(ids))).mappings())
    return out


UPSERT_COLUMNS = ("device_id", "source_id", "item_id", "rule", "send_after", "event_at", "expires_at", "title", "body")
# Per row, the send_after values a settled row's own must reach or pass to count as "moved"
# (made in Python: no time is computed in SQL).
REARM_BOUNDS = ("rearm_before", "rearm_after")

# The whole batch travels as one JSON parameter, unpacked by the database (json_to_recordset /
# json_each): one statement and one round trip per batch, several times faster than executemany.
_UPSERT_ROWS_SOURCE = {
    "postgresql": (
        "SELECT r.* FROM json_to_recordset(CAST(:rows AS json)) AS r(device_id text, source_id bigint, "
        "item_id text, rule text, send_after text, event_at text, expires_at text, title text, body text, "
        "rearm_before text, rearm_after text)"
    ),
    "sqlite": (
        "SELECT " + ", ".join(f"json_extract(value, '$.{c}') AS {c}" for c in UPSERT_COLUMNS + REARM_BOUNDS)
        + " FROM json_each(:rows) WHERE true"
    ),
}

_UPSERT = """
INSERT INTO notification_queue AS q
    (device_id, source_id, item_id, rule, send_after, event_at, expires_at, title, body, status, created_at, updated_at)
SELECT r.device_id, r.source_id, r.item_id, r.rule, r.send_after, r.event_at, r.expires_at, r.title, r.body,
    'pending', :now, :now FROM ({rows}) AS r WHERE true  -- WHERE: SQLite's upsert parse needs it
ON CONFLICT (device_id, item_id, rule) DO UPDATE SET
    source_id = excluded.source_id, send_after = excluded.send_after, event_at = excluded.event_at,
    expires_at = excluded.expires_at, title = excluded.title, body = excluded.body, status = 'pending',
    outcome = NULL, outcome_detail = NULL, payload = NULL, apns_id = NULL, claimed_by = NULL, attempts = 0,
    claimed_at = NULL, settled_at = NULL, sent_at = NULL, updated_at = excluded.updated_at
WHERE (q.status = 'pending' AND (q.send_after <> excluded.send_after OR q.event_at <> excluded.event_at
        OR q.expires_at <> excluded.expires_at OR q.title <> excluded.title
        OR q.body {distinct} excluded.body OR q.source_id {distinct} excluded.source_id))
   OR (q.status = 'settled' AND q.outcome = 'voided')
RETURNING id
"""

# A settled (not voided) row whose send_after moved by at least the threshold: the re-arm below.
_MOVED = """q.device_id = r.device_id AND q.item_id = r.item_id AND q.rule = r.rule
    AND q.status = 'settled' AND q.outcome <> 'voided'
    AND (q.send_after <= r.rearm_before OR q.send_after >= r.rearm_after)"""

_KEEP_HISTORY = """
INSERT INTO notification_history
    (queue_id, device_id, item_id, rule, send_after, outcome, outcome_detail, payload, apns_id, sent_at, settled_at, rearmed_at)
SELECT q.id, q.device_id, q.item_id, q.rule, q.send_after, q.outcome, q.outcome_detail, q.payload, q.apns_id,
    q.sent_at, q.settled_at, :now
FROM notification_queue AS q, ({rows}) AS r WHERE """ + _MOVED + """
ON CONFLICT (queue_id, settled_at) DO NOTHING
RETURNING queue_id
"""

# Only a settlement already in the history is re-armed (same settled_at): a row settled between
# the two statements waits for the next build instead of losing what it recorded.
_REARM = """
UPDATE notification_queue AS q SET
    source_id = r.source_id, send_after = r.send_after, event_at = r.event_at, expires_at = r.expires_at,
    title = r.title, body = r.body, status = 'pending', outcome = NULL, outcome_detail = NULL, payload = NULL,
    apns_id = NULL, claimed_by = NULL, claimed_at = NULL, settled_at = NULL, sent_at = NULL, attempts = 0,
    updated_at = :now
FROM ({rows}) AS r
WHERE """ + _MOVED + """
    AND EXISTS (SELECT 1 FROM notification_history AS h WHERE h.queue_id = q.id AND h.settled_at = q.settled_at)
RETURNING id
"""


def upsert_rows(
    conn: Connection, rows: Sequence[Mapping[str, Any]], now: str, batch: int = 2000, *, rearm_threshold_seconds: int = 300
) -> set[int]:
    """Insert or refresh one row per (device, item, rule); returns the ids actually written.

    A pending row is rewritten only when something about the item changed (an unchanged item writes
    nothing). A voided row comes back to pending (its item returned). A row that was settled in any
    other way comes back only if its ``send_after`` moved by at least ``rearm_threshold_seconds``:
    the item was rescheduled and the new time deserves its own reminder, while a feed jittering by
    a second does not; what it recorded (apns id, sent_at, outcome) is first copied to
    ``notification_history``. A claimed row is in flight and is not touched.
    """
    dialect = conn.dialect.name
    source = _UPSERT_ROWS_SOURCE[dialect]
    upsert = text(_UPSERT.format(rows=source, distinct="IS DISTINCT FROM" if dialect == "postgresql" else "IS NOT"))
    keep, rearm = text(_KEEP_HISTORY.format(rows=source)), text(_REARM.format(rows=source))
    written: set[int] = set()
    for part in _batches(list(rows), batch):
        payload = json.dumps([_upsert_row(r, rearm_threshold_seconds) for r in part], separators=(",", ":"))
        params = {"rows": payload, "now": now}
        if conn.execute(keep, params).first() is not None:
            written.update(row[0] for row in conn.execute(rearm, params))
        written.update(row[0] for row in conn.execute(upsert, params))
    if written:
        announce_pending(conn, min(r["send_after"] for r in rows))
    return written


def _upsert_row(row: Mapping[str, Any], threshold: int) -> dict[str, Any]:
    out = {c: row[c] for c in UPSERT_COLUMNS}
    out["rearm_before"], out["rearm_after"] = shift(row["send_after"], -threshold), shift(row["send_after"], threshold)
    return out


def void_rows(conn: Connection, ids: Sequence[int], detail: str, now: str) -> int:
    """Settle pending rows ``voided``: the item left the feed, its rule or source went away, ..."""
    n = 0
    for batch in _batches(sorted(ids)):
        n += conn.execute(
            update(q)
            .where(q.c.id.in_(batch), q.c.status == PENDING)
            .values(status="settled", outcome="voided", outcome_detail=detail, settled_at=now, updated_at=now)
        ).rowcount
    return n


def void_pending_of_device(conn: Connection, device_id: str, detail: str, now: str) -> int:
    return conn.execute(
        update(q)
        .where(q.c.device_id == device_id, q.c.status == PENDING)
        .values(status="settled", outcome="voided", outcome_detail=detail, settled_at=now, updated_at=now)
    ).rowcount


# ---------------------------------------------------------------- waking the dispatcher

DUE_CHANNEL = "reminders_due"


def announce_pending(conn: Connection, earliest_send_after: str) -> None:
    """Tell listening dispatchers that pending rows were inserted or moved (PostgreSQL NOTIFY).

    Delivered when this transaction commits, so a dispatcher that wakes finds the rows visible.
    The payload is the earliest ``send_after`` written; a listener re-reads the queue anyway. SQLite
    has no notifications: its dispatchers poll.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_notify(DUE_CHANNEL, earliest_send_after)))


def next_send_after(conn: Connection, after: str | None = None) -> str | None:
    """The earliest pending ``send_after`` (later than ``after``, if given): one step down the
    partial due index."""
    stmt = select(func.min(q.c.send_after)).where(q.c.status == PENDING)
    if after is not None:
        stmt = stmt.where(q.c.send_after > after)
    return conn.scalar(stmt)


def beat(conn: Connection, name: str, now: str, *, started_at: str, ends_at: str | None, sent: int, settled: int) -> None:
    """Record a dispatcher's heartbeat (inserted on its first beat)."""
    values = {"name": name, "started_at": started_at, "beat_at": now, "ends_at": ends_at, "sent": sent, "settled": settled}
    ins = _insert(conn)(dispatchers).values(**values)
    conn.execute(
        ins.on_conflict_do_update(
            index_elements=[dispatchers.c.name],
            set_={"beat_at": ins.excluded.beat_at, "sent": ins.excluded.sent, "settled": ins.excluded.settled},
        )
    )


def dispatcher_stopped(conn: Connection, name: str, now: str) -> None:
    conn.execute(update(dispatchers).where(dispatchers.c.name == name).values(stopped_at=now, beat_at=now))


def live_dispatchers(conn: Connection, beat_after: str) -> list[dict[str, Any]]:
    """Dispatchers that have beaten since ``beat_after`` and not stopped, newest beat first."""
    stmt = (
        select(dispatchers)
        .where(dispatchers.c.beat_at > beat_after, dispatchers.c.stopped_at.is_(None))
        .order_by(dispatchers.c.beat_at.desc())
    )
    return [dict(r) for r in conn.execute(stmt).mappings()]


def latest_beat(conn: Connection) -> str | None:
    """The newest heartbeat of any running dispatcher (None when none has ever beaten)."""
    return conn.scalar(select(func.max(dispatchers.c.beat_at)).where(dispatchers.c.stopped_at.is_(None)))


def prune_dispatchers(conn: Connection, before: str) -> int:
    """Forget dispatchers whose last beat is older than ``before``."""
    return conn.execute(delete(dispatchers).where(dispatchers.c.beat_at < before)).rowcount


# ---------------------------------------------------------------- draining the queue


def fail_abandoned(conn: Connection, cutoff: str, now: str) -> int:
    """Claims older than ``cutoff`` belong to a run that died mid-send: failed, never retried."""
    return conn.execute(
        update(q)
        .where(q.c.status == CLAIMED, q.c.claimed_at < cutoff)
        .values(status="settled", outcome="failed", outcome_detail="abandoned", settled_at=now, updated_at=now)
    ).rowcount


def due_ids(conn: Connection, now: str, row_id: int | None = None, limit: int | None = None) -> list[int]:
    """The due predicate: pending and ``send_after`` has passed. Plain text comparison."""
    stmt = select(q.c.id).where(q.c.status == PENDING, q.c.send_after <= now).order_by(q.c.send_after, q.c.id)
    if row_id is not None:
        stmt = stmt.where(q.c.id == row_id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(conn.scalars(stmt))


def claim(conn: Connection, ids: Sequence[int], now: str, claimer: str) -> list[dict[str, Any]]:
    """The compare-and-swap. A row is this caller's to send iff it comes back.

    On PostgreSQL the candidates are locked with SKIP LOCKED in id order, so overlapping claimers
    never deadlock and never wait on each other; the status and due check runs on the locked,
    latest row version.
    """
    if not ids:
        return []
    params = {"claim_ids": sorted(ids), "now": now, "claimer": claimer}
    dialect = conn.dialect.name
    claimed = [dict(r) for r in conn.execute(_claim_statement(dialect), params).mappings()]
    if dialect == "postgresql" or not claimed:
        return claimed
    dev_ids = sorted({r["device_id"] for r in claimed})
    dev = {r["id"]: r for r in conn.execute(select(devices.c.id, *_CLAIM_DEVICE_COLUMNS).where(devices.c.id.in_(dev_ids))).mappings()}
    empty = {c.name: None for c in _CLAIM_DEVICE_COLUMNS}
    return [{**r, **({k: dev[r["device_id"]][k] for k in empty} if r["device_id"] in dev else empty)} for r in claimed]


_CLAIM_DEVICE_COLUMNS = (
    devices.c.apns_token, devices.c.last_tz_offset_seconds, devices.c.token_invalid_at, devices.c.tz_name, devices.c.quiet_hours,
)


@cache
def _claim_statement(dialect: str) -> Any:
    """Built once per dialect: the drain claims every slice with the same statement."""
    now = bindparam("now")
    if dialect == "postgresql":
        # Lock by primary key only: a status predicate here would steer the planner onto the
        # partial due index and scan every pending row for each claim.
        ids = bindparam("claim_ids", type_=postgresql.ARRAY(BigInteger))
        target: Any = select(q.c.id).where(q.c.id == any_(ids)).order_by(q.c.id).with_for_update(skip_locked=True).scalar_subquery()
    else:
        target = bindparam("claim_ids", expanding=True)
    stmt = (
        update(q)
        .where(q.c.id.in_(target), q.c.status == PENDING, q.c.send_after <= now)
        .values(status="claimed", claimed_at=now, claimed_by=bindparam("claimer"), updated_at=now)
        .returning(*q.c)
    )
    if dialect != "postgresql":
        return stmt
    claimed = stmt.cte("claimed")  # one round trip: the UPDATE as a CTE joined to devices
    return select(claimed, *_CLAIM_DEVICE_COLUMNS).outerjoin(devices, devices.c.id == claimed.c.device_id)


SETTLE_FIELDS = ("id", "outcome", "outcome_detail", "payload", "apns_id", "sent_at")

_SETTLE_ROWS_SOURCE = {
    "postgresql": (
        "SELECT r.* FROM json_to_recordset(CAST(:rows AS json)) AS r(id bigint, outcome text, "
        "outcome_detail text, payload text, apns_id text, sent_at text)"
    ),
    "sqlite": "SELECT " + ", ".join(f"json_extract(value, '$.{c}') AS {c}" for c in SETTLE_FIELDS) + " FROM json_each(:rows)",
}

_SETTLE = """
UPDATE notification_queue AS q SET status = 'settled', outcome = r.outcome, outcome_detail = r.outcome_detail,
    payload = r.payload, apns_id = r.apns_id, sent_at = r.sent_at, settled_at = :now, updated_at = :now
FROM ({rows}) AS r
WHERE q.id = r.id AND q.status = 'claimed' AND q.claimed_by = :claimer
"""


def settle(conn: Connection, settlements: Sequence[Mapping[str, Any]], claimer: str, now: str) -> int:
    """Settle claimed rows in one statement; only the claimer's own claims (a swept abandoned claim stays failed).

    Each settlement: ``id, outcome`` and optionally ``outcome_detail, payload, apns_id, sent_at``.
    """
    if not settlements:
        return 0
    stmt = text(_SETTLE.format(rows=_SETTLE_ROWS_SOURCE[conn.dialect.name]))
    payload = json.dumps([{c: s.get(c) for c in SETTLE_FIELDS} for s in settlements], separators=(",", ":"))
    return conn.execute(stmt, {"rows": payload, "claimer": claimer, "now": now}).rowcount


_RETURN_ROWS_SOURCE = {
    "postgresql": "SELECT r.* FROM json_to_recordset(CAST(:rows AS json)) AS r(id bigint, outcome_detail text)",
    "sqlite": "SELECT json_extract(value, '$.id') AS id, json_extract(value, '$.outcome_detail') AS outcome_detail FROM json_each(:rows)",
}

_RETURN_TO_PENDING = """
UPDATE notification_queue AS q SET status = 'pending', attempts = q.attempts + 1, outcome_detail = r.outcome_detail,
    claimed_by = NULL, claimed_at = NULL, updated_at = :now
FROM ({rows}) AS r
WHERE q.id = r.id AND q.status = 'claimed' AND q.claimed_by = :claimer
RETURNING send_after
"""


def return_to_pending(conn: Connection, rows: Sequence[Mapping[str, Any]], claimer: str, now: str) -> int:
    """Give the claimer's claimed rows back to pending, one attempt more: each certainly never reached
    APNs. ``outcome_detail`` keeps why, until the row settles. Wakes listening dispatchers."""
    if not rows:
        return 0
    stmt = text(_RETURN_TO_PENDING.format(rows=_RETURN_ROWS_SOURCE[conn.dialect.name]))
    payload = json.dumps([{"id": r["id"], "outcome_detail": r.get("outcome_detail")} for r in rows], separators=(",", ":"))
    send_afters = list(conn.scalars(stmt, {"rows": payload, "claimer": claimer, "now": now}))
    if send_afters:
        announce_pending(conn, min(send_afters))
    return len(send_afters)


# ---------------------------------------------------------------- drain halts


def record_halt(conn: Connection, scope: str, reason: str, claimer: str, now: str) -> None:
    """Halt every drain of ``scope`` (written once: the first fault found is the one kept)."""
    ins = _insert(conn)(drain_halts).values(scope=scope, reason=reason, claimer=claimer, halted_at=now)
    conn.execute(ins.on_conflict_do_nothing(index_elements=[drain_halts.c.scope]))


def halt_of(conn: Connection, scope: str) -> str | None:
    """Why drains of ``scope`` halted, or None: one primary-key read before each claim."""
    return conn.scalar(select(drain_halts.c.reason).where(drain_halts.c.scope == scope))


def prune_halts(conn: Connection, before: str) -> int:
    return conn.execute(delete(drain_halts).where(drain_halts.c.halted_at < before)).rowcount


# ---------------------------------------------------------------- reading the ledger


QUEUE_COLUMNS = [c.name for c in q.c]


def list_queue(
    conn: Connection,
    *,
    device_id: str | None = None,
    status: str | None = None,
    outcome: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
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
    r = conn.execute(select(q).where(q.c.id == row_id)).mappings().first()
    return dict(r) if r else None


def oldest_built(conn: Connection, chunks: Sequence[int] | None = None) -> tuple[int, str | None]:
    """(devices never built, oldest ``reminders_built_at`` among the rest), live tokens only."""
    live = devices.c.token_invalid_at.is_(None)
    if chunks is not None:
        live = and_(live, devices.c.chunk.in_(list(chunks)))
    never = conn.scalar(select(func.count()).where(live, devices.c.reminders_built_at.is_(None)))
    oldest = conn.scalar(select(func.min(devices.c.reminders_built_at)).where(live))
    return int(never or 0), oldest


def devices_per_chunk(conn: Connection) -> dict[int, int]:
    stmt = select(devices.c.chunk, func.count()).where(devices.c.token_invalid_at.is_(None)).group_by(devices.c.chunk)
    return {c: n for c, n in conn.execute(stmt)}


def stalest_chunks(conn: Connection, limit: int | None = None) -> list[int]:
    """Chunks ordered by their oldest build (never-built devices first)."""
    oldest = func.min(func.coalesce(devices.c.reminders_built_at, ""))
    stmt = (
        select(devices.c.chunk)
        .where(devices.c.token_invalid_at.is_(None))
        .group_by(devices.c.chunk)
        .order_by(oldest, devices.c.chunk)
    )
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(conn.scalars(stmt))


def rules_in_use(conn: Connection) -> list[tuple[int, str]]:
    """Each distinct (reminder_lead_seconds, extra_rules) of live devices."""
    stmt = select(devices.c.reminder_lead_seconds, devices.c.extra_rules).where(devices.c.token_invalid_at.is_(None)).distinct()
    return [(lead, extra) for lead, extra in conn.execute(stmt)]


def min_lead_seconds(conn: Connection) -> int | None:
    return conn.scalar(select(func.min(devices.c.reminder_lead_seconds)).where(devices.c.token_invalid_at.is_(None)))


def oldest_due_pending(conn: Connection, now: str) -> str | None:
    return conn.scalar(select(func.min(q.c.send_after)).where(q.c.status == PENDING, q.c.send_after <= now))


def prune_settled(conn: Connection, before: str, limit: int, *, ended_before: str) -> int:
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


def prune_history(conn: Connection, before: str, limit: int) -> int:
    """Delete up to ``limit`` history rows re-armed before ``before``."""
    h = notification_history
    victims = select(h.c.id).where(h.c.rearmed_at < before).order_by(h.c.rearmed_at).limit(limit)
    return conn.execute(delete(h).where(h.c.id.in_(victims.scalar_subquery()))).rowcount


def history_of(conn: Connection, queue_id: int) -> list[dict[str, Any]]:
    """What a queue row recorded before each re-arm, oldest first."""
    h = notification_history
    stmt = select(h).where(h.c.queue_id == queue_id).order_by(h.c.settled_at, h.c.id)
    return [dict(r) for r in conn.execute(stmt).mappings()]


# ---------------------------------------------------------------- /metrics: bounded reads at scrape time
#
# Each statement reads an index range bounded by a row limit or by recent activity (the window's
# latest settled rows, the due backlog, claims in flight), never by the table: a scrape of a queue
# of a million rows takes milliseconds (bench/bench_metrics.py).

COUNT_CAP = 100_000


def latest_settled(conn: Connection, since: str, now: str, limit: int) -> list[tuple[str, str, str | None, str, str | None]]:
    """(settled_at, outcome, outcome_detail, send_after, sent_at) of the latest ``limit`` rows settled
    in ``(since, now]``, newest first: a backward range on the partial settled_at index, bounded by
    ``limit`` whatever the window holds. Lateness is computed by the caller, never in SQL."""
    stmt = (
        select(q.c.settled_at, q.c.outcome, q.c.outcome_detail, q.c.send_after, q.c.sent_at)
        .where(q.c.status == SETTLED, q.c.settled_at > since, q.c.settled_at <= now)
        .order_by(q.c.settled_at.desc())
        .limit(limit)
    )
    return list(conn.execute(stmt).all())  # type: ignore[arg-type]  # one fetchall, not a fetch per row


def built_after(conn: Connection, now: str) -> int:
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
    oldest_due_send_after: str | None
    claimed: int
    never_built: int
    oldest_built_at: str | None
    built_in_future: int
    settled_in_future: int
    latest_beat: str | None
    live_dispatchers: int


def queue_gauges(conn: Connection, now: str, beat_after: str) -> QueueGauges:
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
        select(func.max(dispatchers.c.beat_at)).where(running).scalar_subquery(),
        select(func.count()).where(running, dispatchers.c.beat_at > beat_after).scalar_subquery(),
    )
    due, oldest_due, claimed, never, oldest, future, settled_future, beat, live_n = conn.execute(stmt).one()
    return QueueGauges(
        int(due), oldest_due, int(claimed), int(never), oldest, int(future), int(settled_future), beat, int(live_n)
    )
