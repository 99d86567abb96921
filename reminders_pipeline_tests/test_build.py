"""Build semantics on SQLite and PostgreSQL, with sources served over real HTTP."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from sqlalchemy import update

from reminders_pipeline import ledger
from reminders_pipeline.devices.registration import DeviceSpec, put_device
from reminders_pipeline.domain.items import ParsedFeed
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.schema import notification_queue
from reminders_pipeline.planning.build import build, queue_rows
from reminders_pipeline.planning.queued import item_moved
from reminders_pipeline.providers.base import RecordingSender
from reminders_pipeline.sending.drain import drain
from reminders_pipeline.sources.urls import shown_url

from .http_sources import Route
from .support import NOW, NOW_S, TOKEN, at, by_key, device, item, rows


def test_one_row_per_future_item_and_rule_with_exact_send_after(db, settings, feeds):
    url = feeds.items("/a.json", [item("e1", 7200), item("e2", 90_000 - 1)])
    device(db, settings, sources=[url], lead=3600, rules=("lead:0@expiry", "lead:90"))
    summary = build(db, settings, now=NOW)
    got = by_key(db)
    assert summary.devices_built == 1 and summary.rows_inserted == len(got)
    assert got[("e1", "lead:3600")]["send_after"] == at(3600)
    assert got[("e1", "lead:90")]["send_after"] == at(7200 - 90)
    assert got[("e1", "lead:0@expiry")]["send_after"] == at(7200 + 1800)
    assert got[("e1", "lead:3600")]["event_at"] == at(7200)
    assert got[("e1", "lead:3600")]["expires_at"] == at(9000)
    # e2's start lead is 86399 - 3600 ahead: inside the 24 h horizon; its expiry rule is beyond it.
    assert ("e2", "lead:3600") in got and ("e2", "lead:0@expiry") not in got
    assert all(r["status"] == "pending" for r in got.values())


def test_arbitrary_leads_are_not_quantized(db, settings, feeds):
    url = feeds.items("/a.json", [item("e1", 5000)])
    device(db, settings, sources=[url], lead=1, rules=("lead:4999", "lead:1234"))
    build(db, settings, now=NOW)
    got = by_key(db)
    assert {k[1]: v["send_after"] for k, v in got.items()} == {
        "lead:1": at(4999),
        "lead:4999": at(1),
        "lead:1234": at(5000 - 1234),
    }


def test_horizon_bounds_what_is_queued(db, settings, feeds):
    horizon = settings.horizon_seconds
    url = feeds.items("/a.json", [item("inside", horizon + 3600), item("outside", horizon + 3601)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    assert set(by_key(db)) == {("inside", "lead:3600")}


def test_started_and_expired_items_are_not_queued(db, settings, feeds):
    url = feeds.items(
        "/a.json",
        [item("started", -60, 600), item("over", -3600, 60), item("future", 600)],
    )
    device(db, settings, sources=[url], rules=("lead:0@expiry",))
    build(db, settings, now=NOW)
    # 'started' still gets its expiry reminder (it has not expired); 'over' gets nothing.
    assert set(by_key(db)) == {("started", "lead:0@expiry"), ("future", "lead:3600"), ("future", "lead:0@expiry")}


def test_event_published_late_is_queued_already_due(db, settings, feeds):
    url = feeds.items("/a.json", [item("soon", 600)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    assert by_key(db)[("soon", "lead:3600")]["send_after"] == at(600 - 3600)


def test_instantaneous_one_second_item(db, settings, feeds):
    url = feeds.items("/a.json", [{"id": "blink", "title": "Blink", "startsAt": NOW_S + 100, "expiresAt": NOW_S + 101}])
    device(db, settings, sources=[url], lead=0, rules=("lead:0@expiry",))
    build(db, settings, now=NOW)
    got = by_key(db)
    assert got[("blink", "lead:0")]["send_after"] == at(100)
    assert got[("blink", "lead:0@expiry")]["send_after"] == at(101)


def test_unchanged_item_writes_nothing_changed_item_updates(db, settings, feeds):
    url = feeds.items("/a.json", [item("e1", 7200)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    before = by_key(db)[("e1", "lead:3600")]
    again = build(db, settings, now=at(60))
    assert (again.rows_inserted, again.rows_updated) == (0, 0)
    assert by_key(db)[("e1", "lead:3600")]["updated_at"] == before["updated_at"]

    feeds.items("/a.json", [item("e1", 9000, title="Moved")])
    moved = build(db, settings, now=at(120))
    row = by_key(db)[("e1", "lead:3600")]
    assert (moved.rows_inserted, moved.rows_updated) == (0, 1)
    assert row["id"] == before["id"] and row["send_after"] == at(9000 - 3600) and row["title"] == "Moved"


def test_item_that_leaves_the_feed_voids_its_pending_row(db, settings, feeds):
    url = feeds.items("/a.json", [item("keep", 7200), item("cancelled", 7200)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    feeds.items("/a.json", [item("keep", 7200)])
    summary = build(db, settings, now=at(60))
    got = by_key(db)
    assert summary.rows_voided == {"left_feed": 1}
    assert got[("cancelled", "lead:3600")]["outcome"] == "voided"
    assert got[("cancelled", "lead:3600")]["outcome_detail"] == "left_feed"
    assert got[("keep", "lead:3600")]["status"] == "pending"


def test_item_that_returns_to_the_feed_is_queued_again(db, settings, feeds):
    url = feeds.items("/a.json", [item("flaky", 7200)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    feeds.items("/a.json", [])
    build(db, settings, now=at(60))
    feeds.items("/a.json", [item("flaky", 7200)])
    build(db, settings, now=at(120))
    row = by_key(db)[("flaky", "lead:3600")]
    assert row["status"] == "pending" and row["outcome"] is None


def test_failed_source_read_voids_nothing_and_others_still_build(db, settings, feeds):
    good = feeds.items("/good.json", [item("g", 7200)])
    bad = feeds.items("/bad.json", [item("b", 7200)])
    device(db, settings, "d1", sources=[good, bad])
    device(db, settings, "d2", sources=[good])
    build(db, settings, now=NOW)
    assert len(rows(db)) == 3

    feeds.fail("/bad.json", 500)
    feeds.items("/good.json", [item("g", 7200), item("g2", 7300)])
    summary = build(db, settings, now=at(60))
    assert summary.sources_failed == [{"url": shown_url(bad), "error": "http_500"}]
    assert summary.rows_voided == {} and summary.rows_inserted == 2
    assert {r["status"] for r in rows(db)} == {"pending"}
    with db.read() as conn:
        src = {s["url"]: s for s in ledger.list_sources(conn)}
    assert src[bad]["consecutive_failures"] == 1 and src[bad]["last_error"] == "http_500"
    assert src[good]["consecutive_failures"] == 0 and src[good]["last_success_at"] == at(60)


def test_each_failure_kind_leaves_rows_alone(db, settings, feeds):
    url = feeds.items("/a.json", [item("e", 7200)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    settings = settings.with_(source_timeout_seconds=0.5, source_max_bytes=1000)
    for route in [
        Route(404, b"gone"),
        Route(200, b"not json"),
        Route(200, b'{"no_items": []}'),
        Route(200, json.dumps({"items": "nope"}).encode()),
        Route(200, b'{"items": []}', delay=2.0),
        Route(200, json.dumps({"items": [item(f"x{i}", 7200) for i in range(50)]}).encode()),
    ]:
        feeds.set("/a.json", route)
        summary = build(db, settings, now=at(60))
        assert len(summary.sources_failed) == 1, route
        assert [r["status"] for r in rows(db)] == ["pending"], route


def test_shared_source_is_read_once_per_build(db, settings, feeds):
    url = feeds.items("/shared.json", [item("e", 7200)])
    for i in range(5):
        device(db, settings, f"d{i}", sources=[url])
    summary = build(db, settings, now=NOW)
    assert feeds.hits["/shared.json"] == 1 and summary.sources_read == 1
    assert len(rows(db)) == 5


def test_item_ids_are_namespaced_by_source(db, settings, feeds):
    a = feeds.items("/a.json", [item("same", 7200, title="From A")])
    b = feeds.items("/b.json", [item("same", 7200, title="From B")])
    device(db, settings, sources=[a, b])
    build(db, settings, now=NOW)
    assert sorted(r["title"] for r in rows(db)) == ["From A", "From B"]


def test_malformed_items_are_rejected_with_reasons_and_the_rest_queue(db, settings, feeds):
    url = feeds.items(
        "/a.json",
        [
            item("ok", 7200),
            {"title": "no id", "startsAt": NOW_S + 7200, "expiresAt": NOW_S + 7300},
            item("backwards", 7200, duration=0),
            item("strtime", 7200) | {"startsAt": "soon"},
            item("float", 7200) | {"startsAt": NOW_S + 7200.5},
            item("bool", 7200) | {"expiresAt": True},
            item("ms", 7200) | {"startsAt": (NOW_S + 7200) * 1000, "expiresAt": (NOW_S + 7300) * 1000},
            item("ok", 7300),
            item("long", 7200, title="x" * 1000),
            "not an object",
        ],
    )
    device(db, settings, sources=[url])
    summary = build(db, settings, now=NOW)
    assert set(by_key(db)) == {("ok", "lead:3600")}
    assert summary.items_rejected == {
        "missing_id": 1,
        "expires_not_after_start": 1,
        "bad_starts_at": 2,
        "bad_expires_at": 1,
        "time_out_of_range": 1,
        "duplicate_id": 1,
        "title_too_long": 1,
        "not_an_object": 1,
    }


def test_rule_change_voids_removed_rule_and_queues_new_one(db, settings, feeds):
    url = feeds.items("/a.json", [item("e", 7200)])
    device(db, settings, sources=[url], rules=("lead:600",))
    build(db, settings, now=NOW)
    device(db, settings, sources=[url], rules=("lead:0@expiry",))
    summary = build(db, settings, now=at(60))
    got = by_key(db)
    assert summary.rows_voided == {"rule_removed": 1}
    assert got[("e", "lead:600")]["outcome_detail"] == "rule_removed"
    assert got[("e", "lead:0@expiry")]["status"] == "pending"
    assert got[("e", "lead:3600")]["status"] == "pending"


def test_unsubscribed_source_voids_its_rows_in_the_registration(db, settings, feeds):
    a = feeds.items("/a.json", [item("a", 7200)])
    b = feeds.items("/b.json", [item("b", 7200)])
    device(db, settings, sources=[a, b])
    build(db, settings, now=NOW)
    device(db, settings, sources=[a])
    dropped, kept = by_key(db)[("b", "lead:3600")], by_key(db)[("a", "lead:3600")]
    assert (dropped["outcome"], dropped["outcome_detail"], kept["status"]) == ("voided", "source_removed", "pending")
    summary = build(db, settings, now=at(60))
    assert summary.rows_voided == {} and by_key(db)[("b", "lead:3600")]["outcome"] == "voided"


def test_a_row_a_build_queued_from_subscriptions_read_before_a_calendar_was_dropped_is_voided_at_its_claim(
    db, settings, feeds
):
    """The build reads the device's subscriptions, then its sources; the device drops calendar b
    meanwhile. The build still writes b's row (it planned from what it read), and the claim, which
    reads the subscription again, settles it ``voided``/``source_removed`` instead of sending it."""
    live = settings.with_(enabled=True)
    a = feeds.items("/a.json", [item("a", 3660)])
    b = feeds.items("/b.json", [item("b", 3660)], delay=1.0)
    device(db, live, sources=[a, b])
    with ThreadPoolExecutor(1) as pool:
        building = pool.submit(build, db, live, now=NOW)
        feeds.wait_for_reads("/b.json", 1)
        device(db, live, sources=[a])  # drops b while the build is reading it
        building.result()
    assert by_key(db)[("b", "lead:3600")]["status"] == "pending"
    sender = RecordingSender()
    drain(db, live, sender.factory(), now=at(60))
    assert sorted(n.payload["aps"]["alert"]["title"] for n in sender.sent) == ["Event a"]
    row = by_key(db)[("b", "lead:3600")]
    assert (row["outcome"], row["outcome_detail"]) == ("voided", "source_removed")


def test_an_older_read_recorded_after_a_newer_one_never_replaces_it(db, settings, feeds):
    """Two overlapping builds: the older (started first) stalls on its read, which still has e1;
    the newer reads e1 cancelled and records first. The older records last: the stored parse
    stays the newer one, the older build plans from it (d2, which only the older build writes,
    gets no row of e1), and nothing of e1 is sent."""
    live = settings.with_(enabled=True)
    url = feeds.items("/a.json", [item("e1", 7200), item("e2", 7200)], delay=1.0)
    device(db, live, "d1", sources=[url])
    device(db, live, "d2", sources=[url])
    with ThreadPoolExecutor(1) as pool:
        older = pool.submit(build, db, live, now=NOW)
        feeds.wait_for_reads("/a.json", 1)
        feeds.items("/a.json", [item("e2", 7200)])  # e1 cancelled
        newer = build(db, live, device_ids=["d1"], now=at(60))
        assert newer.devices_built == 1
        assert older.result().devices_skipped_newer == 1  # d1: written by the newer build
    with db.read() as conn:
        (source,) = ledger.list_sources(conn)
    assert [i.id for i in ParsedFeed.from_json(source["feed_cache"]).items] == ["e2"]
    assert source["last_success_at"] == at(60)
    assert sorted(r["device_id"] for r in rows(db) if r["item_id"].endswith(":e1")) == []
    build(db, live, now=at(120))
    sender = RecordingSender()
    drain(db, live, sender.factory(), now=at(3600))
    assert sorted((n.device_token, n.payload["aps"]["alert"]["title"]) for n in sender.sent) == [
        (TOKEN, "Event e2"),
        (TOKEN, "Event e2"),
    ]


def _two_events(*uids: str) -> str:
    events = "".join(
        f"BEGIN:VEVENT\nUID:{u}\nDTSTAMP:20260101T000000Z\nDTSTART:20260910T100000Z\nDURATION:PT30M\n"
        f"SUMMARY:Event {u}\nEND:VEVENT\n"
        for u in uids
    )
    return f"BEGIN:VCALENDAR\nVERSION:2.0\nPRODID:-//t//EN\n{events}END:VCALENDAR\n"


def test_an_older_build_plans_a_calendar_from_the_newer_read_that_starts_later(db, settings, feeds):
    """As above, for a calendar: the newer build's parse was expanded from its own, later ``now``,
    so it cannot serve the older build's window whole. The older build plans from it all the
    same, holding only what would start before it: d2, which only the older build writes, keeps
    no reminder of the cancelled e1 from the older read, and nothing of e1 is sent."""
    live = settings.with_(enabled=True)
    url = feeds.calendar("/a.ics", _two_events("e1", "e2"))
    device(db, live, "d1", sources=[url])
    device(db, live, "d2", sources=[url])
    build(db, live, now=NOW)
    feeds.routes["/a.ics"].delay = 1.0
    with ThreadPoolExecutor(1) as pool:
        older = pool.submit(build, db, live, now=at(30))
        feeds.wait_for_reads("/a.ics", 2)
        feeds.calendar("/a.ics", _two_events("e2"))  # e1 cancelled
        newer = build(db, live, device_ids=["d1"], now=at(60))
        assert newer.rows_voided == {"left_feed": 1}
        assert older.result().devices_skipped_newer == 1
    e1 = {
        r["device_id"]: (r["status"], r["outcome_detail"])
        for r in rows(db)
        if r["item_id"].endswith(":e1/20260910T100000Z")
    }
    assert e1 == {"d1": ("settled", "left_feed"), "d2": ("settled", "left_feed")}
    sender = RecordingSender()
    drain(db, live, sender.factory(), now=at(3600))
    assert sorted(n.payload["aps"]["alert"]["title"] for n in sender.sent) == ["Event e2", "Event e2"]


def test_rescheduled_beyond_horizon_voids_until_it_comes_back(db, settings, feeds):
    url = feeds.items("/a.json", [item("e", 7200)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    far = settings.horizon_seconds + 7200
    feeds.items("/a.json", [item("e", far)])
    summary = build(db, settings, now=at(60))
    assert summary.rows_voided == {"out_of_horizon": 1}
    later = far - settings.horizon_seconds
    build(db, settings, now=at(later))
    row = by_key(db)[("e", "lead:3600")]
    assert row["status"] == "pending" and row["send_after"] == at(far - 3600)


def test_sent_row_is_not_requeued_unless_rescheduled(db, settings, feeds):
    url = feeds.items("/a.json", [item("e", 7200)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    row = by_key(db)[("e", "lead:3600")]
    with db.write() as conn:
        ledger.claim(conn, [row["id"]], at(3600), "t")
        ledger.settle(conn, [{"id": row["id"], "outcome": "sent", "sent_at": at(3600)}], "t", at(3600))
    build(db, settings, now=at(3700))
    assert by_key(db)[("e", "lead:3600")]["outcome"] == "sent"  # same time: never twice
    feeds.items("/a.json", [item("e", 14400)])
    build(db, settings, now=at(3800))
    moved = by_key(db)[("e", "lead:3600")]
    assert moved["status"] == "pending" and moved["send_after"] == at(14400 - 3600)


def test_stalest_first_with_a_limit_and_built_at_stamped(db, settings, feeds):
    url = feeds.items("/a.json", [])
    for i in range(4):
        device(db, settings, f"d{i}", sources=[url])
    build(db, settings, device_ids=["d0", "d1"], now=NOW)
    summary = build(db, settings, limit=2, now=at(60))
    with db.read() as conn:
        built = {d.id: d.reminders_built_at for d in ledger.list_devices(conn)}
    assert summary.devices_built == 2
    assert built == {"d0": NOW, "d1": NOW, "d2": at(60), "d3": at(60)}


def test_build_by_chunk(db, settings, feeds):
    url = feeds.items("/a.json", [item("e", 7200)])
    for i in range(20):
        device(db, settings, f"d{i}", sources=[url])
    with db.read() as conn:
        chunks = {d.id: d.chunk for d in ledger.list_devices(conn)}
    target = chunks["d0"]
    summary = build(db, settings, chunks=[target], now=NOW)
    assert summary.devices_built == sum(1 for c in chunks.values() if c == target)
    assert {r["device_id"] for r in rows(db)} == {d for d, c in chunks.items() if c == target}


def test_lead_across_a_dst_change_is_absolute(db, settings, feeds):
    # Europe/Berlin leaves DST at 2026-10-25 01:00 UTC; an event at 01:30 UTC with a 2 h lead
    # is reminded at 23:30 UTC the day before: 7200 s earlier, whatever the wall clocks say.
    start = 1792891800  # 2026-10-25T01:30:00Z
    url = feeds.items("/a.json", [{"id": "dst", "title": "DST", "startsAt": start, "expiresAt": start + 3600}])
    device(db, settings, sources=[url], lead=7200)
    build(db, settings, now=Instant.from_stored("2026-10-24T20:00:00.000Z"))
    assert (
        by_key(db)[("dst", "lead:7200")]["send_after"]
        == Instant.from_unix(start - 7200)
        == Instant.from_stored("2026-10-24T23:30:00.000Z")
    )


def test_device_with_dead_token_is_skipped(db, settings, feeds):
    url = feeds.items("/a.json", [item("e", 7200)])
    device(db, settings, sources=[url])
    with db.write() as conn:
        ledger.mark_token_invalid(conn, "dev-1", "ab" * 32, NOW, "Unregistered", NOW)
    assert build(db, settings, now=NOW).devices_built == 0
    device(db, settings, sources=[url], token="cd" * 32)  # registers again
    assert build(db, settings, now=NOW).devices_built == 1


def _send(db, row_id, when):
    with db.write() as conn:
        ledger.claim(conn, [row_id], when, "t")
        ledger.settle(
            conn, [{"id": row_id, "outcome": "sent", "apns_id": "apns-1", "sent_at": when, "payload": "{}"}], "t", when
        )


def test_a_sent_row_is_not_rearmed_by_a_feed_jittering_under_the_threshold(db, settings, feeds):
    url = feeds.items("/a.json", [item("e", 7200)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    row = by_key(db)[("e", "lead:3600")]
    _send(db, row["id"], at(3600))
    feeds.items("/a.json", [item("e", 7200 + settings.rearm_threshold_seconds - 1)])  # 4 min 59 s later
    assert build(db, settings, now=at(3700)).rows_updated == 0
    assert by_key(db)[("e", "lead:3600")]["outcome"] == "sent"
    # the upsert itself, without the build's pre-filter, holds the same line
    moved = {**row, "send_after": at(3600 - settings.rearm_threshold_seconds + 1)}
    with db.write() as conn:
        assert queue_rows(conn, [moved], at(3700), rearm_threshold_seconds=settings.rearm_threshold_seconds) == set()
    assert by_key(db)[("e", "lead:3600")]["outcome"] == "sent"


def test_a_rearmed_row_keeps_what_it_sent_as_history(db, settings, feeds):
    url = feeds.items("/a.json", [item("e", 7200)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    row = by_key(db)[("e", "lead:3600")]
    _send(db, row["id"], at(3600))
    feeds.items("/a.json", [item("e", 7200 + settings.rearm_threshold_seconds)])  # moved by exactly 5 minutes
    assert build(db, settings, now=at(3700)).rows_updated == 1
    rearmed = by_key(db)[("e", "lead:3600")]
    assert (rearmed["id"], rearmed["status"], rearmed["apns_id"], rearmed["sent_at"]) == (
        row["id"],
        "pending",
        None,
        None,
    )
    with db.read() as conn:
        [before] = ledger.history_of(conn, row["id"])
    assert {
        k: before[k] for k in ("send_after", "outcome", "apns_id", "sent_at", "settled_at", "payload", "rearmed_at")
    } == {
        "send_after": at(3600),
        "outcome": "sent",
        "apns_id": "apns-1",
        "sent_at": at(3600),
        "settled_at": at(3600),
        "payload": "{}",
        "rearmed_at": at(3700),
    }
    _send(db, row["id"], at(3900))  # the moved reminder goes, then the meeting moves again
    feeds.items("/a.json", [item("e", 14400)])
    build(db, settings, now=at(4000))
    with db.read() as conn:
        assert [h["sent_at"] for h in ledger.history_of(conn, row["id"])] == [at(3600), at(3900)]


ALARM_ICS = """BEGIN:VCALENDAR\r
VERSION:2.0\r
PRODID:-//alarms//EN\r
BEGIN:VEVENT\r
UID:meet@alarms\r
DTSTART:20261027T150000Z\r
DURATION:PT1H\r
SUMMARY:Meeting\r
BEGIN:VALARM\r
ACTION:DISPLAY\r
DESCRIPTION:Meeting\r
TRIGGER:-PT25M\r
END:VALARM\r
END:VEVENT\r
BEGIN:VEVENT\r
UID:plain@alarms\r
DTSTART:20261027T160000Z\r
DURATION:PT1H\r
SUMMARY:No alarms\r
END:VEVENT\r
END:VCALENDAR\r
"""


def test_a_failed_read_keeps_the_calendar_alarms_rows(db, settings, feeds):
    url = feeds.calendar("/alarms.ics", ALARM_ICS)
    put_device(
        db,
        settings,
        DeviceSpec("uses", TOKEN, 3600, (), (url,), "UTC", alarms=True),
        now=Instant.from_stored("2026-10-27T08:00:00.000Z"),
    )
    build(db, settings, now=Instant.from_stored("2026-10-27T08:00:00.000Z"))
    before = {(r["title"], r["rule"]): r for r in rows(db)}
    assert set(before) == {("Meeting", "lead:1500"), ("No alarms", "lead:3600")}
    feeds.fail("/alarms.ics", 503)
    summary = build(db, settings, now=Instant.from_stored("2026-10-27T08:15:00.000Z"))
    assert summary.sources_failed and summary.rows_voided == {}
    assert {(r["title"], r["rule"]): r for r in rows(db)} == before
    # the device changes its own lead while the calendar still fails: what the alarm gave stays
    put_device(
        db,
        settings,
        DeviceSpec("uses", TOKEN, 1800, (), (url,), "UTC", alarms=True),
        now=Instant.from_stored("2026-10-27T08:20:00.000Z"),
    )
    assert build(db, settings, now=Instant.from_stored("2026-10-27T08:30:00.000Z")).rows_voided == {}
    assert rows(db, status="pending") == list(before.values())


def test_a_rule_the_device_drops_while_its_calendar_fails_is_voided(db, settings, feeds):
    """Not a loss to the failure: the device asked for it, and a successful read would void it too."""
    url = feeds.items("/a.json", [item("e", 7200)])
    device(db, settings, sources=[url], rules=("lead:600",))
    build(db, settings, now=NOW)
    feeds.fail("/a.json", 503)
    device(db, settings, sources=[url])
    summary = build(db, settings, now=at(60))
    got = by_key(db)
    assert summary.rows_voided == {"rule_removed": 1}
    assert got[("e", "lead:600")]["outcome_detail"] == "rule_removed" and got[("e", "lead:3600")]["status"] == "pending"


def test_a_sent_reminder_is_not_sent_again_when_quiet_hours_change(db, settings, feeds):
    """Quiet 22:00-07:30 hold a 07:00 reminder to 07:30 and it is sent; quiet hours then end at
    07:50: the item did not move, so the settled row stays history."""
    start = 1789027200  # 2026-09-10T08:00:00Z
    url = feeds.items("/a.json", [{"id": "e", "title": "Flight", "startsAt": start, "expiresAt": start + 3600}])
    spec = DeviceSpec("dev-1", TOKEN, 3600, (), (url,), "UTC", quiet_hours="22:00-07:30")
    put_device(db, settings, spec, now=Instant.from_stored("2026-09-10T05:00:00.000Z"))
    build(db, settings, now=Instant.from_stored("2026-09-10T05:00:00.000Z"))
    row = by_key(db)[("e", "lead:3600")]
    assert row["send_after"] == Instant.from_stored("2026-09-10T07:30:00.000Z")
    _send(db, row["id"], Instant.from_stored("2026-09-10T07:30:00.000Z"))
    put_device(
        db, settings, replace(spec, quiet_hours="22:00-07:50"), now=Instant.from_stored("2026-09-10T07:31:00.000Z")
    )
    assert build(db, settings, now=Instant.from_stored("2026-09-10T07:32:00.000Z")).rows_updated == 0
    assert by_key(db)[("e", "lead:3600")]["outcome"] == "sent"
    # the upsert itself, without the build's pre-filter, holds the same line
    with db.write() as conn:
        held_later = {**row, "send_after": Instant.from_stored("2026-09-10T07:50:00.000Z")}
        assert (
            queue_rows(conn, [held_later], Instant.from_stored("2026-09-10T07:32:00.000Z"), rearm_threshold_seconds=300)
            == set()
        )
    assert by_key(db)[("e", "lead:3600")]["outcome"] == "sent"


ALL_DAY_ICS = """BEGIN:VCALENDAR\r
VERSION:2.0\r
PRODID:-//days//EN\r
BEGIN:VEVENT\r
UID:bday@days\r
DTSTART;VALUE=DATE:20261027\r
RRULE:FREQ=YEARLY\r
SUMMARY:Birthday\r
END:VEVENT\r
{moved}END:VCALENDAR\r
"""
# This year's occurrence moved a day later: the same occurrence (same id), rescheduled.
MOVED_DAY = """BEGIN:VEVENT\r
UID:bday@days\r
RECURRENCE-ID;VALUE=DATE:20261027\r
DTSTART;VALUE=DATE:20261028\r
SUMMARY:Birthday\r
END:VEVENT\r
"""


def test_a_sent_all_day_reminder_is_not_sent_again_when_the_device_changes_zone(db, settings, feeds):
    """Sent at 09:00 in Lisbon (09:00Z); the device moves to the Azores (UTC-1), which moves the
    row's event_at and send_after by an hour: the item did not move, nothing is re-armed. Moving
    the event to the next day does re-arm it."""
    url = feeds.calendar("/days.ics", ALL_DAY_ICS.format(moved=""))
    spec = DeviceSpec("dev-1", TOKEN, 3600, (), (url,), "Europe/Lisbon")
    put_device(db, settings, spec, now=Instant.from_stored("2026-10-26T20:00:00.000Z"))
    build(db, settings, now=Instant.from_stored("2026-10-26T20:00:00.000Z"))
    [row] = rows(db)
    assert (row["send_after"], row["event_at"]) == (
        Instant.from_stored("2026-10-27T09:00:00.000Z"),
        Instant.from_stored("2026-10-27T00:00:00.000Z"),
    )
    _send(db, row["id"], Instant.from_stored("2026-10-27T09:00:00.000Z"))
    put_device(
        db, settings, replace(spec, tz_name="Atlantic/Azores"), now=Instant.from_stored("2026-10-27T09:10:00.000Z")
    )
    assert build(db, settings, now=Instant.from_stored("2026-10-27T09:15:00.000Z")).rows_updated == 0
    [after] = rows(db)
    assert (after["status"], after["outcome"], after["send_after"]) == (
        "settled",
        "sent",
        Instant.from_stored("2026-10-27T09:00:00.000Z"),
    )
    with db.write() as conn:  # the upsert itself: the Azores row, same item
        azores = {
            **row,
            "send_after": Instant.from_stored("2026-10-27T10:00:00.000Z"),
            "event_at": Instant.from_stored("2026-10-27T01:00:00.000Z"),
            "expires_at": Instant.from_stored("2026-10-28T01:00:00.000Z"),
        }
        assert (
            queue_rows(conn, [azores], Instant.from_stored("2026-10-27T09:15:00.000Z"), rearm_threshold_seconds=300)
            == set()
        )
    feeds.calendar("/days.ics", ALL_DAY_ICS.format(moved=MOVED_DAY))  # a real reschedule
    assert build(db, settings, now=Instant.from_stored("2026-10-27T10:05:00.000Z")).rows_updated == 1
    [moved] = rows(db)
    assert (moved["status"], moved["send_after"]) == ("pending", Instant.from_stored("2026-10-28T10:00:00.000Z"))


def test_a_reminder_settled_before_item_at_existed_is_not_sent_again_when_the_device_changes_zone(db, settings, feeds):
    """A row sent before migration 0009 has no item_at; the device then moves from Lisbon to the
    Azores. Its anchor moved an hour, which any zone change can do: nothing is re-armed. Anchors as
    far apart as UTC+14 and UTC-12 put them are no move either; a day's reschedule still is."""
    url = feeds.calendar("/days.ics", ALL_DAY_ICS.format(moved=""))
    spec = DeviceSpec("dev-1", TOKEN, 3600, (), (url,), "Europe/Lisbon")
    put_device(db, settings, spec, now=Instant.from_stored("2026-10-26T20:00:00.000Z"))
    build(db, settings, now=Instant.from_stored("2026-10-26T20:00:00.000Z"))
    [row] = rows(db)
    _send(db, row["id"], Instant.from_stored("2026-10-27T09:00:00.000Z"))
    with db.write() as conn:  # as the row was written before migration 0009
        conn.execute(update(notification_queue).values(item_at=None))
    put_device(
        db, settings, replace(spec, tz_name="Atlantic/Azores"), now=Instant.from_stored("2026-10-27T09:10:00.000Z")
    )
    assert build(db, settings, now=Instant.from_stored("2026-10-27T09:15:00.000Z")).rows_updated == 0
    [after] = rows(db)
    assert (after["status"], after["outcome"], after["item_at"]) == ("settled", "sent", None)
    lisbon_midnight = 1793059200  # the stored anchor, 2026-10-27T00:00Z
    for hours in (14, -12, 14.1, -12.1):  # the same day's wall time as UTC+14 and UTC-12 see it, and beyond
        wall = Instant.from_unix(lisbon_midnight + int(hours * 3600))
        far = {**row, "event_at": wall, "expires_at": (wall + 86400), "item_at": wall}
        assert item_moved(after, far, 300) == (hours not in (14, -12))
        if hours in (14, -12):
            with db.write() as conn:  # the upsert draws the same line
                assert (
                    queue_rows(
                        conn, [far], Instant.from_stored("2026-10-27T09:15:00.000Z"), rearm_threshold_seconds=300
                    )
                    == set()
                )
    feeds.calendar("/days.ics", ALL_DAY_ICS.format(moved=MOVED_DAY))  # a real reschedule
    assert build(db, settings, now=Instant.from_stored("2026-10-27T10:05:00.000Z")).rows_updated == 1
    [moved] = rows(db)
    assert (moved["status"], moved["send_after"], moved["item_at"]) == (
        "pending",
        Instant.from_stored("2026-10-28T10:00:00.000Z"),
        Instant.from_stored("2026-10-28T00:00:00.000Z"),
    )


