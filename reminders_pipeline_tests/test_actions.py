"""Snooze and Done on a sent alert, end to end on SQLite and PostgreSQL: the device API registers
and acts with the device's own credential, the CLI builds and drains to the mock APNs over HTTP/2,
and the test reads the payloads the mock received and the rows."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from reminders_pipeline.domain.action_tokens import CATEGORY, action_token
from reminders_pipeline.domain.rules import MAX_SNOOZES
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.planning.build import build

from .support import recorded, rows
from .test_http_support import APNS_TOKEN, http_settings

pytestmark = pytest.mark.usefixtures("fresh_mock")


@pytest.fixture
def phone(serve, settings, feeds):
    """A registered device whose item starts in 10 minutes and whose ``lead:1800`` is due now; the
    served app and the device's own client."""
    served = serve(http_settings(settings))
    starts = Instant.now().whole_seconds + 600
    url = feeds.items(
        "/a.json", [{"id": "standup", "title": "Standup", "startsAt": starts, "expiresAt": starts + 1800}]
    )
    body = {"apns_token": APNS_TOKEN, "source_urls": [url], "reminder_lead_seconds": 1800, "extra_rules": ["lead:300"]}
    registered = served.api.put("/v1/devices/phone", json=body)
    assert registered.status_code == 200, registered.text
    served.url_of_feed = url
    served.starts = starts
    served.device = served.as_device(registered.json()["credential"])
    return served


def sent_alert(cli, mock, count: int = 1):
    """Build, drain, and the last alert the mock received (``count`` in all so far)."""
    cli("build", "--all")
    cli("drain")
    received = mock.wait_for_requests(count)
    assert len(received) == count, [r.payload for r in received]
    return received[-1].payload


def act(phone, row_id: int, action: str, **body):
    return phone.device.post(f"/v1/devices/phone/reminders/{row_id}/{action}", json=body)


def row_of(db, rule: str) -> dict:
    (row,) = [r for r in rows(db, device_id="phone") if r["rule"] == rule]
    return row


def test_an_alert_carries_the_category_its_row_and_a_token_the_ledger_never_shows(db, cli, mock, phone):
    payload = sent_alert(cli, mock)
    sent = row_of(db, "lead:1800")
    assert payload["aps"]["category"] == CATEGORY == "REMINDER"
    assert payload["reminder"]["id"] == sent["id"] and sent["outcome"] == "sent"
    token = payload["reminder"]["token"]
    digest, _, shown_at = token.partition(".")
    assert len(digest) == 32 and int(shown_at) == payload["reminder"]["starts_at"] == sent["event_at"].whole_seconds
    assert token != action_token("", "phone", sent["id"], sent["event_at"])
    shown = json.loads(sent["payload"])["payload"]
    assert "token" not in shown["reminder"] and token not in sent["payload"]
    assert "token" not in recorded(payload)["reminder"] and shown == recorded(payload)


def test_a_token_naming_another_instant_acts_on_nothing(db, cli, mock, phone):
    """The instant in the token is signed with the rest: changed, the token is not this alert's."""
    payload = sent_alert(cli, mock)
    digest, _, shown_at = payload["reminder"]["token"].partition(".")
    forged_tokens = (
        f"{digest}.{int(shown_at) + 3600}",
        digest,
        f"{digest}.",
        f"{digest}.x{shown_at}",
        f"{digest}.999999999999",
    )
    for forged in forged_tokens:
        r = act(phone, payload["reminder"]["id"], "done", token=forged)
        assert (r.status_code, r.json()["error"]) == (401, "wrong_action_token"), (forged, r.text)
    assert row_of(db, "lead:1800")["outcome"] == "sent"


