"""The push notification a reminder row becomes: payload and APNs headers, from the row alone.

A row carries the item's whole window, so composing needs no source read. The words are those of
the send's time, not of the row's ``send_after``: a late alert says how far the start is then, and
one sent after it that it started ("Started at 10:00"). Clock times are shown in the device's IANA
zone (DST exact), else its last seen UTC offset, else UTC marked as such. An all-day reminder says
which day ("Today", "Tomorrow", "In 3 days"): its clock time is midnight. A device that names a
locale reads them in its language and clock (``phrases``). Each provider's own form of the payload
is fitted to its own limit (``wire.payload_limit``) by cutting the text.

What a row records of its send (``record_of_send``, read back by ``sent_payload``): the whole payload
is ~300 bytes, most of a settled row, and all of it but the alert body follows from the row's own
columns. The body does not (a clock text depends on the device's zone, which may change after the
send), so the row keeps the body as sent, and the full payload only when re-rendering from the row
and that body does not give back the exact bytes sent (a title cut to fit, another interruption level).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

from reminders_pipeline.domain import phrases
from reminders_pipeline.domain.action_tokens import CATEGORY, action_token
from reminders_pipeline.domain.rows import SendRecord
from reminders_pipeline.domain.rules import Rule, known_rule
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Notification, PayloadLimit, Provider, payload_limit
from reminders_pipeline.domain.zones import wall_datetime, zone_of

DEFAULT_INTERRUPTION_LEVEL = "time-sensitive"  # what a re-render assumes; another level is stored in full
DEFAULT_SOUND = "default"
MAX_COLLAPSE_ID_BYTES = 64
# What a kept ``sent_body`` re-renders as (``notification_queue.sent_format``): 3, with the
# ``REMINDER`` category and the row's id; 2, ``thread-id`` per calendar; NULL, a row sent before,
# per item. Bumped with any change to what compose gives.
SENT_FORMAT = 3
ACTIONS_FORMAT = 3  # the first format with Snooze and Done


def _day_text(days: int) -> str:
    return "Today" if days == 0 else "Tomorrow" if days == 1 else f"In {days} days"


def _body(row: Mapping[str, Any], rule: Rule, now: Instant) -> str:
    """The alert's body as sent at ``now``: time to leave, else the item's own body, else its
    time, in the device's language when it names one. A snooze reads as a ``lead:0`` reminder:
    when the item starts."""
    if rule.snooze:
        rule = Rule(0)
    starts: Instant = row["event_at"]
    if rule.leave:
        return _leave_text(row, starts)
    if row.get("body"):
        return str(row["body"])
    if row.get("locale"):
        return _spoken(row, rule, now)
    if rule.anchor == "day":
        return _day_text(_days_ahead(row, now))
    at: Instant = starts if rule.anchor == "start" else row["expires_at"]
    passed = at - now <= -phrases.NOW_WITHIN.total_seconds()
    if rule.anchor == "expiry":
        return f"{'Ended' if passed else 'Ends'} at {zone_of(row).clock(at)}"
    return f"{'Started' if passed else 'Starts'} at {zone_of(row).clock(at)}"


def _days_ahead(row: Mapping[str, Any], now: Instant) -> int:
    """How many local days an all-day item's first day is after the send's (its ``event_at`` is
    that day's midnight in the device's zone); 0 once the day has come."""
    zone = zone_of(row)
    first, sent = (wall_datetime(zone.to_wall(t)).date() for t in (row["event_at"], now))
    return max(0, (first - sent).days)


def _spoken(row: Mapping[str, Any], rule: Rule, now: Instant) -> str:
    """The body in the device's language and clock (``phrases``), its times seen from ``now``,
    when it is sent; on UTC's clock, marked as such, when the device's zone is not known."""
    speaker = phrases.speaker(row["locale"], phrases.valid_clock(row.get("clock")))
    if rule.anchor == "day":
        return speaker.day(_days_ahead(row, now))
    zone = zone_of(row)
    known = zone.tz_name is not None or zone.offset_seconds is not None
    start = rule.anchor == "start"
    at: Instant = row["event_at"] if start else row["expires_at"]
    words = speaker.words
    return speaker.anchored(
        wall_datetime(zone.to_wall(at)),
        wall_datetime(zone.to_wall(now)),
        timedelta(seconds=at - now),
        (words.starts, words.started) if start else (words.ends, words.ended),
        "" if known else " UTC",
    )


def _leave_text(row: Mapping[str, Any], starts: Instant) -> str:
    """Time to leave: "Leave now for <title>", with its start and the item's own body (a place)."""
    if row.get("locale"):
        speaker = phrases.speaker(row["locale"], phrases.valid_clock(row.get("clock")))
        zone = zone_of(row)
        text = speaker.words.leave.format(title=row["title"])
        text += f" · {speaker.time(wall_datetime(zone.to_wall(starts)))}"
    else:
        text = f"Leave now for {row['title']} · Starts at {zone_of(row).clock(starts)}"
    return f"{text} · {row['body']}" if row.get("body") else text


