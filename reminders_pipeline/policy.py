"""The send-time policy: one function from (row, now, settings) to what happens to a claimed row.

Checked in this order (the README's policy table):

1. ``event_expired``: a start-anchored reminder once the event is over (``now >= expires_at``).
2. ``event_started`` / ``event_expired``: a reminder with a lead once its anchor has passed; a
   "starts in 10 minutes" alert after the start is noise. A zero lead (``lead:0``,
   ``lead:0@expiry``) is *about* the anchor itself, so it is bounded by lateness alone: otherwise
   it could never be delivered.
3. ``too_late``: ``now - send_after > MAX_LATENESS_SECONDS``.
4. ``disabled``: ``REMINDERS_ENABLED`` is not exactly ``"true"``; recorded with what would have gone.
5. ``send``.

Guards come before ``disabled`` so a dry run shows exactly what a live run would have done.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from .rules import parse_rule
from .settings import Settings
from .times import unix_from_iso

Decision = Literal["send", "disabled", "event_started", "event_expired", "too_late"]


def decide(row: Mapping[str, Any], now: str, settings: Settings) -> Decision:
    rule = parse_rule(row["rule"])
    now_s = unix_from_iso(now)
    starts, expires = unix_from_iso(row["event_at"]), unix_from_iso(row["expires_at"])
    if rule.anchor == "start" and now_s >= expires:
        return "event_expired"
    if rule.lead_seconds > 0 and now_s >= rule.anchor_unix(starts, expires):
        return "event_started" if rule.anchor == "start" else "event_expired"
    if now_s - unix_from_iso(row["send_after"]) > settings.max_lateness_seconds:
        return "too_late"
    if not settings.enabled:
        return "disabled"
    return "send"
