"""iCalendar sources: one item per event occurrence in a window, via icalendar + recurring-ical-events.

Recurrence (RRULE, RDATE, EXDATE, RECURRENCE-ID overrides) and VTIMEZONE/TZID are the libraries'
job; this module maps occurrences onto the item contract.

An occurrence's id is its UID plus its *original* start (RECURRENCE-ID), so a moved occurrence keeps
its id and updates its row, and a deleted one leaves the feed and voids its row. An event without
UID (RFC 5545 requires one; exports often lack it) gets one made from its DTSTART, SUMMARY and its
position among events with the same two, so the id is the same at every read. An event without
SUMMARY gets ``FALLBACK_TITLE``.

Floating times and all-day dates have no zone of their own: they are returned as wall seconds
(the wall time read as UTC) with ``floating=True``, and the build resolves them in each device's
zone (``zones.LocalTime``). So that no occurrence goes missing near the window's edges whatever
the device's zone, the expansion runs ``MAX_OFFSET_SECONDS`` (14 h) wider on both sides.

A DURATION's days and weeks are nominal (added to the wall time, so a P1D event across a DST
change still ends at the same clock time) and its hours, minutes and seconds exact (added to the
instant), as RFC 5545 section 3.3.6 says; recurring-ical-events adds the whole duration to the
wall time, so the end is computed here.

Expansion is bounded, and checked at every occurrence a recurrence rule yields (dateutil's own
``between`` builds a whole span's list first, so the rules are iterated lazily here):

- at most ``max_items`` occurrences are turned into items (soonest first; the rest are counted as
  rejected ``over_item_cap``, built and set aside in ``ParsedFeed.aside`` with their ids in
  ``ParsedFeed.cut_ids``, cancelled ones neither counted nor kept), and one series builds at most
  that many per slice of the window, though it walks on to the end of its first day, so a flood
  is told from a full slice;
- a series that recurs more often than once a minute (more than ``MAX_PER_DAY`` a day, counted
  from where its walk starts, before the window too), or spends more than ``series_seconds`` of
  CPU time (its thread's), is dropped and counted ``runaway_series`` (``FREQ=SECONDLY``); the
  calendar's other events still count;
- a series the library cannot expand (an absurd date that overflows) is dropped alone and counted
  ``bad_recurrence``; a dropped series' UID is kept in ``ParsedFeed.partial_series``, so its rows
  are not voided as if its occurrences had left the feed; one dropped after some of its
  occurrences were counted is expanded away (the calendar replays without it, each series charged
  afresh), so it takes no place under the cap; after ``MAX_REPLAYS`` replays, such a series'
  counted occurrences keep their places;
- a rule's walk starts from DTSTART only where it must (COUNT, or a month or year period), else
  a whole number of periods later, just before the window; a rule none of whose day filters
  matches a day of the window is not walked at all (``_bounded``);
- past a ``deadline`` (``time.monotonic()``), or once ``cancel`` is set (its caller stopped
  waiting), the read fails ``parse_timeout`` at the next occurrence, so an abandoned thread stops.

The caller runs this in a thread.

Longer than 350 lines because each bound above is checked inside the one expansion walk (lazily, per
occurrence, across replays): the walk, its meter and its replay share their state.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any, Protocol, cast

import icalendar
import recurring_ical_events
from dateutil.rrule import DAILY, HOURLY, MINUTELY, SECONDLY, WEEKLY, _iterinfo, rrule
from recurring_ical_events import ComponentsWithName, Series
from recurring_ical_events.util import compare_greater, convert_to_datetime, is_pytz, is_pytz_dt, normalize_pytz

from reminders_pipeline.domain.items import (
    ADDRESS_TEXT_LENGTH,
    ASIDE_CAPS,
    MAX_ID_LENGTH,
    MAX_TITLE_LENGTH,
    FeedError,
    ParsedFeed,
    address_digest,
    checked_item,
)
from reminders_pipeline.domain.rules import ALARM_REACH_SECONDS, MAX_LEAD_SECONDS, MAX_TRAVEL_SECONDS
from reminders_pipeline.domain.zones import MAX_OFFSET_SECONDS

FALLBACK_TITLE = "Untitled event"
SERIES_SECONDS = 1.0  # CPU a series may take per read, by default (an HOURLY series from 2020 takes ~0.25 s)
MAX_PER_DAY = 1441  # occurrences a day a series may average: a minutely series passes, a secondly one not
MAX_REPLAYS = 3  # full expansions again without a series dropped after its occurrences took places
TICKS_PER_CHECK = 16  # expansion steps between two readings of the deadline and the series' CPU clock
PRESELECT_ABOVE = 2000  # events in one calendar above which out-of-window single events skip parsing
_VEVENT = re.compile(rb"^BEGIN:VEVENT\r?\n.*?^END:VEVENT\r?\n", re.S | re.M)
_RECURRING = re.compile(rb"^(RRULE|RDATE|EXRULE|RECURRENCE-ID)[;:]", re.M)
_DURATION = re.compile(rb"^DURATION[;:]", re.M)
_PERIOD_SECONDS = {SECONDLY: 1, MINUTELY: 60, HOURLY: 3600, DAILY: 86400, WEEKLY: 7 * 86400}


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


class SeriesRunaway(Exception):
    """A series over its share of the expansion: dropped, the calendar goes on."""


class ExpansionMeter:
    """The work one calendar's expansion may do, checked at every occurrence a rule yields."""

    def __init__(
        self, span_limit: int | None, series_seconds: float, deadline: float | None, cancel: threading.Event | None
    ) -> None:
        self.span_limit = span_limit  # occurrences one series may yield in one slice
        self.series_seconds = series_seconds
        self.deadline = deadline
        self.cancel = cancel
        self.spent: dict[int, float] = {}  # CPU seconds per series (by id), over every slice
        self._series = 0
        self._since = 0.0
        self._ticks = 0

    def enter(self, series: Any) -> None:
        self._series, self._since = id(series), time.thread_time()

    def leave(self) -> None:
        self.spent[self._series] = self.spent.get(self._series, 0.0) + time.thread_time() - self._since

    def tick(self) -> None:
        """Reads the clocks every ``TICKS_PER_CHECK`` ticks: a tick is a few microseconds of
        expansion, and a thread's CPU clock is a system call that would cost as much."""
        self._ticks += 1
        if self._ticks % TICKS_PER_CHECK:
            return
        if (self.cancel is not None and self.cancel.is_set()) or _late(self.deadline):
            raise FeedError("parse_timeout")
        if self.spent.get(self._series, 0.0) + time.thread_time() - self._since > self.series_seconds:
            raise SeriesRunaway()


