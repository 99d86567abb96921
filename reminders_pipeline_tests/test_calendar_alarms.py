"""Calendar alarms from real calendars, queued at the instants RFC 5545 gives: relative to the
start or the end (``RELATED=END``), absolute, and repeated (``REPEAT``/``DURATION``), each
repetition its own row. The oracle is icalendar's own alarm computation (``icalendar.alarms``)
over recurring-ical-events' occurrences; the files are those two libraries' test data. On SQLite
and PostgreSQL, with the calendars served over real HTTP."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import icalendar
import pytest
import recurring_ical_events
from icalendar.alarms import Alarms

from reminders_pipeline.devices.registration import DeviceSpec, put_device
from reminders_pipeline.domain.rules import ALARM_REACH_SECONDS
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.zones import MAX_OFFSET_SECONDS
from reminders_pipeline.planning.build import build
from reminders_pipeline.sources.ics import parse_ics_feed
from reminders_pipeline.sources.ics_items import MAX_ALARM_REPEATS, MAX_ALARM_RULES, alarm_rules

from .support import TOKEN, rows

RIE = Path(recurring_ical_events.__file__).parent / "test" / "calendars"
ICALENDAR = Path(icalendar.__file__).parent / "tests" / "calendars"
# Thunderbird's snoozed and postponed alarms are left out: X-MOZ-SNOOZE-TIME is one client's
# state, which the oracle applies and the author's alarms do not say.
CALENDARS = [
    RIE / "alarm_1_week_before_event.ics",
    RIE / "alarm_absolute.ics",
    RIE / "alarm_absolute_repeat.ics",
    RIE / "alarm_around_event_boundaries.ics",
    RIE / "alarm_at_start_of_event.ics",
    RIE / "alarm_of_repeated_event.ics",
    RIE / "alarm_several_in_one.ics",
    RIE / "alarms_at_the_same_time.ics",
    RIE / "alarms_different_in_same_event.ics",
    ICALENDAR / "alarm_etar_future.ics",
    ICALENDAR / "alarm_google_future.ics",
    ICALENDAR / "alarm_thunderbird_2_future.ics",
    ICALENDAR / "alarm_thunderbird_future.ics",
]


def _unix(value: date | datetime) -> int:
    """Seconds of a time the oracle gives; a floating one read in UTC, the device's zone here."""
    if not isinstance(value, datetime):
        value = datetime(value.year, value.month, value.day)
    return int((value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp())


def rfc_instants(body: bytes) -> set[int]:
    """Every DISPLAY or AUDIO alarm instant of every occurrence, up to its anchor (the start, or
    the end for ``RELATED=END``): what a phone would show."""
    calendar = icalendar.Calendar.from_ical(body)
    out = set()
    for occurrence in recurring_ical_events.of(calendar).between(datetime(2000, 1, 1), datetime(2030, 1, 1)):
        for at in Alarms(occurrence).times:
            alarm = at.alarm
            if str(alarm.get("ACTION", "")).upper() not in ("DISPLAY", "AUDIO"):
                continue
            relative = isinstance(alarm.get("TRIGGER").dt, timedelta)
            anchor = occurrence.end if relative and alarm.TRIGGER_RELATED == "END" else occurrence.start
            if _unix(at.trigger) <= _unix(anchor):
                out.add(_unix(at.trigger))
    return out


@pytest.mark.parametrize("path", CALENDARS, ids=lambda p: p.name)
def test_real_calendar_alarms_are_queued_at_the_rfc_5545_instants(db, settings, feeds, path):
    body = path.read_bytes()
    expected = rfc_instants(body)
    assert expected
    now = Instant.from_unix(min(expected) - 3600)
    wide = settings.with_(horizon_seconds=max(expected) - now.whole_seconds + 3600)
    url = feeds.calendar(f"/{path.name}", body)
    # A lead no calendar here uses: its rows are the events without alarms, the rest the alarms'.
    put_device(db, wide, DeviceSpec("uses", TOKEN, 7, (), (url,), "UTC", alarms=True), now=now)
    build(db, wide, now=now)
    queued = {r["send_after"].whole_seconds for r in rows(db, device_id="uses") if r["rule"] != "lead:7"}
    assert queued == expected


def _calendar(*alarms: str) -> str:
    """One event, 13:00-14:00 UTC on 2026-10-27, with these VALARM bodies."""
    blocks = [f"BEGIN:VALARM\r\nACTION:DISPLAY\r\nDESCRIPTION:Review\r\n{a}\r\nEND:VALARM" for a in alarms]
    event = ["BEGIN:VEVENT", "UID:review@repeat", "DTSTART:20261027T130000Z", "DURATION:PT1H", "SUMMARY:Review"]
    return "\r\n".join(["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//repeat//EN", *event, *blocks, "END:VEVENT",
                          "END:VCALENDAR", ""])  # fmt: skip


@pytest.mark.parametrize(
    "alarm",
    [
        "TRIGGER:-PT50M\r\nREPEAT:4\r\nDURATION:PT15M",
        "TRIGGER;RELATED=END:-PT40M\r\nREPEAT:3\r\nDURATION:PT10M",
        "TRIGGER;VALUE=DATE-TIME:20261027T113000Z\r\nREPEAT:5\r\nDURATION:PT20M",
        "TRIGGER:-P1D\r\nREPEAT:2\r\nDURATION:PT12H",
    ],
    ids=["before the start", "before the end", "absolute", "a day before, in half days"],
)
def test_a_repeating_alarm_is_queued_at_the_oracles_instants(db, settings, feeds, alarm):
    body = _calendar(alarm).encode()
    expected = rfc_instants(body)
    now = Instant.from_stored("2026-10-26T08:00:00.000Z")
    wide = settings.with_(horizon_seconds=3 * 86400)
    url = feeds.calendar("/one.ics", body)
    put_device(db, wide, DeviceSpec("uses", TOKEN, 7, (), (url,), "UTC", alarms=True), now=now)
    build(db, wide, now=now)
    queued = sorted(r["send_after"].whole_seconds for r in rows(db, device_id="uses"))
    assert len(expected) > 1 and queued == sorted(expected)  # each instant once: no duplicate row


def test_a_repeating_alarm_is_a_row_per_repetition_until_the_start_and_each_is_sent_once(db, settings, feeds):
    """REPEAT:3 every 10 minutes from 25 minutes before: 25, 15 and 5 minutes before the start;
    the fourth repetition would fall after it and is not queued."""
    ics = REPEATING.replace("{repeat}", "3")
    url = feeds.calendar("/repeat.ics", ics)
    now = Instant.from_stored("2026-10-27T08:00:00.000Z")
    put_device(db, settings, DeviceSpec("uses", TOKEN, 3600, (), (url,), "UTC", alarms=True), now=now)
    build(db, settings, now=now)
    got = {r["rule"]: r["send_after"].stored for r in rows(db, device_id="uses")}
    assert got == {
        "lead:1500": "2026-10-27T12:35:00.000Z",
        "lead:900": "2026-10-27T12:45:00.000Z",
        "lead:300": "2026-10-27T12:55:00.000Z",
    }
    again = build(db, settings, now=Instant.from_stored("2026-10-27T08:15:00.000Z"))
    assert (again.rows_inserted, again.rows_updated) == (0, 0)


def test_repetitions_past_the_bound_are_not_queued():
    """A calendar asking for a million repetitions a second apart gets MAX_ALARM_REPEATS of them."""
    event = icalendar.Calendar.from_ical(REPEATING.replace("{repeat}", "1000000").replace("PT10M", "PT1S"))
    (vevent,) = event.walk("VEVENT")
    rules = alarm_rules(vevent, vevent["DTSTART"].dt)
    assert rules == tuple(f"lead:{1500 - k}" for k in range(MAX_ALARM_REPEATS + 1))


def test_an_event_gives_at_most_max_alarm_rules():
    """A hostile calendar with a hundred repeating alarms on one event: a bounded number of rows."""
    alarms = [f"TRIGGER:-PT{60 + k}M\r\nREPEAT:12\r\nDURATION:PT1M" for k in range(100)]
    (vevent,) = icalendar.Calendar.from_ical(_calendar(*alarms)).walk("VEVENT")
    rules = alarm_rules(vevent, vevent["DTSTART"].dt)
    assert len(rules) == MAX_ALARM_RULES and rules[0] == "lead:3600"


def test_an_event_with_a_repeated_trigger_is_rejected_and_the_rest_are_queued(db, settings, feeds):
    """Two TRIGGER lines in one alarm: icalendar gives a list where a calendar gives one value."""
    twice = _calendar("TRIGGER:-PT15M\r\nTRIGGER:-PT25M").replace(
        "END:VCALENDAR",
        "BEGIN:VEVENT\r\nUID:other@repeat\r\nDTSTART:20261027T150000Z\r\nDURATION:PT1H\r\n"
        "SUMMARY:Other\r\nEND:VEVENT\r\nEND:VCALENDAR",
    )
    url = feeds.calendar("/twice.ics", twice)
    now = Instant.from_stored("2026-10-27T08:00:00.000Z")
    put_device(db, settings, DeviceSpec("uses", TOKEN, 3600, (), (url,), "UTC", alarms=True), now=now)
    summary = build(db, settings, now=now)
    assert summary.items_rejected == {"malformed_event": 1} and not summary.sources_failed
    assert [r["title"] for r in rows(db, device_id="uses")] == ["Other"]


@pytest.mark.parametrize(
    ("repeat", "duration"), [("2", ""), ("", "PT10M"), ("-1", "PT10M"), ("2", "-PT10M"), ("0", "PT10M")]
)
def test_a_malformed_repeat_keeps_the_first_trigger(repeat, duration):
    lines = [line for line in REPEATING.splitlines() if not line.startswith(("REPEAT", "DURATION:PT10M"))]
    extra = [*([f"REPEAT:{repeat}"] if repeat else []), *([f"DURATION:{duration}"] if duration else [])]
    at = lines.index("END:VALARM")
    event = icalendar.Calendar.from_ical("\r\n".join([*lines[:at], *extra, *lines[at:]]) + "\r\n")
    (vevent,) = event.walk("VEVENT")
    assert alarm_rules(vevent, vevent["DTSTART"].dt) == ("lead:1500",)


REPEATING = "\r\n".join(
    [
        "BEGIN:VCALENDAR",
        "VERSION:2.0",
        "PRODID:-//repeat//EN",
        "BEGIN:VEVENT",
        "UID:review@repeat",
        "DTSTART:20261027T130000Z",
        "DURATION:PT1H",
        "SUMMARY:Review",
        "BEGIN:VALARM",
        "ACTION:DISPLAY",
        "DESCRIPTION:Review",
        "TRIGGER:-PT25M",
        "REPEAT:{repeat}",
        "DURATION:PT10M",
        "END:VALARM",
        "END:VEVENT",
        "END:VCALENDAR",
        "",
    ]
)


def _daily(uid: str, alarm: str | None) -> str:
    valarm = f"BEGIN:VALARM\r\nACTION:DISPLAY\r\nTRIGGER{alarm}\r\nEND:VALARM\r\n" if alarm else ""
    return (
        f"BEGIN:VEVENT\r\nUID:{uid}\r\nDTSTART:20260910T120000Z\r\nDURATION:PT30M\r\n"
        f"RRULE:FREQ=DAILY;COUNT=60\r\nSUMMARY:{uid}\r\n{valarm}END:VEVENT\r\n"
    )


def test_a_series_with_alarms_is_read_further_by_its_longest_lead_and_no_more_than_a_week():
    """The read window is what the subscribers' rules need; a series with alarms runs on by its
    alarms' reach (an absolute trigger's, which differs per occurrence, and one over a week: a
    week), so each occurrence whose alarm falls in the window is read, and nothing more."""
    body = "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//t//EN\r\n"
    body += _daily("plain", None) + _daily("two-days", ":-P2D") + _daily("end", ";RELATED=END:-PT5H")
    body += _daily("month", ":-P30D") + _daily("absolute", ";VALUE=DATE-TIME:20260901T000000Z")
    body += "END:VCALENDAR\r\n"
    start = Instant.from_stored("2026-09-10T00:00:00.000Z").whole_seconds
    feed = parse_ics_feed(body.encode(), start, start + 86400)

    def last_day(uid: str) -> int:
        return max(i.starts_at for i in feed.items if i.id.startswith(uid + "/")) // 86400 - start // 86400

    # The window ends 2026-09-11 00:00Z, and every read runs 14 h further (floating times): 14:00.
    assert MAX_OFFSET_SECONDS == 14 * 3600
    assert last_day("plain") == 1  # 09-11 12:00
    assert last_day("end") == 1  # 5 h more, to 19:00: no further occurrence
    assert last_day("two-days") == 3  # to 09-13 14:00
    assert last_day("month") == last_day("absolute") == ALARM_REACH_SECONDS // 86400 + 1  # to 09-18 14:00
