"""Reminder rules: ``lead:N`` (N seconds before the start), ``lead:N@expiry`` (before expiresAt) and,
for all-day items, ``day:N@HH:MM`` (N days before the day, at that local time).

``leave`` is time to leave: at the start less the item's travel time (``X-APPLE-TRAVEL-DURATION``,
or the calendar subscription's travel time), added to every timed item that has one.

``agenda@HH:MM`` is a device's morning agenda: at that local time, one alert listing the day's
events (``agenda``); at most one per device. Its rows are stored under the rule ``agenda``
whatever the time, so a device that moves its agenda's time still has one row per local day.

``snooze:N`` is a reminder's N-th snooze (1 to ``MAX_SNOOZES``), first queued by the Snooze action
on a sent alert (``actions``), then planned from its own row (``plan.want_snoozes``): sent at the
time asked, up to the item's end.

A trailing ``!`` (``lead:0!``, ``day:0@09:00!``) lets the rule's reminders break through the
device's quiet hours.

A rule names a policy, not a column: an expiry-anchored reminder extends the value rather than
adding a column, because ``UNIQUE(device_id, item_id, rule)`` is what lets distinct rules coexist
for one item.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from reminders_pipeline.domain.times import Instant

Anchor = Literal["start", "expiry", "day"]

_RULE = re.compile(r"^lead:(?P<lead>[^@!]*)(?:@(?P<anchor>[^!]*))?(?P<bang>!?)$")
_AGENDA_RULE = re.compile(r"^agenda@(?P<hh>\d{2}):(?P<mm>\d{2})$")
_DAY_RULE = re.compile(r"^day:(?P<days>[^@!]*)@(?P<hh>\d{2}):(?P<mm>\d{2})(?P<bang>!?)$")
MAX_LEAD_SECONDS = 366 * 86400
MAX_DAYS = 366
LEAVE = "leave"
MAX_TRAVEL_SECONDS = 3 * 3600  # a longer travel time asks for no leave reminder: every read reaches this far
ALARM_REACH_SECONDS = (
    7 * 86400
)  # a calendar series with alarms is read up to this much further: alarms are rarely earlier
DEFAULT_ALL_DAY_RULES = ("day:0@09:00",)
SNOOZE_PREFIX = "snooze:"
AGENDA = "agenda"  # an agenda row's rule (``Rule.row_rule``)
MAX_SNOOZES = 12  # per reminder of an item on a device: the rule names ``snooze:1`` to ``snooze:12``


class RuleError(ValueError):
    """A rule string that cannot be used; the message says why."""


@dataclass(frozen=True, order=True)
class Rule:
    lead_seconds: int  # day rules: N days before the day, in seconds (for ordering and the read window)
    anchor: Anchor = "start"
    at_minutes: int = 0  # day rules: the local time of day, minutes after midnight
    breakthrough: bool = False  # sent during quiet hours
    leave: bool = False  # time to leave: its lead is the item's travel time
    snooze: int = 0  # ``snooze:N``: the N-th snooze, anchored at the item's end (sent up to it)
    agenda: bool = False  # ``agenda@HH:MM``: the day's agenda, anchored at the local day's end

    @property
    def before_start(self) -> bool:
        """Sent before its anchor, never after it (a ``lead:0`` may still go within lateness)."""
        return self.lead_seconds > 0 or self.leave

    @property
    def row_rule(self) -> str:
        """What a queue row made by this rule stores as its rule: its name, but one ``agenda`` for
        every agenda time."""
        return AGENDA if self.agenda else self.name

    @property
    def ends_with_item(self) -> bool:
        """Never sent once its item is over: start-anchored, all-day, snoozed and agenda reminders
        (an ``@expiry`` one is about the end itself)."""
        return self.anchor in ("start", "day") or bool(self.snooze) or self.agenda

    @property
    def derived(self) -> str | None:
        """Why no person writes this rule (it comes from elsewhere), or None for one they may."""
        if self.leave:
            return "time to leave comes from a travel time, not a rule"
        if self.snooze:
            return "snooze:N reminders come from the Snooze action on an alert, not a rule"
        return None

    @property
    def name(self) -> str:
        """The canonical text stored in ``notification_queue.rule``."""
        if self.snooze:
            return f"{SNOOZE_PREFIX}{self.snooze}"
        bang = "!" if self.breakthrough else ""
        if self.agenda:
            hours, minutes = divmod(self.at_minutes, 60)
            return f"{AGENDA}@{hours:02d}:{minutes:02d}"
        if self.leave:
            return LEAVE + bang
        if self.anchor == "day":
            hours, minutes = divmod(self.at_minutes, 60)
            return f"day:{self.days}@{hours:02d}:{minutes:02d}{bang}"
        suffix = "" if self.anchor == "start" else "@expiry"
        return f"lead:{self.lead_seconds}{suffix}{bang}"

    @property
    def days(self) -> int:
        return self.lead_seconds // 86400

    @property
    def all_day(self) -> bool:
        """Day rules apply to all-day items only; lead rules to timed items only."""
        return self.anchor == "day"

    @property
    def reach_seconds(self) -> int:
        """How far before an item's start its reminder can fall: what a source read must cover."""
        if self.leave:
            return MAX_TRAVEL_SECONDS
        if self.agenda:
            return 86400  # the whole local day of an agenda the horizon reaches
        return self.lead_seconds + 86400 if self.anchor == "day" else self.lead_seconds

    def anchor_time(self, starts_at: Instant, expires_at: Instant) -> Instant:
        """What the reminder is about. A day rule is bounded by the end of the event's last day."""
        return starts_at if self.anchor == "start" else expires_at

    def day_wall(self, day_start_wall: int) -> int:
        """A day rule's send time as wall-clock seconds (read as UTC), from the day's local midnight."""
        return day_start_wall - self.lead_seconds + self.at_minutes * 60

    def __str__(self) -> str:
        return self.name


