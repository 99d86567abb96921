"""Sources and subscriptions: which feeds a device reads, and how each feed's last read went."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Text, bindparam, case, delete, func, literal, or_, select, update

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger._common import batches, insert_on_conflict
from reminders_pipeline.ledger.schema import IsoTime, device_sources, sources


def set_subscriptions(
    conn: Connection,
    device_id: str,
    urls: Sequence[str],
    now: Instant,
    calendars: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Make the device subscribe to exactly ``urls``, creating sources on first use, each with its
    ``calendars`` settings as columns (``calendar_settings.CalendarSettings.columns``; a URL not named
    there: ``CALENDAR_DEFAULTS``)."""
    if urls:
        ins = insert_on_conflict(conn)(sources)
        # In sorted order: two registrations inserting the same new URLs in opposite orders would
        # each wait on the other's unique-index entry (a deadlock on PostgreSQL).
        rows = [{"url": u, "created_at": now} for u in sorted(set(urls))]
        conn.execute(ins.on_conflict_do_nothing(index_elements=[sources.c.url]), rows)
    wanted = select(sources.c.id).where(sources.c.url.in_(list(urls))) if urls else None
    drop = delete(device_sources).where(device_sources.c.device_id == device_id)
    if wanted is not None:
        drop = drop.where(device_sources.c.source_id.not_in(wanted))
    conn.execute(drop)
    if urls:
        ins = insert_on_conflict(conn)(device_sources).from_select(
            ["device_id", "source_id"],
            select(literal(device_id).label("device_id"), sources.c.id).where(sources.c.url.in_(list(urls))),
        )
        conn.execute(ins.on_conflict_do_nothing())
        _set_calendar_settings(conn, device_id, urls, calendars or {})


def _set_calendar_settings(
    conn: Connection, device_id: str, urls: Sequence[str], calendars: Mapping[str, Mapping[str, Any]]
) -> None:
    """One statement for every subscription of the device, each url's settings or the defaults."""
    source_id = select(sources.c.id).where(sources.c.url == bindparam("b_url")).scalar_subquery()
    stmt = (
        update(device_sources)
        .where(device_sources.c.device_id == device_id, device_sources.c.source_id == source_id)
        .values({c: bindparam(f"b_{c}") for c in CALENDAR_DEFAULTS})
    )
    rows = [{f"b_{c}": v for c, v in {**CALENDAR_DEFAULTS, **calendars.get(u, {})}.items()} for u in urls]
    conn.execute(stmt, [{"b_url": u, **row} for u, row in zip(urls, rows, strict=True)])


CALENDAR_DEFAULTS: dict[str, Any] = {
    "rules": None,
    "interruption_level": None,
    "breakthrough": 0,
    "muted": 0,
    "travel_seconds": None,
}
HAS_CALENDAR_SETTINGS = or_(
    device_sources.c.rules.is_not(None),
    device_sources.c.interruption_level.is_not(None),
    device_sources.c.breakthrough != 0,
    device_sources.c.muted != 0,
    device_sources.c.travel_seconds.is_not(None),
)


def calendar_settings(conn: Connection, device_ids: Sequence[str]) -> dict[str, dict[int, dict[str, Any]]]:
    """The subscriptions of these devices with settings of their own, as columns, by device and source."""
    out: dict[str, dict[int, dict[str, Any]]] = {d: {} for d in device_ids}
    for ids in batches(list(device_ids)):
        stmt = select(device_sources).where(device_sources.c.device_id.in_(ids), HAS_CALENDAR_SETTINGS)
        for row in conn.execute(stmt).mappings():
            out[row["device_id"]][row["source_id"]] = {c: row[c] for c in CALENDAR_DEFAULTS}
    return out


