"""Declined invitations alert nothing: a device names its person's attendee addresses, and an
event (or one occurrence of a series) one of them declined (``PARTSTAT=DECLINED``) queues no row;
a decline after the build voids the pending rows (``declined``) at the next successful read, and
an invitation accepted again is queued again. End to end on SQLite and PostgreSQL: the CLI
registers and builds, the drain sends to the mock APNs over HTTP/2, and the test reads what
arrived and the rows."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from reminders_pipeline.devices.registration import MAX_ATTENDEES, DeviceError, DeviceSpec, put_device
from reminders_pipeline.domain.items import ParsedFeed, address_digest, address_of
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.sources.ics import parse_ics_feed
from reminders_pipeline.sources.ics_items import MAX_DECLINED

from .support import TOKEN, rows

pytestmark = pytest.mark.usefixtures("fresh_mock")


def _stamp(unix: int) -> str:
    return datetime.fromtimestamp(unix, UTC).strftime("%Y%m%dT%H%M%SZ")


def calendar(starts: int, *, standup: str = "ACCEPTED", review: str = "DECLINED", skip_second: bool = True) -> str:
    """Four invitations to ann: a standup she accepted (or not), a review she declined, a talk
    only bob declined, and an hourly series whose second occurrence she declined alone."""

    def event(uid: str, summary: str, at: int, partstat: str, extra: str = "") -> str:
        return (
            f"BEGIN:VEVENT\r\nUID:{uid}\r\nDTSTAMP:20261201T000000Z\r\nDTSTART:{_stamp(at)}\r\n"
            f"DTEND:{_stamp(at + 1800)}\r\nSUMMARY:{summary}\r\n{extra}"
            f"ORGANIZER:mailto:boss@example.org\r\n"
            f"ATTENDEE;CN=Ann;PARTSTAT={partstat}:MAILTO:Ann@Example.org\r\n"
            f"ATTENDEE;PARTSTAT=ACCEPTED:mailto:carl@example.org\r\nEND:VEVENT\r\n"
        )

    series = event("hourly", "Hourly", starts + 60, "ACCEPTED", "RRULE:FREQ=HOURLY;COUNT=3\r\n")
    skipped = (
        event("hourly", "Hourly", starts + 60 + 3600, "DECLINED", f"RECURRENCE-ID:{_stamp(starts + 60 + 3600)}\r\n")
        if skip_second
        else ""
    )
    talk = (
        f"BEGIN:VEVENT\r\nUID:talk\r\nDTSTAMP:20261201T000000Z\r\nDTSTART:{_stamp(starts + 30)}\r\n"
        f"DTEND:{_stamp(starts + 1830)}\r\nSUMMARY:Talk\r\n"
        f"ATTENDEE;PARTSTAT=DECLINED:mailto:bob@example.org\r\nEND:VEVENT\r\n"
    )
    return (
        "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//test//declined//EN\r\n"
        + event("standup", "Standup", starts, standup)
        + event("review", "Review", starts + 10, review)
        + talk
        + series
        + skipped
        + "END:VCALENDAR\r\n"
    )


def titled(db, device_id: str, title: str) -> list[dict]:
    return [r for r in rows(db, device_id=device_id) if r["title"] == title]


def _titles(requests) -> list[str]:
    return sorted(r.payload["aps"]["alert"]["title"] for r in requests)


def test_a_declined_invitation_alerts_nothing_and_a_later_decline_voids_its_reminder(db, cli, feeds, mock):
    now = Instant.now().whole_seconds
    starts = now + 1200  # lead:1800: every first occurrence is due now
    url = feeds.calendar("/work.ics", calendar(starts, review="ACCEPTED"))
    put = json.loads(
        cli(
            "device", "put", "ann-phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url,
            "--attendee", "MAILTO:Ann@Example.org", "--no-all-day-rules",
        ).output
    )  # fmt: skip
    assert put["attendees"] == ["ann@example.org"]
    cli("build", "--all")
    queued = {r["title"] for r in rows(db, device_id="ann-phone")}
    assert queued == {"Standup", "Review", "Talk", "Hourly"}
    assert len(titled(db, "ann-phone", "Hourly")) == 2  # the declined occurrence has none

    feeds.calendar("/work.ics", calendar(starts, review="DECLINED"))  # ann declines the review
    built = json.loads(cli("build", "--all").output)
    assert built["rows_voided"] == {"declined": 1}
    (review,) = titled(db, "ann-phone", "Review")
    assert (review["status"], review["outcome"], review["outcome_detail"]) == ("settled", "voided", "declined")

    drained = json.loads(cli("drain").output)
    assert drained["outcomes"] == {"sent": 3}
    sent = mock.wait_for_requests(3)
    assert _titles(sent) == ["Hourly", "Standup", "Talk"]
    assert all(r.token == TOKEN for r in sent)


def test_an_invitation_accepted_again_is_queued_again(db, cli, feeds, mock):
    starts = Instant.now().whole_seconds + 1200
    url = feeds.calendar("/work.ics", calendar(starts, standup="DECLINED", skip_second=False))
    cli(
        "device", "put", "ann-phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url,
        "--attendee", "ann@example.org",
    )  # fmt: skip
    cli("build", "--all")
    assert not titled(db, "ann-phone", "Standup")
    feeds.calendar("/work.ics", calendar(starts, standup="ACCEPTED", skip_second=False))
    cli("build", "--all")
    (standup,) = titled(db, "ann-phone", "Standup")
    assert standup["status"] == "pending"
    json.loads(cli("drain").output)
    assert "Standup" in _titles(mock.wait_for_requests(4))


def test_a_device_that_names_no_address_or_another_one_is_alerted_for_every_invitation(db, cli, feeds):
    starts = Instant.now().whole_seconds + 1200
    url = feeds.calendar("/work.ics", calendar(starts))
    cli("device", "put", "anon", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    cli(
        "device",
        "put",
        "carl",
        "--apns-token",
        TOKEN,
        "--lead",
        "1800",
        "--source",
        url,
        "--attendee",
        "carl@example.org",
    )
    cli("build", "--all")
    for device_id in ("anon", "carl"):
        assert {r["title"] for r in rows(db, device_id=device_id)} == {"Standup", "Review", "Talk", "Hourly"}
        assert len(titled(db, device_id, "Hourly")) == 3


def test_adding_an_address_to_a_device_voids_what_it_declined(db, cli, feeds):
    starts = Instant.now().whole_seconds + 1200
    url = feeds.calendar("/work.ics", calendar(starts))
    base = ("device", "put", "ann-phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    cli(*base)
    cli("build", "--all")
    cli(*base, "--attendee", "ann@example.org")
    built = json.loads(cli("build", "--all").output)
    assert built["rows_voided"] == {"declined": 2}  # the review, and the series' second occurrence


@pytest.mark.parametrize(
    "address, message",
    [("ann", "not an email address"), ("ann @x.org", "not an email address"), ("a@" + "x" * 300, "not an email")],
)
def test_a_bad_address_exits_2_and_stores_nothing(cli, address, message):
    out = cli("device", "put", "p", "--apns-token", TOKEN, "--attendee", address, code=2).output
    assert message in out
    assert json.loads(cli("device", "list").output) == []


def test_an_address_is_compared_as_its_mailbox():
    assert {address_of(a) for a in ("MAILTO:Ann@X.org", "mailto: ann@x.org", " ann@X.ORG ")} == {"ann@x.org"}


def test_too_many_addresses_are_refused(db, settings):
    spec = DeviceSpec("p", TOKEN, attendees=[f"a{i}@x.org" for i in range(MAX_ATTENDEES + 1)])
    with pytest.raises(DeviceError, match="attendees"):
        put_device(db, settings, spec)


def test_an_event_keeps_at_most_max_declined_addresses_and_survives_the_cache():
    attendees = "".join(f"ATTENDEE;PARTSTAT=DECLINED:mailto:p{i:03d}@x.org\r\n" for i in range(MAX_DECLINED + 10))
    body = (
        "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nBEGIN:VEVENT\r\nUID:big\r\nDTSTART:20270101T100000Z\r\n"
        f"SUMMARY:All hands\r\n{attendees}ATTENDEE;PARTSTAT=TENTATIVE:mailto:t@x.org\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"
    ).encode()
    start = int(datetime(2026, 12, 1, tzinfo=UTC).timestamp())
    feed = parse_ics_feed(body, start, start + 90 * 86400)
    (item,) = feed.items
    assert len(item.declined) == MAX_DECLINED and item.declined == tuple(sorted(item.declined))
    assert address_digest("t@x.org") not in item.declined and address_digest("p000@x.org") in item.declined
    assert len(feed.to_json()) < 4000  # 32 short digests, not the addresses
    assert ParsedFeed.from_json(feed.to_json()).items == feed.items


def test_the_http_contract_takes_attendees_and_the_widget_feed_marks_what_they_declined(served, feeds):
    starts = Instant.now().whole_seconds + 1200
    url = feeds.calendar("/work.ics", calendar(starts))
    r = served.put_device("ann-phone", source_urls=[url], attendees=["mailto:ANN@example.org"])
    assert r.status_code == 200, r.text
    assert served.api.get("/v1/devices/ann-phone").json()["attendees"] == ["ann@example.org"]
    feed = served.api.get("/v1/devices/ann-phone/feed").json()
    declined = {(i["title"], i["declined"]) for i in feed["items"]}
    assert declined == {("Standup", False), ("Review", True), ("Talk", False), ("Hourly", False), ("Hourly", True)}
    for bad in (["not-an-address"], "ann@example.org", [f"a{i}@x.org" for i in range(MAX_ATTENDEES + 1)]):
        r = served.put_device("ann-phone", attendees=bad)
        assert r.status_code == 422 and r.json()["field"] == "attendees", r.text
