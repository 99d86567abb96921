"""An iCalendar event as the item contract has it: its occurrence ids, times, marks and alarms.

An occurrence's id is its UID plus its *original* start (RECURRENCE-ID), so a moved occurrence keeps
its id; an event without UID gets one made from its DTSTART, SUMMARY and position (``synthesize_uids``).
A DURATION's days and weeks are nominal and its hours, minutes and seconds exact (RFC 5545 3.3.6).
Each occurrence is read in place (``_OccurrenceEvent``), not copied.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from datetime import UTC, date, datetime, timedelta
from typing import Any

import icalendar

from reminders_pipeline.domain.items import (
    ADDRESS_TEXT_LENGTH,
    MAX_ID_LENGTH,
    MAX_TITLE_LENGTH,
    address_digest,
)
from reminders_pipeline.domain.rules import ALARM_REACH_SECONDS, MAX_LEAD_SECONDS, MAX_TRAVEL_SECONDS

FALLBACK_TITLE = "Untitled event"


def _unix(value: date | datetime) -> tuple[int, bool]:
    """(Unix seconds, floating). Dates and naive datetimes are read as UTC and marked floating."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return int(value.replace(tzinfo=UTC).timestamp()), True
        return int(value.timestamp()), False
    return int(datetime(value.year, value.month, value.day, tzinfo=UTC).timestamp()), True


def _occurrence_id(uid: str, original: date | datetime) -> str:
    if isinstance(original, datetime):
        stamp = (
            original.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
            if original.tzinfo
            else original.strftime("%Y%m%dT%H%M%S")
        )
    else:
        stamp = original.strftime("%Y%m%d")
    item_id = f"{uid}/{stamp}"
    if len(item_id) > MAX_ID_LENGTH:
        item_id = f"{_uid_digest(uid)}/{stamp}"
    return item_id


def _uid_digest(uid: str) -> str:
    return hashlib.sha256(uid.encode()).hexdigest()


def _series_keys(uid: str) -> set[str]:
    """What ``items.series_key`` reads from the ids of a series' occurrences, long UID or not."""
    return {uid, _uid_digest(uid)}


def synthesize_uids(calendar: icalendar.Calendar) -> None:
    """Give every VEVENT without UID a stable one: a hash of DTSTART, SUMMARY and its ordinal among
    UID-less events with the same two (so adding an unrelated event never renames it)."""
    seen: Counter[tuple[str, str]] = Counter()
    for event in calendar.walk("VEVENT"):
        if event.get("UID"):
            continue
        start = event.get("DTSTART")
        key = (start.to_ical().decode() if start is not None else "", str(event.get("SUMMARY", "")))
        digest = hashlib.sha256("\x00".join((*key, str(seen[key]))).encode()).hexdigest()[:32]
        seen[key] += 1
        event.add("UID", f"synth-{digest}")


def _durations(calendar: icalendar.Calendar) -> dict[tuple[str, str], timedelta]:
    """DURATION per (UID, RECURRENCE-ID or ''), read before expansion (occurrences lose it)."""
    out: dict[tuple[str, str], timedelta] = {}
    for event in calendar.walk("VEVENT"):
        duration = event.get("DURATION")
        if duration is not None and event.get("DTEND") is None:
            rid = event.get("RECURRENCE-ID")
            out[(str(event.get("UID")), rid.to_ical().decode() if rid is not None else "")] = duration.dt
    return out


def _end(
    event: Any, start: date | datetime, durations: dict[tuple[str, str], timedelta]
) -> tuple[date | datetime, int]:
    """(end as a date/datetime, exact seconds still to add to its instant)."""
    uid, rid = str(event.get("UID")), event.get("RECURRENCE-ID")
    duration = durations.get((uid, rid.to_ical().decode() if rid is not None else "")) or durations.get((uid, ""))
    if duration is not None and isinstance(start, datetime):
        nominal = start + timedelta(days=duration.days)  # wall-clock arithmetic, aware or not
        return nominal, duration.seconds
    end_prop = event.get("DTEND")
    if end_prop is not None:
        return end_prop.dt, 0
    if duration is not None:
        return start + duration, 0
    return start + (timedelta(days=1) if not isinstance(start, datetime) else timedelta(seconds=1)), 0


