"""iCalendar sources: one item per event occurrence in a window, via icalendar + recurring-ical-events.

Recurrence (RRULE, RDATE, EXDATE, RECURRENCE-ID overrides), VTIMEZONE/TZID and DURATION/DTEND are
the libraries' job; this module only maps occurrences onto the item contract.

An occurrence's id is its UID plus its *original* start (RECURRENCE-ID), so a moved occurrence keeps
its id and updates its row, and a deleted one leaves the feed and voids its row.

Floating times and all-day dates have no zone of their own: they are returned as if UTC with
``floating=True``, and the build shifts them by the device's last seen UTC offset. An offset is
not a zone, so a floating event on the far side of a DST change from the offset's capture is off
by the DST difference (usually one hour); all-day reminders are approximate in the same way.
"""

from __future__ import annotations

import hashlib
from datetime import date, datetime, timedelta, timezone
from typing import Any

import icalendar
import recurring_ical_events

from .feed import MAX_ID_LENGTH, FeedError, ParsedFeed


def _unix(value: date | datetime) -> tuple[int, bool]:
    """(Unix seconds, floating). Dates and naive datetimes are read as UTC and marked floating."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return int(value.replace(tzinfo=timezone.utc).timestamp()), True
        return int(value.timestamp()), False
    return int(datetime(value.year, value.month, value.day, tzinfo=timezone.utc).timestamp()), True


def _occurrence_id(uid: str, original: date | datetime) -> str:
    if isinstance(original, datetime):
        stamp = original.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ") if original.tzinfo else original.strftime("%Y%m%dT%H%M%S")
    else:
        stamp = original.strftime("%Y%m%d")
    item_id = f"{uid}/{stamp}"
    if len(item_id) > MAX_ID_LENGTH:
        item_id = f"{hashlib.sha256(uid.encode()).hexdigest()}/{stamp}"
    return item_id


def _raw_item(event: Any) -> dict[str, Any] | str:
    """The wire-format dict for one occurrence (validated like a JSON item), or a reject reason."""
    if str(event.get("STATUS", "")).upper() == "CANCELLED":
        return "cancelled"
    uid, start_prop = event.get("UID"), event.get("DTSTART")
    if not uid or start_prop is None:
        return "missing_id" if not uid else "bad_starts_at"
    start = start_prop.dt
    end_prop = event.get("DTEND")
    if end_prop is not None:
        end = end_prop.dt
    elif event.get("DURATION") is not None:
        end = start + event["DURATION"].dt
    else:
        end = start + (timedelta(days=1) if not isinstance(start, datetime) else timedelta(seconds=1))
    starts_at, floating = _unix(start)
    expires_at, _ = _unix(end)
    original = event["RECURRENCE-ID"].dt if event.get("RECURRENCE-ID") is not None else start
    location = event.get("LOCATION")
    return {
        "id": _occurrence_id(str(uid), original),
        "title": str(event.get("SUMMARY", "")).strip(),
        "body": str(location).strip() if location else None,
        "startsAt": starts_at,
        "expiresAt": max(expires_at, starts_at + 1),  # an instantaneous event still lasts one second
        "floating": floating,
    }


def parse_ics_feed(body: bytes, window_start: int, window_end: int) -> ParsedFeed:
    """Occurrences overlapping [window_start, window_end] (Unix seconds); cancelled ones excluded."""
    try:
        calendar = icalendar.Calendar.from_ical(body)
    except Exception:  # icalendar raises ValueError and friends on garbage; their text quotes the body
        raise FeedError("not_icalendar") from None
    lo = datetime.fromtimestamp(window_start, timezone.utc)
    hi = datetime.fromtimestamp(window_end, timezone.utc)
    try:
        occurrences = recurring_ical_events.of(calendar, skip_bad_series=True).between(lo, hi)
    except Exception:
        raise FeedError("bad_recurrence") from None
    feed = ParsedFeed()
    for event in occurrences:
        raw = _raw_item(event)
        if isinstance(raw, str):
            if raw != "cancelled":
                feed.rejected[raw] += 1
            continue
        floating = raw.pop("floating")
        feed.add(raw, floating=floating)
    return feed
