"""The morning agenda (``agenda@HH:MM``), end to end on SQLite and PostgreSQL: the CLI registers
and builds, the drain sends to the mock APNs over HTTP/2, and the test reads the payloads and the
rows: one row per device per local day, at that local time through DST, none on an empty day."""

from __future__ import annotations

import json

import pytest

from reminders_pipeline.domain.times import Instant

from .support import TOKEN, rows

pytestmark = pytest.mark.usefixtures("fresh_mock")

DAY = Instant.from_stored("2026-09-10T00:00:00.000Z").whole_seconds  # a Thursday


def event(item_id: str, starts: int, minutes: int = 30, title: str | None = None) -> dict:
    return {"id": item_id, "title": title or item_id.title(), "startsAt": starts, "expiresAt": starts + minutes * 60}


def ics_all_day(uid: str, date: str, summary: str) -> str:
    return f"BEGIN:VEVENT\r\nUID:{uid}\r\nDTSTAMP:20260901T000000Z\r\nDTSTART;VALUE=DATE:{date}\r\nSUMMARY:{summary}\r\nEND:VEVENT\r\n"


def calendar(*events: str) -> str:
    return "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//test//EN\r\n" + "".join(events) + "END:VCALENDAR\r\n"


def agendas(db, device_id: str = "phone") -> dict[str, dict]:
    return {r["item_id"]: r for r in rows(db, device_id=device_id) if r["rule"] == "agenda"}


def put(cli, *args: str) -> dict:
    return json.loads(cli("device", "put", "phone", "--apns-token", TOKEN, "--lead", "600", *args).output)


def test_the_agenda_lists_the_days_events_at_its_local_time_once(db, cli, feeds, mock):
    # Berlin is UTC+2: 07:00 local is 05:00Z. Two timed events today, one tomorrow, a holiday today.
    timed = feeds.items(
        "/work.json",
        [
            event("standup", DAY + 7 * 3600),
            event("review", DAY + 9 * 3600 + 1800),
            event("later", DAY + 86400 + 8 * 3600),
        ],
    )
    holiday = feeds.calendar("/holidays.ics", calendar(ics_all_day("h1", "20260910", "Reunification rehearsal")))
    put(cli, "--source", timed, "--source", holiday, "--tz", "Europe/Berlin", "--rule", "agenda@07:00")
    cli("build", "--all", "--now", "2026-09-10T03:00:00Z")
    (today,) = agendas(db).values()
    assert today["item_id"] == "agenda:2026-09-10"
    assert today["send_after"] == Instant.from_stored("2026-09-10T05:00:00.000Z")
    assert (today["title"], today["body"]) == (
        "Today: 3 events",
        "Reunification rehearsal · 09:00 Standup · 11:30 Review",
    )

    cli("drain", "--now", "2026-09-10T04:59:59Z")
    assert not [r for r in mock.requests if r.payload["reminder"]["rule"] == "agenda"]  # never early
    assert json.loads(cli("drain", "--now", "2026-09-10T05:00:01Z").output)["kinds"] == {"agenda:sent": 1}
    (sent,) = [r for r in mock.wait_for_requests(1) if r.payload["reminder"]["rule"] == "agenda"]
    assert sent.payload["aps"]["alert"] == {"title": "Today: 3 events", "body": today["body"]}
    assert sent.payload["aps"]["category"] == "REMINDER" and sent.payload["aps"]["thread-id"] == "agenda:2026-09-10"

    # Rebuilt, and rebuilt after the device moves to Tokyo: still one agenda for that day, sent once.
    cli("build", "--all", "--now", "2026-09-10T06:00:00Z")
    put(cli, "--source", timed, "--source", holiday, "--tz", "Asia/Tokyo", "--rule", "agenda@07:00")
    cli("build", "--all", "--now", "2026-09-10T06:30:00Z")
    cli("drain", "--now", "2026-09-10T07:00:00Z")
    assert agendas(db)["agenda:2026-09-10"]["outcome"] == "sent"
    assert len([r for r in mock.requests if r.payload["reminder"]["rule"] == "agenda"]) == 1


def test_no_agenda_on_an_empty_day_and_one_whose_day_empties_is_voided(db, cli, feeds):
    url = feeds.items("/a.json", [event("dentist", DAY + 86400 + 10 * 3600)])  # tomorrow only
    put(cli, "--source", url, "--rule", "agenda@07:00")  # UTC
    cli("build", "--all", "--now", "2026-09-10T06:30:00Z")  # today's 07:00 is ahead, and today is empty
    assert agendas(db) == {}
    cli("build", "--all", "--now", "2026-09-10T07:30:00Z")  # the horizon (a day) reaches tomorrow's
    assert set(agendas(db)) == {"agenda:2026-09-11"}
    feeds.items("/a.json", [])
    cli("build", "--all", "--now", "2026-09-10T07:40:00Z")
    emptied = agendas(db)["agenda:2026-09-11"]
    assert (emptied["outcome"], emptied["outcome_detail"]) == ("voided", "empty_day")


