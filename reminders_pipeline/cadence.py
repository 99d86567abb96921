"""The longest gap between two firings of a cron schedule.

The two invariants the seed names are relationships between cadences and limits, so the check
derives each cadence from the very cron string the schedule runs on: retuning one cron without the
other side fails ``reminders check`` instead of quietly reopening the gap.
"""

from __future__ import annotations


class CronError(ValueError):
    pass


def _expand(field: str, low: int, high: int) -> list[int]:
    values: set[int] = set()
    for part in field.split(","):
        base, _, step_text = part.partition("/")
        step = int(step_text) if step_text else 1
        if step <= 0:
            raise CronError(f"bad step in {field!r}")
        if base == "*":
            start, end = low, high
        elif "-" in base:
            a, b = base.split("-", 1)
            start, end = int(a), int(b)
        else:
            start = int(base)
            end = high if step_text else start
        if not (low <= start <= end <= high):
            raise CronError(f"{field!r} is outside {low}-{high}")
        values.update(range(start, end + 1, step))
    return sorted(values)


def cron_cadence_seconds(cron: str) -> int:
    """Longest interval, in seconds, between consecutive firings of a daily-repeating cron.

    Only minute and hour fields may vary; day, month and weekday must be ``*`` because a reminder
    cadence that skips days is not a cadence.
    """
    fields = cron.split()
    if len(fields) != 5:
        raise CronError(f"cron {cron!r} must have 5 fields")
    if fields[2:] != ["*", "*", "*"]:
        raise CronError(f"cron {cron!r}: day, month and weekday fields must be '*'")
    try:
        minutes = _expand(fields[0], 0, 59)
        hours = _expand(fields[1], 0, 23)
    except ValueError as exc:
        raise CronError(f"cron {cron!r}: {exc}") from None
    firings = sorted(h * 3600 + m * 60 for h in hours for m in minutes)
    gaps = [b - a for a, b in zip(firings, firings[1:])]
    gaps.append(firings[0] + 86400 - firings[-1])
    return max(gaps)
