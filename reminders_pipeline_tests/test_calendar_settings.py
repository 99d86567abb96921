"""Settings per calendar subscription: a calendar's own rules (kind by kind before the device's,
after the event's own alarms), its interruption level, breaking through quiet hours, muted; and
``thread-id`` per calendar. End to end on SQLite and PostgreSQL: the CLI and the device API
register, the build queues, the drain sends to the mock APNs over HTTP/2, and the test reads the
payloads and the rows."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from reminders_pipeline.domain.notification import sent_payload
from reminders_pipeline.domain.times import Instant

from .support import TOKEN, recorded, rows

pytestmark = pytest.mark.usefixtures("fresh_mock")


def items(prefix: str, starts: int, n: int = 2) -> list[dict]:
    return [
        {"id": f"{prefix}{i}", "title": f"{prefix} {i}", "startsAt": starts + i, "expiresAt": starts + 1800}
        for i in range(n)
    ]


def by_source(db, device_id: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in rows(db, device_id=device_id):
        out.setdefault(r["source_id"], []).append(r)
    return out


def test_each_calendar_alerts_with_its_own_rules_level_and_thread(db, cli, feeds, mock):
    starts = Instant.now().whole_seconds + 500  # lead:600 and lead:1800 are both due now
    work = feeds.items("/work.json", items("work", starts))
    family = feeds.items("/family.json", items("family", starts))
    hobby = feeds.items("/hobby.json", items("hobby", starts))
    put = json.loads(
        cli(
            "device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800",
            "--source", work, "--source", family, "--source", hobby,
            "--calendar-rule", work, "lead:600", "--calendar-level", work, "passive", "--calendar-muted", hobby,
        ).output
    )  # fmt: skip
    assert {c["url"]: (c["rules"], c["interruption_level"], c["muted"]) for c in put["calendars"]} == {
        work: (["lead:600"], "passive", False),
        hobby: (None, None, True),
    }
    cli("build", "--all")
    queued = {(r["title"].split()[0], r["rule"]) for r in rows(db, device_id="phone")}
    assert queued == {("work", "lead:600"), ("family", "lead:1800")}

    assert json.loads(cli("drain").output)["outcomes"] == {"sent": 4}
    sent = mock.wait_for_requests(4)
    aps = {r.payload["aps"]["alert"]["title"]: r.payload["aps"] for r in sent}
    assert {t: a["interruption-level"] for t, a in aps.items()} == {
        "work 0": "passive", "work 1": "passive", "family 0": "time-sensitive", "family 1": "time-sensitive",
    }  # fmt: skip
    threads = {t.split()[0]: a["thread-id"] for t, a in aps.items()}
    assert len({a["thread-id"] for a in aps.values()}) == 2 and threads["work"] != threads["family"]
    assert aps["work 0"]["thread-id"] == aps["work 1"]["thread-id"]

    # What the ledger shows was sent is what was sent, byte for byte, for either kind of record.
    for row in rows(db, device_id="phone"):
        request = next(r for r in sent if r.payload["aps"]["alert"]["title"] == row["title"])
        assert json.loads(row["payload"])["payload"] == recorded(request.payload)


def test_muting_a_calendar_voids_its_pending_reminders_at_once_and_unmuting_queues_them_again(db, cli, feeds, mock):
    starts = Instant.now().whole_seconds + 7200
    work = feeds.items("/work.json", items("work", starts))
    base = ("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", work)
    cli(*base)
    cli("build", "--all")
    assert {r["status"] for r in rows(db, device_id="phone")} == {"pending"}
    cli(*base, "--calendar-muted", work)
    assert {(r["status"], r["outcome_detail"]) for r in rows(db, device_id="phone")} == {("settled", "muted")}
    built = json.loads(cli("build", "--all").output)
    assert built["rows_inserted"] == 0 and built["rows_updated"] == 0
    cli(*base)
    cli("build", "--all")
    assert {r["status"] for r in rows(db, device_id="phone")} == {"pending"}


def test_a_row_queued_again_as_its_calendar_was_muted_is_voided_at_the_claim(db, cli, feeds, mock):
    from sqlalchemy import update

    from reminders_pipeline.ledger.schema import device_sources

    starts = Instant.now().whole_seconds + 600
    work = feeds.items("/work.json", items("work", starts, 1))
    cli("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", work)
    cli("build", "--all")
    with db.write() as conn:  # muted without the registration's voiding: a build that read the device before
        conn.execute(update(device_sources).values(muted=1))
    assert json.loads(cli("drain").output)["outcomes"] == {"voided": 1}
    (row,) = rows(db, device_id="phone")
    assert row["outcome_detail"] == "muted" and mock.requests == []


def _quiet_around_now() -> str:
    now = datetime.now(UTC)
    start, end = (now.hour - 1) % 24, (now.hour + 2) % 24
    return f"{start:02d}:00-{end:02d}:00"


def test_a_calendar_that_breaks_through_quiet_hours_is_sent_inside_them(db, cli, feeds, mock):
    starts = Instant.now().whole_seconds + 600
    work = feeds.items("/work.json", items("work", starts, 1))
    family = feeds.items("/family.json", items("family", starts, 1))
    cli(
        "device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--tz", "UTC",
        "--source", work, "--source", family, "--quiet-hours", _quiet_around_now(),
        "--calendar-breakthrough", family,
    )  # fmt: skip
    cli("build", "--all")
    drained = json.loads(cli("drain").output)
    assert drained["outcomes"] == {"sent": 1, "quiet_hours": 1}
    (request,) = mock.wait_for_requests(1)
    assert request.payload["aps"]["alert"]["title"] == "family 0"


ALARMED = (
    "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//t//t//EN\r\n"
    "BEGIN:VEVENT\r\nUID:a\r\nDTSTART:{start}\r\nDTEND:{end}\r\nSUMMARY:Alarmed\r\n"
    "BEGIN:VALARM\r\nACTION:DISPLAY\r\nDESCRIPTION:x\r\nTRIGGER:-PT5M\r\nEND:VALARM\r\nEND:VEVENT\r\n"
    "BEGIN:VEVENT\r\nUID:b\r\nDTSTART:{start}\r\nDTEND:{end}\r\nSUMMARY:Plain\r\nEND:VEVENT\r\n"
    "END:VCALENDAR\r\n"
)


def test_an_events_own_alarms_come_before_the_calendars_rules_which_come_before_the_devices(db, cli, feeds):
    starts = Instant.now().whole_seconds + 7200
    stamp = "%Y%m%dT%H%M%SZ"
    body = ALARMED.format(
        start=datetime.fromtimestamp(starts, UTC).strftime(stamp),
        end=datetime.fromtimestamp(starts + 1800, UTC).strftime(stamp),
    )
    cal = feeds.calendar("/cal.ics", body)
    other = feeds.items("/other.json", items("other", starts, 1))
    cli(
        "device", "put", "phone", "--apns-token", TOKEN, "--lead", "3600", "--alarms", "--no-all-day-rules",
        "--source", cal, "--source", other, "--calendar-rule", cal, "lead:900", "--calendar-rule", cal, "day:1@18:00",
    )  # fmt: skip
    cli("build", "--all")
    assert {(r["title"], r["rule"]) for r in rows(db, device_id="phone")} == {
        ("Alarmed", "lead:300"),  # the event's own alarm
        ("Plain", "lead:900"),  # the calendar's lead rule
        ("other 0", "lead:3600"),  # the device's
    }


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--calendar-rule", "https://elsewhere.example/x.ics", "lead:60"], "not among the device's sources"),
        (["--calendar-rule", "{url}", "lead:-5"], "negative"),
        (["--calendar-level", "{url}", "critical"], "critical"),
        (["--calendar-level", "{url}", "passive", "--calendar-level", "{url}", "active"], "one level per source"),
    ],
)
def test_a_bad_calendar_setting_exits_2_and_stores_nothing(cli, feeds, extra, message):
    url = feeds.items("/a.json", [])
    args = [a.format(url=url) for a in extra]
    out = cli("device", "put", "p", "--apns-token", TOKEN, "--source", url, *args, code=2).output
    assert message in out
    assert json.loads(cli("device", "list").output) == []


def test_the_device_api_takes_and_shows_calendar_settings(served, feeds):
    a, b = feeds.items("/a.json", []), feeds.items("/b.json", [])
    calendars = [{"url": a, "rules": ["lead:300", "day:0@08:00"], "interruption_level": "active", "breakthrough": True}]
    r = served.put_device("phone", source_urls=[a, b], calendars=calendars)
    assert r.status_code == 200, r.text
    shown = served.api.get("/v1/devices/phone").json()["calendars"]
    assert shown == [
        {
            "url": a,
            "rules": ["lead:300", "day:0@08:00"],
            "interruption_level": "active",
            "breakthrough": True,
            "muted": False,
            "travel_seconds": None,
        }
    ]
    for bad in (
        [{"url": "https://not-subscribed.example/x.json"}],
        [{"url": a, "rules": ["lead:x"]}],
        [{"url": a, "interruption_level": "critical"}],
    ):
        r = served.put_device("phone", source_urls=[a, b], calendars=bad)
        assert r.status_code == 422 and r.json()["field"].startswith("calendars"), r.text
    assert served.api.get("/v1/devices/phone").json()["calendars"] == shown  # nothing was written


def test_a_row_sent_before_thread_ids_per_calendar_still_shows_its_own():
    stored = {
        "id": 1, "device_id": "d", "source_id": 7, "item_id": "7:e", "rule": "lead:3600", "title": "T",
        "body": None, "payload": None, "sent_body": "Starts at 12:00",
        "event_at": Instant.from_stored("2026-09-10T10:00:00.000Z"),
        "expires_at": Instant.from_stored("2026-09-10T11:00:00.000Z"),
    }  # fmt: skip
    legacy = json.loads(sent_payload({**stored, "sent_format": None}))
    current = json.loads(sent_payload({**stored, "sent_format": 2}))
    assert legacy["payload"]["aps"]["thread-id"] == "7:e"
    assert current["payload"]["aps"]["thread-id"] == "calendar-7"
