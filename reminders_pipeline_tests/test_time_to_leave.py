"""Time to leave: an event's travel time (``X-APPLE-TRAVEL-DURATION``), or the calendar
subscription's, adds a ``leave`` reminder at start − travel with its own text, under the same
guards as any rule (quiet hours, never early, never after the start). End to end on SQLite and
PostgreSQL through the CLI, the build and the mock APNs."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from reminders_pipeline.domain.policy import decide
from reminders_pipeline.domain.rules import MAX_TRAVEL_SECONDS
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.sources.ics import parse_ics_feed

from .support import TOKEN, recorded, rows

pytestmark = pytest.mark.usefixtures("fresh_mock")
STAMP = "%Y%m%dT%H%M%SZ"


def event(uid: str, summary: str, starts: int, travel: str | None = None, location: str | None = None) -> str:
    lines = [
        "BEGIN:VEVENT", f"UID:{uid}", "DTSTAMP:20261201T000000Z",
        f"DTSTART:{datetime.fromtimestamp(starts, UTC).strftime(STAMP)}",
        f"DTEND:{datetime.fromtimestamp(starts + 1800, UTC).strftime(STAMP)}", f"SUMMARY:{summary}",
    ]  # fmt: skip
    if travel:
        lines.append(f"X-APPLE-TRAVEL-DURATION;VALUE=DURATION:{travel}")
    if location:
        lines.append(f"LOCATION:{location}")
    return "\r\n".join([*lines, "END:VEVENT"]) + "\r\n"


def calendar(*events: str) -> str:
    return "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//t//t//EN\r\n" + "".join(events) + "END:VCALENDAR\r\n"


def leaves(db, device_id: str = "phone") -> dict[str, dict]:
    return {r["title"]: r for r in rows(db, device_id=device_id) if r["rule"] == "leave"}


def test_the_events_travel_time_adds_a_leave_reminder_with_its_own_text(db, cli, feeds, mock):
    starts = Instant.now().whole_seconds + 600
    url = feeds.calendar(
        "/cal.ics",
        calendar(
            event("dentist", "Dentist", starts, "PT15M", "Main St 5"),
            event("call", "Call", starts + 5),
            event("far", "Far away", starts + 7200, "PT5H"),  # past MAX_TRAVEL_SECONDS: no leave reminder
        ),
    )
    cli("device", "put", "phone", "--apns-token", TOKEN, "--lead", "900", "--source", url, "--tz", "UTC")
    cli("build", "--all")
    (leave,) = leaves(db).values()
    assert leave["title"] == "Dentist" and leave["send_after"].whole_seconds == starts - 900
    assert json.loads(cli("drain").output)["outcomes"] == {"sent": 3}  # dentist's lead and leave, the call's lead
    sent = mock.wait_for_requests(3)
    bodies = sorted(r.payload["aps"]["alert"]["body"] for r in sent if r.payload["reminder"]["rule"] == "leave")
    clock = datetime.fromtimestamp(starts, UTC).strftime("%H:%M")
    assert bodies == [f"Leave now for Dentist · Starts at {clock} · Main St 5"]
    assert {r.payload["reminder"]["rule"] for r in sent} == {"leave", "lead:900"}
    for row in [r for r in rows(db, device_id="phone") if r["outcome"] == "sent"]:  # shown as sent
        (request,) = [
            r
            for r in sent
            if (r.payload["reminder"]["item_id"], r.payload["reminder"]["rule"]) == (row["item_id"], row["rule"])
        ]
        assert json.loads(row["payload"])["payload"] == recorded(request.payload)


def test_the_subscriptions_travel_time_serves_items_without_their_own(db, cli, feeds):
    starts = Instant.now().whole_seconds + 7200
    cal = feeds.calendar("/cal.ics", calendar(event("own", "Own", starts, "PT10M"), event("plain", "Plain", starts)))
    json_feed = feeds.items("/a.json", [{"id": "j", "title": "Json", "startsAt": starts, "expiresAt": starts + 60}])
    day = feeds.items("/day.json", [])
    cli(
        "device", "put", "phone", "--apns-token", TOKEN, "--source", cal, "--source", json_feed, "--source", day,
        "--calendar-travel", cal, "1800", "--calendar-travel", json_feed, "2700",
    )  # fmt: skip
    cli("build", "--all")
    got = {title: starts - r["send_after"].whole_seconds for title, r in leaves(db).items()}
    assert got == {"Own": 600, "Plain": 1800, "Json": 2700}


def test_a_travel_time_removed_voids_its_leave_reminder_and_one_changed_moves_it(db, cli, feeds):
    starts = Instant.now().whole_seconds + 7200
    cli_args = ("device", "put", "phone", "--apns-token", TOKEN)
    url = feeds.calendar("/cal.ics", calendar(event("e", "Trip", starts, "PT20M")))
    cli(*cli_args, "--source", url)
    cli("build", "--all")
    assert leaves(db)["Trip"]["send_after"].whole_seconds == starts - 1200
    feeds.calendar("/cal.ics", calendar(event("e", "Trip", starts, "PT40M")))
    cli("build", "--all")
    (moved,) = leaves(db).values()
    assert (moved["status"], moved["send_after"].whole_seconds) == ("pending", starts - 2400)
    feeds.calendar("/cal.ics", calendar(event("e", "Trip", starts)))
    cli("build", "--all")
    (gone,) = leaves(db).values()
    assert (gone["status"], gone["outcome_detail"]) == ("settled", "rule_removed")


def _quiet_around_now() -> str:
    hour = datetime.now(UTC).hour
    return f"{(hour - 1) % 24:02d}:00-{(hour + 2) % 24:02d}:00"


def test_time_to_leave_keeps_quiet_hours(db, cli, feeds, mock):
    starts = Instant.now().whole_seconds + 600
    url = feeds.calendar("/cal.ics", calendar(event("e", "Trip", starts, "PT15M")))
    cli(
        "device", "put", "phone", "--apns-token", TOKEN, "--lead", "7200", "--tz", "UTC", "--source", url,
        "--quiet-hours", _quiet_around_now(),
    )  # fmt: skip
    cli("build", "--all")
    assert json.loads(cli("drain").output)["outcomes"].get("sent") is None
    assert leaves(db)["Trip"]["outcome"] == "quiet_hours"
    assert mock.requests == []


@pytest.mark.parametrize("value", ["PT1.5H", "garbage", "-PT10M", ""])
def test_an_unreadable_travel_time_is_none_and_the_event_is_still_queued(value):
    start = int(datetime(2026, 12, 20, tzinfo=UTC).timestamp())
    events = "".join(
        event(f"e{i}", f"E{i}", start + 86400 + i * 3600).replace(
            "END:VEVENT", f"X-APPLE-TRAVEL-DURATION;VALUE=DURATION:{value}\r\nEND:VEVENT"
        )
        for i in range(3)
    )
    feed = parse_ics_feed(calendar(events).encode(), start, start + 30 * 86400, max_items=2)  # one past the cap
    assert [i.travel_seconds for i in feed.items] == [0, 0] and feed.rejected == {"over_item_cap": 1}


def test_an_all_day_event_gets_no_leave_reminder():
    body = (
        b"BEGIN:VCALENDAR\r\nVERSION:2.0\r\nBEGIN:VEVENT\r\nUID:d\r\nDTSTART;VALUE=DATE:20270101\r\n"
        b"SUMMARY:Holiday\r\nX-APPLE-TRAVEL-DURATION;VALUE=DURATION:PT1H\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"
    )
    start = int(datetime(2026, 12, 20, tzinfo=UTC).timestamp())
    (item,) = parse_ics_feed(body, start, start + 30 * 86400).items
    assert item.all_day and item.travel_seconds == 0


def test_a_leave_reminder_claimed_after_the_start_is_never_sent(settings):
    starts = Instant.from_unix(1_800_000_000)
    row = {"rule": "leave", "event_at": starts, "expires_at": starts + 1800, "send_after": starts - 600}
    assert decide(row, starts + 1, settings.with_(enabled=True)) == "event_started"
    assert decide(row, starts - 1, settings.with_(enabled=True)) == "send"


@pytest.mark.parametrize("extra", [["--rule", "leave"], ["--rule", "leave!"], ["--calendar-rule", "{url}", "leave"]])
def test_leave_is_no_rule_a_person_can_give(cli, feeds, extra):
    url = feeds.items("/a.json", [])
    out = cli("device", "put", "p", "--apns-token", TOKEN, "--source", url, *[a.format(url=url) for a in extra], code=2)
    assert "travel time" in out.output
    assert json.loads(cli("device", "list").output) == []


@pytest.mark.parametrize("seconds", ["0", str(MAX_TRAVEL_SECONDS + 1), "ten"])
def test_a_bad_travel_time_exits_2(cli, feeds, seconds):
    url = feeds.items("/a.json", [])
    cli("device", "put", "p", "--apns-token", TOKEN, "--source", url, "--calendar-travel", url, seconds, code=2)
    assert json.loads(cli("device", "list").output) == []
