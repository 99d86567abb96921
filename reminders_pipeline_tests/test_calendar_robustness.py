"""Real-world iCalendar on SQLite and PostgreSQL: UID-less calendars from the icalendar and
recurring-ical-events test suites queued in full with stable ids, a FREQ=MINUTELY flood and a
50,000-event calendar capped and counted while the rest of the chunk builds, parsing bounded in
time and off the event loop, and the read window per device."""

from __future__ import annotations

import threading
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import icalendar
import pytest
import recurring_ical_events

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import LOOPBACK_NETWORKS
from reminders_pipeline.devices.registration import DeviceSpec, put_device
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.planning.build import build
from reminders_pipeline.sources import reader as sources
from reminders_pipeline.sources.egress import parse_networks
from reminders_pipeline.sources.urls import shown_url

from .support import TOKEN, rows

UTC = UTC
DAY = 86400
SUITES = {
    "icalendar": Path(icalendar.__file__).parent / "tests",
    "recurring_ical_events": Path(recurring_ical_events.__file__).parent / "test",
}
# Every UID-less calendar of the two suites that the libraries themselves read without error
# (the others are deliberately broken calendars, bare VEVENTs, or events before 2000).
UIDLESS = [
    ("icalendar", "calendars/issue_156_RDATE_with_PERIOD_TZID_khal.ics"),
    ("icalendar", "calendars/issue_237_fail_to_parse_timezone_with_non_ascii_tzid.ics"),
    ("icalendar", "calendars/issue_722_missing_VTIMEZONE_custom.ics"),
    ("icalendar", "events/event_with_recurrence_exdates_on_different_lines.ics"),
    ("icalendar", "events/issue_104_mark_events_broken.ics"),
    ("icalendar", "events/issue_157_removes_trailing_semicolon.ics"),
    ("icalendar", "events/rfc_7265_example_4.ics"),
    ("recurring_ical_events", "calendars/duration.ics"),
    ("recurring_ical_events", "calendars/issue_107_omitting_last_event.ics"),
    ("recurring_ical_events", "calendars/issue_113_period_rdate_duration.ics"),
    ("recurring_ical_events", "calendars/issue_128_only_first_event.ics"),
    ("recurring_ical_events", "calendars/issue_15_duplicated_events.ics"),
    ("recurring_ical_events", "calendars/rdate.ics"),
    ("recurring_ical_events", "calendars/rdate2.ics"),
    ("recurring_ical_events", "calendars/rdate_hackerpublicradio.ics"),
]


def _naive_start(value: date | datetime) -> datetime:
    return value.replace(tzinfo=None) if isinstance(value, datetime) else datetime(value.year, value.month, value.day)


def _instant(value: date | datetime) -> int:
    """UTC device: floating and all-day times read as UTC; day:0@00:00 sends at the day's start."""
    if isinstance(value, datetime) and value.tzinfo:
        return int(value.timestamp())
    return int(_naive_start(value).replace(tzinfo=UTC).timestamp())


@pytest.mark.parametrize("suite, name", UIDLESS, ids=[n.rsplit("/", 1)[1] for _, n in UIDLESS])
def test_uidless_calendars_are_queued_in_full_with_stable_ids(db, settings, feeds, suite, name):
    body = (SUITES[suite] / name).read_bytes()
    assert b"\nUID" not in body.replace(b"\r\n", b"\n")
    cal = icalendar.Calendar.from_ical(body)
    first = min(_naive_start(ev["DTSTART"].dt) for ev in cal.walk("VEVENT") if ev.get("DTSTART") is not None)
    now = int(first.replace(tzinfo=UTC).timestamp()) - DAY
    horizon = 400 * DAY
    lo, hi = datetime.fromtimestamp(now, UTC), datetime.fromtimestamp(now + horizon + 1, UTC)
    want = sum(
        1
        for ev in recurring_ical_events.of(cal).between(lo, hi)
        if str(ev.get("STATUS", "")).upper() != "CANCELLED" and now < _instant(ev["DTSTART"].dt) <= now + horizon
    )
    assert want > 0
    url = feeds.calendar("/uidless.ics", body)
    settings = settings.with_(horizon_seconds=horizon)
    put_device(db, settings, DeviceSpec("d", TOKEN, 0, (), (url,), "UTC", ("day:0@00:00",)), now=Instant.from_unix(now))
    summary = build(db, settings, now=Instant.from_unix(now))
    assert summary.sources_failed == [] and "missing_id" not in summary.items_rejected
    assert len({r["item_id"] for r in rows(db)}) == want
    again = build(db, settings, now=Instant.from_unix(now + 60))  # read again: the same ids, nothing churns
    assert (again.rows_inserted, again.rows_voided) == (0, {})


def test_event_without_summary_gets_a_fallback_title(db, settings, feeds):
    ics = (
        "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nBEGIN:VEVENT\r\nDTSTART:20261020T090000Z\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"
    )
    url = feeds.calendar("/untitled.ics", ics)
    now = Instant.from_stored("2026-10-20T07:00:00.000Z")
    put_device(db, settings, DeviceSpec("d", TOKEN, 3600, (), (url,)), now=now)
    build(db, settings, now=now)
    assert [(r["title"], r["send_after"]) for r in rows(db)] == [
        ("Untitled event", Instant.from_stored("2026-10-20T08:00:00.000Z"))
    ]


NOW = Instant.from_stored("2026-10-18T12:00:00.000Z")
NOW_S = int(NOW.unix)
MINUTELY = b"BEGIN:VCALENDAR\r\nVERSION:2.0\r\nBEGIN:VEVENT\r\nUID:m@x\r\nDTSTART:20261018T120000Z\r\nRRULE:FREQ=MINUTELY\r\nSUMMARY:Tick\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"


