"""The send-time policy: one function from (row, now, settings) to what happens to a claimed row,
and the build's quiet-hours hold that decides which ``send_after`` a row gets.

``decide`` checks in this order (the policy table in docs/guide.md):

1. ``event_expired``: a start-anchored, all-day (``day:``), snoozed (``snooze:N``) or agenda
   (``agenda@HH:MM``) reminder once the event is over (``now >= expires_at``; an all-day event
   ends with its last day, an agenda with its local day).
2. ``event_started`` / ``event_expired``: a reminder with a lead once its anchor has passed; a
   "starts in 10 minutes" alert after the start is noise. A zero lead (``lead:0``,
   ``lead:0@expiry``) is *about* the anchor itself, so it is bounded by lateness alone: otherwise
   it could never be delivered. A day rule names a time of day, not a distance from midnight: like
   ``lead:0@expiry`` it is bounded by the event's end and lateness only, never ``event_started``.
3. ``too_late``: ``now`` is more than ``MAX_LATENESS_SECONDS`` past the row's ``send_after`` (or,
   for a row held to the end of quiet hours at send time, past that end: ``lateness_base``).
4. ``held`` / ``quiet_hours``: ``now`` falls in the device's quiet hours (its zone) and the rule
   has no ``!``. A row claimed late inside them (the build moves a reminder due inside the window
   to its end) is ``held``: back to pending until the window ends (``quiet_end``), when its event
   is still ahead then, as ``held_send_after`` decides for the build. Otherwise the alert would
   go after its event began: ``quiet_hours``.
5. ``disabled``: ``REMINDERS_ENABLED`` is not exactly ``"true"``; recorded with what would have gone.
6. ``send``.

Guards come before ``disabled`` so a dry run shows exactly what a live run would have done.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from reminders_pipeline.domain.rules import Rule, known_rule
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.zones import QuietHours, Zone, ZoneError, parse_quiet_hours, zone_of

if TYPE_CHECKING:  # the settings are handed in; the domain reads no environment
    from reminders_pipeline.config.settings import Settings

Decision = Literal["send", "disabled", "event_started", "event_expired", "too_late", "quiet_hours", "held"]


def decide(row: Mapping[str, Any], now: Instant, settings: Settings) -> Decision:
    """``row``: a claimed queue row joined with its device (``tz_name``, ``quiet_hours``, offset)."""
    rule = known_rule(row["rule"])
    starts, expires = row["event_at"], row["expires_at"]
    if rule.ends_with_item and now >= expires:
        return "event_expired"
    if rule.anchor != "day" and rule.before_start and now >= rule.anchor_time(starts, expires):
        return "event_started" if rule.anchor == "start" else "event_expired"
    if now - lateness_base(row) > settings.max_lateness_seconds:
        return "too_late"
    if not _breaks_through(row, rule) and _in_quiet_hours(row, now):
        return "held" if quiet_end(row, now) is not None else "quiet_hours"
    if not settings.enabled:
        return "disabled"
    return "send"


def lateness_base(row: Mapping[str, Any]) -> Instant:
    """What lateness counts from: the rule's time, ``send_after``, as the build held it. A row the
    drain held to the end of quiet hours counts from that end (``held_until``), as if the build had
    held it, through any retries after it. A retry's backoff (``not_before``) does not move it: a
    retried row is still bounded by its rule's time or its hold's end."""
    send_after: Instant = row["send_after"]
    held = row.get("held_until")
    return max(send_after, held) if held else send_after


def quiet_end(row: Mapping[str, Any], now: Instant) -> Instant | None:
    """When a row claimed inside its device's quiet hours may go: the window's end, if that is
    still before what the reminder is about (the condition ``held_send_after`` applies). None: the
    row cannot wait (not in quiet hours, a ``!`` rule, or the event would have begun)."""
    rule = known_rule(row["rule"])
    quiet, zone = _quiet_hours(row), zone_of(row)
    if _breaks_through(row, rule) or quiet is None or not quiet.contains(now, zone):
        return None
    end = quiet.end_after(now, zone)
    return end if end < rule.anchor_time(row["event_at"], row["expires_at"]) else None


def _breaks_through(row: Mapping[str, Any], rule: Rule) -> bool:
    """A ``!`` rule, or a calendar the device lets through quiet hours (``calendar_breakthrough``)."""
    return rule.breakthrough or bool(row.get("calendar_breakthrough"))


def _in_quiet_hours(row: Mapping[str, Any], now: Instant) -> bool:
    quiet = _quiet_hours(row)
    return quiet is not None and quiet.contains(now, zone_of(row))


def _quiet_hours(row: Mapping[str, Any]) -> QuietHours | None:
    try:
        return parse_quiet_hours(row.get("quiet_hours"))
    except ZoneError:  # validated when stored; a window that no longer parses must not stop a send
        return None


def held_send_after(send_after: Instant, rule: Rule, anchor: Instant, quiet: QuietHours | None, zone: Zone) -> Instant:
    """The build's half of quiet hours: a reminder due inside the window is held to its end when
    what it is about (``anchor``: the event's start; for ``@expiry`` and day rules its end) is still
    ahead then; otherwise it keeps its time and the drain settles it ``quiet_hours``. ``!`` rules
    are never held."""
    if quiet is None or rule.breakthrough or not quiet.contains(send_after, zone):
        return send_after
    end = max(send_after, quiet.end_after(send_after, zone))
    return end if end < anchor else send_after