def test_an_expiry_rule_is_rearmed_by_its_end_moving_not_its_start(db, settings, feeds):
    url = feeds.items("/a.json", [item("e", 7200, duration=1800)])
    device(db, settings, sources=[url], rules=("lead:0@expiry",))
    build(db, settings, now=NOW)
    row = by_key(db)[("e", "lead:0@expiry")]
    _send(db, row["id"], at(9000))
    feeds.items("/a.json", [item("e", 3600, duration=5400)])  # starts an hour earlier, same end
    build(db, settings, now=at(9100))
    assert by_key(db)[("e", "lead:0@expiry")]["outcome"] == "sent"
    feeds.items("/a.json", [item("e", 7200, duration=3600)])  # ends 30 minutes later
    build(db, settings, now=at(9200))
    assert by_key(db)[("e", "lead:0@expiry")]["status"] == "pending"


def test_a_meeting_moved_into_the_past_sends_nothing_for_its_old_time(db, settings, feeds):
    """13:00 meeting (lead:3600 due 12:00) moved to 10:30; the build at 11:00 no longer queues it,
    but the pending row takes the item as read, and the drain at 12:00 settles it event_started
    instead of sending "Starts at 13:00". A sent row of a past item stays as it was."""
    live = settings.with_(enabled=True)
    url = feeds.items("/a.json", [item("m", 5 * 3600, 7200, "Meeting"), item("done", 2 * 3600, title="Standup")])
    device(db, live, sources=[url])
    build(db, live, now=NOW)
    _send(db, by_key(db)[("done", "lead:3600")]["id"], at(3600))
    feeds.items("/a.json", [item("m", 2 * 3600 + 1800, 7200, "Meeting"), item("done", 1800, title="Standup, moved")])
    build(db, live, now=at(3 * 3600))
    row = by_key(db)[("m", "lead:3600")]
    assert (row["status"], row["event_at"], row["send_after"]) == ("pending", at(2 * 3600 + 1800), at(3600 + 1800))
    assert (by_key(db)[("done", "lead:3600")]["status"], by_key(db)[("done", "lead:3600")]["title"]) == (
        "settled",
        "Standup",
    )
    sender = RecordingSender()
    drain(db, live, sender.factory(), now=at(4 * 3600))
    assert sender.sent == [] and by_key(db)[("m", "lead:3600")]["outcome"] == "event_started"