def thread_id(row: Mapping[str, Any]) -> str:
    """Per calendar, so iOS groups a calendar's alerts together: its source id, which no change of
    URL text or title moves."""
    source_id = row.get("source_id")
    return f"calendar-{source_id}" if source_id is not None else str(row["item_id"])[:64]


def collapse_id(device_id: str, item_id: str) -> str:
    """Per item (not per rule), so a later reminder for the same item replaces the earlier one."""
    return hashlib.sha256(f"{device_id}\x00{item_id}".encode()).hexdigest()[:MAX_COLLAPSE_ID_BYTES]


def _fit(note: Notification, limit: PayloadLimit) -> Notification:
    """Truncate body, then title, until the provider's own form of the payload (``limit.wire``)
    fits its limit; never reject."""
    alert = note.payload["aps"]["alert"]  # compose's own dict: truncated in place
    size = len(limit.wire(note))
    for key in ("body", "title"):
        while size > limit.max_bytes and alert.get(key):
            text = alert[key]
            per_char = (len(json.dumps(text, ensure_ascii=False).encode()) - 2) / len(
                text
            )  # bytes sent per character, escapes included
            keep = max(0, len(text) - math.ceil((size - limit.max_bytes + 3) / per_char) - 1)
            alert[key] = text[:keep] + "…" if keep else ""
            note = replace(note)  # a new instance: its body is serialised afresh
            size = len(limit.wire(note))
    return note


def compose(
    row: Mapping[str, Any],
    interruption_level: str = DEFAULT_INTERRUPTION_LEVEL,
    sound: str = DEFAULT_SOUND,
    sent_format: int | None = SENT_FORMAT,
    *,
    now: Instant,
) -> Notification:
    """The notification for a queue row joined with its device (``target``, ``last_tz_offset_seconds``,
    ``credential_hash``: the key of the alert's action token, ``actions``), sent at ``now``: its
    words say how far the item's start (or end) is then, not when the row was due.
    ``sent_format``: the format composed (``SENT_FORMAT``; None, as a release before it did)."""
    rule = known_rule(row["rule"])
    note = _assemble(row, rule, _body(row, rule, now), interruption_level, sound, sent_format)
    return _fit(note, payload_limit(note.provider))