def metered_series(meter: ExpansionMeter) -> type[Series]:
    """recurring-ical-events' ``Series`` whose rules are iterated lazily, with one ``meter.tick()``
    per start a rule yields (before the window too: a rule runs from its DTSTART) and per
    occurrence built."""

    # recurring-ical-events has no type information: its classes are Any to mypy, subclassed here.
    class RecurrenceRules(Series.RecurrenceRules):  # type: ignore[misc]
        def rrule_between(self, span_start: Any, span_stop: Any) -> Iterator[Any]:
            first, last = convert_to_datetime(span_start, self.tzinfo), convert_to_datetime(span_stop, self.tzinfo)
            if is_pytz(self.tzinfo):  # as the library does: pytz zones shift by up to an hour at changes
                first, last = normalize_pytz(first - timedelta(hours=1)), normalize_pytz(last + timedelta(hours=1))
            for rule in self.rrules:
                yield from _rule_between(rule, first, last, meter)

    class MeteredSeries(Series):  # type: ignore[misc]
        def occurrence(self, adapter: Any, start: Any = None, end: Any = None) -> Any:
            meter.tick()
            return super().occurrence(adapter, start, end)

    MeteredSeries.RecurrenceRules = RecurrenceRules
    return MeteredSeries


class _PytzZone(Protocol):
    """A pytz zone (``is_pytz_dt``): it places a wall time itself, with ``localize``."""

    def localize(self, dt: datetime) -> datetime: ...


def _rule_between(rule: Any, first: datetime, last: datetime, meter: ExpansionMeter) -> Iterator[Any]:
    """One dateutil rule's starts in [first, last], soonest first, at most ``meter.span_limit``."""
    seen, found, origin, allowed = 0, 0, None, MAX_PER_DAY
    for start in _bounded(rule, first, last):
        meter.tick()
        seen += 1
        origin = start if origin is None else origin
        if seen > allowed:  # MAX_PER_DAY for each day begun since the first start
            allowed = MAX_PER_DAY * ((start - origin).days + 1)
            if seen > allowed:
                raise SeriesRunaway()
        if start > last:
            return
        if meter.span_limit is not None and found >= meter.span_limit:
            if (start - origin).days >= 1:
                return
            continue  # still counting a day's starts: a flood is told from a full slice here
        if start < first:
            continue
        if is_pytz_dt(start):
            start = cast(_PytzZone, start.tzinfo).localize(start.replace(tzinfo=None))
        if rule.until is None or not compare_greater(start, rule.until):
            found += 1
            yield start