def test_a_feed_changed_in_one_event_replans_that_event_and_every_agenda_in_the_horizon(db, cli, feeds):
    """A re-plan by item reads only the changed event's rows and the device's agendas, and decides
    each day again: here the event is retitled, then moved off its day (that day's agenda is
    voided, the new day's made), as a full plan from the same feed would."""
    work = feeds.items("/work.json", [event("standup", DAY + 9 * 3600), event("lunch", DAY + 12 * 3600)])
    other = feeds.items("/other.json", [event("gym", DAY + 18 * 3600)])
    put(cli, "--source", work, "--source", other, "--rule", "agenda@07:00", "--tz", "UTC")
    cli("build", "--all", "--now", "2026-09-10T06:00:00Z")
    assert agendas(db)["agenda:2026-09-10"]["body"] == "09:00 Standup · 12:00 Lunch · 18:00 Gym"

    feeds.items("/other.json", [event("gym", DAY + 18 * 3600, title="Swim")])
    changed = json.loads(cli("build", "--all", "--now", "2026-09-10T06:15:00Z").output)
    assert (changed["devices_items_replanned"], changed["rows_updated"]) == (1, 2)  # the event's and the agenda
    assert agendas(db)["agenda:2026-09-10"]["body"] == "09:00 Standup · 12:00 Lunch · 18:00 Swim"

    feeds.items("/work.json", [event("standup", DAY + 86400 + 9 * 3600)])  # lunch gone, standup tomorrow
    feeds.items("/other.json", [event("gym", DAY + 2 * 86400 + 18 * 3600, title="Swim")])
    moved = json.loads(cli("build", "--all", "--now", "2026-09-10T06:50:00Z").output)
    assert moved["devices_items_replanned"] == 1
    assert moved["rows_voided"] == {"left_feed": 1, "out_of_horizon": 2, "empty_day": 1}
    assert agendas(db)["agenda:2026-09-10"]["outcome_detail"] == "empty_day"
    step = json.loads(cli("build", "--all", "--now", "2026-09-10T07:05:00Z").output)
    assert step["devices_unchanged"] == 1
    assert agendas(db)["agenda:2026-09-11"]["body"] == "09:00 Standup"


def test_an_agenda_held_for_quiet_hours_past_its_time_is_left_to_the_drain_by_a_full_plan(db, cli, feeds, mock):
    """06:30 falls in the quiet hours to 07:00: the row waits until 07:00. A full plan between the
    two (here after a new registration) neither voids nor re-times it, and it is sent at 07:00."""
    url = feeds.items("/a.json", [event("standup", DAY + 9 * 3600)])
    args = ("--source", url, "--rule", "agenda@06:30", "--tz", "UTC", "--quiet-hours", "22:00-07:00")
    put(cli, *args)
    cli("build", "--all", "--now", "2026-09-10T06:00:00Z")
    assert agendas(db)["agenda:2026-09-10"]["send_after"] == Instant.from_stored("2026-09-10T07:00:00.000Z")
    put(cli, *args)  # a registration: the next build plans in full
    full = json.loads(cli("build", "--all", "--now", "2026-09-10T06:45:00Z").output)
    assert full["rows_voided"] == {} and agendas(db)["agenda:2026-09-10"]["status"] == "pending"
    assert json.loads(cli("drain", "--now", "2026-09-10T07:00:01Z").output)["kinds"] == {"agenda:sent": 1}


def test_the_agenda_follows_the_zone_through_dst_nights(db, cli, feeds):
    # New York falls back on 2026-11-01 (01:30 happens twice) and springs forward on 2027-03-14
    # (02:30 never happens): one row per day, at the first 01:30 and at the jump past 02:30.
    url = feeds.items(
        "/a.json",
        [event("fall", Instant.from_stored("2026-11-01T15:00:00.000Z").whole_seconds),
         event("spring", Instant.from_stored("2027-03-14T15:00:00.000Z").whole_seconds)],
    )  # fmt: skip
    put(cli, "--source", url, "--tz", "America/New_York", "--rule", "agenda@01:30")
    cli("build", "--all", "--now", "2026-11-01T03:00:00Z")
    cli("build", "--all", "--now", "2026-11-01T05:45:00Z")  # between the two 01:30s
    assert agendas(db)["agenda:2026-11-01"]["send_after"] == Instant.from_stored("2026-11-01T05:30:00.000Z")
    put(cli, "--source", url, "--tz", "America/New_York", "--rule", "agenda@02:30")
    cli("build", "--all", "--now", "2027-03-14T05:00:00Z")
    assert agendas(db)["agenda:2027-03-14"]["send_after"] == Instant.from_stored("2027-03-14T07:30:00.000Z")
    assert len(agendas(db)) == 2