def subscriptions(conn: Connection, device_ids: Sequence[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {d: [] for d in device_ids}
    for ids in batches(list(device_ids)):
        stmt = select(device_sources.c.device_id, device_sources.c.source_id).where(device_sources.c.device_id.in_(ids))
        for dev, src in conn.execute(stmt):
            out[dev].append(src)
    return out


def sources_by_id(conn: Connection, source_ids: Iterable[int]) -> dict[int, dict[str, Any]]:
    ids = sorted(set(source_ids))
    out: dict[int, dict[str, Any]] = {}
    for batch in batches(ids):
        for r in conn.execute(select(sources).where(sources.c.id.in_(batch))).mappings():
            out[r["id"]] = dict(r)
    return out


def list_sources(conn: Connection) -> list[dict[str, Any]]:
    subs = select(device_sources.c.source_id, func.count().label("n")).group_by(device_sources.c.source_id).subquery()
    stmt = (
        select(sources, func.coalesce(subs.c.n, 0).label("subscribers"))
        .outerjoin(subs, subs.c.source_id == sources.c.id)
        .order_by(sources.c.id)
    )
    return [dict(r) for r in conn.execute(stmt).mappings()]


def _record_reads(conn: Connection, reads: Sequence[Mapping[str, Any]], *conditions: Any, **values: Any) -> None:
    """One UPDATE executed once per read source, where ``conditions`` hold: each read's fields
    arrive as ``b_<field>`` parameters."""
    if not reads:
        return
    stmt = update(sources).where(sources.c.id == bindparam("b_id"), *conditions).values(**values)
    conn.execute(stmt, [{f"b_{k}": v for k, v in r.items()} for r in reads])


def record_source_success(conn: Connection, results: Sequence[Mapping[str, Any]], now: Instant) -> None:
    """``results``: ``{"id", "items", "rejected", "etag", "last_modified", "feed_cache", "cache_until",
    "content_hash"}`` per source read successfully at ``now`` (the build's own time, which orders
    builds: ``lock_devices``).

    Reads are recorded in order: a read made before the stored parse's (``last_success_at``) records
    nothing, so two overlapping builds whose older one records last keep the newer parse
    (``newer_parses`` names those sources). A failure recorded after this read (``last_read_at``
    later) keeps its streak. A fresh parse (``feed_cache`` set) writes the cache, its content hash,
    its calendar bound and the validators as one. A read that reused the cache (``feed_cache`` None:
    a 304, or the body last parsed) writes none of them over what is stored: an overlapping build
    may have stored a newer parse meanwhile, and this read's validators and hash would label it as
    the old one. It fills in only a hash still missing (a cache stored before hashes were kept)."""
    fields = ("id", "items", "rejected", "etag", "last_modified", "feed_cache", "cache_until", "content_hash")
    at = literal(now, IsoTime())
    failed_since = sources.c.last_read_at > at

    def unless_failed_since(value: Any, stored: Any) -> Any:
        return case((failed_since, stored), else_=value)

    _record_reads(
        conn,
        [{f: r.get(f) for f in fields} for r in results],
        or_(sources.c.last_success_at.is_(None), sources.c.last_success_at <= at),
        last_read_at=unless_failed_since(at, sources.c.last_read_at),
        last_success_at=at,
        consecutive_failures=unless_failed_since(0, sources.c.consecutive_failures),
        failing_since=unless_failed_since(None, sources.c.failing_since),
        alerted_at=unless_failed_since(None, sources.c.alerted_at),
        last_error=unless_failed_since(None, sources.c.last_error),
        last_item_count=bindparam("b_items"),
        last_rejected_count=bindparam("b_rejected"),
        etag=_if_parsed(bindparam("b_etag"), sources.c.etag),
        last_modified=_if_parsed(bindparam("b_last_modified"), sources.c.last_modified),
        feed_cache=_if_parsed(bindparam("b_feed_cache"), sources.c.feed_cache),
        cache_until=_if_parsed(bindparam("b_cache_until", type_=IsoTime()), sources.c.cache_until),
        content_hash=_if_parsed(
            bindparam("b_content_hash"), func.coalesce(sources.c.content_hash, bindparam("b_content_hash"))
        ),
    )


def newer_parses(conn: Connection, source_ids: Iterable[int], now: Instant) -> dict[int, dict[str, Any]]:
    """Of these sources read successfully at ``now``, those whose stored parse comes from a later
    read (``record_source_success`` kept it), as rows."""
    out: dict[int, dict[str, Any]] = {}
    for ids in batches(sorted(set(source_ids))):
        stmt = select(sources).where(sources.c.id.in_(ids), sources.c.last_success_at > literal(now, IsoTime()))
        out.update((r["id"], dict(r)) for r in conn.execute(stmt).mappings())
    return out


def _if_parsed(read: Any, stored: Any) -> Any:
    """The read's value when it parsed the feed afresh, else what is stored."""
    return case((bindparam("b_feed_cache", type_=Text()).is_not(None), read), else_=stored)


def record_source_failure(conn: Connection, failures: Sequence[Mapping[str, Any]], now: Instant) -> None:
    """``failures``: ``{"id", "error"}`` per source whose read at ``now`` failed. Its rows are left
    alone. A failure older than the last read recorded (an overlapping build's) records nothing."""
    at = literal(now, IsoTime())
    _record_reads(
        conn,
        [{"id": f["id"], "error": f["error"]} for f in failures],
        or_(sources.c.last_read_at.is_(None), sources.c.last_read_at <= at),
        last_read_at=at,
        last_error_at=at,
        last_error=bindparam("b_error"),
        consecutive_failures=sources.c.consecutive_failures + 1,
        failing_since=func.coalesce(sources.c.failing_since, at),
    )


def claim_source_alerts(conn: Connection, failing_before: Instant, now: Instant) -> list[dict[str, Any]]:
    """Sources failing since before ``failing_before`` and not yet alerted; marks them alerted (once per streak)."""
    due = select(sources.c.id).where(sources.c.failing_since < failing_before, sources.c.alerted_at.is_(None))
    rows = conn.execute(
        update(sources)
        .where(sources.c.id.in_(due.scalar_subquery()))
        .values(alerted_at=now)
        .returning(
            sources.c.id, sources.c.url, sources.c.failing_since, sources.c.last_error, sources.c.consecutive_failures
        )
    ).mappings()
    return [dict(r) for r in rows]