def _bounded(rule: Any, first: datetime, last: datetime) -> Iterator[datetime]:
    """The rule's starts, from just before ``first`` where the rule allows.

    dateutil returns control only when a start matches, even past UNTIL, so a rule that never
    matches (30 February) would run to year 9999 between two meter ticks: a rule none of whose
    day filters matches a day of the span yields nothing, without asking dateutil. A rule without
    COUNT of a fixed period starts its walk a whole number of periods after DTSTART, just before
    ``first``: the same instants, at a cost that does not grow with the series' age (COUNT is
    counted from DTSTART). The rdate set (DTSTART, RDATE) is finite and iterated as it is."""
    if not isinstance(rule, rrule):
        return iter(rule)
    if not any(_day_matches(rule, first.date() - timedelta(days=1), last.date() + timedelta(days=1))):
        return iter(())
    if rule._count is not None:
        return iter(rule)
    return iter(rule.replace(dtstart=_walk_start(rule, first)))


def _day_matches(rule: rrule, first_day: date, last_day: date) -> Iterator[bool]:
    """Per day of [first_day, last_day], whether it passes the rule's day filters (BYMONTH,
    BYWEEKNO, BYDAY, BYMONTHDAY, BYYEARDAY, BYEASTER), read from dateutil's own masks."""
    info, month = _iterinfo(rule), None
    day = first_day
    while day <= last_day:
        if (day.year, day.month) != month:
            month = (day.year, day.month)
            info.rebuild(*month)
        yield _passes(rule, info, day.toordinal() - info.yearordinal)
        day += timedelta(days=1)


def _passes(rule: rrule, info: Any, i: int) -> bool:
    """dateutil's day filter (``rrule._iter``) for day ``i`` of the year ``info`` was built for."""
    return not (
        (rule._bymonth and info.mmask[i] not in rule._bymonth)
        or (rule._byweekno and not info.wnomask[i])
        or (rule._byweekday and info.wdaymask[i] not in rule._byweekday)
        or (info.nwdaymask and not info.nwdaymask[i])
        or (rule._byeaster and not info.eastermask[i])
        or (
            (rule._bymonthday or rule._bynmonthday)
            and info.mdaymask[i] not in rule._bymonthday
            and info.nmdaymask[i] not in rule._bynmonthday
        )
        or (rule._byyearday and i + 1 not in rule._byyearday and -info.yearlen + i not in rule._byyearday)
    )


def _walk_start(rule: rrule, first: datetime) -> datetime:
    """DTSTART advanced by whole periods (INTERVAL x FREQ, in the rule's wall time) to a period
    and a day before ``first``, so that a first week cut short by the new start (``BYSETPOS``
    counts within it) ends before ``first``; DTSTART itself for periods of no fixed length."""
    dtstart: datetime = rule._dtstart
    seconds = _PERIOD_SECONDS.get(rule._freq)
    if seconds is None:
        return dtstart
    period = seconds * rule._interval
    wall = dtstart.replace(tzinfo=None)
    first_wall = (first.astimezone(dtstart.tzinfo) if dtstart.tzinfo is not None else first).replace(tzinfo=None)
    periods = (int((first_wall - wall).total_seconds()) - period - 86400) // period
    if periods <= 0:
        return dtstart
    return (wall + timedelta(seconds=periods * period)).replace(tzinfo=dtstart.tzinfo)


def parse_ics_feed(
    body: bytes,
    window_start: int,
    window_end: int,
    *,
    max_items: int | None = None,
    deadline: float | None = None,
    series_seconds: float = SERIES_SECONDS,
    cancel: threading.Event | None = None,
) -> ParsedFeed:
    """Occurrences overlapping [window_start, window_end] (Unix seconds, widened by 14 h each side
    for floating times); cancelled ones excluded; bounded as the module docstring says."""
    body = preselect(body, window_start, window_end + ALARM_REACH_SECONDS)
    _check(deadline)
    try:
        calendar = icalendar.Calendar.from_ical(body)
    except Exception:  # icalendar raises ValueError and friends on garbage; their text quotes the body
        raise FeedError("not_icalendar") from None
    _check(deadline)
    lo = datetime.fromtimestamp(window_start - MAX_OFFSET_SECONDS, UTC)
    hi = window_end + MAX_OFFSET_SECONDS
    synthesize_uids(calendar)
    durations = _durations(calendar)
    reaches = alarm_reaches(calendar)
    meter = ExpansionMeter(max_items, series_seconds, deadline, cancel)
    try:
        query = recurring_ical_events.of(
            calendar, skip_bad_series=True, components=[ComponentsWithName("VEVENT", series=metered_series(meter))]
        )
    except Exception:
        raise FeedError("bad_recurrence") from None
    dropped: list[tuple[Any, str]] = []
    while True:
        feed = ParsedFeed()
        meter.spent.clear()  # a replay charges each series afresh: the one dropped is not its fault
        replay = len(dropped) < MAX_REPLAYS
        try:
            _fill(
                feed,
                _occurrences(query, lo, hi, reaches, meter, feed, dropped, replay),
                durations,
                window_start,
                max_items,
                deadline,
            )
        except _Replay as again:  # a series dropped after some of its occurrences took places under the cap
            dropped.append((again.series, again.reason))
            continue
        feed.cap_until = _cap_until(feed, window_start)
        return feed


