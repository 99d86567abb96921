"""A morning agenda (``agenda@07:00``): at that local time, one alert listing the day's events,
how many and the first few with their times, all-day events first.

One row per device per local day: its item is the day (``agenda:2026-09-10``), its rule
``agenda`` (whatever the time the device names, so a new time re-times the day's row), its time the
rule's local time on that day in the device's zone (DST exact), its end the day's end. Its words
are made at the build, in the device's language and clock, from every calendar the device
subscribes to and has not muted; a declined invitation is not listed. A day with no event has no
row (a pending one is voided ``empty_day``). A snooze of a sent agenda is re-planned with its
day: it says what the day now holds, or is voided ``empty_day`` too. The build makes an agenda
only from a complete picture: while a calendar's read fails, the device's agenda rows are left
as they are. Its end is kept as wall time too (``item_at``), so a new zone re-times a pending
agenda but never makes a second one for a day already sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

from reminders_pipeline.domain import phrases
from reminders_pipeline.domain.items import Item
from reminders_pipeline.domain.policy import held_send_after
from reminders_pipeline.domain.rows import PlannedRow
from reminders_pipeline.domain.rules import Rule
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.zones import QuietHours, Zone, wall_datetime

ITEM_PREFIX = "agenda:"
MAX_LISTED = 3  # events named in the body; the rest are counted
MAX_TITLE = 60
DAY = 86400


def agenda_days(rule: Rule, zone: Zone, now: Instant, horizon: int, after: Instant | None) -> Iterator[int]:
    """Each local day (its midnight as wall seconds) whose agenda time falls after ``now`` (and
    after ``after``, up to which an earlier plan made them) and within the horizon."""
    lower, upper = max(now, after) if after is not None else now, now + horizon
    day = int(zone.to_wall(now) // DAY) * DAY - DAY
    while True:
        at = Instant.from_unix(zone.to_unix(day + rule.at_minutes * 60))
        if at > upper:
            return
        if at > lower:
            yield day
        day += DAY


def agenda_come(rule: Rule, zone: Zone, now: Instant) -> set[str]:
    """The days (yesterday and today, item ids) whose agenda time is not after ``now``: a pending
    agenda of one is due, or held for quiet hours past it, and the drain settles it; no plan does."""
    today = int(zone.to_wall(now) // DAY) * DAY
    return {
        agenda_item_id(day)
        for day in (today - DAY, today)
        if Instant.from_unix(zone.to_unix(day + rule.at_minutes * 60)) <= now
    }


def agenda_item_id(day: int) -> str:
    """The agenda's item: its local date (``agenda:2026-09-10``)."""
    return ITEM_PREFIX + datetime.fromtimestamp(day, UTC).date().isoformat()


def agenda_day(item_id: str) -> int:
    """The day an agenda's item names, as its midnight in wall seconds (``agenda_item_id``'s inverse)."""
    return int(datetime.fromisoformat(item_id.removeprefix(ITEM_PREFIX)).replace(tzinfo=UTC).timestamp())


def agenda_row(
    device: dict[str, Any], rule: Rule, day: int, items: Iterable[Item], zone: Zone, quiet: QuietHours | None
) -> PlannedRow | None:
    """The day's agenda row from the device's items fixed in its zone; None for a day with none."""
    starts, ends = Instant.from_unix(zone.to_unix(day)), Instant.from_unix(zone.to_unix(day + DAY))
    today = sorted(
        (i for i in items if i.starts < ends and i.expires > starts),
        key=lambda i: (not i.all_day, i.starts, i.title),
    )
    if not today:
        return None
    send = Instant.from_unix(zone.to_unix(day + rule.at_minutes * 60))
    title, body = _words(device, today, zone)
    return {
        "device_id": device["id"],
        "source_id": None,
        "item_id": agenda_item_id(day),
        "rule": rule.row_rule,
        "send_after": held_send_after(send, rule, ends, quiet, zone),
        "event_at": starts,
        "expires_at": ends,
        "title": title,
        "body": body,
        "item_at": Instant.from_unix(day + DAY),
    }


def _words(device: dict[str, Any], today: list[Item], zone: Zone) -> tuple[str, str]:
    """ "Today: 3 events" and "Holiday · 09:00 Standup · 11:30 Review · +1", in the device's
    language and clock when it names one, else English on a 24-hour clock."""
    locale = device.get("locale")
    speaker = phrases.speaker(locale or phrases.FALLBACK, phrases.valid_clock(device.get("clock")))

    def when(item: Item) -> str:
        return speaker.time(wall_datetime(zone.to_wall(item.starts))) if locale else zone.clock(item.starts)

    listed = [_cut(i.title) if i.all_day else f"{when(i)} {_cut(i.title)}" for i in today[:MAX_LISTED]]
    if len(today) > MAX_LISTED:
        listed.append(f"+{len(today) - MAX_LISTED}")
    return speaker.agenda(len(today)), " · ".join(listed)


def _cut(title: str) -> str:
    return title if len(title) <= MAX_TITLE else title[: MAX_TITLE - 1] + "…"