def test_a_signed_token_naming_the_ends_of_time_is_answered(db, cli, mock, phone):
    """Whoever holds the credential can sign any instant: one at 1970 or 9999 settles nothing of
    this alert's event and is answered, never a 500."""
    from sqlalchemy import select

    from reminders_pipeline.domain.times import MAX_UNIX
    from reminders_pipeline.ledger.schema import devices

    payload = sent_alert(cli, mock)
    row_id = payload["reminder"]["id"]
    with db.read() as conn:
        key = conn.scalar(select(devices.c.credential_hash).where(devices.c.id == "phone"))
    for at in (0, 5, MAX_UNIX):
        r = act(phone, row_id, "done", token=action_token(key, "phone", row_id, Instant.from_unix(at)))
        assert (r.status_code, r.json()["acknowledged"]) == (200, 0), r.text
    assert [r["status"] for r in rows(db, device_id="phone") if r["rule"] != "lead:1800"] == ["pending"] * (
        len(rows(db, device_id="phone")) - 1
    )


def test_snooze_queues_one_row_sent_at_its_time_and_snoozing_it_again_makes_the_next(db, cli, mock, phone):
    payload = sent_alert(cli, mock)
    token, row_id = payload["reminder"]["token"], payload["reminder"]["id"]
    r = act(phone, row_id, "snooze", token=token, seconds=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["created"] is True and answer["snooze"]["rule"] == "snooze:1"
    snoozed = row_of(db, "snooze:1")
    assert snoozed["status"] == "pending" and snoozed["id"] == answer["snooze"]["id"]
    assert abs(snoozed["send_after"].whole_seconds - (Instant.now().whole_seconds + 120)) <= 5
    assert answer["snooze"]["send_after"] == snoozed["send_after"].whole_seconds

    cli("drain")  # not due yet: nothing goes before its time
    assert row_of(db, "snooze:1")["status"] == "pending" and len(mock.requests) == 1
    later = (snoozed["send_after"] + 1).stored
    assert json.loads(cli("drain", "--now", later).output)["kinds"] == {"snooze:sent": 1}
    (first, again) = mock.wait_for_requests(2)
    assert again.payload["reminder"]["rule"] == "snooze:1" and again.payload["aps"]["category"] == CATEGORY
    assert again.payload["aps"]["alert"]["title"] == "Standup"
    assert again.headers["apns-collapse-id"] == first.headers["apns-collapse-id"]  # it replaces the first alert
    assert row_of(db, "snooze:1")["outcome"] == "sent"

    r = act(phone, again.payload["reminder"]["id"], "snooze", token=again.payload["reminder"]["token"], seconds=60)
    assert r.status_code == 200 and r.json()["snooze"]["rule"] == "snooze:2", r.text


def test_ten_concurrent_identical_snoozes_make_one_row(db, cli, mock, phone):
    payload = sent_alert(cli, mock)
    token, row_id = payload["reminder"]["token"], payload["reminder"]["id"]
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: act(phone, row_id, "snooze", token=token, seconds=300), range(10)))
    assert [a.status_code for a in answers] == [200] * 10, [a.text for a in answers]
    assert sorted(a.json()["created"] for a in answers) == [False] * 9 + [True]
    assert len({a.json()["snooze"]["id"] for a in answers}) == 1
    assert len([r for r in rows(db, device_id="phone") if r["rule"].startswith("snooze:")]) == 1


def test_done_settles_the_events_other_pending_reminders_and_a_rebuild_keeps_them_settled(db, cli, mock, phone, feeds):
    payload = sent_alert(cli, mock)
    assert row_of(db, "lead:300")["status"] == "pending"
    r = act(phone, payload["reminder"]["id"], "done", token=payload["reminder"]["token"])
    assert r.status_code == 200 and r.json()["acknowledged"] == 1, r.text
    later = row_of(db, "lead:300")
    assert (later["status"], later["outcome"]) == ("settled", "acknowledged")
    cli("build", "--all")
    assert row_of(db, "lead:300")["outcome"] == "acknowledged"  # not queued again
    cli("drain", "--now", (later["send_after"] + 1).stored)
    assert len(mock.requests) == 1

    # Moved by an hour, the event is another appointment: its reminders come back.
    starts = phone.starts + 3600
    feeds.items("/a.json", [{"id": "standup", "title": "Standup", "startsAt": starts, "expiresAt": starts + 1800}])
    cli("build", "--all")
    assert row_of(db, "lead:300")["status"] == "pending"