def _fill(
    feed: ParsedFeed,
    occurrences: Iterator[Any],
    durations: Any,
    window_start: int,
    max_items: int | None,
    deadline: float | None,
) -> None:
    """Build the occurrences into ``feed`` up to the cap, then note (not build) the ones cut."""
    cut = 0
    for occurrence in occurrences:
        if max_items is not None and len(feed.items) >= max_items:  # the cap is full: note the id, build nothing more
            if cut >= max_items * ASIDE_CAPS or _late(deadline):
                feed.cut_from = _occurrence_start(occurrence) - MAX_OFFSET_SECONDS  # unseen from here
                break
            cut += _note_cut(feed, occurrence, durations)
            continue
        try:
            raw = _raw_item(_OccurrenceEvent(occurrence), durations)
        except (AttributeError, TypeError, ValueError, KeyError, OverflowError):  # a property repeated or mis-typed
            raw = "malformed_event"
        if isinstance(raw, dict) and not raw["floating"] and raw["expiresAt"] <= window_start:
            continue  # over before the window in every zone: the 14 h widening is for floating times only
        _add(feed, raw)


def _cap_until(feed: ParsedFeed, window_start: int) -> int | None:
    """When the cap cut something: the first instant a kept item stops counting under it (a timed
    one when it is over, a floating one 14 h after its wall-time end, as the expansion counts it).
    From then a cut occurrence may belong among the soonest, so the feed must be expanded again
    rather than reused on 304."""
    if not feed.cut_ids and feed.cut_from is None:
        return None
    ends = [i.expires_at + (MAX_OFFSET_SECONDS if i.floating else 0) for i in feed.items]
    return max(min(ends, default=window_start), window_start)


class _Replay(Exception):
    """A series was dropped after its occurrences were counted under the cap: expand again without it."""

    def __init__(self, series: Any, reason: str) -> None:
        super().__init__(reason)
        self.series, self.reason = series, reason


def _note_cut(feed: ParsedFeed, occurrence: Any, durations: dict[tuple[str, str], timedelta]) -> int:
    """Set aside an occurrence the cap cut (1), or nothing for a cancelled one (0). It is built as
    a kept one is (at most ``ASIDE_CAPS`` caps of them), so a row queued for
    it before is brought in line when it moves, though no new row is queued for it."""
    view = _OccurrenceEvent(occurrence)
    try:
        raw = _raw_item(view, durations)
    except (AttributeError, TypeError, ValueError, KeyError, OverflowError):  # as ``_fill`` rejects it
        raw = "malformed_event"
    if raw == "cancelled":
        return 0
    if isinstance(raw, str):
        event = view.source
        rid = event.get("RECURRENCE-ID")
        feed.set_aside(None, _occurrence_id(str(event.get("UID")), rid.dt if rid is not None else occurrence.start))
        return 1
    checked = checked_item(raw, _marks(raw))
    feed.set_aside(checked if not isinstance(checked, str) else None, raw["id"])
    return 1


