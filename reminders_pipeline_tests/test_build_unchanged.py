"""A tick where nothing changed: the build plans only what the horizon moved over, reads no
existing row, and parses no body it has parsed before; anything that changed plans in full.
On SQLite and PostgreSQL, with sources served over real HTTP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from reminders_pipeline import ledger
from reminders_pipeline.devices.registration import DeviceSpec, put_device
from reminders_pipeline.planning import build as build_mod
from reminders_pipeline.planning.build import build
from reminders_pipeline.planning.plan_key import FULL_PLAN_SECONDS
from reminders_pipeline.sources import reader as sources_mod

from .calendars import calendar
from .http_sources import Route
from .support import NOW, TOKEN, at, by_key, device, item, rows

HOUR = 3600


@pytest.fixture
def existing_reads(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The device ids of every ``ledger.existing_rows`` call the build makes for every row."""
    calls: list[list[str]] = []
    real = ledger.existing_rows

    def recording(conn: Any, device_ids: Any, item_ids: Any = None) -> Any:
        calls.append(list(device_ids) if item_ids is None else [*device_ids, "items:", *item_ids])
        return real(conn, device_ids, item_ids)

    monkeypatch.setattr(ledger, "existing_rows", recording)
    return calls


def counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of the parser ``sources.<name>``."""
    calls: list[int] = []
    real: Callable[..., Any] = getattr(sources_mod, name)

    def parse(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sources_mod, name, parse)
    return calls


def test_an_unchanged_tick_queues_only_what_the_horizon_moved_over(db, settings, feeds, existing_reads):
    horizon = settings.horizon_seconds
    url = feeds.items("/a.json", [item("soon", 2 * HOUR), item("later", horizon + 2 * HOUR)])
    device(db, settings, sources=[url])
    first = build(db, settings, now=NOW)
    assert (first.devices_unchanged, first.rows_inserted) == (0, 1)
    assert existing_reads == [["dev-1"]]

    step = build(db, settings, now=at(30 * 60))  # 'later' is due at NOW + horizon + 1 h: not yet
    assert (step.devices_built, step.devices_unchanged, step.rows_inserted) == (1, 1, 0)

    step = build(db, settings, now=at(3 * HOUR))  # now it is inside the horizon
    assert (step.devices_unchanged, step.rows_inserted, step.rows_updated) == (1, 1, 0)
    assert existing_reads == [["dev-1"]]  # neither step read the device's rows
    got = by_key(db)
    assert got[("later", "lead:3600")]["send_after"] == at(horizon + HOUR)
    assert got[("later", "lead:3600")]["status"] == "pending"
    assert got[("soon", "lead:3600")]["send_after"] == at(HOUR)


def test_a_body_served_again_without_validators_is_not_parsed_again(db, settings, feeds, monkeypatch):
    parsed = counting(monkeypatch, "parse_json_feed")
    url = feeds.items("/a.json", [item("e1", 2 * HOUR)])  # no ETag, no Last-Modified
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    again = build(db, settings, now=at(900))
    assert len(parsed) == 1 and feeds.hits["/a.json"] == 2
    assert (again.sources_not_modified, again.devices_unchanged) == (1, 1)

    feeds.items("/a.json", [item("e1", 3 * HOUR)])  # the body changed: parsed, planned in full
    moved = build(db, settings, now=at(1800))
    assert len(parsed) == 2 and (moved.sources_not_modified, moved.devices_unchanged) == (0, 0)
    assert by_key(db)[("e1", "lead:3600")]["send_after"] == at(2 * HOUR)


def test_a_304_tick_is_unchanged_too(db, settings, feeds, existing_reads):
    url = feeds.items("/a.json", [item("e1", 2 * HOUR)], etag='"v1"')
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    again = build(db, settings, now=at(900))
    assert feeds.not_modified["/a.json"] == 1
    assert (again.sources_not_modified, again.devices_unchanged) == (1, 1)
    assert len(existing_reads) == 1


def test_a_device_change_plans_in_full(db, settings, feeds, existing_reads):
    url = feeds.items("/a.json", [item("e1", 2 * HOUR)])
    device(db, settings, sources=[url], lead=HOUR)
    build(db, settings, now=NOW)
    put_device(db, settings, DeviceSpec("dev-1", TOKEN, 1800, (), (url,)), now=at(60))
    changed = build(db, settings, now=at(900))
    assert changed.devices_unchanged == 0 and len(existing_reads) == 2
    assert changed.rows_voided == {"rule_removed": 1}
    got = by_key(db)
    assert got[("e1", "lead:1800")]["status"] == "pending"
    assert got[("e1", "lead:3600")]["outcome"] == "voided"


def test_what_entered_the_horizon_while_a_read_failed_is_queued_once_it_answers(db, settings, feeds):
    horizon = settings.horizon_seconds
    body = [item("soon", 2 * HOUR), item("later", horizon + 2 * HOUR)]
    url = feeds.items("/a.json", body)
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    feeds.set("/a.json", Route(500, b"down"))
    failed = build(db, settings, now=at(3 * HOUR))  # 'later' entered the horizon during the outage
    assert len(failed.sources_failed) == 1 and failed.rows_inserted == 0
    feeds.items("/a.json", body)  # the same body as before the outage
    back = build(db, settings, now=at(3 * HOUR + 900))
    assert back.devices_unchanged == 0  # the failed build left no plan to step from
    assert back.rows_inserted == 1 and ("later", "lead:3600") in by_key(db)
    assert build(db, settings, now=at(4 * HOUR)).devices_unchanged == 1


def test_a_longer_horizon_queues_what_it_brings_in_and_a_shorter_one_plans_in_full(db, settings, feeds):
    horizon = settings.horizon_seconds
    url = feeds.items("/a.json", [item("e1", 2 * HOUR), item("far", horizon + 5 * HOUR)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    assert ("far", "lead:3600") not in by_key(db)

    longer = settings.with_(horizon_seconds=horizon + 6 * HOUR)
    step = build(db, longer, now=at(900))
    assert (step.devices_unchanged, step.rows_inserted) == (1, 1)
    assert by_key(db)[("far", "lead:3600")]["status"] == "pending"

    shorter = build(db, settings, now=at(1800))  # back to the shorter horizon: 'far' is out again
    assert shorter.devices_unchanged == 0 and shorter.rows_voided == {"out_of_horizon": 1}


def test_every_device_plans_in_full_at_least_once_a_day(db, settings, feeds):
    url = feeds.items("/a.json", [item("e1", 30 * HOUR)])
    device(db, settings, sources=[url], device_id="a")
    device(db, settings, sources=[url], device_id="b")
    build(db, settings, now=NOW)
    next_day = build(db, settings, now=at(FULL_PLAN_SECONDS))
    assert next_day.devices_built == 2 and next_day.devices_unchanged == 0


def test_a_feed_the_item_cap_cut_plans_in_full(db, settings, feeds):
    capped = settings.with_(source_max_items=1)
    url = feeds.items("/a.json", [item("e1", 2 * HOUR), item("e2", 3 * HOUR)])
    device(db, settings, sources=[url])
    first = build(db, capped, now=NOW)
    assert first.items_rejected == {"over_item_cap": 1}
    assert build(db, capped, now=at(900)).devices_unchanged == 0


@pytest.mark.parametrize("etag", [None, '"v1"'])
def test_a_new_item_cap_parses_the_feed_again_whether_or_not_it_answers_304(db, settings, feeds, monkeypatch, etag):
    parsed = counting(monkeypatch, "parse_json_feed")
    url = feeds.items("/a.json", [item(f"e{k}", (k + 2) * HOUR) for k in range(4)], etag=etag)
    device(db, settings, sources=[url])
    build(db, settings.with_(source_max_items=10), now=NOW)
    capped = build(db, settings.with_(source_max_items=2), now=at(900))
    assert len(parsed) == 2 and capped.items_rejected == {"over_item_cap": 2}
    assert capped.devices_unchanged == 0 and feeds.not_modified["/a.json"] == 0


def test_a_row_claimed_while_its_event_is_cancelled_is_voided_once_it_is_pending_again(db, settings, feeds):
    """A full plan leaves a claimed row alone (it is in flight). Should the drain give it back to
    pending (a retry, a hold), the next build must still see it, though the feed is unchanged."""
    url = feeds.items("/a.json", [item("e1", 2 * HOUR), item("e2", 3 * HOUR)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    row_id = by_key(db)[("e1", "lead:3600")]["id"]
    with db.write() as conn:
        assert [r["id"] for r in ledger.claim(conn, [row_id], at(HOUR), "drain-1")] == [row_id]
    feeds.items("/a.json", [item("e2", 3 * HOUR)])  # e1 cancelled while its row is in flight
    build(db, settings, now=at(HOUR + 10))
    assert by_key(db)[("e1", "lead:3600")]["status"] == "claimed"
    with db.write() as conn:
        ledger.return_to_pending(
            conn, [{"id": row_id, "outcome_detail": "retry", "spent": 1}], "drain-1", at(HOUR + 20)
        )
    again = build(db, settings, now=at(HOUR + 900))  # the same feed as the build before
    assert again.devices_unchanged == 0
    row = by_key(db)[("e1", "lead:3600")]
    assert (row["outcome"], row["outcome_detail"]) == ("voided", "left_feed")


def test_a_read_that_reused_the_cache_never_relabels_a_newer_parse(db, settings):
    """Two overlapping builds: one parsed the feed's new body and stored it; the other, slower,
    reused the old cache (a 304) and records after it. The newer parse keeps its own hash and
    validators, or a later read would take it for the old body."""
    device(db, settings, sources=["https://example.com/a.json"])
    with db.write() as conn:
        (source_id,) = ledger.subscriptions(conn, ["dev-1"])["dev-1"]
        fresh = {"id": source_id, "items": 0, "rejected": 0, "etag": '"v2"', "last_modified": None}
        ledger.record_source_success(conn, [{**fresh, "feed_cache": '{"items": []}', "content_hash": "h2"}], NOW)
        stale = {**fresh, "etag": '"v1"', "feed_cache": None, "content_hash": "h1"}
        ledger.record_source_success(conn, [stale], at(1))
        stored = ledger.sources_by_id(conn, [source_id])[source_id]
    assert (stored["etag"], stored["content_hash"], stored["feed_cache"]) == ('"v2"', "h2", '{"items": []}')


def test_a_device_that_uses_calendar_alarms_steps_and_queues_an_early_alarm_its_last_read_missed(db, settings, feeds):
    """A calendar is read a week past its subscribers' reach for a device that uses alarms. An
    event past that, whose alarm leads by more, enters a later read of the same body (here widened
    by another subscriber's ten-day lead) with its alarm already inside the last plan's reach: the
    step queues it, as a full plan would."""
    far = """BEGIN:VEVENT
UID:far@example.org
DTSTART:20260920T080000Z
DURATION:PT1H
RRULE:FREQ=DAILY;COUNT=2
SUMMARY:Far off
BEGIN:VALARM
ACTION:DISPLAY
TRIGGER:-P10DT20H
END:VALARM
END:VEVENT"""
    url = feeds.calendar("/a.ics", calendar(far))
    put_device(db, settings, DeviceSpec("alarms", TOKEN, HOUR, (), (url,), alarms=True), now=NOW)
    put_device(db, settings, DeviceSpec("ten-days", TOKEN, 10 * 86400, (), (url,)), now=NOW)
    second = ("far@example.org/20260921T080000Z", "lead:936000")  # its alarm: NOW + 4 h
    build(db, settings, device_ids=["alarms"], now=NOW)
    assert second not in by_key(db) and ("far@example.org/20260920T080000Z", "lead:936000") in by_key(db)

    step = build(db, settings, now=at(900))
    assert step.devices_unchanged == 1  # "alarms"; "ten-days" is planned for the first time
    got = by_key(db)
    assert (got[second]["send_after"], got[second]["status"]) == (at(4 * HOUR), "pending")


def test_each_write_transaction_holds_about_the_row_budget(db, settings, feeds, monkeypatch):
    """A sweep writes in short transactions, so a claim on SQLite waits behind one of them, never
    behind the whole sweep: here 4 rows per device and a budget of 10, so two devices at most."""
    monkeypatch.setattr(build_mod, "WRITE_TRANSACTION_ROWS", 10)
    locked: list[list[str]] = []
    real = ledger.lock_devices

    def recording(conn: Any, device_ids: Any, **kw: Any) -> Any:
        locked.append(list(device_ids))
        return real(conn, device_ids, **kw)

    monkeypatch.setattr(ledger, "lock_devices", recording)
    url = feeds.items("/a.json", [item(f"e{k}", (k + 2) * HOUR) for k in range(4)])
    for n in range(5):
        device(db, settings, f"dev-{n}", sources=[url])
    summary = build(db, settings, now=NOW)
    assert [len(ids) for ids in locked] == [2, 2, 1]
    assert (summary.devices_built, summary.rows_inserted) == (5, 20)


def test_a_plan_made_before_a_void_is_made_again_in_full(db, settings, feeds, monkeypatch):
    """Each device is planned before its write transaction. A row voided in between forgets the
    device's plan; the transaction sees that, plans the device in full, and the row comes back."""
    url = feeds.items("/a.json", [item("e1", 2 * HOUR), item("e2", 3 * HOUR)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    row_id = by_key(db)[("e1", "lead:3600")]["id"]
    real = ledger.plan_states
    reads: list[int] = []

    def voiding_after_the_first_read(conn: Any, device_ids: Any) -> Any:
        states = real(conn, device_ids)
        if not reads:
            with db.write() as other:
                ledger.void_rows(other, [row_id], "by_hand", at(800))
        reads.append(1)
        return states

    monkeypatch.setattr(ledger, "plan_states", voiding_after_the_first_read)
    again = build(db, settings, now=at(900))
    assert len(reads) == 2 and again.devices_unchanged == 0
    row = by_key(db)[("e1", "lead:3600")]
    assert (row["status"], row["outcome"]) == ("pending", None)


def test_a_device_removed_while_the_sources_are_read_is_left_out_and_the_rest_are_built(
    db, settings, feeds, monkeypatch
):
    """Devices are selected before the reads, which may take minutes; one removed meanwhile has
    no plan state to read, and the build goes on with the others."""
    url = feeds.items("/a.json", [item("e1", 2 * HOUR)])
    for n in range(3):
        device(db, settings, f"dev-{n}", sources=[url])
    real = build_mod.record_reads

    def removing_one(*args: Any, **kwargs: Any) -> Any:
        with db.write() as conn:
            ledger.delete_device(conn, "dev-1", NOW)
        return real(*args, **kwargs)

    monkeypatch.setattr(build_mod, "record_reads", removing_one)
    summary = build(db, settings, now=NOW)
    with db.read() as conn:
        rows = ledger.existing_rows(conn, ["dev-0", "dev-1", "dev-2"])
    assert sorted(r["device_id"] for r in rows) == ["dev-0", "dev-2"]
    assert summary.devices_built == 2


# -- a feed changed in some items -------------------------------------------------------------


def pending(db: Any, device_id: str) -> dict[tuple[str, str], tuple[Any, ...]]:
    """A device's pending rows as a full plan would make them: what each will send, and when."""
    return {
        (r["item_id"], r["rule"]): (r["send_after"], r["event_at"], r["expires_at"], r["title"])
        for r in rows(db, device_id=device_id, status="pending")
    }


def own_ids(read: list[str]) -> list[str]:
    """The items an ``existing_reads`` entry read rows of, without the source namespace."""
    return sorted(i.split(":", 1)[1] for i in read[read.index("items:") + 1 :])


@pytest.mark.parametrize("etag", [None, '"v1"'])
def test_a_feed_changed_in_some_items_plans_and_reads_only_those(db, settings, feeds, existing_reads, etag):
    url = feeds.items("/a.json", [item("a", 2 * HOUR), item("b", 3 * HOUR), item("c", 4 * HOUR)], etag=etag)
    device(db, settings, sources=[url], rules=("lead:0",))
    build(db, settings, now=NOW)
    body = [item("a", 2 * HOUR), item("b", 5 * HOUR), item("d", 6 * HOUR)]  # b moved, c gone, d new
    feeds.items("/a.json", body, etag=etag and '"v2"')
    changed = build(db, settings, now=at(900))
    assert (changed.devices_items_replanned, changed.devices_unchanged) == (1, 0)
    assert existing_reads[-1][0] == "dev-1" and own_ids(existing_reads[-1]) == ["b", "c", "d"]
    assert changed.rows_voided == {"left_feed": 2}
    assert (changed.rows_inserted, changed.rows_updated) == (2, 2)
    got = by_key(db)
    assert got[("b", "lead:3600")]["send_after"] == at(4 * HOUR)
    assert got[("d", "lead:0")]["send_after"] == at(6 * HOUR)

    device(db, settings, "dev-2", sources=[url], rules=("lead:0",))  # planned in full from the same feed
    build(db, settings, device_ids=["dev-2"], now=at(900))
    assert pending(db, "dev-1") == pending(db, "dev-2") and len(pending(db, "dev-1")) == 6


def test_an_item_changed_past_the_last_plan_reach_and_an_unchanged_one_entering_it(db, settings, feeds):
    """The changed item is planned in full, whatever the last plan reached; the unchanged one only
    where the horizon moved, as in a tick where nothing changed."""
    horizon = settings.horizon_seconds
    url = feeds.items("/a.json", [item("near", 2 * HOUR), item("far", horizon + 2 * HOUR)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    feeds.items("/a.json", [item("near", 2 * HOUR, title="Renamed"), item("far", horizon + 2 * HOUR)])
    changed = build(db, settings, now=at(3 * HOUR))
    assert changed.devices_items_replanned == 1
    got = by_key(db)
    assert got[("near", "lead:3600")]["title"] == "Renamed"
    assert got[("far", "lead:3600")]["status"] == "pending"


def test_a_calendar_override_replans_only_its_occurrence(db, settings, feeds, existing_reads):
    longer = settings.with_(horizon_seconds=4 * 86400)
    series = """BEGIN:VEVENT
UID:standup@example.org
DTSTART:20260910T120000
DURATION:PT15M
RRULE:FREQ=DAILY;COUNT=4
SUMMARY:Standup
END:VEVENT"""
    moved = """BEGIN:VEVENT
UID:standup@example.org
RECURRENCE-ID:20260911T120000
DTSTART:20260911T130000
DURATION:PT15M
SUMMARY:Standup (moved)
END:VEVENT"""
    url = feeds.calendar("/team.ics", calendar(series))
    for name in ("berlin", "again"):
        spec = DeviceSpec(name, TOKEN, HOUR, (), (url,), "Europe/Berlin")
        put_device(db, longer, spec, now=NOW)
    build(db, longer, device_ids=["berlin"], now=NOW)
    feeds.calendar("/team.ics", calendar(series, moved))
    changed = build(db, longer, device_ids=["berlin"], now=at(900))
    assert changed.devices_items_replanned == 1 and len(own_ids(existing_reads[-1])) == 1
    assert changed.rows_updated == 1 and not changed.rows_voided
    build(db, longer, device_ids=["again"], now=at(900))
    assert pending(db, "berlin") == pending(db, "again")
    titles = sorted(title for _, _, _, title in pending(db, "berlin").values())
    assert titles == ["Standup", "Standup", "Standup", "Standup (moved)"]


def test_a_device_whose_last_plan_is_older_than_the_replaced_parse_plans_in_full(db, settings, feeds):
    """Only a plan made from the very parse the new feed was compared with may skip the rest:
    a device left out of the build between two changes plans in full."""
    url = feeds.items("/a.json", [item("a", 2 * HOUR), item("b", 3 * HOUR)])
    device(db, settings, "often", sources=[url])
    device(db, settings, "seldom", sources=[url])
    build(db, settings, now=NOW)
    feeds.items("/a.json", [item("a", 2 * HOUR), item("b", 4 * HOUR)])
    build(db, settings, device_ids=["often"], now=at(900))
    feeds.items("/a.json", [item("a", 5 * HOUR), item("b", 4 * HOUR)])
    both = build(db, settings, now=at(1800))
    assert (both.devices_built, both.devices_items_replanned) == (2, 1)
    assert pending(db, "often") == pending(db, "seldom")
    assert {k[0].split(":")[1]: v[0] for k, v in pending(db, "seldom").items()} == {
        "a": at(4 * HOUR),
        "b": at(3 * HOUR),
    }


def test_a_changed_feed_the_item_cap_cut_plans_in_full(db, settings, feeds):
    capped = settings.with_(source_max_items=2)
    url = feeds.items("/a.json", [item(f"e{k}", (k + 2) * HOUR) for k in range(3)])
    device(db, settings, sources=[url])
    build(db, capped, now=NOW)
    feeds.items("/a.json", [item("e0", 2 * HOUR, title="Renamed"), *(item(f"e{k}", (k + 2) * HOUR) for k in (1, 2))])
    changed = build(db, capped, now=at(900))
    assert (changed.devices_items_replanned, changed.devices_unchanged) == (0, 0)
    assert by_key(db)[("e0", "lead:3600")]["title"] == "Renamed"


def test_only_the_changed_sources_items_are_read(db, settings, feeds, existing_reads):
    one = feeds.items("/one.json", [item("a", 2 * HOUR)])
    two = feeds.items("/two.json", [item("b", 3 * HOUR)])
    device(db, settings, sources=[one, two])
    build(db, settings, now=NOW)
    feeds.items("/two.json", [item("b", 3 * HOUR), item("c", 4 * HOUR)])
    changed = build(db, settings, now=at(900))
    assert changed.devices_items_replanned == 1 and own_ids(existing_reads[-1]) == ["c"]
    assert (changed.rows_inserted, changed.rows_updated) == (1, 0)


def test_past_the_lookup_bound_the_rows_are_read_whole_and_only_the_changed_items_kept(
    db, settings, feeds, existing_reads, monkeypatch
):
    """A feed that changes in many items is looked up by device, not by a list of thousands of ids."""
    monkeypatch.setattr(build_mod, "ITEM_LOOKUP_MAX", 1)
    url = feeds.items("/a.json", [item("a", 2 * HOUR), item("b", 3 * HOUR), item("c", 4 * HOUR)])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    feeds.items("/a.json", [item("a", 2 * HOUR), item("b", 5 * HOUR), item("c", 6 * HOUR, title="Renamed")])
    changed = build(db, settings, now=at(900))
    assert changed.devices_items_replanned == 1 and existing_reads[-1] == ["dev-1"]
    assert (changed.rows_inserted, changed.rows_updated, changed.rows_voided) == (0, 2, {})
    got = by_key(db)
    assert (got[("b", "lead:3600")]["send_after"], got[("c", "lead:3600")]["title"]) == (at(4 * HOUR), "Renamed")


def test_a_body_changed_in_no_item_is_a_step(db, settings, feeds, existing_reads):
    """A body whose bytes change but whose items do not (a regenerated DTSTAMP, a field the
    parser ignores) is planned like an unchanged feed, and counted as one."""
    url = feeds.items("/a.json", [item("a", 2 * HOUR, note="v1")])
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    feeds.items("/a.json", [item("a", 2 * HOUR, note="v2")])
    again = build(db, settings, now=at(900))
    assert (again.devices_items_replanned, again.devices_unchanged, again.sources_not_modified) == (0, 1, 0)
    assert existing_reads == [["dev-1"]]


def test_the_changed_items_are_named_once_per_source_not_per_subscriber(
    db, settings, feeds, existing_reads, monkeypatch
):
    """The lookup of a shared feed's changed items costs its items, not items x subscribers: it
    is built inside the write transaction."""
    url = feeds.items("/a.json", [item(f"e{k}", (k + 2) * HOUR) for k in range(20)])
    for n in range(5):
        device(db, settings, f"dev-{n}", sources=[url])
    build(db, settings, now=NOW)
    feeds.items("/a.json", [item(f"e{k}", (k + 2) * HOUR, title=f"New {k}") for k in range(20)])
    named: list[str] = []
    real = build_mod.namespaced
    monkeypatch.setattr(build_mod, "namespaced", lambda *args: named.append(real(*args)) or named[-1])
    changed = build(db, settings, now=at(900))
    assert (changed.devices_items_replanned, changed.rows_updated) == (5, 100)
    assert len(named) == 20 and len(own_ids(existing_reads[-1])) == 20