def test_done_racing_the_send_of_the_same_reminder_makes_at_most_one_alert(db, cli, mock, phone, feeds):
    """The ``lead:300`` row is made due and drained while Done on the sent ``lead:1800`` alert
    settles it: whichever wins, it reaches the phone at most once and ends settled."""
    payload = sent_alert(cli, mock)
    pending = row_of(db, "lead:300")
    due = (pending["send_after"] + 1).stored
    with ThreadPoolExecutor(2) as pool:
        drained = pool.submit(cli, "drain", "--now", due)
        done = pool.submit(act, phone, payload["reminder"]["id"], "done", token=payload["reminder"]["token"])
        drained.result()
        assert done.result().status_code == 200
    settled = row_of(db, "lead:300")
    mock.wait_for_requests(2, timeout=1)
    alerts = [r for r in mock.requests if r.payload["reminder"]["rule"] == "lead:300"]
    assert settled["outcome"] in ("sent", "acknowledged")
    assert len(alerts) == (1 if settled["outcome"] == "sent" else 0)
    assert done.result().json()["acknowledged"] == (0 if settled["outcome"] == "sent" else 1)


@pytest.mark.parametrize("claimer", ["waiting for the answer", "died after the send"])
def test_an_alert_on_the_phone_before_its_settlement_is_written_can_be_snoozed_and_done(db, cli, mock, phone, claimer):
    """APNs may show the alert before its answer reaches the sender (a slow answer), and a claimer
    killed between its send and its settlement leaves the row failed ``abandoned`` though the alert
    went: the alert's token proves it was sent, so the person's Snooze and Done still count."""
    from reminders_pipeline import ledger

    cli("build", "--all")
    mock.script_default(hold=True)
    with ThreadPoolExecutor(1) as pool:
        draining = pool.submit(cli, "drain")
        (held,) = mock.wait_for_requests(1, timeout=30)
        reminder = held.payload["reminder"]
        assert row_of(db, "lead:1800")["status"] == "claimed"
        if claimer == "died after the send":
            with db.write() as conn:
                assert ledger.fail_abandoned(conn, Instant.now() + 60, Instant.now()) == 1
        snoozed = act(phone, reminder["id"], "snooze", token=reminder["token"], seconds=120)
        done = act(phone, reminder["id"], "done", token=reminder["token"])
        mock.release_held()
        draining.result(timeout=60)
    assert snoozed.status_code == 200 and snoozed.json()["snooze"]["rule"] == "snooze:1", snoozed.text
    assert (done.status_code, done.json().get("acknowledged")) == (200, 2), done.text
    assert {r["rule"]: r["outcome"] for r in rows(db, device_id="phone")} == {
        "lead:1800": "sent" if claimer == "waiting for the answer" else "failed",
        "lead:300": "acknowledged",
        "snooze:1": "acknowledged",
    }


class LosesItsAnswers:
    """The APNs sender, but no result comes back: the drain fails each row it sent ``no_result``."""

    def __init__(self, inner) -> None:
        self.inner = inner

    async def send_many(self, notifications):
        await self.inner.send_many(notifications)
        return []

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_an_alert_whose_send_lost_its_result_can_be_snoozed_and_done(db, cli, mock, phone, settings):
    """A row failed ``no_result`` may have sent its alert (the request was made, its answer lost),
    so the alert's Snooze and Done count as on any sent one."""
    from reminders_pipeline.providers.routing import default_sender_factory
    from reminders_pipeline.sending.drain import drain

    cli("build", "--all")
    live = settings.with_(**mock.apns_settings(), enabled=True)
    summary = drain(db, live, lambda: LosesItsAnswers(default_sender_factory(live)()))
    assert summary.details == {"failed:no_result": 1}, summary.as_dict()
    reminder = mock.wait_for_requests(1)[0].payload["reminder"]
    snoozed = act(phone, reminder["id"], "snooze", token=reminder["token"], seconds=120)
    done = act(phone, reminder["id"], "done", token=reminder["token"])
    assert snoozed.status_code == 200 and snoozed.json()["snooze"]["rule"] == "snooze:1", snoozed.text
    assert (done.status_code, done.json().get("acknowledged")) == (200, 2), done.text
    assert {r["rule"]: (r["outcome"], r["outcome_detail"]) for r in rows(db, device_id="phone")} == {
        "lead:1800": ("failed", "no_result"),
        "lead:300": ("acknowledged", "done"),
        "snooze:1": ("acknowledged", "done"),
    }


