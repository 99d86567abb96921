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

The caller runs this in a thread. An event becomes an item in ``ics_items``; a series is metered
and its rules walked in ``ics_expansion``; a large calendar's far events are set aside before
parsing in ``ics_prefilter``. This module is the walk itself: the window, the cap and the replays.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import icalendar
import recurring_ical_events
from recurring_ical_events import ComponentsWithName

from reminders_pipeline.domain.items import (
    ASIDE_CAPS,
    FeedError,
    ParsedFeed,
    checked_item,
)
from reminders_pipeline.domain.rules import ALARM_REACH_SECONDS
from reminders_pipeline.domain.zones import MAX_OFFSET_SECONDS
from reminders_pipeline.sources.ics_expansion import ExpansionMeter, SeriesRunaway, _check, _late, metered_series
from reminders_pipeline.sources.ics_items import (
    _durations,
    _marks,
    _occurrence_id,
    _OccurrenceEvent,
    _raw_item,
    _series_keys,
    _unix,
    alarm_reaches,
    synthesize_uids,
)
from reminders_pipeline.sources.ics_prefilter import preselect

SERIES_SECONDS = 1.0  # CPU a series may take per read, by default (an HOURLY series from 2020 takes ~0.25 s)
MAX_REPLAYS = 3  # full expansions again without a series dropped after its occurrences took places


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


def _add(feed: ParsedFeed, raw: dict[str, Any] | str) -> None:
    if isinstance(raw, str):
        if raw != "cancelled":
            feed.rejected[raw] += 1
        return
    feed.add(raw, _marks(raw))
