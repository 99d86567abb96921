"""The push notification a reminder row becomes: payload and APNs headers, from the row alone.

A row carries the item's whole window, so composing needs no source read. Clock times are shown in
the device's IANA zone (DST exact), else its last seen UTC offset, else UTC marked as such. An
all-day reminder says which day ("Today", "Tomorrow", "In 3 days"): its clock time is midnight.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace
from typing import Any, Mapping

from .rules import parse_rule
from .sender import Notification
from .times import unix_from_iso
from .zones import LocalTime, ZoneError

MAX_PAYLOAD_BYTES = 4096
MAX_COLLAPSE_ID_BYTES = 64
INTERRUPTION_LEVELS = ("passive", "active", "time-sensitive", "critical")


def local_clock(unix: float, tz_offset_seconds: int | None, tz_name: str | None = None) -> str:
    """``HH:MM`` in the device's zone or offset, or UTC marked as such when neither is known."""
    try:
        return LocalTime(tz_name, tz_offset_seconds).clock(unix)
    except ZoneError:  # a zone gone from the database: the offset still reads right most of the year
        return LocalTime(None, tz_offset_seconds).clock(unix)


def _day_text(days: int) -> str:
    return "Today" if days == 0 else "Tomorrow" if days == 1 else f"In {days} days"


def collapse_id(device_id: str, item_id: str) -> str:
    """Per item (not per rule), so a later reminder for the same item replaces the earlier one."""
    return hashlib.sha256(f"{device_id}\x00{item_id}".encode()).hexdigest()[:MAX_COLLAPSE_ID_BYTES]


def _fit(note: Notification) -> Notification:
    """Truncate body, then title, until the payload's bytes fit APNs' 4 KB; never reject."""
    alert = note.payload["aps"]["alert"]  # compose's own dict: truncated in place
    for key in ("body", "title"):
        while len(note.body) > MAX_PAYLOAD_BYTES and alert.get(key):
            text = alert[key]
            per_char = (len(json.dumps(text, ensure_ascii=False).encode()) - 2) / len(text)  # bytes sent per character, escapes included
            keep = max(0, len(text) - math.ceil((len(note.body) - MAX_PAYLOAD_BYTES + 3) / per_char) - 1)
            alert[key] = text[:keep] + "…" if keep else ""
            note = replace(note)  # a new instance: its body is serialised afresh
    return note


def compose(row: Mapping[str, Any], interruption_level: str = "time-sensitive", sound: str = "default") -> Notification:
    """The notification for a queue row joined with its device (``apns_token``, ``last_tz_offset_seconds``)."""
    rule = parse_rule(row["rule"])
    starts = unix_from_iso(row["event_at"])
    ends = unix_from_iso(row["expires_at"])
    tz, tz_name = row.get("last_tz_offset_seconds"), row.get("tz_name")
    if row.get("body"):
        body = row["body"]
    elif rule.anchor == "day":
        body = _day_text(rule.days)
    elif rule.anchor == "expiry":
        body = f"Ends at {local_clock(ends, tz, tz_name)}"
    else:
        body = f"Starts at {local_clock(starts, tz, tz_name)}"
    payload = {
        "aps": {
            "alert": {"title": row["title"], "body": body},
            "sound": sound,
            "interruption-level": interruption_level,
            "thread-id": str(row["item_id"])[:64],
        },
        "reminder": {"item_id": row["item_id"], "rule": row["rule"], "starts_at": int(starts)},
    }
    return _fit(
        Notification(
            row_id=int(row["id"]),
            device_id=row["device_id"],
            device_token=row["apns_token"],
            payload=payload,
            collapse_id=collapse_id(row["device_id"], row["item_id"]),
            expiration=int(starts if rule.anchor == "start" else ends),  # day rules: the end of the last day
        )
    )