def test_the_agenda_speaks_the_devices_language_and_clock(db, cli, feeds, mock):
    url = feeds.items("/a.json", [event("zahnarzt", DAY + 12 * 3600, title="Zahnarzt")] * 1)
    put(cli, "--source", url, "--tz", "Europe/Berlin", "--rule", "agenda@07:00", "--locale", "de-DE")
    cli("build", "--all", "--now", "2026-09-10T03:00:00Z")
    (today,) = agendas(db).values()
    assert (today["title"], today["body"]) == ("Heute: 1 Termin", "14:00 Zahnarzt")
    put(cli, "--source", url, "--tz", "Europe/Berlin", "--rule", "agenda@07:00", "--locale", "en-US")
    cli("build", "--all", "--now", "2026-09-10T03:10:00Z")
    assert agendas(db)["agenda:2026-09-10"]["body"] == "2:00 PM Zahnarzt"


def test_more_events_than_listed_are_counted_and_declined_or_muted_ones_left_out(db, cli, feeds):
    many = [event(f"e{i}", DAY + (8 + i) * 3600) for i in range(5)]
    work = feeds.items("/work.json", many)
    hobby = feeds.items("/hobby.json", [event("climbing", DAY + 18 * 3600)])
    declined = (
        "BEGIN:VEVENT\r\nUID:i1\r\nDTSTAMP:20260901T000000Z\r\nDTSTART:20260910T160000Z\r\nDURATION:PT1H\r\n"
        "SUMMARY:Budget\r\nATTENDEE;PARTSTAT=DECLINED:mailto:me@example.com\r\nEND:VEVENT\r\n"
    )
    invites = feeds.calendar("/invites.ics", calendar(declined))
    put(
        cli, "--source", work, "--source", hobby, "--source", invites, "--tz", "UTC", "--rule", "agenda@07:00",
        "--calendar-muted", hobby, "--attendee", "me@example.com",
    )  # fmt: skip
    cli("build", "--all", "--now", "2026-09-10T03:00:00Z")
    (today,) = agendas(db).values()
    assert (today["title"], today["body"]) == ("Today: 5 events", "08:00 E0 · 09:00 E1 · 10:00 E2 · +2")


def test_an_agenda_rule_is_checked_like_any_rule(cli):
    for bad, why in (("agenda@25:00", "00:00 to 23:59"), ("agenda", "names its time")):
        out = cli("device", "put", "phone", "--apns-token", TOKEN, "--rule", bad, code=2).output
        assert why in out, out
    out = cli(
        "device", "put", "phone", "--apns-token", TOKEN, "--rule", "agenda@07:00", "--rule", "agenda@08:00", code=2
    ).output
    assert "at most one agenda" in out


def test_a_new_zone_never_leaves_an_agenda_at_the_old_zones_time(db, cli, feeds):
    url = feeds.items("/a.json", [event("standup", DAY + 86400 + 15 * 3600)])  # tomorrow, 15:00Z
    put(cli, "--source", url, "--tz", "Europe/Berlin", "--rule", "agenda@07:00")
    cli("build", "--all", "--now", "2026-09-10T05:00:00Z")  # tomorrow's 07:00 in Berlin is 05:00Z: in the horizon
    assert agendas(db)["agenda:2026-09-11"]["send_after"] == Instant.from_stored("2026-09-11T05:00:00.000Z")
    put(cli, "--source", url, "--tz", "America/New_York", "--rule", "agenda@07:00")
    cli("build", "--all", "--now", "2026-09-10T05:10:00Z")  # New York's 07:00 (11:00Z) is past the horizon
    moved = agendas(db)["agenda:2026-09-11"]
    assert (moved["status"], moved["outcome_detail"]) == ("settled", "out_of_horizon")
    cli("build", "--all", "--now", "2026-09-10T12:00:00Z")  # reached: queued again at New York's time
    again = agendas(db)["agenda:2026-09-11"]
    assert (again["status"], again["send_after"]) == ("pending", Instant.from_stored("2026-09-11T11:00:00.000Z"))