def test_a_token_for_a_row_that_sent_nothing_acts_on_nothing(db, cli, mock, phone):
    """Whoever holds the credential can sign a token for any row of the device: one for a row
    still pending (or voided) names no alert that went, so Snooze and Done are refused."""
    from sqlalchemy import select

    from reminders_pipeline.ledger.schema import devices

    sent_alert(cli, mock)
    pending = row_of(db, "lead:300")
    with db.read() as conn:
        key = conn.scalar(select(devices.c.credential_hash).where(devices.c.id == "phone"))
    token = action_token(key, "phone", pending["id"], pending["event_at"])
    for action, body in (("snooze", {"seconds": 120}), ("done", {})):
        r = act(phone, pending["id"], action, token=token, **body)
        assert (r.status_code, r.json()["error"]) == (409, "not_sent"), r.text
    assert [r["status"] for r in rows(db, device_id="phone")] == ["settled", "pending"]


def test_another_devices_row_is_404_a_wrong_token_401_and_nothing_changes(db, cli, mock, phone):
    payload = sent_alert(cli, mock)
    token, row_id = payload["reminder"]["token"], payload["reminder"]["id"]
    other = phone.api.put("/v1/devices/tablet", json={"apns_token": APNS_TOKEN, "source_urls": [phone.url_of_feed]})
    tablet = phone.as_device(other.json()["credential"])
    before = rows(db)
    for action, body in (("snooze", {"token": token, "seconds": 60}), ("done", {"token": token})):
        r = tablet.post(f"/v1/devices/tablet/reminders/{row_id}/{action}", json=body)
        assert (r.status_code, r.json()["error"]) == (404, "no_reminder"), r.text
        r = tablet.post(f"/v1/devices/phone/reminders/{row_id}/{action}", json=body)  # the tablet's credential
        assert (r.status_code, r.json()["error"]) == (401, "unauthorized"), r.text
        r = act(phone, row_id, action, **{**body, "token": "0" * 32})
        assert (r.status_code, r.json()["error"]) == (401, "wrong_action_token"), r.text
        r = act(phone, 999_999, action, **body)
        assert (r.status_code, r.json()["error"]) == (404, "no_reminder"), r.text
        r = act(phone, row_of(db, "lead:300")["id"], action, **body)  # not sent, and not its token
        assert r.status_code == 401, r.text
        r = phone.device.post(f"/v1/devices/phone/reminders/x1/{action}", json=body)
        assert (r.status_code, r.json()["field"]) == (422, "row_id"), r.text
        r = act(phone, row_id, action)
        assert (r.status_code, r.json()["field"]) == (422, "token"), r.text
    assert rows(db) == before


def test_a_late_action_or_a_snooze_past_the_end_is_refused_and_changes_nothing(db, cli, mock, phone):
    payload = sent_alert(cli, mock)
    token, row_id = payload["reminder"]["token"], payload["reminder"]["id"]
    before = rows(db)
    ends = phone.starts + 1800
    for body in ({"seconds": 3600}, {"until": ends}, {"until": ends - 7200}, {"seconds": 60, "until": ends - 60}):
        r = act(phone, row_id, "snooze", token=token, **body)
        assert r.status_code == 422, r.text
    r = act(phone, row_id, "snooze", token=token, seconds=60, now=ends)
    assert (r.status_code, r.json()["error"]) == (409, "event_ended"), r.text
    r = act(phone, row_id, "done", token=token, now=ends + 60)
    assert (r.status_code, r.json()["error"]) == (409, "event_ended"), r.text
    assert rows(db) == before
    r = act(phone, row_id, "snooze", token=token, until=ends - 60)
    assert r.status_code == 200 and r.json()["snooze"]["send_after"] == ends - 60, r.text