def parse_rule(text: str) -> Rule:
    """Parse ``lead:N``, ``lead:N@expiry``, ``lead:N@start``, ``day:N@HH:MM``, each optionally with ``!``."""
    if not isinstance(text, str):
        raise RuleError(f"rule must be text like 'lead:3600', got {text!r}")
    text = text.strip()
    if text in (LEAVE, LEAVE + "!"):
        return Rule(0, "start", breakthrough=text.endswith("!"), leave=True)
    if text.startswith("day:"):
        return _parse_day_rule(text)
    if text.startswith(SNOOZE_PREFIX):
        return snooze_rule(text)
    if text.startswith(AGENDA):
        return _parse_agenda_rule(text)
    match = _RULE.match(text)
    if not match:
        raise RuleError(f"unknown rule {text!r}: expected 'lead:N', 'lead:N@expiry' or 'day:N@HH:MM'")
    lead_text, anchor = match.group("lead"), match.group("anchor")
    if not re.fullmatch(r"-?\d+", lead_text):
        raise RuleError(f"rule {text!r}: lead must be a whole number of seconds, got {lead_text!r}")
    lead = int(lead_text)
    if lead < 0:
        raise RuleError(f"rule {text!r}: lead must not be negative")
    if lead > MAX_LEAD_SECONDS:
        raise RuleError(f"rule {text!r}: lead is longer than a year")
    if anchor not in (None, "start", "expiry"):
        raise RuleError(f"rule {text!r}: unknown anchor {anchor!r} (use 'expiry' or leave it out)")
    return Rule(lead, "expiry" if anchor == "expiry" else "start", breakthrough=bool(match.group("bang")))


@lru_cache(maxsize=4096)
def known_rule(text: str) -> Rule:
    """``parse_rule`` of a rule known to parse (a calendar alarm's, a stored one), cached: a build
    asks per item and device, a drain per row while composing and deciding it. An invalid one
    raises as ``parse_rule`` does (an error is not cached)."""
    return parse_rule(text)


