"""The send-time policy: one function from (row, now, settings) to what happens to a claimed row,
and the build's quiet-hours hold that decides which ``send_after`` a row gets.

``decide`` checks in this order (the README's policy table):

1. ``event_expired``: a start-anchored or all-day (``day:``) reminder once the event is over
   (``now >= expires_at``; an all-day event ends with its last day).
2. ``event_started`` / ``event_expired``: a reminder with a lead once its anchor has passed; a
   "starts in 10 minutes" alert after the start is noise. A zero lead (``lead:0``,
   ``lead:0@expiry``) is *about* the anchor itself, so it is bounded by lateness alone: otherwise
   it could never be delivered. A day rule names a time of day, not a distance from midnight: like
   ``lead:0@expiry`` it is bounded by the event's end and lateness only, never ``event_started``.
3. ``too_late``: ``now - send_after > MAX_LATENESS_SECONDS``.
4. ``quiet_hours``: ``now`` falls in the device's quiet hours (its zone) and the rule has no
   ``!``. The build already moved every reminder it could to the window's end; what is still
   inside would have gone after its event began.
5. ``disabled``: ``REMINDERS_ENABLED`` is not exactly ``"true"``; recorded with what would have gone.
6. ``send``.

Guards come before ``disabled`` so a dry run shows exactly what a live run would have done.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from .feed import Item
from .rules import Rule, parse_rule
from .settings import Settings
from .times import unix_from_iso
from .zones import LocalTime, QuietHours, ZoneError, local_time, parse_quiet_hours

Decision = Literal["send", "disabled", "event_started", "event_expired", "too_late", "quiet_hours"]


def decide(row: Mapping[str, Any], now: str, settings: Settings) -> Decision:
    """``row``: a claimed queue row joined with its device (``tz_name``, ``quiet_hours``, offset)."""
    rule = parse_rule(row["rule"])
    now_s = unix_from_iso(now)
    starts, expires = unix_from_iso(row["event_at"]), unix_from_iso(row["expires_at"])
    if rule.anchor in ("start", "day") and now_s >= expires:
        return "event_expired"
    if rule.anchor != "day" and rule.lead_seconds > 0 and now_s >= rule.anchor_unix(starts, expires):
        return "event_started" if rule.anchor == "start" else "event_expired"
    if now_s - unix_from_iso(row["send_after"]) > settings.max_lateness_seconds:
        return "too_late"
    if not rule.breakthrough and _in_quiet_hours(row, now_s):
        return "quiet_hours"
    if not settings.enabled:
        return "disabled"
    return "send"


def _in_quiet_hours(row: Mapping[str, Any], now_s: float) -> bool:
    try:
        quiet = parse_quiet_hours(row.get("quiet_hours"))
        return quiet is not None and quiet.contains(now_s, local_time(dict(row)))
    except ZoneError:  # validated when stored; a zone gone from the database must not stop a send
        return False


def held_send_after(send_after: int, rule: Rule, item: Item, quiet: QuietHours | None, local: LocalTime) -> int:
    """The build's half of quiet hours: a reminder due inside the window is held to its end when
    the event is still ahead then (its start; for ``@expiry`` and day rules its end); otherwise it
    keeps its time and the drain settles it ``quiet_hours``. ``!`` rules are never held."""
    if quiet is None or rule.breakthrough or not quiet.contains(send_after, local):
        return send_after
    end = max(send_after, quiet.end_after(send_after, local))
    return end if end < rule.anchor_unix(item.starts_at, item.expires_at) else send_after
