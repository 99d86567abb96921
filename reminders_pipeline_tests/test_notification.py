"""The push notification a row becomes: text, clock time in the device's offset, headers, 4 KB."""

import json

import pytest

from reminders_pipeline.domain.notification import compose as compose_at
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import PAYLOAD_LIMITS, payload_limit

T = 1_789_029_000  # 2026-09-10T08:30:00Z
MAX_PAYLOAD_BYTES = PAYLOAD_LIMITS["apns"].max_bytes
LEAD_TIME = Instant.from_unix(T - 600)


def compose(row, *args, now=LEAD_TIME):
    """``row``'s notification sent at ``now``: by default at its ``lead:600`` time."""
    return compose_at(row, *args, now=now)


def row(**over):
    base = {
        "id": 7,
        "device_id": "d",
        "item_id": "3:standup",
        "rule": "lead:600",
        "title": "Standup",
        "body": None,
        "event_at": Instant.from_unix(T),
        "expires_at": Instant.from_unix(T + 1800),
        "target": "ab" * 32,
        "last_tz_offset_seconds": 7200,
    }
    return base | over


def test_clock_time_in_the_device_offset_and_headers():
    note = compose(row())
    assert note.payload["aps"]["alert"] == {"title": "Standup", "body": "Starts at 10:30"}
    assert note.payload["aps"]["interruption-level"] == "time-sensitive"
    assert note.expiration == T and len(note.collapse_id.encode()) <= 64
    assert compose(row(rule="lead:0@expiry")).payload["aps"]["alert"]["body"] == "Ends at 11:00"
    assert compose(row(rule="lead:0@expiry")).expiration == T + 1800
    assert compose(row(last_tz_offset_seconds=None)).payload["aps"]["alert"]["body"] == "Starts at 08:30 UTC"


def test_a_send_after_the_start_or_end_says_it_started_or_ended():
    after = Instant.from_unix(T + 1800 + 300)
    assert (
        compose(row(rule="lead:0"), now=Instant.from_unix(T + 30)).payload["aps"]["alert"]["body"] == "Starts at 10:30"
    )
    assert (
        compose(row(rule="lead:0"), now=Instant.from_unix(T + 60)).payload["aps"]["alert"]["body"] == "Started at 10:30"
    )
    assert compose(row(rule="lead:0@expiry"), now=after).payload["aps"]["alert"]["body"] == "Ended at 11:00"


def test_the_same_item_collapses_across_rules_but_not_across_items():
    assert compose(row()).collapse_id == compose(row(rule="lead:3600")).collapse_id
    assert compose(row()).collapse_id != compose(row(item_id="3:retro")).collapse_id


def test_long_text_is_truncated_to_fit_never_rejected():
    for body in ("x" * 10_000, "é" * 5_000, "🎉" * 3_000, '"' * 3_000, "line\n" * 1_500, "\x01" * 1_200):
        note = compose(row(body=body, title="T" * 300))
        sent = json.dumps(note.payload, ensure_ascii=False, separators=(",", ":")).encode()
        assert note.body == sent and MAX_PAYLOAD_BYTES - 16 <= len(sent) <= MAX_PAYLOAD_BYTES
        alert = note.payload["aps"]["alert"]
        assert alert["body"].endswith("…") and alert["title"] == "T" * 300


@pytest.mark.parametrize("provider", ["apns", "webpush", "fcm"])
def test_long_text_is_fitted_to_each_providers_own_form_and_limit(provider):
    """What each provider's limit counts (``PayloadLimit.wire``): APNs' JSON body, Web Push's
    plaintext, FCM's whole message; cut to just under it."""
    limit = payload_limit(provider)
    for title, body in (("T" * 300, "é" * 5_000), ("🎉" * 3_000, None), ('"' * 5_000, "\x01" * 1_200)):
        note = compose(row(provider=provider, target="f" * 160, title=title, body=body))
        assert limit.max_bytes - 16 <= len(limit.wire(note)) <= limit.max_bytes, (title[:1], len(limit.wire(note)))
