"""Expanding a recurring series within bounds: the meter each series is charged on, and the rule walk.

A series that recurs more than ``MAX_PER_DAY`` a day, or spends more than its CPU allowance, raises
``SeriesRunaway``; a rule's walk starts just before the window where it may (``_walk_start``), and
a rule none of whose day filters matches a day of the window is not walked at all (``_bounded``).
The expansion itself (``ics.parse_ics_feed``) charges every occurrence here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import date, datetime, timedelta
from typing import Any, Protocol, cast

from dateutil.rrule import DAILY, HOURLY, MINUTELY, SECONDLY, WEEKLY, _iterinfo, rrule
from recurring_ical_events import Series
from recurring_ical_events.util import compare_greater, convert_to_datetime, is_pytz, is_pytz_dt, normalize_pytz

from reminders_pipeline.domain.items import (
    FeedError,
)

MAX_PER_DAY = 1441  # occurrences a day a series may average: a minutely series passes, a secondly one not


TICKS_PER_CHECK = 16  # expansion steps between two readings of the deadline and the series' CPU clock


_PERIOD_SECONDS = {SECONDLY: 1, MINUTELY: 60, HOURLY: 3600, DAILY: 86400, WEEKLY: 7 * 86400}


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


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _check(deadline: float | None) -> None:
    if _late(deadline):
        raise FeedError("parse_timeout")