@lru_cache(maxsize=4096)
def expiry_anchored(text: str) -> bool:
    """Whether a stored rule is anchored at its item's end (``lead:N@expiry``), so that a settled
    row's re-arm compares ``expires_at`` rather than ``event_at``. Cached: a build asks per row."""
    return parse_rule(text).anchor == "expiry"


def snooze_rule(text: str) -> Rule:
    """``snooze:N``, N from 1 to ``MAX_SNOOZES``: at its item's end, no lead (``lead:0@expiry``'s
    anchor; the policy also ends it there)."""
    digits = text[len(SNOOZE_PREFIX) :]
    if not re.fullmatch(r"[1-9]\d?", digits) or int(digits) > MAX_SNOOZES:
        raise RuleError(f"rule {text!r}: expected 'snooze:N', N from 1 to {MAX_SNOOZES}")
    return Rule(0, "expiry", snooze=int(digits))


def _parse_agenda_rule(text: str) -> Rule:
    """``agenda@HH:MM``; a row's ``agenda`` reads as the agenda at midnight (its time is the row's)."""
    if text == AGENDA:
        return Rule(0, "expiry", agenda=True)
    match = _AGENDA_RULE.match(text)
    if not match:
        raise RuleError(f"rule {text!r}: expected 'agenda@HH:MM' (the day's agenda at that local time)")
    hours, minutes = int(match.group("hh")), int(match.group("mm"))
    if hours > 23 or minutes > 59:
        raise RuleError(f"rule {text!r}: time of day must be 00:00 to 23:59")
    return Rule(0, "expiry", hours * 60 + minutes, agenda=True)


@lru_cache(maxsize=4096)
def rule_kind(text: str) -> str:
    """A stored rule's kind, as the counts name it: ``lead``, ``expiry``, ``day``, ``leave``,
    ``snooze`` or ``agenda``. Cached: a drain asks per row."""
    rule = parse_rule(text)
    if rule.leave or rule.agenda:
        return LEAVE if rule.leave else AGENDA
    if rule.snooze:
        return "snooze"
    return {"start": "lead", "expiry": "expiry", "day": "day"}[rule.anchor]


def is_agenda(text: str) -> bool:
    """Whether a rule is a device's agenda (a row per local day, no item of its own)."""
    return text == AGENDA or text.startswith(AGENDA + "@")


def agenda_rule(extra_rules: Iterable[str]) -> Rule | None:
    """The device's agenda rule among its lead rules, if it has one."""
    return next((r for r in map(parse_rule, extra_rules) if r.agenda), None)


def is_snooze(text: str) -> bool:
    """Whether a stored rule is a snooze (the build plans those from their own rows, and never
    re-arms one)."""
    return text.startswith(SNOOZE_PREFIX)


def _parse_day_rule(text: str) -> Rule:
    match = _DAY_RULE.match(text)
    if not match:
        raise RuleError(f"rule {text!r}: expected 'day:N@HH:MM' (N days before the day, at that local time)")
    if not re.fullmatch(r"\d{1,3}", match.group("days")) or int(match.group("days")) > MAX_DAYS:
        raise RuleError(f"rule {text!r}: days must be a whole number from 0 to {MAX_DAYS}")
    hours, minutes = int(match.group("hh")), int(match.group("mm"))
    if hours > 23 or minutes > 59:
        raise RuleError(f"rule {text!r}: time of day must be 00:00 to 23:59")
    return Rule(int(match.group("days")) * 86400, "day", hours * 60 + minutes, bool(match.group("bang")))


def device_rules(
    reminder_lead_seconds: int, extra_rules: Iterable[str], all_day_rules: Iterable[str] = ()
) -> list[Rule]:
    """A device's rules for its items: ``lead:<reminder_lead_seconds>``, its extra rules and its
    all-day rules, deduplicated; its agenda is no item's (``agenda_rule``)."""
    rules = {Rule(int(reminder_lead_seconds))}
    rules.update(rule for rule in map(parse_rule, extra_rules) if not rule.agenda)
    rules.update(parse_rule(r) for r in all_day_rules)
    return sorted(rules)
