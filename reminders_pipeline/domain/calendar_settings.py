"""A device's settings for one calendar it subscribes to (``device_sources``): its own rules, the
alert's interruption level, breaking through quiet hours, muted, a travel time (``leave``).

Precedence for an item: the event's own alarms (when the device uses them), then the calendar's
rules, then the device's. The calendar's rules replace the device's kind by kind: its lead rules
those of timed items, its day rules those of all-day items; a kind it names none of keeps the
device's. A muted calendar queues nothing for the device, and muting voids its pending rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from reminders_pipeline.domain.rules import MAX_TRAVEL_SECONDS, Rule, RuleError, parse_rule

Level = Literal["passive", "active", "time-sensitive"]
LEVELS: tuple[Level, ...] = ("passive", "active", "time-sensitive")
MAX_CALENDAR_RULES = 32


class SubscriptionError(ValueError):
    """A calendar setting that cannot be used; the message says why."""


@dataclass(frozen=True)
class CalendarSettings:
    rules: tuple[str, ...] | None = None  # canonical rule names, lead and day rules; None: the device's
    interruption_level: Level | None = None  # None: the deployment's (REMINDERS_INTERRUPTION_LEVEL)
    breakthrough: bool = False  # its reminders are sent during the device's quiet hours
    muted: bool = False
    travel_seconds: int | None = None  # a ``leave`` reminder this long before each timed item without its own

    @property
    def default(self) -> bool:
        return self == CalendarSettings()

    def columns(self) -> dict[str, Any]:
        """As ``device_sources`` stores it."""
        return {
            "rules": None if self.rules is None else " ".join(self.rules),
            "interruption_level": self.interruption_level,
            "breakthrough": int(self.breakthrough),
            "muted": int(self.muted),
            "travel_seconds": self.travel_seconds,
        }

    @classmethod
    def of_columns(cls, row: Mapping[str, Any]) -> CalendarSettings:
        rules = row["rules"]
        return cls(
            None if rules is None else tuple(rules.split()),
            row["interruption_level"],
            bool(row["breakthrough"]),
            bool(row["muted"]),
            row.get("travel_seconds"),
        )


def checked(
    rules: Iterable[str] | None = None,
    interruption_level: str | None = None,
    breakthrough: bool = False,
    muted: bool = False,
    travel_seconds: int | None = None,
) -> CalendarSettings:
    """Settings as given by a person (the CLI, the device API), canonical, or ``SubscriptionError``."""
    names = None
    if rules is not None:
        texts = list(rules)
        if len(texts) > MAX_CALENDAR_RULES:
            raise SubscriptionError(f"at most {MAX_CALENDAR_RULES} rules per calendar")
        try:
            parsed = [parse_rule(t) for t in texts]
        except RuleError as exc:
            raise SubscriptionError(str(exc)) from None
        for rule in parsed:
            if rule.leave:
                raise SubscriptionError("time to leave comes from a travel time (travel_seconds), not a rule")
            if rule.derived:
                raise SubscriptionError(rule.derived)
            if rule.agenda:
                raise SubscriptionError("an agenda lists all the device's calendars: it is a device rule")
        names = tuple(dict.fromkeys(r.name for r in parsed))
    if interruption_level is not None and interruption_level not in LEVELS:
        raise SubscriptionError(f"interruption level must be one of {', '.join(LEVELS)}, got {interruption_level!r}")
    if travel_seconds is not None and (
        isinstance(travel_seconds, bool)
        or not isinstance(travel_seconds, int)
        or not 0 < travel_seconds <= MAX_TRAVEL_SECONDS
    ):
        raise SubscriptionError(f"travel time must be a whole number of seconds from 1 to {MAX_TRAVEL_SECONDS}")
    return CalendarSettings(names, interruption_level, bool(breakthrough), bool(muted), travel_seconds)


def calendar_rules(device_rules: Mapping[str, Rule], settings: CalendarSettings | None) -> dict[str, Rule]:
    """The rules a calendar's items take: the calendar's own, kind by kind, else the device's."""
    if settings is None or settings.rules is None:
        return dict(device_rules)
    own = [parse_rule(name) for name in settings.rules]
    out: dict[str, Rule] = {}
    for all_day in (False, True):
        kind = [r for r in own if r.all_day == all_day] or [r for r in device_rules.values() if r.all_day == all_day]
        out.update((r.name, r) for r in kind)
    return out