def test_at_most_twelve_snoozes_per_reminder(db, cli, mock, phone):
    payload = sent_alert(cli, mock)
    for n in range(1, MAX_SNOOZES + 1):
        reminder = payload["reminder"]
        r = act(phone, reminder["id"], "snooze", token=reminder["token"], seconds=1)
        assert r.status_code == 200 and r.json()["snooze"]["rule"] == f"snooze:{n}", r.text
        cli("drain", "--now", (Instant.now() + 2).stored)
        payload = mock.wait_for_requests(n + 1)[-1].payload
        assert payload["reminder"]["rule"] == f"snooze:{n}"
    r = act(phone, payload["reminder"]["id"], "snooze", token=payload["reminder"]["token"], seconds=1)
    assert (r.status_code, r.json()["error"]) == (409, "snooze_limit"), r.text


def standup(feeds, starts: int, title: str = "Standup") -> None:
    feeds.items("/a.json", [{"id": "standup", "title": title, "startsAt": starts, "expiresAt": starts + 1800}])


def test_a_pending_snooze_follows_its_event_and_goes_when_the_event_does(db, cli, mock, phone, feeds):
    payload = sent_alert(cli, mock)
    act(phone, payload["reminder"]["id"], "snooze", token=payload["reminder"]["token"], seconds=120)
    cli("build", "--all")
    assert row_of(db, "snooze:1")["status"] == "pending"
    standup(feeds, phone.starts + 60, "Standup (room 4)")  # moved a minute and retitled: the snooze follows
    cli("build", "--all")
    moved = row_of(db, "snooze:1")
    assert (moved["status"], moved["title"]) == ("pending", "Standup (room 4)")
    assert moved["event_at"].whole_seconds == phone.starts + 60
    feeds.items("/a.json", [])  # cancelled
    cli("build", "--all")
    gone = row_of(db, "snooze:1")
    assert (gone["outcome"], gone["outcome_detail"]) == ("voided", "left_feed")


def test_a_snooze_is_made_from_the_event_as_last_read(db, cli, mock, phone, feeds):
    """A sent row keeps the event as it was sent: a snooze made later takes the event as its
    calendar now reads, and refuses one that is gone."""
    payload = sent_alert(cli, mock)
    token, row_id = payload["reminder"]["token"], payload["reminder"]["id"]
    standup(feeds, phone.starts + 120, "Standup moved")  # under the re-arm threshold: the sent row stays
    cli("build", "--all")
    r = act(phone, row_id, "snooze", token=token, seconds=60)
    assert r.status_code == 200, r.text
    made = row_of(db, "snooze:1")
    assert (made["title"], made["event_at"].whole_seconds) == ("Standup moved", phone.starts + 120)
    assert row_of(db, "lead:1800")["title"] == "Standup"  # what was sent stays as sent


def test_a_snooze_of_a_cancelled_event_is_refused_and_changes_nothing(db, cli, mock, phone, feeds):
    payload = sent_alert(cli, mock)
    feeds.items("/a.json", [])  # cancelled after the alert went
    cli("build", "--all")
    before = rows(db)
    r = act(phone, payload["reminder"]["id"], "snooze", token=payload["reminder"]["token"], seconds=60)
    assert (r.status_code, r.json()["error"]) == (409, "event_changed"), r.text
    assert rows(db) == before
    cli("drain", "--now", (Instant.now() + 120).stored)
    assert len(mock.requests) == 1


