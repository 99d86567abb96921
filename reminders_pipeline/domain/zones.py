"""A device's ``Zone``: its IANA zone when known, else its last seen UTC offset, else UTC.

Floating iCalendar times and all-day dates carry no zone: they are wall-clock times, kept as
"wall seconds" (the wall time read as if it were UTC) until a device's zone fixes them. Resolution
follows RFC 5545: a wall time in a spring-forward gap uses the offset before the gap (02:30
becomes 03:30), an ambiguous one the first occurrence; that is ``zoneinfo`` with ``fold=0``.
Quiet hours are different: a window of the clock, not a time to resolve once, so their end is the
first instant after a send at which the clock reads it (in a fold, the pass the send is in).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from reminders_pipeline.domain.times import Instant

MAX_OFFSET_SECONDS = 14 * 3600  # the largest UTC offset in use (Pacific/Kiritimati, +14:00)
# The widest UTC offset a widget may report (+-18:00, what any platform represents); wider than
# any zone in use, so an old widget's offset is stored as it comes.
MAX_TZ_OFFSET_SECONDS = 18 * 3600
MAX_ZONE_NAME = 64
# Public because the HTTP contract states them (anchored) in /openapi.json.
ZONE_NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_+\-]*(/[A-Za-z0-9_+\-]+){0,2}")
# Blank (or only whitespace) means no quiet hours.
QUIET_HOURS_PATTERN = re.compile(r"\s*(?:(\d{2}):(\d{2})-(\d{2}):(\d{2}))?\s*")


class ZoneError(ValueError):
    """Not a zone the zone database knows, or not a quiet-hours window."""


@lru_cache(maxsize=1024)
def zone_info(name: str) -> ZoneInfo:
    """The zone called ``name`` (``Europe/Berlin``); ``ZoneError`` for anything else."""
    if not isinstance(name, str) or len(name) > MAX_ZONE_NAME or not ZONE_NAME_PATTERN.fullmatch(name):
        raise ZoneError(f"not an IANA time zone name: {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ZoneError(f"unknown time zone {name!r}") from None


def valid_zone_name(name: str) -> str:
    zone_info(name)
    return name


@dataclass(frozen=True)
class Zone:
    """How one device reads a clock: an IANA zone (``ZoneInfo``, DST exact), or a fixed UTC offset
    (an old widget's), or UTC when neither is known. Stored as ``devices.tz_name`` and
    ``devices.last_tz_offset_seconds``; the name wins when both are set."""

    tz_name: str | None = None
    offset_seconds: int | None = None

    @staticmethod
    def of(tz_name: str | None, offset_seconds: int | None) -> Zone:
        """The zone of a stored name and offset. A name the zone database no longer knows (an
        upgrade renamed it) falls back to the offset, which still reads right most of the year,
        rather than failing a build, a send or the clock text of an alert."""
        try:
            return Zone(tz_name and valid_zone_name(tz_name), offset_seconds)
        except ZoneError:
            return Zone(None, offset_seconds)

    def to_unix(self, wall: int) -> int:
        """Wall seconds -> Unix seconds of the instant, DST exact in a zone (a feed's wire times)."""
        if self.tz_name:
            return _wall_to_unix(wall, self.tz_name)
        return wall - (self.offset_seconds or 0)

    def to_wall(self, when: Instant | float) -> float:
        """An instant (or its Unix seconds) -> wall seconds on this zone's clock."""
        unix = when.unix if isinstance(when, Instant) else when
        if self.tz_name:
            local = datetime.fromtimestamp(unix, zone_info(self.tz_name))
            return unix + local.utcoffset().total_seconds()  # type: ignore[union-attr]
        return unix + (self.offset_seconds or 0)

    def first_reading(self, wall: int, after: Instant) -> Instant:
        """``_first_reading`` as an instant."""
        return Instant.from_unix(self._first_reading(wall, after.unix))

    def _first_reading(self, wall: int, after: float) -> int:
        """The first instant after ``after`` at which this clock reads ``wall`` or later, given that it
        reads earlier than ``wall`` at ``after``.

        In a fold the clock reads ``wall`` twice: this is the reading in the pass ``after`` is in (or
        the next one), never the first pass's when ``after`` is already in the second. In a
        spring-forward gap the clock never reads ``wall``: this is the instant it jumps past it.
        """
        if not self.tz_name:
            return wall - (self.offset_seconds or 0)
        naive = wall_datetime(wall)
        both = sorted(int(naive.replace(tzinfo=zone_info(self.tz_name), fold=f).timestamp()) for f in (0, 1))
        exact = [t for t in both if t > after and self.to_wall(t) == wall]
        if exact:
            return exact[0]
        # A gap: the clock reads before ``wall`` at ``lo`` and past it at ``hi``; find the jump.
        lo, hi = int(after), max(both[-1], int(after) + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.to_wall(mid) >= wall:
                hi = mid
            else:
                lo = mid
        return hi

    def clock(self, when: Instant) -> str:
        """``HH:MM`` on this zone's clock, or UTC marked as such when nothing local is known."""
        if not self.tz_name and self.offset_seconds is None:
            return f"{_hh_mm(when.whole_seconds)} UTC"
        return _hh_mm(self.to_wall(when))


def _hh_mm(wall: float) -> str:
    """``HH:MM`` of seconds on a clock: its time of day, whatever the date."""
    minutes = math.floor(wall) % 86_400 // 60
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


@lru_cache(maxsize=1 << 16)
def _wall_to_unix(wall: int, tz_name: str) -> int:
    """Cached: a build resolves the same floating times for every device in one zone."""
    return int(wall_datetime(wall).replace(tzinfo=zone_info(tz_name)).timestamp())


def wall_datetime(wall: float) -> datetime:
    """Wall-clock seconds (a local time read as UTC) as the naive datetime a clock shows."""
    return datetime(1970, 1, 1) + timedelta(seconds=int(wall))


def zone_of(device: object) -> Zone:
    """The ``Zone`` of a device record or a row joined with its device (``tz_name``, ``last_tz_offset_seconds``)."""
    if isinstance(device, Mapping):
        return Zone.of(device.get("tz_name"), device.get("last_tz_offset_seconds"))
    return Zone.of(getattr(device, "tz_name", None), getattr(device, "last_tz_offset_seconds", None))


@dataclass(frozen=True)
class QuietHours:
    """A daily window of local time, ``start`` inclusive, ``end`` exclusive; may wrap midnight."""

    start_minutes: int
    end_minutes: int

    @property
    def text(self) -> str:
        return "{:02d}:{:02d}-{:02d}:{:02d}".format(*divmod(self.start_minutes, 60), *divmod(self.end_minutes, 60))

    def _minutes(self, wall: float) -> float:
        return (wall % 86400) / 60

    def contains(self, when: Instant, zone: Zone) -> bool:
        m = self._minutes(zone.to_wall(when))
        if self.start_minutes <= self.end_minutes:
            return self.start_minutes <= m < self.end_minutes
        return m >= self.start_minutes or m < self.end_minutes

    def end_after(self, when: Instant, zone: Zone) -> Instant:
        """When the window containing ``when`` is over: the first instant after it at which the
        zone's clock reads the end time (``Zone.first_reading``: the right pass of a fold, the jump
        of a gap). Never before ``when`` (to the second): a hold only ever moves a send later."""
        wall = zone.to_wall(when)
        end = int(wall // 86400) * 86400 + self.end_minutes * 60
        if end <= wall:
            end += 86400
        return max(Instant.from_unix(when.whole_seconds), zone.first_reading(end, when))


def parse_quiet_hours(text: str | None) -> QuietHours | None:
    """``22:00-07:00`` -> ``QuietHours``; None or empty -> no quiet hours. ``ZoneError`` if malformed."""
    if text is None:
        return None
    match = QUIET_HOURS_PATTERN.fullmatch(text) if isinstance(text, str) else None
    if not match:
        raise ZoneError(f"quiet hours must look like 22:00-07:00, got {text!r}")
    if match.group(1) is None:
        return None
    h1, m1, h2, m2 = map(int, match.groups())
    if h1 > 23 or h2 > 23 or m1 > 59 or m2 > 59 or (h1, m1) == (h2, m2):
        raise ZoneError(f"quiet hours {text!r}: two different times of day, 00:00 to 23:59")
    return QuietHours(h1 * 60 + m1, h2 * 60 + m2)