class _OccurrenceEvent:
    """An occurrence read as an event: its source component with the occurrence's DTSTART, DTEND
    and RECURRENCE-ID, as recurring-ical-events' ``Occurrence.as_component`` gives it, without
    copying the component and its alarms for every occurrence (bench_build's zoned calendars:
    about a tenth of their parse). Reads the library's ``Occurrence._adapter._component``,
    pinned and checked by a canary."""

    def __init__(self, occurrence: Any) -> None:
        self.source: icalendar.Component = occurrence._adapter._component
        start = icalendar.vDDDTypes(occurrence.start)
        rid = self.source.get("RECURRENCE-ID")
        self._own = {
            "DTSTART": start,
            "DTEND": icalendar.vDDDTypes(occurrence.end),
            "DURATION": None,
            "RECURRENCE-ID": start if rid is None else rid,
        }

    def get(self, name: str, default: Any = None) -> Any:
        value = self._own[name] if name in self._own else self.source.get(name)
        return default if value is None else value

    def __getitem__(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def walk(self, name: str) -> list[Any]:
        return self.source.walk(name)


def _raw_item(event: Any, durations: dict[tuple[str, str], timedelta]) -> dict[str, Any] | str:
    """The wire-format dict for one occurrence (validated like a JSON item), or a reject reason."""
    if str(event.get("STATUS", "")).upper() == "CANCELLED":
        return "cancelled"
    start_prop = event.get("DTSTART")
    if start_prop is None:
        return "bad_starts_at"
    start = start_prop.dt
    end, tail = _end(event, start, durations)
    starts_at, floating = _unix(start)
    end_unix, _ = _unix(end)
    expires_at = end_unix + tail  # floating: the wall-time reading; the build redoes the tail exactly
    original = event["RECURRENCE-ID"].dt if event.get("RECURRENCE-ID") is not None else start
    location = event.get("LOCATION")
    title = str(event.get("SUMMARY", "")).strip() or FALLBACK_TITLE
    return {
        "id": _occurrence_id(str(event.get("UID")), original),
        "title": title[: MAX_TITLE_LENGTH - 1] + "…" if len(title) > MAX_TITLE_LENGTH else title,
        "body": str(location).strip() if location else None,
        "startsAt": starts_at,
        "expiresAt": max(expires_at, starts_at + 1),  # an instantaneous event still lasts one second
        "floating": floating,
        "all_day": not isinstance(start, datetime),
        "tail_seconds": tail if floating else 0,
        "alarms": alarm_rules(event, start),
        "declined": declined(event),
        "travel_seconds": 0 if isinstance(start, date) and not isinstance(start, datetime) else travel_seconds(event),
    }


MARKS = (
    "floating",
    "all_day",
    "tail_seconds",
    "alarms",
    "declined",
    "travel_seconds",
)  # ``_raw_item``'s keys that are no wire field


MAX_DECLINED = 32  # declined attendees kept per event, in the calendar's order: each is stored with every occurrence


def declined(event: Any) -> tuple[str, ...]:
    """The attendee addresses that declined this event (``PARTSTAT=DECLINED``, RFC 5545 3.2.12), as
    ``items.address_digest`` of ``items.address_of``: how a plan compares a device's own."""
    attendees = event.get("ATTENDEE", [])
    out: set[str] = set()
    for attendee in attendees if isinstance(attendees, list) else [attendees]:
        if len(out) >= MAX_DECLINED:
            break
        params = getattr(attendee, "params", {})
        if str(params.get("PARTSTAT", "")).upper() == "DECLINED" and len(attendee) <= ADDRESS_TEXT_LENGTH:
            out.add(address_digest(str(attendee)))
    return tuple(sorted(out))


def travel_seconds(event: Any) -> int:
    """Apple Calendar's travel time to the event (``X-APPLE-TRAVEL-DURATION``, a DURATION), in
    seconds; 0 when absent, unreadable, not positive or longer than ``MAX_TRAVEL_SECONDS``."""
    try:
        value = event.get("X-APPLE-TRAVEL-DURATION")
        if value is None:
            return 0
        duration = getattr(value, "dt", None)  # typed by VALUE=DURATION
        if not isinstance(duration, timedelta):
            duration = icalendar.vDuration.from_ical(value.to_ical().decode())  # type: ignore[no-untyped-call]
    except Exception:  # noqa: BLE001 - an unreadable travel time (icalendar raises its own kinds) is none
        return 0
    seconds = int(duration.total_seconds()) if isinstance(duration, timedelta) else 0
    return seconds if 0 < seconds <= MAX_TRAVEL_SECONDS else 0


def _marks(raw: dict[str, Any]) -> dict[str, Any]:
    """Take from ``raw`` what the calendar states beyond the wire format (``items.checked_item``)."""
    return {name: raw.pop(name) for name in MARKS}


MAX_ALARM_REPEATS = 12  # repetitions of one alarm queued at most, past its first trigger: each is a row


MAX_ALARM_RULES = 32  # rules one event's alarms give at most (each a row per occurrence), in the calendar's order


def alarm_rules(event: Any, start: date | datetime) -> tuple[str, ...]:
    """The event's DISPLAY and AUDIO alarms as rules: a TRIGGER before the start is ``lead:N``,
    before the end (``RELATED=END``) ``lead:N@expiry``, an absolute one ``lead:N`` from the start.
    ``REPEAT`` with ``DURATION`` adds a rule per repetition (RFC 5545 3.8.6.2), each its own row,
    up to ``MAX_ALARM_REPEATS`` and until the anchor; each repetition counts on its own, so one
    within ``MAX_LEAD_SECONDS`` is kept though its first trigger is not. A trigger after its anchor
    cannot be a lead and is left out; the phone shows what remains. At most ``MAX_ALARM_RULES``."""
    rules = []
    for alarm in event.walk("VALARM"):
        trigger = alarm.get("TRIGGER")
        if str(alarm.get("ACTION", "")).upper() not in ("DISPLAY", "AUDIO") or trigger is None:
            continue
        value = trigger.dt
        if isinstance(value, timedelta):
            lead, anchor = (
                -int(value.total_seconds()),
                "@expiry" if str(trigger.params.get("RELATED", "")).upper() == "END" else "",
            )
        elif isinstance(value, datetime) and isinstance(start, datetime) and start.tzinfo is not None:
            lead, anchor = int(_unix(start)[0] - _unix(value)[0]), ""
        else:
            continue
        count, every = _repeats(alarm)
        for k in range(count + 1):
            if 0 <= lead - k * every <= MAX_LEAD_SECONDS:
                rules.append(f"lead:{lead - k * every}{anchor}")
    return tuple(dict.fromkeys(rules))[:MAX_ALARM_RULES]


def alarm_reaches(calendar: icalendar.Calendar) -> dict[str, int]:
    """How much further than its subscribers' window each series with alarms (by UID) is read:
    its DISPLAY and AUDIO alarms' longest lead, at most ``ALARM_REACH_SECONDS`` (for an absolute
    trigger, whose lead differs per occurrence, that bound), so the occurrences whose alarms fall
    inside the window are in the read, and a series without alarms costs nothing more."""
    out: dict[str, int] = {}
    for event in calendar.walk("VEVENT"):
        for alarm in event.walk("VALARM"):
            trigger = alarm.get("TRIGGER")
            if str(alarm.get("ACTION", "")).upper() not in ("DISPLAY", "AUDIO") or trigger is None:
                continue
            value = getattr(trigger, "dt", None)
            lead = -int(value.total_seconds()) if isinstance(value, timedelta) else ALARM_REACH_SECONDS
            uid = str(event.get("UID"))
            out[uid] = max(out.get(uid, 0), min(max(lead, 0), ALARM_REACH_SECONDS))
    return out


def _repeats(alarm: Any) -> tuple[int, int]:
    """An alarm's repetitions after its first trigger and the seconds between them, or (0, 0)
    where ``REPEAT`` and a positive ``DURATION`` do not both hold: the first trigger still counts."""
    try:
        count, duration = int(alarm.get("REPEAT", 0)), alarm.get("DURATION")
        every = int(duration.dt.total_seconds()) if duration is not None else 0
    except (TypeError, ValueError, AttributeError):
        return 0, 0
    return (min(count, MAX_ALARM_REPEATS), every) if count > 0 and every > 0 else (0, 0)