def test_a_snooze_of_an_alert_from_a_calendar_the_device_dropped_is_refused_and_changes_nothing(db, cli, mock, phone):
    """The registration that drops the calendar voids its pending reminders there and then
    (``source_removed``), and a snooze of an alert it sent is refused (``unsubscribed``)."""
    payload = sent_alert(cli, mock)
    body = {"apns_token": APNS_TOKEN, "source_urls": [], "reminder_lead_seconds": 1800, "extra_rules": ["lead:300"]}
    assert phone.api.put("/v1/devices/phone", json=body).status_code == 200
    later = row_of(db, "lead:300")
    assert (later["outcome"], later["outcome_detail"]) == ("voided", "source_removed")
    before = rows(db)
    row_id, token = payload["reminder"]["id"], payload["reminder"]["token"]
    r = act(phone, row_id, "snooze", token=token, seconds=60)
    assert (r.status_code, r.json()["error"]) == (409, "unsubscribed"), r.text
    assert "unsubscribed" in cli("queue", "snooze", "phone", str(row_id), "--seconds", "60", code=1).output
    assert rows(db) == before
    cli("drain", "--now", (Instant.now() + 600).stored)
    assert len(mock.requests) == 1


def test_a_snooze_after_overlapping_builds_takes_the_event_as_the_newer_read_has_it(
    db, cli, mock, phone, feeds, settings
):
    """An older build stalls on its read (the event retitled), a newer one reads it cancelled and
    records first; the older records last. The calendar as last read is the newer read: the
    snooze is refused as for any cancelled event, and nothing more is sent."""
    payload = sent_alert(cli, mock)
    standup(feeds, phone.starts, "Standup (room 2)")
    feeds.routes["/a.json"].delay = 1.0
    with ThreadPoolExecutor(1) as pool:
        older = pool.submit(build, db, settings, now=Instant.now())
        feeds.wait_for_reads("/a.json", 2)
        feeds.items("/a.json", [])  # cancelled
        cli("build", "--all")
        older.result()
    r = act(phone, payload["reminder"]["id"], "snooze", token=payload["reminder"]["token"], seconds=60)
    assert (r.status_code, r.json()["error"]) == (409, "event_changed"), r.text
    cli("build", "--all")
    cli("drain", "--now", (Instant.now() + 120).stored)
    assert len(mock.requests) == 1


def test_the_cli_snoozes_and_marks_done_as_an_operator(db, cli, mock, phone):
    payload = sent_alert(cli, mock)
    row_id = str(payload["reminder"]["id"])
    out = json.loads(cli("queue", "snooze", "phone", row_id, "--seconds", "60").output)
    assert out["created"] is True and out["snooze"]["rule"] == "snooze:1"
    assert json.loads(cli("queue", "done", "phone", row_id).output)["acknowledged"] == 2  # lead:300, snooze:1
    assert {r["rule"]: r["outcome"] for r in rows(db, device_id="phone")} == {
        "lead:1800": "sent", "lead:300": "acknowledged", "snooze:1": "acknowledged",
    }  # fmt: skip
    assert "no reminder" in cli("queue", "done", "tablet", row_id, code=1).output
    assert "--seconds" in cli("queue", "snooze", "phone", row_id, "--seconds", "0", code=2).output
    assert "--until" in cli("queue", "snooze", "phone", row_id, "--until", "2000-01-01T00:00:00Z", code=2).output
    cli("device", "remove", "phone")  # its rows stay in the ledger, and act on nothing
    assert "no reminder" in cli("queue", "snooze", "phone", row_id, "--seconds", "60", code=1).output


def test_a_token_of_a_pruned_alert_acts_on_no_row_made_after_it(db, cli, mock, phone, feeds, settings):
    """Issue 38 finding 7: the alert's rows are pruned, the calendar's next event is queued and
    sent. Its rows get new ids, never the pruned ones (SQLite reused the highest without
    AUTOINCREMENT), so the old alert's Done, pressed late, finds no reminder and settles nothing
    of the new event."""
    payload = sent_alert(cli, mock)
    old_token, old_id = payload["reminder"]["token"], payload["reminder"]["id"]
    assert act(phone, old_id, "done", token=old_token).status_code == 200  # lead:300 settles too
    old_ids = {r["id"] for r in rows(db, device_id="phone")}
    past_retention = Instant.now() + settings.retention_seconds + 86_400
    assert json.loads(cli("prune", "--now", past_retention.stored).output)["deleted"] == len(old_ids)
    assert rows(db, device_id="phone") == []

    standup(feeds, phone.starts + 300, "Retro")  # the calendar's next event, its lead:1800 due now
    sent_alert(cli, mock, count=2)
    new = {r["rule"]: r for r in rows(db, device_id="phone")}
    assert new["lead:1800"]["outcome"] == "sent" and new["lead:300"]["status"] == "pending"

    before = rows(db)
    for action, body in (("done", {}), ("snooze", {"seconds": 60})):
        r = act(phone, old_id, action, token=old_token, **body)
        assert r.status_code == 404 and r.json()["error"] == "no_reminder", r.text
    assert rows(db) == before
    assert min(r["id"] for r in new.values()) > max(old_ids)


