"""The widget's feed (``GET /v1/devices/{id}/feed``): a device's sources merged, soonest first.

Served from the reads a build or an earlier request recorded while they are fresh, so requests,
however many, cannot multiply the reads of one source. The zone and locale the widget reports are
stored first, best-effort: floating calendar times use the zone, and neither can fail a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from reminders_pipeline import ledger
from reminders_pipeline.config.log_throttle import first_line
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.items import ParsedFeed, address_digest
from reminders_pipeline.domain.rules import device_rules
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.zones import Zone, zone_of
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.planning.plan import namespaced
from reminders_pipeline.planning.source_reads import (
    failed_sources,
    in_order,
    make_reader,
    read_window,
    record_reads,
    source_state,
)
from reminders_pipeline.sources.reader import SourceRead, SourceReader, Window

log = logging.getLogger(__name__)


@dataclass
class ComposedFeed:
    """A device's feed as the widget sees it: item bounds stay Unix seconds (the wire contract)."""

    device_id: str
    items: list[dict[str, Any]]
    sources_failed: list[dict[str, str]]


def feed_as_reported(
    db: Database,
    settings: Settings,
    device_id: str,
    reported: Zone | None,
    locale: str | None,
    on_zone_write_failed: Callable[[], None] = lambda: None,
) -> ComposedFeed | None:
    """The feed after storing the zone and locale the widget reports, when they changed; None for
    an unknown device. A write that fails is logged (and ``on_zone_write_failed`` called for a
    zone), never raised: the feed goes out with what the device had."""
    with db.read() as conn:
        record = ledger.get_device(conn, device_id)
    if record is None:
        return None
    if reported is not None and not stored_already(reported, record):  # before composing
        zone = f"the zone {reported.tz_name or reported.offset_seconds}"
        _store(db, device_id, zone, lambda conn: _write_zone(conn, device_id, reported), on_zone_write_failed)
    if locale is not None and locale != record.locale:
        _store(db, device_id, f"the locale {locale}", lambda conn: ledger.store_locale(conn, device_id, locale))
    return compose_feed(db, settings, device_id)


def stored_already(reported: Zone, record: ledger.DeviceRecord) -> bool:
    """Whether the device already has the zone name, or the offset, its widget reports."""
    if reported.tz_name is not None:
        return reported.tz_name == record.tz_name
    return reported.offset_seconds == record.last_tz_offset_seconds


def _write_zone(conn: Connection, device_id: str, reported: Zone) -> None:
    if reported.tz_name is not None:
        ledger.store_tz_name(conn, device_id, reported.tz_name)
    elif reported.offset_seconds is not None:
        ledger.store_tz_offset(conn, device_id, reported.offset_seconds)


def _store(
    db: Database,
    device_id: str,
    what: str,
    write: Callable[[Connection], object],
    failed: Callable[[], None] = lambda: None,
) -> None:
    """One conditional write (the UPDATE re-checks that it changed), best-effort."""
    try:
        with db.write() as conn:
            write(conn)
    except Exception as exc:  # noqa: BLE001 - a zone or a locale can never fail a feed request
        failed()
        log.warning("could not store %s for %s: %s: %s", what, device_id, type(exc).__name__, first_line(exc))


def compose_feed(
    db: Database, settings: Settings, device_id: str, reader: SourceReader | None = None, now: Instant | None = None
) -> ComposedFeed | None:
    """The device's sources merged, soonest first; None for an unknown device.

    A source read in the last ``REMINDERS_FEED_CACHE_SECONDS`` (by a build or an earlier request)
    is served as that read left it, its feed from ``sources.feed_cache`` or its failure as recorded:
    requests, however many, cannot multiply the reads of one source. Older sources are read now,
    under the build's bounds, and recorded like a build's reads.
    """
    with db.read() as conn:
        record = ledger.get_device(conn, device_id)
        if record is None:
            return None
        subs = ledger.subscriptions(conn, [device_id])[device_id]
        rows = ledger.sources_by_id(conn, subs)
    now = now or Instant.now()
    rules = device_rules(record.reminder_lead_seconds, record.extra_rules, record.all_day_rules)
    window = read_window(rules, now, settings.horizon_seconds)
    since = now - settings.feed_cache_seconds
    reads = {sid: read for sid, row in rows.items() if (read := recent_read(row, since, window)) is not None}
    stale = {sid: source_state(row) for sid, row in rows.items() if sid not in reads}
    if stale:
        reader = reader or make_reader(settings)
        fresh = reader.read_all(stale, window)
        reads.update(in_order(reader, fresh, record_reads(db, fresh, now, settings), window))
    zone = zone_of(record)
    attendees = frozenset(address_digest(a) for a in record.attendees)
    items = [
        {
            "id": namespaced(read.source_id, item.id),
            "title": item.title,
            "body": item.body,
            "startsAt": item.starts_at,
            "expiresAt": item.expires_at,
            "declined": item.declined_by(attendees),
        }
        for read in reads.values()
        if read.feed is not None
        for item in (i.for_local(zone) for i in read.feed.items)
    ]
    items.sort(key=lambda i: (i["startsAt"], i["id"]))
    return ComposedFeed(device_id, items, failed_sources(reads))


def recent_read(row: dict[str, Any], since: Instant, window: Window) -> SourceRead | None:
    """A source's last read as recorded, if it was made at or after ``since`` and its cached feed
    covers ``window``; None when the source must be read again."""
    if row["last_read_at"] is None or row["last_read_at"] < since:
        return None
    if row["last_error"] is not None:
        return SourceRead(row["id"], row["url"], error=row["last_error"])
    if row["feed_cache"] is None or (row["cache_until"] is not None and row["cache_until"] < window[1]):
        return None
    try:
        feed = ParsedFeed.from_json(row["feed_cache"])
    except (ValueError, KeyError, TypeError):
        return None
    return SourceRead(row["id"], row["url"], feed=feed, cache_until=row["cache_until"])
