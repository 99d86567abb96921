"""Daily cron schedules as the minutes of the day they fire: the longest gap, and a delayed copy.

The two invariants the design names are relationships between cadences and limits, so the check
derives each cadence from the very cron string the schedule runs on: retuning one cron without the
other side fails ``reminders check`` instead of quietly reopening the gap. The check schedule is
derived the same way (``crons_after``), so it keeps following ``REMINDERS_DRAIN_CRON``.

Parsing and stepping are cronsim's; this module only adds the rule that a cadence repeats daily.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from functools import lru_cache

from cronsim import CronSim, CronSimError

DAY_MINUTES = 24 * 60
_DAY = datetime(2026, 1, 1, tzinfo=UTC)  # any UTC day will do: only minutes and hours vary


class CronError(ValueError):
    pass


@lru_cache(maxsize=32)
def firing_minutes(cron: str) -> tuple[int, ...]:
    """Minutes of the (UTC) day at which a daily-repeating cron fires, ascending.

    Only minute and hour fields may vary; day, month and weekday must be ``*`` because a reminder
    cadence that skips days is not a cadence.
    """
    fields = cron.split()
    if len(fields) != 5:
        raise CronError(f"cron {cron!r} must have 5 fields")
    if fields[2:] != ["*", "*", "*"]:
        raise CronError(f"cron {cron!r}: day, month and weekday fields must be '*'")
    try:
        ticks = CronSim(cron, _DAY - timedelta(minutes=1))  # CronSim yields times after its start
    except CronSimError as exc:
        raise CronError(f"cron {cron!r}: {exc}") from None
    minutes = []
    for tick in ticks:
        if tick.date() != _DAY.date():
            break
        minutes.append(tick.hour * 60 + tick.minute)
    return tuple(minutes)


def cron_cadence_seconds(cron: str) -> int:
    """Longest interval, in seconds, between consecutive firings of a daily-repeating cron."""
    firings = firing_minutes(cron)
    gaps = [b - a for a, b in zip(firings, firings[1:])]
    gaps.append(firings[0] + DAY_MINUTES - firings[-1])
    return max(gaps) * 60


def crons_after(cron: str, delay_minutes: int) -> tuple[str, ...]:
    """Cron strings that together fire ``delay_minutes`` after each firing of ``cron``.

    One string when every delayed minute falls in the same hours (any cron whose hour field is
    ``*``); otherwise one per set of hours, which a Dagster schedule accepts as a list.
    """
    hours_by_minute: dict[int, set[int]] = defaultdict(set)
    for minute_of_day in firing_minutes(cron):
        hour, minute = divmod((minute_of_day + delay_minutes) % DAY_MINUTES, 60)
        hours_by_minute[minute].add(hour)
    minutes_by_hours: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for minute in sorted(hours_by_minute):
        minutes_by_hours[tuple(sorted(hours_by_minute[minute]))].append(minute)
    return tuple(f"{_field(m, 60)} {_field(h, 24)} * * *" for h, m in sorted(minutes_by_hours.items()))


def _field(values: list[int] | tuple[int, ...], size: int) -> str:
    return "*" if len(values) == size else ",".join(map(str, values))