def test_done_settles_the_occurrence_it_showed_never_the_reminders_of_a_move_made_meanwhile(
    db, cli, mock, phone, feeds, monkeypatch
):
    """Issue 38 (4): Done reads the alert in one transaction and settles in another. A build that
    moves the event by an hour commits in between (its reminders are another appointment's): the
    Done must leave them, and settle only reminders of the instant the alert showed. (Before: it
    settled every pending reminder of the item, the moved ones included, and they were lost.)"""
    from reminders_pipeline.devices import actions

    payload = sent_alert(cli, mock)
    real = actions._acted_on

    def build_meanwhile(*args, **kwargs):
        found = real(*args, **kwargs)
        standup(feeds, phone.starts + 3600)
        cli("build", "--all")
        return found

    monkeypatch.setattr(actions, "_acted_on", build_meanwhile)
    r = act(phone, payload["reminder"]["id"], "done", token=payload["reminder"]["token"])
    assert r.status_code == 200 and r.json()["acknowledged"] == 0, r.text
    moved = row_of(db, "lead:300")
    assert (moved["status"], moved["event_at"].whole_seconds) == ("pending", phone.starts + 3600)


def test_a_snooze_voided_while_its_event_was_out_of_the_feed_comes_back_and_goes_once(db, cli, mock, phone, feeds):
    """Issue 38 (5): the calendar drops the event for one read and has it back at the next. The
    snooze voided ``left_feed`` meanwhile is pending again at the time asked, a repeated request
    answers with it, and it is sent once when due. (Before: it stayed voided, and the repeated
    request answered with a ``send_after`` that was never sent.)"""
    payload = sent_alert(cli, mock)
    token, row_id = payload["reminder"]["token"], payload["reminder"]["id"]
    asked = act(phone, row_id, "snooze", token=token, seconds=120).json()["snooze"]
    feeds.items("/a.json", [])  # out of the feed for one read
    cli("build", "--all")
    gone = row_of(db, "snooze:1")
    assert (gone["outcome"], gone["outcome_detail"]) == ("voided", "left_feed")
    r = act(phone, row_id, "snooze", token=token, seconds=60)
    assert (r.status_code, r.json()["error"]) == (409, "event_changed"), r.text

    standup(feeds, phone.starts, "Standup (back)")
    cli("build", "--all")
    back = row_of(db, "snooze:1")
    assert (back["status"], back["id"], back["title"]) == ("pending", asked["id"], "Standup (back)")
    assert back["send_after"].whole_seconds == asked["send_after"]  # as asked: never early
    again = act(phone, row_id, "snooze", token=token, seconds=600)
    assert again.status_code == 200 and again.json()["created"] is False, again.text
    assert again.json()["snooze"] == asked

    cli("drain", "--now", (back["send_after"] + 1).stored)
    cli("build", "--all", "--now", (back["send_after"] + 2).stored)
    cli("drain", "--now", (back["send_after"] + 3).stored)
    mock.wait_for_requests(2)
    snoozes = [r for r in mock.requests if r.payload["reminder"]["rule"] == "snooze:1"]
    assert len(snoozes) == 1 and snoozes[0].payload["aps"]["alert"]["title"] == "Standup (back)"
    assert row_of(db, "snooze:1")["outcome"] == "sent"