PLAIN = {"id": "e", "title": "Plain", "startsAt": NOW_S + 7200, "expiresAt": NOW_S + 9000}


def big_calendar(n: int = 50_000) -> bytes:
    """One event a minute from NOW, n of them (35 days), as an export would list them."""
    base = datetime.fromtimestamp(NOW_S, UTC)
    events = (
        f"BEGIN:VEVENT\r\nUID:e{i}@big\r\nDTSTART:{(base + timedelta(minutes=i)).strftime('%Y%m%dT%H%M%SZ')}\r\n"
        f"DURATION:PT30M\r\nSUMMARY:Event {i}\r\nEND:VEVENT\r\n"
        for i in range(n)
    )
    return b"BEGIN:VCALENDAR\r\nVERSION:2.0\r\n" + "".join(events).encode() + b"END:VCALENDAR\r\n"


def test_a_flood_and_a_huge_calendar_are_capped_and_counted_and_the_chunk_builds(db, settings, feeds):
    # The parse bound is generous here (the next test is about it): on a loaded machine the huge
    # calendar's parse may take longer than the default 10 s, and this test is about the cap.
    settings = settings.with_(source_max_bytes=8_000_000, source_parse_seconds=300.0)
    flood = feeds.calendar("/minutely.ics", MINUTELY)
    huge = feeds.calendar("/huge.ics", big_calendar())
    plain = feeds.items("/plain.json", [PLAIN])
    for name, url in (("flood", flood), ("huge", huge), ("plain", plain)):
        put_device(db, settings, DeviceSpec(name, TOKEN, 3600, (), (url,)), now=NOW)
    summary = build(db, settings, now=NOW)
    assert summary.sources_failed == [] and summary.devices_built == 3
    assert summary.items_rejected["over_item_cap"] > 2000  # both sources cut, and the cut counted
    per_device: dict[str, int] = {}
    for r in rows(db):
        per_device[r["device_id"]] = per_device.get(r["device_id"], 0) + 1
    # The cap keeps the soonest: every minute in (now, now + horizon + lead] is queued for both.
    assert per_device == {"flood": 1500, "huge": 1500, "plain": 1}
    with db.read() as conn:
        counts = {s["url"]: (s["last_item_count"], s["last_rejected_count"]) for s in ledger.list_sources(conn)}
    assert counts[flood][0] == counts[huge][0] == settings.source_max_items
    assert counts[flood][1] > 0 and counts[huge][1] > 0


def test_a_parse_past_its_bound_fails_only_its_own_source(db, settings, feeds):
    settings = settings.with_(source_max_bytes=8_000_000, source_parse_seconds=0.1)
    huge = feeds.calendar("/huge.ics", big_calendar())
    plain = feeds.items("/plain.json", [PLAIN])
    put_device(db, settings, DeviceSpec("huge", TOKEN, 3600, (), (huge,)), now=NOW)
    put_device(db, settings, DeviceSpec("plain", TOKEN, 3600, (), (plain,)), now=NOW)
    summary = build(db, settings, now=NOW)
    assert summary.sources_failed == [{"url": shown_url(huge), "error": "parse_timeout"}]
    assert [r["device_id"] for r in rows(db)] == ["plain"]


def test_parsing_runs_off_the_event_loop(feeds, monkeypatch):
    threads = []
    real = sources.parse_ics_feed

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(sources, "parse_ics_feed", spy)
    url = feeds.calendar("/one.ics", MINUTELY)
    reads = sources.SourceReader(allow_networks=parse_networks(LOOPBACK_NETWORKS)).read_all({1: url}, (NOW, NOW + DAY))
    assert reads[1].ok and threads and all(t.startswith("reminders-parse") for t in threads)


def test_read_window_is_per_device_not_the_longest_lead_in_the_chunk(db, settings, feeds):
    far = feeds.calendar("/far.ics", MINUTELY.replace(b"m@x", b"far@x").replace(b"FREQ=MINUTELY", b"FREQ=DAILY"))
    near = feeds.calendar("/near.ics", MINUTELY.replace(b"m@x", b"near@x").replace(b"FREQ=MINUTELY", b"FREQ=HOURLY"))
    put_device(db, settings, DeviceSpec("far", TOKEN, 200 * DAY, (), (far,)), now=NOW)
    put_device(db, settings, DeviceSpec("near", TOKEN, 3600, (), (near,)), now=NOW)
    build(db, settings, now=NOW)
    with db.read() as conn:
        until = {s["url"]: s["cache_until"] for s in ledger.list_sources(conn)}
    slack = sources.ICS_CACHE_SLACK_SECONDS
    # near: horizon + its own reach (the default all-day rule's day, longer than lead:3600) + slack.
    assert until[near] == Instant.from_unix(NOW_S + settings.horizon_seconds + DAY + slack)
    assert until[far] == Instant.from_unix(NOW_S + settings.horizon_seconds + 200 * DAY + slack)


def test_each_occurrence_once_though_slices_meet_on_it():
    """Slices of the expansion end on whole minutes here: an occurrence on a boundary is yielded once."""
    from reminders_pipeline.sources.ics import parse_ics_feed

    feed = parse_ics_feed(MINUTELY, NOW_S, NOW_S + 3 * DAY, max_items=100_000)
    assert feed.rejected == {} and len(feed.items) == 3 * 1440 + 14 * 60 + 1  # to the window's end + 14 h
