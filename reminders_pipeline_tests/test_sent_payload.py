"""What a settled row records of its send: the alert body, and the whole payload only where the
row cannot re-render it; every reader (``notification.as_shown``, the CLI, history) shows the payload
as it was sent."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from reminders_pipeline import ledger
from reminders_pipeline.cli import main
from reminders_pipeline.domain.notification import as_shown, stored_payload
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.schema import notification_queue as q
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.base import RecordingSender
from reminders_pipeline.sending.drain import drain

from .support import NOW, at, by_key, device, item, rows


def stored(db, row_id):
    """The columns as the database holds them, not as readers show them."""
    with db.read() as conn:
        return conn.execute(select(q.c.payload, q.c.sent_body).where(q.c.id == row_id)).one()


def send_one(db, settings, feeds, title="Weekly planning", zone="Europe/Berlin"):
    url = feeds.items("/a.json", [item("e", 7200, title=title)])
    device(db, settings, sources=[url])
    with db.write() as conn:
        ledger.store_tz_name(conn, "dev-1", zone)
    build(db, settings, now=NOW)
    sender = RecordingSender()
    drain(db, settings, sender.factory(), now=at(3605))
    assert len(sender.sent) == (1 if settings.enabled else 0)
    return by_key(db)[("e", "lead:3600")], (sender.sent or [None])[0]


def test_a_rerenderable_send_stores_its_body_only_and_reads_back_byte_for_byte(db, settings, feeds):
    row, note = send_one(db, settings.with_(enabled=True), feeds)
    assert note.payload["aps"]["alert"]["body"] == "Starts at 12:00"  # 10:00Z in Berlin (CEST)
    assert tuple(stored(db, row["id"])) == (None, "Starts at 12:00")
    assert row["payload"] == stored_payload(note) and "sent_body" not in row
    with db.read() as conn:
        assert as_shown(ledger.get_row(conn, row["id"]))["payload"] == stored_payload(note)


def test_the_payload_shown_is_the_one_sent_after_the_device_changes_zone(db, settings, feeds):
    """The clock text depends on the device's zone at the send; a later zone leaves it alone."""
    row, note = send_one(db, settings.with_(enabled=True), feeds)
    with db.write() as conn:
        assert ledger.store_tz_name(conn, "dev-1", "Asia/Tokyo")
    assert json.loads(rows(db)[0]["payload"])["payload"]["aps"]["alert"]["body"] == "Starts at 12:00"
    assert rows(db)[0]["payload"] == stored_payload(note)


def test_a_title_cut_to_fit_is_stored_whole():
    """Feeds cap titles, so only a direct row reaches this: the re-render would show it uncut."""
    from reminders_pipeline.domain.notification import compose, record_of_send, sent_payload

    row = {
        "id": 1,
        "device_id": "d",
        "item_id": "1:x",
        "rule": "lead:60",
        "event_at": NOW,
        "expires_at": NOW,
        "title": "x" * 5000,
        "body": None,
        "target": "ab",
    }
    note = compose(row, now=NOW - 60)
    assert note.payload["aps"]["alert"]["title"].endswith("…")
    record = record_of_send(row, note)
    assert record == {"payload": stored_payload(note), "sent_body": None, "sent_format": None}
    assert sent_payload({**row, **record}) == stored_payload(note)


def test_another_interruption_level_is_stored_whole(db, settings, feeds):
    row, note = send_one(db, settings.with_(enabled=True, interruption_level="active"), feeds)
    assert tuple(stored(db, row["id"])) == (stored_payload(note), None)
    assert json.loads(row["payload"])["payload"]["aps"]["interruption-level"] == "active"


def test_a_dry_run_records_what_would_have_been_sent_the_same_way(db, settings, feeds):
    row, _ = send_one(db, settings, feeds)  # enabled=False: settled disabled
    assert row["outcome"] == "disabled"
    assert tuple(stored(db, row["id"])) == (None, "Starts at 12:00")
    assert json.loads(row["payload"])["payload"]["aps"]["alert"] == {
        "title": "Weekly planning",
        "body": "Starts at 12:00",
    }


def test_a_rearmed_row_keeps_the_whole_payload_it_sent_in_history(db, settings, feeds):
    live = settings.with_(enabled=True)
    row, note = send_one(db, live, feeds)
    feeds.items("/a.json", [item("e", 7200 + 3600, title="Moved planning")])
    assert build(db, live, now=at(3700)).rows_updated == 1
    with db.read() as conn:
        [before] = ledger.history_of(conn, row["id"])
    assert before["payload"] == stored_payload(note)
    rearmed = by_key(db)[("e", "lead:3600")]
    assert rearmed["payload"] is None and tuple(stored(db, row["id"])) == (None, None)


