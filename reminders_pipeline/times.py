"""The only place stored times are made.

Every stored time is ISO-8601 UTC text exactly like JavaScript's ``Date.toISOString()``:
``2026-09-10T08:30:00.000Z``. Fixed width and zero padded, so text order is chronological order
and SQL compares times as plain strings. The ``T`` is load-bearing: SQLite's ``datetime()`` emits a
space, which sorts below ``T`` and would silently break the due predicate. Never compute a stored
time in SQL; write it through these helpers.
"""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime
from functools import lru_cache

ISO_PATTERN = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")

# Years outside 1970..9999 cannot be written fixed-width (or are not plausible event times).
MIN_UNIX = 0
MAX_UNIX = 253402300799  # 9999-12-31T23:59:59Z
# A pretend clock (``--now``, the HTTP ``now``) must leave the core room to shift it by leads,
# horizons and cut-offs without leaving the storable range: 2000-01-01 to 3000-01-01.
MIN_NOW_UNIX = 946684800
MAX_NOW_UNIX = 32503680000


def iso_from_unix(seconds: float) -> str:
    """Unix seconds (wire format) -> stored ISO text, millisecond precision."""
    if type(seconds) is int:
        return _iso_from_whole_seconds(seconds)
    return _iso_from_millis(round(seconds * 1000))


@lru_cache(maxsize=1 << 16)
def _iso_from_whole_seconds(seconds: int) -> str:
    """Cached: a build formats the same item times once per subscriber of a shared source."""
    return _iso_from_millis(seconds * 1000)


def _iso_from_millis(millis: int) -> str:
    if not MIN_UNIX * 1000 <= millis <= MAX_UNIX * 1000 + 999:
        raise ValueError(f"unix time {millis / 1000!r} is outside 1970..9999")
    whole, ms = divmod(millis, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{ms:03d}Z"


@lru_cache(maxsize=1 << 16)
def unix_from_iso(text: str) -> float:
    """Stored ISO text -> Unix seconds. Used only at the point of arithmetic (lateness guards).

    Cached: the drain's policy reads the same ``now`` and the same event times for every row.
    """
    if not ISO_PATTERN.match(text):
        raise ValueError(f"not a stored time (YYYY-MM-DDTHH:MM:SS.mmmZ): {text!r}")
    # Field slicing instead of strptime: the drain converts several times per row.
    dt = datetime(
        int(text[0:4]),
        int(text[5:7]),
        int(text[8:10]),
        int(text[11:13]),
        int(text[14:16]),
        int(text[17:19]),
        tzinfo=UTC,
    )
    return dt.timestamp() + int(text[20:23]) / 1000


def iso_floor(seconds: float) -> str:
    """Unix seconds -> stored text, rounded *down* to the millisecond: a clock that must never run
    ahead of itself (the dispatcher's claim is due when ``send_after <= now``)."""
    return iso_from_unix(math.floor(seconds * 1000) / 1000)


def seconds_between(earlier: str, later: str) -> float:
    """``later - earlier`` in seconds, exact to the stored millisecond, for times read in bulk
    (/metrics' lateness of thousands of rows): the C ISO parser, without ``unix_from_iso``'s
    validation and cache, which a column of distinct times would only miss (about 15x slower)."""
    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()


def now_utc() -> str:
    """The current time as stored text."""
    return iso_from_unix(time.time())


def shift(text: str, seconds: float) -> str:
    """A stored time moved by ``seconds`` (negative for earlier)."""
    return iso_from_unix(unix_from_iso(text) + seconds)


def parse_when(value: str) -> str:
    """A user-supplied instant (ISO-8601 with an offset or ``Z``, or Unix seconds) -> stored text.

    Naive ISO times are refused: an instant without a zone is ambiguous.
    """
    value = value.strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", value):
        return iso_from_unix(float(value))
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"not an ISO-8601 time or Unix seconds: {value!r}") from None
    if dt.tzinfo is None:
        raise ValueError(f"time {value!r} has no UTC offset; add Z or +HH:MM")
    return iso_from_unix(dt.timestamp())


def is_stored_time(text: object) -> bool:
    return isinstance(text, str) and bool(ISO_PATTERN.match(text))
