"""Calendars as people keep them, on SQLite and PostgreSQL: floating, all-day and TZID times
resolved in each device's IANA zone (an oracle built independently with recurring_ical_events and
zoneinfo), the west-of-UTC floating event that must never vanish, all-day rules, quiet hours, and
the zone's capture over HTTP and the CLI."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import icalendar
import pytest
import recurring_ical_events
from click.testing import CliRunner
from sqlalchemy import event

from reminders_pipeline import ledger
from reminders_pipeline.cli import main
from reminders_pipeline.devices.registration import DeviceSpec, put_device
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.base import RecordingSender
from reminders_pipeline.sending.drain import drain

from .support import TOKEN, rows
from .test_http_support import error_of

UTC = UTC
ZONES = ["America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "Asia/Kolkata", "Pacific/Chatham"]
LEAD = 900
FLOATING_TIMES = ["0100", "0145", "0215", "0230", "0300", "0900"]  # around every zone's DST change


def oracle_calendar() -> str:
    """Daily floating events at the times DST changes move, a daily all-day event, and TZID events
    inside New York's and Lord Howe's gaps; DURATION PT3H everywhere (exact, RFC 5545)."""
    events = [
        f"BEGIN:VEVENT\nUID:f{t}@oracle\nDTSTART:20260301T{t}00\nDURATION:PT3H\nRRULE:FREQ=DAILY;UNTIL=20261130T000000\n"
        f"SUMMARY:F{t}\nEND:VEVENT"
        for t in FLOATING_TIMES
    ]
    events.append(
        "BEGIN:VEVENT\nUID:day@oracle\nDTSTART;VALUE=DATE:20260301\nRRULE:FREQ=DAILY;UNTIL=20261130\nSUMMARY:AllDay\nEND:VEVENT"
    )
    for uid, tz, t in (("ny", "America/New_York", "0230"), ("lh", "Australia/Lord_Howe", "0215")):
        events.append(
            f"BEGIN:VEVENT\nUID:{uid}@oracle\nDTSTART;TZID={tz}:20260301T{t}00\nDURATION:PT3H\n"
            f"RRULE:FREQ=DAILY;COUNT=280\nSUMMARY:{uid.upper()}{t}\nEND:VEVENT"
        )
    return (
        "\r\n".join(["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//oracle//EN", *events, "END:VCALENDAR", ""])
        .replace("\n", "\r\n")
        .replace("\r\r\n", "\r\n")
    )


def expected(ics: str, tz: str, now: int, horizon: int) -> set[tuple]:
    """Independently: the occurrences recurring_ical_events lists, resolved with zoneinfo (fold=0 is
    RFC 5545's rule for gaps and folds); lead:900 for timed items, day:0@09:00 for all-day ones."""
    zone = ZoneInfo(tz)
    lo, hi = datetime.fromtimestamp(now - 3 * 86400, UTC), datetime.fromtimestamp(now + horizon + 3 * 86400, UTC)
    out = set()
    for ev in recurring_ical_events.of(icalendar.Calendar.from_ical(ics)).between(lo, hi):
        start, title = ev["DTSTART"].dt, str(ev["SUMMARY"])
        if not isinstance(start, datetime):
            begins = int(datetime(start.year, start.month, start.day, tzinfo=zone).timestamp())
            nxt = start + timedelta(days=1)
            ends = int(datetime(nxt.year, nxt.month, nxt.day, tzinfo=zone).timestamp())
            send = int(datetime(start.year, start.month, start.day, 9, tzinfo=zone).timestamp())
            if ends > now and send <= now + horizon:
                out.add((title, begins, ends, send, "day:0@09:00"))
            continue
        begins = int((start if start.tzinfo else start.replace(tzinfo=zone)).timestamp())
        if begins > now and begins - LEAD <= now + horizon:
            out.add((title, begins, begins + 3 * 3600, begins - LEAD, f"lead:{LEAD}"))
    return out


@pytest.mark.parametrize(
    "now, horizon",
    [
        (Instant.from_stored("2026-03-05T00:00:00.000Z"), 35 * 86400),
        (Instant.from_stored("2026-09-24T00:00:00.000Z"), 40 * 86400),
    ],
    ids=["march-april-changes", "september-november-changes"],
)
def test_oracle_floating_all_day_and_tzid_in_five_zones_across_dst(db, settings, feeds, now, horizon):
    ics = oracle_calendar()
    url = feeds.calendar("/oracle.ics", ics)
    settings = settings.with_(horizon_seconds=horizon)
    for tz in ZONES:
        put_device(db, settings, DeviceSpec(tz.replace("/", ":"), TOKEN, LEAD, (), (url,), tz), now=now)
    summary = build(db, settings, now=now)
    assert summary.sources_failed == [] and summary.items_rejected == {}
    got: dict[str, set] = {tz: set() for tz in ZONES}
    for r in rows(db):
        assert r["status"] == "pending"
        got[r["device_id"].replace(":", "/")].add(
            (
                r["title"],
                int(r["event_at"].unix),
                int(r["expires_at"].unix),
                int(r["send_after"].unix),
                r["rule"],
            )
        )
    for tz in ZONES:
        want = expected(ics, tz, int(now.unix), horizon)
        assert len(want) > 200
        assert got[tz] == want, (tz, sorted(got[tz] ^ want)[:6])


FLOATING_MEETING = """BEGIN:VCALENDAR\r
VERSION:2.0\r
PRODID:-//west//EN\r
BEGIN:VEVENT\r
UID:meeting@west\r
DTSTART:20261020T090000\r
DTEND:20261020T100000\r
SUMMARY:Standup\r
END:VEVENT\r
END:VCALENDAR\r
"""


@pytest.mark.parametrize("how", ["offset", "zone"])
def test_west_of_utc_floating_event_stays_queued_through_every_build_until_sent(db, settings, feeds, how):
    """UTC-4 (offset only, or America/New_York in October): 09:00 floating is 13:00Z. Builds every
    30 minutes from a day before keep one pending row with the same send_after; then it is sent."""
    url = feeds.calendar("/west.ics", FLOATING_MEETING)
    first = Instant.from_stored("2026-10-19T13:00:00.000Z")
    put_device(
        db,
        settings,
        DeviceSpec("west", TOKEN, 900, (), (url,), "America/New_York" if how == "zone" else None),
        now=first,
    )
    if how == "offset":
        with db.write() as conn:
            ledger.store_tz_offset(conn, "west", -4 * 3600)
    t = int(first.unix)
    while t <= int((Instant.from_stored("2026-10-20T12:45:00.000Z")).unix):
        summary = build(db, settings, now=Instant.from_unix(t))
        assert summary.rows_voided == {}, Instant.from_unix(t)
        queued = rows(db)
        assert [(r["status"], r["send_after"], r["event_at"]) for r in queued] == [
            (
                "pending",
                Instant.from_stored("2026-10-20T12:45:00.000Z"),
                Instant.from_stored("2026-10-20T13:00:00.000Z"),
            )
        ], Instant.from_unix(t)
        t += 1800
    sent = drain(
        db,
        settings.with_(enabled=True),
        RecordingSender().factory(),
        now=Instant.from_stored("2026-10-20T12:46:00.000Z"),
    )
    assert sent.outcomes == {"sent": 1}


ALL_DAY_AND_TIMED = """BEGIN:VCALENDAR\r
VERSION:2.0\r
PRODID:-//days//EN\r
BEGIN:VEVENT\r
UID:birthday@days\r
DTSTART;VALUE=DATE:20261027\r
SUMMARY:Birthday\r
END:VEVENT\r
BEGIN:VEVENT\r
UID:call@days\r
DTSTART;TZID=Europe/Berlin:20261027T150000\r
DURATION:PT30M\r
SUMMARY:Call\r
END:VEVENT\r
END:VCALENDAR\r
"""


def test_all_day_items_take_day_rules_and_timed_items_lead_rules(db, settings, feeds):
    url = feeds.calendar("/days.ics", ALL_DAY_AND_TIMED)
    spec = DeviceSpec(
        "berlin", TOKEN, 3600, ("lead:0@expiry",), (url,), "Europe/Berlin", ("day:1@18:00", "day:0@09:00")
    )
    put_device(db, settings.with_(horizon_seconds=3 * 86400), spec, now=Instant.from_stored("2026-10-25T12:00:00.000Z"))
    build(db, settings.with_(horizon_seconds=3 * 86400), now=Instant.from_stored("2026-10-25T12:00:00.000Z"))
    got = {(r["title"], r["rule"]): r["send_after"] for r in rows(db)}
    assert got == {
        ("Birthday", "day:1@18:00"): Instant.from_stored("2026-10-26T17:00:00.000Z"),  # 18:00 CET the evening before
        ("Birthday", "day:0@09:00"): Instant.from_stored("2026-10-27T08:00:00.000Z"),  # 09:00 CET on the day
        ("Call", "lead:3600"): Instant.from_stored("2026-10-27T13:00:00.000Z"),
        ("Call", "lead:0@expiry"): Instant.from_stored("2026-10-27T14:30:00.000Z"),
    }


def test_all_day_reminder_is_queued_after_the_day_began_and_sent(db, settings, feeds):
    """Built at 08:55 on the day (the event "began" at midnight): still queued, then sent at 09:00;
    a build after the day's end queues nothing, and the drain settles a leftover event_expired."""
    url = feeds.calendar("/days.ics", ALL_DAY_AND_TIMED)
    live = settings.with_(enabled=True)
    put_device(
        db,
        live,
        DeviceSpec("berlin", TOKEN, 3600, (), (url,), "Europe/Berlin"),
        now=Instant.from_stored("2026-10-27T07:55:00.000Z"),
    )
    build(db, live, now=Instant.from_stored("2026-10-27T07:55:00.000Z"))
    [row] = [r for r in rows(db) if r["title"] == "Birthday"]
    assert (row["rule"], row["send_after"], row["event_at"], row["expires_at"]) == (
        "day:0@09:00",
        Instant.from_stored("2026-10-27T08:00:00.000Z"),
        Instant.from_stored("2026-10-26T23:00:00.000Z"),
        Instant.from_stored("2026-10-27T23:00:00.000Z"),
    )
    sender = RecordingSender()
    assert drain(db, live, sender.factory(), now=Instant.from_stored("2026-10-27T08:00:30.000Z")).outcomes == {
        "sent": 1
    }
    assert sender.sent[0].payload["aps"]["alert"]["body"] == "Today"


def test_quiet_hours_hold_settle_and_break_through(db, settings, feeds):
    """Quiet 22:00-07:00 Berlin. 08:00 event, lead 2 h: due 06:00, held to 07:00 (still ahead).
    06:30 event at lead 0: would be held past its start, so settled quiet_hours. The ``!`` rule
    breaks through at 06:30. The row keeps its anchor (event_at)."""
    ics = """BEGIN:VCALENDAR\r
VERSION:2.0\r
PRODID:-//quiet//EN\r
BEGIN:VEVENT\r
UID:late@quiet\r
DTSTART;TZID=Europe/Berlin:20261027T080000\r
DURATION:PT1H\r
SUMMARY:Flight\r
END:VEVENT\r
BEGIN:VEVENT\r
UID:early@quiet\r
DTSTART;TZID=Europe/Berlin:20261027T063000\r
DURATION:PT1H\r
SUMMARY:Alarm\r
END:VEVENT\r
END:VCALENDAR\r
"""
    url = feeds.calendar("/quiet.ics", ics)
    live = settings.with_(enabled=True)
    now = Instant.from_stored("2026-10-26T20:00:00.000Z")
    spec = DeviceSpec("q", TOKEN, 7200, ("lead:0", "lead:0!"), (url,), "Europe/Berlin", (), "22:00-07:00")
    put_device(db, live, spec, now=now)
    build(db, live, now=now)
    got = {(r["title"], r["rule"]): (r["send_after"], r["event_at"]) for r in rows(db)}
    assert got[("Flight", "lead:7200")] == (
        Instant.from_stored("2026-10-27T06:00:00.000Z"),
        Instant.from_stored("2026-10-27T07:00:00.000Z"),
    )  # held to 07:00 CET
    assert got[("Alarm", "lead:0")] == (
        Instant.from_stored("2026-10-27T05:30:00.000Z"),
        Instant.from_stored("2026-10-27T05:30:00.000Z"),
    )
    assert got[("Alarm", "lead:0!")] == (
        Instant.from_stored("2026-10-27T05:30:00.000Z"),
        Instant.from_stored("2026-10-27T05:30:00.000Z"),
    )
    assert got[("Alarm", "lead:7200")] == (
        Instant.from_stored("2026-10-27T03:30:00.000Z"),
        Instant.from_stored("2026-10-27T05:30:00.000Z"),
    )  # 04:30 local, not held
    sender = RecordingSender()
    drain(db, live, sender.factory(), now=Instant.from_stored("2026-10-27T03:30:30.000Z"))
    drain(db, live, sender.factory(), now=Instant.from_stored("2026-10-27T05:30:10.000Z"))
    outcomes = {(r["title"], r["rule"]): r["outcome"] for r in rows(db) if r["status"] == "settled"}
    assert outcomes == {
        ("Alarm", "lead:0"): "quiet_hours",
        ("Alarm", "lead:0!"): "sent",
        ("Alarm", "lead:7200"): "quiet_hours",
    }
    drain(db, live, sender.factory(), now=Instant.from_stored("2026-10-27T06:00:05.000Z"))
    assert {(r["title"], r["rule"]): r["outcome"] for r in rows(db)}[("Flight", "lead:7200")] == "sent"


def test_feed_route_stores_the_zone_only_when_it_changes(served):
    served.put_device("phone-1")
    db = served.db
    assert served.api.get("/v1/devices/phone-1/feed", params={"tz": "Europe/Berlin"}).status_code == 200
    with db.read() as conn:
        assert ledger.get_device(conn, "phone-1").tz_name == "Europe/Berlin"
    with db.write() as conn:
        assert ledger.store_tz_name(conn, "phone-1", "Europe/Berlin") is False  # conditional: nothing written
        assert ledger.store_tz_name(conn, "phone-1", "Asia/Kolkata") is True
    assert served.api.get("/v1/devices/phone-1/feed", params={"tz": "-14400"}).status_code == 200  # old widgets
    with db.read() as conn:
        record = ledger.get_device(conn, "phone-1")
    assert (record.tz_name, record.last_tz_offset_seconds) == ("Asia/Kolkata", -14400)
    for bad in ("Mars/Olympus", "Europe/Berlin/x/y", "../../etc/passwd", "Europe/Berlin\n"):
        r = served.api.get("/v1/devices/phone-1/feed", params={"tz": bad})
        assert r.status_code == 422 and error_of(r)["field"] == "tz", bad


def test_a_zone_is_written_only_when_it_changes(served, db):
    served.put_device("phone-1")
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("UPDATE") or statement.strip().upper() == "BEGIN IMMEDIATE":
            seen.append(statement)

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        assert served.api.get("/v1/devices/phone-1/feed", params={"tz": "America/New_York"}).status_code == 200
        assert len([s for s in seen if "tz_name" in s]) == 1
        seen.clear()
        for _ in range(2):
            assert served.api.get("/v1/devices/phone-1/feed", params={"tz": "America/New_York"}).status_code == 200
        assert seen == []  # unchanged: no UPDATE, and on SQLite not even a write transaction
    finally:
        event.remove(db.engine, "before_cursor_execute", record)


def test_widget_feed_resolves_floating_times_in_the_device_zone(served, feeds):
    """The widget's feed runs on the real clock: a floating 09:00 two days from now, and an
    all-day item that day, come back as New York's 09:00 and midnight, DST exact."""
    day = (datetime.now(UTC) + timedelta(days=2)).date()
    ics = (
        "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nBEGIN:VEVENT\r\nUID:f@w\r\n"
        f"DTSTART:{day:%Y%m%d}T090000\r\nDURATION:PT1H\r\nSUMMARY:Floating\r\nEND:VEVENT\r\n"
        f"BEGIN:VEVENT\r\nUID:a@w\r\nDTSTART;VALUE=DATE:{day:%Y%m%d}\r\nSUMMARY:All day\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"
    )
    served.put_device("phone-1", source_urls=[feeds.calendar("/w.ics", ics)])
    feed = served.api.get("/v1/devices/phone-1/feed", params={"tz": "America/New_York"}).json()
    ny = ZoneInfo("America/New_York")
    got = {i["title"]: (i["startsAt"], i["expiresAt"]) for i in feed["items"]}
    nine = datetime(day.year, day.month, day.day, 9, tzinfo=ny)
    midnight = datetime(day.year, day.month, day.day, tzinfo=ny)
    following = day + timedelta(days=1)
    assert got["Floating"] == (int(nine.timestamp()), int(nine.timestamp()) + 3600)
    assert got["All day"] == (
        int(midnight.timestamp()),
        int(datetime(following.year, following.month, following.day, tzinfo=ny).timestamp()),
    )


def test_device_api_sets_zone_all_day_rules_and_quiet_hours(served):
    r = served.put_device(
        "phone-1", tz="Australia/Lord_Howe", all_day_rules=["day:1@18:00"], quiet_hours="22:30-06:45", alarms=True
    )
    assert r.status_code == 200, r.text
    d = served.api.get("/v1/devices/phone-1").json()
    assert (d["tz_name"], d["all_day_rules"], d["quiet_hours"], d["use_alarms"]) == (
        "Australia/Lord_Howe",
        ["day:1@18:00"],
        "22:30-06:45",
        True,
    )
    served.put_device("phone-1")  # omitted: the zone stays (the widget reports it), the rest take defaults
    d = served.api.get("/v1/devices/phone-1").json()
    assert (d["tz_name"], d["all_day_rules"], d["quiet_hours"], d["use_alarms"]) == (
        "Australia/Lord_Howe",
        ["day:0@09:00"],
        None,
        False,
    )
    for field, value in [
        ("tz", "Nowhere/Land"),
        ("tz", 5),
        ("all_day_rules", ["lead:60"]),
        ("all_day_rules", ["day:0@25:00"]),
        ("quiet_hours", "22-07"),
        ("extra_rules", ["day:0@09:00"]),
        ("alarms", "yes"),
    ]:
        r = served.put_device("phone-1", **{field: value})
        assert r.status_code == 422 and error_of(r)["field"] == field, (field, value, r.text)


def test_cli_device_put_tz(db_url):
    runner = CliRunner()
    env = {"REMINDERS_DATABASE_URL": db_url}
    ok = runner.invoke(
        main,
        [
            "device",
            "put",
            "p",
            "--apns-token",
            TOKEN,
            "--tz",
            "Pacific/Chatham",
            "--all-day-rule",
            "day:2@08:00",
            "--quiet-hours",
            "23:00-06:00",
            "--alarms",
        ],
        env=env,
    )
    assert ok.exit_code == 0, ok.output
    d = json.loads(ok.output)
    assert (d["tz_name"], d["all_day_rules"], d["quiet_hours"], d["use_alarms"]) == (
        "Pacific/Chatham",
        ["day:2@08:00"],
        "23:00-06:00",
        True,
    )
    bad = runner.invoke(main, ["device", "put", "p", "--apns-token", TOKEN, "--tz", "Pacific/Nowhere"], env=env)
    assert bad.exit_code == 2 and "Pacific/Nowhere" in bad.output
    none = runner.invoke(main, ["device", "put", "p", "--apns-token", TOKEN, "--no-all-day-rules"], env=env)
    assert json.loads(none.output)["all_day_rules"] == []


ALARMS = """BEGIN:VCALENDAR\r
VERSION:2.0\r
PRODID:-//alarms//EN\r
BEGIN:VEVENT\r
UID:dentist@alarms\r
DTSTART:20261027T130000Z\r
DURATION:PT1H\r
SUMMARY:Dentist\r
BEGIN:VALARM\r
ACTION:DISPLAY\r
DESCRIPTION:Dentist\r
TRIGGER:-PT15M\r
END:VALARM\r
BEGIN:VALARM\r
ACTION:AUDIO\r
TRIGGER;RELATED=END:-PT5M\r
END:VALARM\r
BEGIN:VALARM\r
ACTION:DISPLAY\r
DESCRIPTION:Dentist\r
TRIGGER;VALUE=DATE-TIME:20261027T090000Z\r
END:VALARM\r
BEGIN:VALARM\r
ACTION:EMAIL\r
TRIGGER:-PT1H\r
END:VALARM\r
BEGIN:VALARM\r
ACTION:DISPLAY\r
TRIGGER:PT10M\r
END:VALARM\r
END:VEVENT\r
BEGIN:VEVENT\r
UID:plain@alarms\r
DTSTART:20261027T150000Z\r
DURATION:PT1H\r
SUMMARY:No alarms\r
END:VEVENT\r
END:VCALENDAR\r
"""


def test_a_device_using_calendar_alarms_gets_what_the_author_asked_for(db, settings, feeds):
    """DISPLAY/AUDIO triggers before the start, before the end and absolute become the item's
    rules; EMAIL and after-the-start triggers are left out; an event without alarms keeps the
    device's rules; a device not using alarms ignores them; a dropped alarm voids its row."""
    url = feeds.calendar("/alarms.ics", ALARMS)
    now = Instant.from_stored("2026-10-27T08:00:00.000Z")
    put_device(db, settings, DeviceSpec("uses", TOKEN, 3600, (), (url,), "UTC", alarms=True), now=now)
    put_device(db, settings, DeviceSpec("ignores", TOKEN, 3600, (), (url,), "UTC"), now=now)
    build(db, settings, now=now)
    got = {(r["device_id"], r["title"], r["rule"]): r["send_after"] for r in rows(db)}
    assert got == {
        ("uses", "Dentist", "lead:900"): Instant.from_stored("2026-10-27T12:45:00.000Z"),
        ("uses", "Dentist", "lead:300@expiry"): Instant.from_stored("2026-10-27T13:55:00.000Z"),
        ("uses", "Dentist", "lead:14400"): Instant.from_stored("2026-10-27T09:00:00.000Z"),
        ("uses", "No alarms", "lead:3600"): Instant.from_stored("2026-10-27T14:00:00.000Z"),
        ("ignores", "Dentist", "lead:3600"): Instant.from_stored("2026-10-27T12:00:00.000Z"),
        ("ignores", "No alarms", "lead:3600"): Instant.from_stored("2026-10-27T14:00:00.000Z"),
    }
    feeds.calendar("/alarms.ics", ALARMS.replace("TRIGGER:-PT15M", "TRIGGER:-PT20M"))
    summary = build(db, settings, now=Instant.from_stored("2026-10-27T08:01:00.000Z"))
    assert summary.rows_voided == {"rule_removed": 1}
    assert {r["rule"] for r in rows(db, status="pending") if r["device_id"] == "uses" and r["title"] == "Dentist"} == {
        "lead:1200",
        "lead:300@expiry",
        "lead:14400",
    }