def _assemble(
    row: Mapping[str, Any],
    rule: Rule,
    body: str,
    interruption_level: str = DEFAULT_INTERRUPTION_LEVEL,
    sound: str = DEFAULT_SOUND,
    sent_format: int | None = SENT_FORMAT,
) -> Notification:
    """The notification of ``row`` (its rule parsed) with the alert body ``body``, as it is before any fitting."""
    starts: Instant = row["event_at"]
    ends: Instant = row["expires_at"]
    aps: dict[str, Any] = {
        "alert": {"title": row["title"], "body": body},
        "sound": sound,
        "interruption-level": interruption_level,
        "thread-id": thread_id(row) if sent_format is not None else str(row["item_id"])[:64],
    }
    reminder: dict[str, Any] = {"item_id": row["item_id"], "rule": row["rule"], "starts_at": starts.whole_seconds}
    if sent_format is not None and sent_format >= ACTIONS_FORMAT:
        aps["category"] = CATEGORY
        reminder["id"] = int(row["id"])
        if row.get("credential_hash"):  # last: the record of the send leaves it out (``stored_payload``)
            reminder["token"] = action_token(row["credential_hash"], row["device_id"], int(row["id"]), starts)
    payload = {"aps": aps, "reminder": reminder}
    return Notification(
        row_id=int(row["id"]),
        device_id=row["device_id"],
        device_token=row["target"],
        provider=row.get("provider") or Provider.APNS,
        payload=payload,
        collapse_id=collapse_id(row["device_id"], row["item_id"]),
        expiration=(starts if rule.anchor == "start" else ends).whole_seconds,  # day rules: the end of the last day
    )


def stored_payload(note: Notification) -> str:
    """The record of an alert: the body exactly as sent (serialised once) but for its action token,
    a credential the ledger never shows, and its headers."""
    sent = note.body.decode()
    token = note.payload["reminder"].get("token")
    if token is not None:
        sent = sent.replace(f',"token":"{token}"', "", 1)
    return f'{{"payload":{sent},"collapse_id":{json.dumps(note.collapse_id)},"expiration":{note.expiration}}}'


def record_of_send(row: Mapping[str, Any], note: Notification) -> SendRecord:
    """The columns that record ``note`` (composed from ``row``) on its queue row: ``sent_body`` alone
    when ``sent_payload`` gives the payload back byte for byte, else the whole ``payload``.

    Decided without composing again (that doubled the drain's composing cost): besides the row's
    columns, ``compose`` takes the interruption level, the sound and, for the body alone, the
    device's zone and the time of the send; and ``_fit`` may cut the title or body to the
    provider's limit. With the body kept as sent, the re-render (which fits nothing: what was sent
    fit) matches exactly when the level and sound are the defaults and the title went out uncut (a
    cut body is kept cut). test_sent_payload checks this against an actual re-render over every
    rule kind, level, provider and cut.
    """
    aps = note.payload["aps"]
    body = aps["alert"]["body"]
    if (
        body
        and aps["alert"]["title"] == row["title"]
        and aps["interruption-level"] == DEFAULT_INTERRUPTION_LEVEL
        and aps["sound"] == DEFAULT_SOUND
    ):
        return {"payload": None, "sent_body": body, "sent_format": SENT_FORMAT}
    return {"payload": stored_payload(note), "sent_body": None, "sent_format": None}


def sent_payload(row: Mapping[str, Any]) -> str | None:
    """What the row's send carried (or would have, in a dry run), as ``stored_payload`` wrote it;
    None when nothing was composed. Every reader of the ledger shows payloads through this."""
    if row.get("payload") is not None or row.get("sent_body") is None:
        return row.get("payload")
    return _rerender(row, row["sent_body"])


def as_shown(row: Mapping[str, Any]) -> dict[str, Any]:
    """A queue row as people see it (``reminders queue list``): ``payload`` is what was sent, stored
    or re-rendered (``sent_payload``); ``sent_body`` is how it is stored, not shown."""
    out = dict(row)
    out["payload"] = sent_payload(out)
    out.pop("sent_body", None)
    return out


def _rerender(row: Mapping[str, Any], body: str) -> str:
    """The row's payload with the given alert body: nothing from the device or the settings."""
    return stored_payload(
        _assemble({**row, "target": ""}, known_rule(row["rule"]), body, sent_format=row.get("sent_format"))
    )