def test_a_sent_or_done_snooze_is_never_queued_again_by_a_build(db, cli, mock, phone, feeds):
    """The plan wants only the snoozes still to send: when the event moves by more than the re-arm
    threshold (another appointment), the rule rows re-arm, but a sent snooze stays sent and one
    settled by Done stays settled."""
    payload = sent_alert(cli, mock)
    snoozed = act(phone, payload["reminder"]["id"], "snooze", token=payload["reminder"]["token"], seconds=60)
    cli("drain", "--now", Instant.from_unix(snoozed.json()["snooze"]["send_after"] + 1).stored)
    again = mock.wait_for_requests(2)[-1].payload["reminder"]
    assert again["rule"] == "snooze:1" and row_of(db, "snooze:1")["outcome"] == "sent"
    assert act(phone, again["id"], "snooze", token=again["token"], seconds=60).json()["snooze"]["rule"] == "snooze:2"
    assert act(phone, again["id"], "done", token=again["token"]).json()["acknowledged"] == 2  # lead:300, snooze:2

    standup(feeds, phone.starts + 3600)
    cli("build", "--all")
    assert row_of(db, "lead:300")["status"] == "pending"
    assert (row_of(db, "snooze:1")["outcome"], row_of(db, "snooze:2")["outcome"]) == ("sent", "acknowledged")
    cli("drain", "--now", (Instant.now() + 600).stored)
    assert len(mock.wait_for_requests(3, timeout=1)) == 2


def test_a_snooze_reads_its_event_from_the_calendar_when_no_row_of_it_is_left_pending(db, cli, mock, phone, feeds):
    """The item a snooze is made from is the calendar's as last read, not a queue row's: after
    Done, no row of the event is pending for a build to keep in line, yet a snooze made after a
    retitle says the new title, and one made after a cancel is refused."""
    payload = sent_alert(cli, mock)
    token, row_id = payload["reminder"]["token"], payload["reminder"]["id"]
    assert act(phone, row_id, "done", token=token).json()["acknowledged"] == 1  # lead:300
    standup(feeds, phone.starts, "Standup (room 4)")
    cli("build", "--all")
    assert {r["status"] for r in rows(db, device_id="phone")} == {"settled"}
    r = act(phone, row_id, "snooze", token=token, seconds=60)
    assert r.status_code == 200 and row_of(db, "snooze:1")["title"] == "Standup (room 4)", r.text
    cli("drain", "--now", (row_of(db, "snooze:1")["send_after"] + 1).stored)
    again = mock.wait_for_requests(2)[-1].payload["reminder"]
    assert act(phone, again["id"], "done", token=again["token"]).status_code == 200

    feeds.items("/a.json", [])  # cancelled: nothing pending of it is voided, the calendar says it
    cli("build", "--all")
    r = act(phone, again["id"], "snooze", token=again["token"], seconds=60)
    assert (r.status_code, r.json()["error"]) == (409, "event_changed"), r.text


def test_done_ends_a_snooze_voided_while_its_event_was_away_so_its_return_sends_nothing(db, cli, mock, phone, feeds):
    """Found in review: a snooze voided ``left_feed`` while its event was out of the feed, then
    Done on the alert, then the event back. The build would revive the snooze (it was voided only
    for the event's absence) and send it after Done; Done now ends that snooze too."""
    payload = sent_alert(cli, mock)
    token, row_id = payload["reminder"]["token"], payload["reminder"]["id"]
    act(phone, row_id, "snooze", token=token, seconds=120)
    feeds.items("/a.json", [])  # out of the feed for one read
    cli("build", "--all")
    assert row_of(db, "snooze:1")["outcome_detail"] == "left_feed"
    assert act(phone, row_id, "done", token=token).status_code == 200
    standup(feeds, phone.starts)
    cli("build", "--all")
    ended = row_of(db, "snooze:1")
    assert (ended["status"], ended["outcome"]) == ("settled", "acknowledged")
    cli("drain", "--now", (ended["send_after"] + 1).stored)
    assert [r for r in mock.requests if r.payload["reminder"]["rule"] == "snooze:1"] == []