def _occurrences(
    query: Any,
    lo: datetime,
    hi: int,
    reaches: dict[str, int],
    meter: ExpansionMeter,
    feed: ParsedFeed,
    dropped: list[tuple[Any, str]],
    replay: bool,
) -> Iterator[Any]:
    """Occurrences soonest first, in slices that double from one day: a flood (``FREQ=MINUTELY``)
    is cut after a slice or two instead of being expanded over the whole window first. Each series
    is expanded on its own, so one that runs away or overflows is dropped and counted alone; the
    series in ``dropped`` (with their reasons) are left out from the start, and one dropped after
    it yielded raises ``_Replay`` where ``replay`` allows, so none of its occurrences holds a place
    under the cap (after ``MAX_REPLAYS`` such series, the yielded ones keep theirs). A series with
    alarms runs on past ``hi`` by their reach (``reaches``).
    (recurring-ical-events' own ``after`` re-expands each series from its start and is far slower.)
    An occurrence is yielded in the slice where it starts; the first slice also yields those
    already under way. Occurrences are yielded as the library's ``Occurrence``, read as items only
    where the cap keeps or sets them aside."""
    start, size = int(lo.timestamp()), 86400
    first = True
    for series, dropped_reason in dropped:
        feed.rejected[dropped_reason] += 1
        feed.partial_series |= _series_keys(str(series.uid))
    live = [s for s in query.series if all(s is not d for d, _ in dropped)]
    last = {id(s): hi + reaches.get(str(s.uid), 0) for s in live}
    yielded: set[int] = set()
    while live:
        batch = []
        for series in list(live):
            if start > last[id(series)]:
                live.remove(series)
                continue
            end = min(start + size, last[id(series)] + 1)
            found, reason = _expand(series, start, end, meter)
            if reason is not None:
                if replay and id(series) in yielded:
                    raise _Replay(series, reason)
                live.remove(series)
                feed.rejected[reason] += 1
                feed.partial_series |= _series_keys(str(series.uid))
            batch += [(o, id(series), end) for o in found]
        batch.sort(key=lambda entry: _occurrence_start(entry[0]))
        for occurrence, series_id, end in batch:
            if (first or _occurrence_start(occurrence) >= start) and _occurrence_start(occurrence) < end:
                yielded.add(series_id)
                yield occurrence  # each occurrence once, whichever slices overlap it
        start, size, first = start + size, size * 2, False


def _expand(series: Any, start: int, end: int, meter: ExpansionMeter) -> tuple[list[Any], str | None]:
    """One series' occurrences in one slice, or why the series is dropped from the calendar."""
    meter.enter(series)
    try:
        return list(series.between(datetime.fromtimestamp(start, UTC), datetime.fromtimestamp(end, UTC))), None
    except FeedError:
        raise
    except SeriesRunaway:
        return [], "runaway_series"
    except Exception:  # the library's own errors, or an OverflowError from a year-9999 date
        return [], "bad_recurrence"
    finally:
        meter.leave()


def _occurrence_start(occurrence: Any) -> int:
    try:
        return _unix(occurrence.start)[0]
    except (OverflowError, ValueError, OSError):
        return 0


def preselect(body: bytes, window_start: int, window_end: int) -> bytes:
    """A calendar with more than ``PRESELECT_ABOVE`` events loses, before parsing, the single
    (non-recurring) events that surely lie outside the window: parsing costs a fraction of a
    millisecond per event, so years of exported history would otherwise take seconds. "Surely":
    a local time read as UTC is within 14 h of its instant, and an event whose start or end cannot
    be read from its raw text is kept. Nothing in the window is dropped, so nothing is counted."""
    if body.count(b"BEGIN:VEVENT") <= PRESELECT_ABOVE:
        return body
    text = re.sub(rb"\r?\n[ \t]", b"", body)  # unfold (RFC 5545 3.1); icalendar does the same
    lo, hi = window_start - 2 * MAX_OFFSET_SECONDS, window_end + 2 * MAX_OFFSET_SECONDS
    kept, last = [], 0
    for block in _VEVENT.finditer(text):
        if _surely_outside(block.group(), lo, hi):
            kept.append(text[last : block.start()])
            last = block.end()
    kept.append(text[last:])
    return b"".join(kept)


def _surely_outside(block: bytes, lo: int, hi: int) -> bool:
    if _RECURRING.search(block):
        return False
    start = _raw_time(block, b"DTSTART")
    if start is None:
        return False
    if start > hi:
        return True
    if _DURATION.search(block):
        return False
    end = _raw_time(block, b"DTEND")
    return (end if end is not None else start + 86400) < lo


def _raw_time(block: bytes, name: bytes) -> int | None:
    """A DATE or DATE-TIME property's value as UTC seconds (local times read as UTC), or None."""
    match = re.search(rb"^" + name + rb"(?:;[^:\r\n]*)?:(\d{8})(?:T(\d{6})Z?)?\r?$", block, re.M)
    if not match:
        return None
    try:
        day, clock = match.group(1).decode(), (match.group(2) or b"000000").decode()
        return int(datetime.strptime(day + clock, "%Y%m%d%H%M%S").replace(tzinfo=UTC).timestamp())
    except ValueError:
        return None


def _add(feed: ParsedFeed, raw: dict[str, Any] | str) -> None:
    if isinstance(raw, str):
        if raw != "cancelled":
            feed.rejected[raw] += 1
        return
    feed.add(raw, _marks(raw))


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _check(deadline: float | None) -> None:
    if _late(deadline):
        raise FeedError("parse_timeout")