def test_a_snoozed_agenda_says_the_day_as_last_read(db, cli, feeds, mock):
    """Issue 38 (3): the agenda went at 07:00 and was snoozed an hour; then Standup is cancelled.
    The snooze is re-planned with the day's agenda and says what the day now holds; a day left
    empty voids it ``empty_day``, and an event back on the day brings it back. (Before: it
    repeated "10:00 Standup · 11:00 Review".)"""
    url = feeds.items("/a.json", [event("standup", DAY + 10 * 3600), event("review", DAY + 11 * 3600)])
    put(cli, "--source", url, "--rule", "agenda@07:00", "--tz", "UTC")
    cli("build", "--all", "--now", "2026-09-10T06:30:00Z")
    cli("drain", "--now", "2026-09-10T07:00:01Z")
    (sent,) = [r for r in mock.wait_for_requests(1) if r.payload["reminder"]["rule"] == "agenda"]
    assert sent.payload["aps"]["alert"]["body"] == "10:00 Standup · 11:00 Review"
    row_id = str(sent.payload["reminder"]["id"])
    made = json.loads(
        cli("queue", "snooze", "phone", row_id, "--seconds", "3600", "--now", "2026-09-10T07:01:00Z").output
    )

    def snoozed() -> dict:
        (row,) = [r for r in rows(db, device_id="phone") if r["rule"] == "snooze:1"]
        assert row["id"] == made["snooze"]["id"] and row["send_after"].whole_seconds == made["snooze"]["send_after"]
        return row

    feeds.items("/a.json", [event("review", DAY + 11 * 3600)])  # Standup cancelled
    cli("build", "--all", "--now", "2026-09-10T07:20:00Z")
    assert (snoozed()["status"], snoozed()["title"], snoozed()["body"]) == ("pending", "Today: 1 event", "11:00 Review")

    feeds.items("/a.json", [event("review", DAY + 86400 + 11 * 3600)])  # Review moved to tomorrow: today is empty
    cli("build", "--all", "--now", "2026-09-10T07:30:00Z")
    assert (snoozed()["outcome"], snoozed()["outcome_detail"]) == ("voided", "empty_day")

    feeds.items("/a.json", [event("review", DAY + 11 * 3600, title="Review (back)")])
    cli("build", "--all", "--now", "2026-09-10T07:40:00Z")
    assert (snoozed()["status"], snoozed()["body"]) == ("pending", "11:00 Review (back)")
    cli("drain", "--now", "2026-09-10T08:01:01Z")
    (again,) = [r for r in mock.wait_for_requests(2) if r.payload["reminder"]["rule"] == "snooze:1"]
    assert again.payload["aps"]["alert"] == {"title": "Today: 1 event", "body": "11:00 Review (back)"}


def test_a_snooze_due_before_the_next_build_says_the_day_as_last_read(db, cli, feeds, mock):
    """Issue 38 (3): the agenda went; a build reads Standup cancelled; the agenda is snoozed 5
    minutes and drained before any build re-plans the snooze. It lists the day as last read, not
    the agenda's old words. (Before: "10:00 Standup · 11:00 Review" again.)"""
    url = feeds.items("/a.json", [event("standup", DAY + 10 * 3600), event("review", DAY + 11 * 3600)])
    put(cli, "--source", url, "--rule", "agenda@07:00", "--tz", "UTC")
    cli("build", "--all", "--now", "2026-09-10T06:30:00Z")
    cli("drain", "--now", "2026-09-10T07:00:01Z")
    (sent,) = mock.wait_for_requests(1)
    feeds.items("/a.json", [event("review", DAY + 11 * 3600)])
    cli("build", "--all", "--now", "2026-09-10T07:10:00Z")
    row_id = str(sent.payload["reminder"]["id"])
    cli("queue", "snooze", "phone", row_id, "--seconds", "300", "--now", "2026-09-10T07:11:00Z")
    cli("drain", "--now", "2026-09-10T07:16:01Z")
    (again,) = [r for r in mock.wait_for_requests(2) if r.payload["reminder"]["rule"] == "snooze:1"]
    assert again.payload["aps"]["alert"] == {"title": "Today: 1 event", "body": "11:00 Review"}


def test_a_snooze_of_an_agenda_whose_day_was_read_empty_is_refused(db, cli, feeds, mock):
    """Issue 38 (3): the agenda went; a build reads the day's only event cancelled. A snooze of
    the agenda is refused as a snooze of a cancelled event is (409 ``event_changed``), and nothing
    is queued: before, it was made and, due before the next build, sent with the old words."""
    url = feeds.items("/a.json", [event("standup", DAY + 10 * 3600)])
    put(cli, "--source", url, "--rule", "agenda@07:00", "--tz", "UTC")
    cli("build", "--all", "--now", "2026-09-10T06:30:00Z")
    cli("drain", "--now", "2026-09-10T07:00:01Z")
    (sent,) = mock.wait_for_requests(1)
    feeds.items("/a.json", [])
    cli("build", "--all", "--now", "2026-09-10T07:10:00Z")
    before = rows(db, device_id="phone")
    row_id = str(sent.payload["reminder"]["id"])
    refused = cli("queue", "snooze", "phone", row_id, "--seconds", "300", "--now", "2026-09-10T07:11:00Z", code=1)
    assert "event_changed" in refused.output
    assert rows(db, device_id="phone") == before