def test_the_cli_lists_the_payload_as_sent(db, db_url, settings, feeds):
    row, note = send_one(db, settings.with_(enabled=True), feeds)
    env = {"REMINDERS_DATABASE_URL": db_url, "REMINDERS_ENABLED": "false"}
    result = CliRunner().invoke(main, ["queue", "list", "--status", "settled"], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (listed,) = json.loads(result.output)
    assert listed["payload"] == stored_payload(note)


@pytest.mark.parametrize("body", ["", None])
def test_a_send_without_a_body_to_keep_is_stored_whole(body):
    """``record_of_send`` never keeps an empty body: the re-render would fall back to the rule's."""
    from reminders_pipeline.domain.notification import compose, record_of_send

    row = {
        "id": 1,
        "device_id": "d",
        "item_id": "1:x",
        "rule": "lead:60",
        "event_at": NOW,
        "expires_at": NOW,
        "title": "t",
        "body": None,
        "target": "ab",
    }
    note = compose(row, now=NOW - 60)
    note.payload["aps"]["alert"]["body"] = body
    assert record_of_send(row, note) == {"payload": stored_payload(note), "sent_body": None, "sent_format": None}


MATRIX_ROW = {
    "id": 7,
    "device_id": "d",
    "item_id": "3:standup",
    "event_at": Instant.from_stored("2026-09-10T08:30:00.000Z"),
    "expires_at": Instant.from_stored("2026-09-10T09:00:00.000Z"),
    "target": "ab" * 32,
}


@pytest.mark.parametrize("rule", ["lead:600", "lead:0@expiry", "day:1@09:00", "lead:0!"])
@pytest.mark.parametrize("zone", [(None, None), ("Europe/Berlin", None), (None, -18000), ("Gone/Zone", 3600)])
@pytest.mark.parametrize("level", ["time-sensitive", "active"])
@pytest.mark.parametrize(
    "title, body",
    [
        ("Standup", None),
        ("Standup", "Bring the numbers"),
        ("T" * 300, "é" * 5000),
        ("x" * 5000, None),
        ("🎉" * 3000, "\x01" * 2000),
    ],
)
@pytest.mark.parametrize("provider", ["apns", "webpush", "fcm"])
def test_what_a_row_records_reads_back_as_the_exact_bytes_sent(rule, zone, level, title, body, provider):
    """``record_of_send`` decides without composing again; whatever it keeps, ``sent_payload`` of the
    row gives back the bytes sent, for every rule kind, zone, level, provider and cut (each
    provider cuts to its own limit; the device's zone and provider are gone from the row when it is
    read back: the clock text must come from what was kept)."""
    from reminders_pipeline.domain.notification import compose, record_of_send, sent_payload

    row = {
        **MATRIX_ROW,
        "rule": rule,
        "title": title,
        "body": body,
        "tz_name": zone[0],
        "last_tz_offset_seconds": zone[1],
        "provider": provider,
    }
    note = compose(row, level, now=row["event_at"] - 600)
    record = record_of_send(row, note)
    gone = ("tz_name", "last_tz_offset_seconds", "target", "provider")
    stored_row = {k: v for k, v in row.items() if k not in gone}
    assert sent_payload({**stored_row, **record}) == stored_payload(note)
    uncut = note.payload["aps"]["alert"]["title"] == title
    assert (record["payload"] is None) == (level == "time-sensitive" and uncut)


# The exact bytes a row stored as its body re-renders to. Rows settled by an earlier release are
# shown through today's compose: a change to compose (keys, thread-id, collapse id, expiration,
# defaults) changes what every such row says was sent. If this fails, the change needs a way to
# keep old rows' records (store their payload whole first, or version sent_body), not a new literal.
PINNED_ROW = dict(
    id=42,
    device_id="dev-1",
    item_id="1:e",
    rule="lead:3600",
    event_at=Instant.from_stored("2026-09-10T10:00:00.000Z"),
    expires_at=Instant.from_stored("2026-09-10T11:00:00.000Z"),
    title="Weekly planning",
    body=None,
    payload=None,
    sent_body="Starts at 12:00",
    target="ab",
    tz_name="Europe/Berlin",
    last_tz_offset_seconds=None,
)
PINNED_PAYLOAD = (
    '{"payload":{"aps":{"alert":{"title":"Weekly planning","body":"Starts at 12:00"},"sound":"default",'
    '"interruption-level":"time-sensitive","thread-id":"1:e"},"reminder":{"item_id":"1:e","rule":"lead:3600",'
    '"starts_at":1789034400}},"collapse_id":"6e07793709caf54da2a7246ec890d1669e8971caa89b6bc1fd7918d49ac77d27",'
    '"expiration":1789034400}'
)


def test_a_stored_body_re_renders_to_the_bytes_earlier_releases_sent():
    from reminders_pipeline.domain.notification import sent_payload

    assert sent_payload(PINNED_ROW) == PINNED_PAYLOAD
