"""Time in the core is an ``Instant``; stored time is ISO-8601 UTC text, made only here.

Every stored time is text exactly like JavaScript's ``Date.toISOString()``:
``2026-09-10T08:30:00.000Z``. Fixed width and zero padded, so text order is chronological order
and SQL compares times as plain strings. The ``T`` is load-bearing: SQLite's ``datetime()`` emits a
space, which sorts below ``T`` and would silently break the due predicate. Never compute a stored
time in SQL; write it through ``Instant.stored``.

The core (build, plan, policy, drain, dispatch, checks) passes ``Instant`` values and nothing else
for "when". They become stored text at the storage boundary (the ledger's ``IsoTime`` columns,
``schema.py``) and Unix seconds at the wire (feeds, the widget, APNs), nowhere in between.
Durations stay plain seconds: ``instant + 60``, ``later - earlier`` (a float).
"""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, overload

ISO_PATTERN = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")

# Years outside 1970..9999 cannot be written fixed-width (or are not plausible event times).
MIN_UNIX = 0
MAX_UNIX = 253402300799  # 9999-12-31T23:59:59Z
_MAX_MS = MAX_UNIX * 1000 + 999
# A pretend clock (``--now``, the HTTP ``now``) must leave the core room to shift it by leads,
# horizons and cut-offs without leaving the storable range: 2000-01-01 to 3000-01-01.
MIN_NOW_UNIX = 946684800
MAX_NOW_UNIX = 32503680000


class Instant:
    """A moment, to the millisecond (the stored precision): the core's one type for "when".

    Immutable and ordered. ``+``/``-`` take seconds; the difference of two instants is seconds.
    Built from the wire (``from_unix``), from storage (``from_stored``), from a person
    (``parse``) or from the clock (``now``, rounded down: a clock that never runs ahead).
    """

    __slots__ = ("ms",)
    ms: int  # milliseconds since 1970-01-01T00:00:00Z

    def __init__(self, ms: int) -> None:
        if not 0 <= ms <= _MAX_MS:
            raise ValueError(f"unix time {ms / 1000!r} is outside 1970..9999")
        object.__setattr__(self, "ms", ms)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Instant is immutable")

    @classmethod
    def from_unix(cls, seconds: float) -> Instant:
        """Unix seconds (the wire) -> the instant, to the nearest millisecond."""
        return cls(seconds * 1000 if type(seconds) is int else round(seconds * 1000))

    @classmethod
    def floor(cls, seconds: float) -> Instant:
        """Unix seconds -> the instant, rounded down to the millisecond: never later than ``seconds``."""
        return cls(math.floor(seconds * 1000))

    @classmethod
    def now(cls) -> Instant:
        """The current time, rounded down: a row due at it is due by the real clock too."""
        return cls(time.time_ns() // 1_000_000)

    @staticmethod
    def from_stored(text: str) -> Instant:
        """Stored ISO text -> the instant; ``ValueError`` for any other shape."""
        return _from_stored(text)

    @classmethod
    def parse(cls, value: str) -> Instant:
        """A person's instant: ISO-8601 with an offset or ``Z``, or Unix seconds. A naive ISO time
        is refused: an instant without a zone is ambiguous."""
        value = value.strip()
        if re.fullmatch(r"-?\d+(\.\d+)?", value):
            return cls.from_unix(float(value))
        try:
            dt = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise ValueError(f"not an ISO-8601 time or Unix seconds: {value!r}") from None
        if dt.tzinfo is None:
            raise ValueError(f"time {value!r} has no UTC offset; add Z or +HH:MM")
        return cls.from_unix(dt.timestamp())

    @property
    def stored(self) -> str:
        """The stored text (``2026-09-10T08:30:00.000Z``): what the ledger writes and people read."""
        return _stored_text(self.ms)

    @property
    def unix(self) -> float:
        """Unix seconds, with the milliseconds: for the wire and for zone arithmetic."""
        return self.ms / 1000

    @property
    def whole_seconds(self) -> int:
        """Unix seconds rounded down: the wire's whole-second fields (APNs expiration, feed windows)."""
        return self.ms // 1000

    def __add__(self, seconds: float) -> Instant:
        return Instant(self.ms + (seconds * 1000 if type(seconds) is int else round(seconds * 1000)))

    @overload
    def __sub__(self, other: Instant) -> float: ...
    @overload
    def __sub__(self, other: float) -> Instant: ...
    def __sub__(self, other: Instant | float) -> float | Instant:
        if isinstance(other, Instant):
            return (self.ms - other.ms) / 1000
        return self + -other

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Instant) and self.ms == other.ms

    def __hash__(self) -> int:
        return hash(self.ms)

    def __lt__(self, other: Instant) -> bool:
        return self.ms < other.ms

    def __le__(self, other: Instant) -> bool:
        return self.ms <= other.ms

    def __gt__(self, other: Instant) -> bool:
        return self.ms > other.ms

    def __ge__(self, other: Instant) -> bool:
        return self.ms >= other.ms

    def __repr__(self) -> str:
        return f"Instant({self.stored!r})"

    def __str__(self) -> str:
        return self.stored

    def __reduce__(self) -> tuple[Any, ...]:
        return (Instant, (self.ms,))


@lru_cache(maxsize=1 << 16)
def _stored_text(ms: int) -> str:
    """Cached: a build writes the same item times once per subscriber of a shared source."""
    whole, frac = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{frac:03d}Z"


@lru_cache(maxsize=1 << 16)
def _from_stored(text: str) -> Instant:
    """Cached: the claim reads the same event times for every subscriber's row."""
    if not isinstance(text, str) or not ISO_PATTERN.match(text):
        raise ValueError(f"not a stored time (YYYY-MM-DDTHH:MM:SS.mmmZ): {text!r}")
    dt = datetime(
        int(text[0:4]),
        int(text[5:7]),
        int(text[8:10]),
        int(text[11:13]),
        int(text[14:16]),
        int(text[17:19]),
        tzinfo=UTC,
    )
    return Instant(int(dt.timestamp()) * 1000 + int(text[20:23]))


def stored_or_none(instant: Instant | None) -> str | None:
    """The stored text of an optional instant: how the shells show one."""
    return None if instant is None else instant.stored


def as_json(value: object) -> str:
    """``json.dumps(..., default=as_json)``: an instant in JSON is its stored text, anything else unknown."""
    if isinstance(value, Instant):
        return value.stored
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