def test_a_lead_zero_reminder_of_a_meeting_moved_to_just_now_goes_with_its_new_time(db, settings, feeds):
    live = settings.with_(enabled=True)
    url = feeds.items("/a.json", [item("m", 5 * 3600, title="Meeting")])
    device(db, live, sources=[url], lead=0)
    build(db, live, now=NOW)
    feeds.items("/a.json", [item("m", 3 * 3600 - 120, title="Meeting, moved")])  # 10:58, built at 11:00
    build(db, live, now=at(3 * 3600))
    sender = RecordingSender()
    drain(db, live, sender.factory(), now=at(3 * 3600 + 300))
    [sent] = sender.sent
    row = by_key(db)[("m", "lead:0")]
    assert (row["outcome"], row["event_at"], row["title"]) == ("sent", at(3 * 3600 - 120), "Meeting, moved")
    assert sent.payload["aps"]["alert"]["title"] == "Meeting, moved"


HOURLY_ICS = """BEGIN:VCALENDAR\r
VERSION:2.0\r
PRODID:-//hourly//EN\r
BEGIN:VEVENT\r
UID:hourly@shared\r
DTSTART:20260910T090000Z\r
DURATION:PT30M\r
RRULE:FREQ=HOURLY;COUNT=12\r
SUMMARY:Check-in\r
END:VEVENT\r
END:VCALENDAR\r
"""


def test_a_build_for_an_earlier_now_reads_a_shared_calendar_again_not_its_later_parse(db, settings, feeds):
    """Issue 38 (9): a calendar shared by two devices, read first by a build at 14:00 (its parse
    expands occurrences from then on), then by a build at 08:00 for the second device (a backfill,
    or a host whose clock is behind). The cached parse starts too late for it: the source is read
    and expanded again, so the second device gets its 09:00-13:00 reminders. (Before: the parse was
    reused and those occurrences were missing: no rows, no error.)"""
    url = feeds.calendar("/hourly.ics", HOURLY_ICS)
    device(db, settings, "late", sources=[url], lead=600)
    build(db, settings, now=at(6 * 3600))  # 14:00: occurrences from 14:00 to 20:00
    device(db, settings, "early", sources=[url], lead=600)
    build(db, settings, now=NOW)  # 08:00
    early = sorted(r["event_at"].whole_seconds - NOW_S for r in rows(db) if r["device_id"] == "early")
    assert early[:5] == [3600, 7200, 10800, 14400, 18000], early
    assert len(early) == 12
