"""Drain semantics on SQLite and PostgreSQL with the recording sender (no APNs requests)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections import Counter
from contextlib import contextmanager

import pytest
from sqlalchemy.exc import InternalError, OperationalError
from sqlalchemy.exc import TimeoutError as SATimeoutError

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings, SettingsError
from reminders_pipeline.domain.rows import ClaimedRow, PlannedRow, QueueRow
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.ledger.schema import notification_queue
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.base import RecordingSender, SendResult
from reminders_pipeline.providers.routing import checked_sender_factory
from reminders_pipeline.sending.drain import batches_of, drain, fail_abandoned, find_due, send_batch, send_batch_async
from reminders_pipeline.sending.settlement import SettlementsNotWritten, write_settlement

from .support import NOW, TOKEN, at, by_key, device, item, recorded, rows


def queue_one(db, settings, feeds, starts_in=7200, **kw):
    url = feeds.items("/a.json", [item("e", starts_in)])
    device(db, settings, sources=[url], **kw)
    build(db, settings, now=NOW)
    return by_key(db)


def test_due_predicate_is_send_after_passed_and_pending(db, settings, feeds):
    got = queue_one(db, settings, feeds)
    row_id = got[("e", "lead:3600")]["id"]
    assert find_due(db, at(3599)) == []
    assert find_due(db, Instant.from_stored("2026-09-10T08:59:59.999Z")) == []
    assert find_due(db, at(3600)) == [row_id]
    assert find_due(db, at(5000)) == [row_id]


def test_due_not_windowed_a_skipped_tick_recovers(db, live, feeds):
    queue_one(db, live, feeds)
    sender = RecordingSender()
    # No drain at the due time; the next one, 20 minutes late, still sends it.
    summary = drain(db, live, sender.factory(), now=at(3600 + 1200))
    assert summary.outcomes == {"sent": 1}
    assert summary.lateness_seconds == [1200.0]


def test_sent_row_is_settled_with_sent_at_and_apns_id(db, live, feeds):
    queue_one(db, live, feeds)
    sender = RecordingSender()
    drain(db, live, sender.factory(), now=at(3605))
    (row,) = rows(db)
    assert (row["status"], row["outcome"], row["sent_at"], row["claimed_at"]) == ("settled", "sent", at(3605), at(3605))
    assert row["apns_id"] == "recorded-1"
    (note,) = sender.sent
    assert note.device_token == TOKEN and note.payload["aps"]["alert"]["title"] == "Event e"
    assert note.expiration == at(7200).whole_seconds
    assert json.loads(row["payload"])["payload"] == recorded(note.payload)


def test_a_second_drain_sends_nothing(db, live, feeds):
    queue_one(db, live, feeds)
    sender = RecordingSender()
    drain(db, live, sender.factory(), now=at(3605))
    again = drain(db, live, sender.factory(), now=at(3610))
    assert again.claimed == 0 and len(sender.sent) == 1


def test_dry_run_settles_disabled_with_what_would_have_been_sent(db, settings, feeds):
    queue_one(db, settings, feeds)
    summary = drain(
        db, settings, checked_sender_factory(db, settings), now=at(3605)
    )  # enabled=False: no sender is even built
    (row,) = rows(db)
    assert summary.outcomes == {"disabled": 1}
    assert row["outcome"] == "disabled" and row["sent_at"] is None
    assert json.loads(row["payload"])["payload"]["aps"]["alert"]["title"] == "Event e"


@pytest.mark.parametrize(
    "drain_at, rule, expected",
    [
        (7200 + 10, "lead:600", "event_started"),
        (7200 + 1800, "lead:600", "event_expired"),
        (3600 + 1801, "lead:3600", "too_late"),
        (7200 + 1800 + 60, "lead:0@expiry", "sent"),
        (7200 + 60, "lead:0", "sent"),
    ],
)
def test_send_time_policy_through_the_drain(db, live, feeds, drain_at, rule, expected):
    url = feeds.items("/a.json", [item("e", 7200)])
    lead = int(rule.split(":")[1].split("@")[0])
    extra = (rule,) if "@" in rule else ()
    device(db, live, sources=[url], lead=lead if not extra else 3600, rules=extra)
    build(db, live, now=NOW)
    target = by_key(db)[("e", rule)]
    drain(db, live, RecordingSender().factory(), now=at(drain_at), row_id=target["id"])
    assert by_key(db)[("e", rule)]["outcome"] == expected


def test_drain_by_row_id_touches_only_that_row(db, live, feeds):
    url = feeds.items("/a.json", [item("a", 7200), item("b", 7200)])
    device(db, live, sources=[url])
    build(db, live, now=NOW)
    got = by_key(db)
    sender = RecordingSender()
    summary = drain(db, live, sender.factory(), now=at(3600), row_id=got[("a", "lead:3600")]["id"])
    assert summary.outcomes == {"sent": 1}
    assert by_key(db)[("b", "lead:3600")]["status"] == "pending"
    # Not due yet: nothing happens.
    assert drain(db, live, sender.factory(), now=at(10), row_id=got[("b", "lead:3600")]["id"]).claimed == 0


def test_single_claim_delivery_across_threads(db_url, live, feeds):
    url = feeds.items("/a.json", [item(f"e{i}", 7200 + i) for i in range(300)])
    first = Database(db_url)
    device(first, live, sources=[url])
    build(first, live, now=NOW)
    ids = find_due(first, at(4000))
    assert len(ids) == 300
    senders = [RecordingSender() for _ in range(4)]
    barrier = threading.Barrier(4)
    errors = []

    def run(sender):
        db = Database(db_url)
        try:
            barrier.wait()
            send_batch(
                db,
                live.with_(claim_batch_size=25),
                list(reversed(ids)) if sender is senders[1] else ids,
                sender.factory(),
                now=at(4000),
            )
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            db.dispose()

    threads = [threading.Thread(target=run, args=(s,)) for s in senders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    sent_ids = Counter(n.row_id for s in senders for n in s.sent)
    assert set(sent_ids) == set(ids) and max(sent_ids.values()) == 1
    assert {r["outcome"] for r in rows(first)} == {"sent"}
    first.dispose()


def test_claim_returns_only_rows_that_are_mine(db, live, feeds):
    got = queue_one(db, live, feeds)
    row_id = got[("e", "lead:3600")]["id"]
    with db.write() as conn:
        assert [r["id"] for r in ledger.claim(conn, [row_id], at(3600), "a")] == [row_id]
    with db.write() as conn:
        assert ledger.claim(conn, [row_id], at(3600), "b") == []
    with db.write() as conn:  # b cannot settle a's claim
        assert ledger.settle(conn, [{"id": row_id, "outcome": "sent"}], "b", at(3601)) == 0


def test_a_claimed_row_carries_exactly_the_keys_its_type_names(db, live, feeds):
    got = queue_one(db, live, feeds)
    row_id = got[("e", "lead:3600")]["id"]
    assert set(QueueRow.__annotations__) == set(notification_queue.c.keys())
    assert set(PlannedRow.__annotations__) < set(QueueRow.__annotations__)
    with db.write() as conn:
        (claimed,) = ledger.claim(conn, [row_id], at(3600), "a")
    assert set(claimed) == set(ClaimedRow.__annotations__)
    assert claimed["target"] == TOKEN and claimed["provider"] == "apns" and claimed["subscribed"]


def test_a_claim_under_a_halted_scope_claims_nothing_and_other_scopes_claim_on(db, live, feeds):
    got = queue_one(db, live, feeds)
    row_id = got[("e", "lead:3600")]["id"]
    with db.write() as conn:
        ledger.record_halt(conn, "run-1", "apns", "InvalidProviderToken", "a", at(3600))
        ledger.record_halt(conn, "run-1_x", "fcm", "fcm:SENDER_ID_MISMATCH", "a", at(3600))
    with db.write() as conn:
        assert ledger.claim(conn, [row_id], at(3600), "a", unless_halted="run-1") == []
        assert ledger.halts_of(conn, "run-1") == {"apns": "InvalidProviderToken"}  # not run-1_x's: LIKE's _ escaped
    assert [r["status"] for r in rows(db)] == ["pending"]
    with db.write() as conn:
        assert [r["id"] for r in ledger.claim(conn, [row_id], at(3600), "b", unless_halted="run-2")] == [row_id]


def test_abandoned_claim_is_failed_never_retried(db, live, feeds):
    got = queue_one(db, live, feeds)
    row_id = got[("e", "lead:3600")]["id"]
    with db.write() as conn:
        ledger.claim(conn, [row_id], at(3600), "died")
    assert fail_abandoned(db, live, at(3600 + live.abandon_after_seconds)) == 0  # not yet
    assert fail_abandoned(db, live, at(3600 + live.abandon_after_seconds + 1)) == 1
    sender = RecordingSender()
    summary = drain(db, live, sender.factory(), now=at(3600 + 2000))
    row = by_key(db)[("e", "lead:3600")]
    assert (row["outcome"], row["outcome_detail"]) == ("failed", "abandoned")
    assert sender.sent == [] and summary.claimed == 0
    with db.write() as conn:  # the dead run, if it wakes, cannot overwrite the verdict
        assert ledger.settle(conn, [{"id": row_id, "outcome": "sent"}], "died", at(9000)) == 0
    build(db, live, now=at(3600 + 2100))  # and the build does not revive it
    assert by_key(db)[("e", "lead:3600")]["outcome"] == "failed"


def test_cancellation_before_the_drain_means_nothing_is_sent(db, live, feeds):
    queue_one(db, live, feeds)
    feeds.items("/a.json", [])
    build(db, live, now=at(60))
    sender = RecordingSender()
    summary = drain(db, live, sender.factory(), now=at(3600))
    assert sender.sent == [] and summary.claimed == 0
    assert by_key(db)[("e", "lead:3600")]["outcome_detail"] == "left_feed"


def test_failed_send_settles_failed_with_reason(db, live, feeds):
    queue_one(db, live, feeds)
    sender = RecordingSender(script={TOKEN: SendResult(0, False, reason="InternalServerError", status=500)})
    summary = drain(db, live, sender.factory(), now=at(3600))
    row = by_key(db)[("e", "lead:3600")]
    assert (row["outcome"], row["outcome_detail"]) == ("failed", "InternalServerError")
    assert summary.details == {"failed:InternalServerError": 1}
    assert drain(db, live, sender.factory(), now=at(3700)).claimed == 0  # never retried


def test_dead_token_marks_device_and_voids_its_other_rows(db, live, feeds):
    url = feeds.items("/a.json", [item("now", 3600), item("later", 7200)])
    device(db, live, sources=[url])
    build(db, live, now=NOW)
    sender = RecordingSender(
        script={
            TOKEN: SendResult(0, False, reason="Unregistered", status=410, token_invalid=True, token_invalid_at=at(5))
        }
    )
    summary = drain(db, live, sender.factory(), now=at(0))
    got = by_key(db)
    assert got[("now", "lead:3600")]["outcome"] == "failed"
    assert (got[("later", "lead:3600")]["outcome"], got[("later", "lead:3600")]["outcome_detail"]) == (
        "voided",
        "unregistered",
    )
    assert summary.tokens_invalidated == 1 and summary.voided_by_token == 1
    with db.read() as conn:
        dev = ledger.get_device(conn, "dev-1")
    assert dev.token_invalid_at == at(5) and dev.token_invalid_reason == "Unregistered"


def test_a_dead_token_answer_older_than_the_devices_registration_marks_nothing(db, live, feeds):
    """Apple: stop sending "unless the device registers again after" the 410's timestamp. A 410
    timestamped before the device's last registration (the same token) is stale, and so is a
    BadDeviceToken (no timestamp) for a send claimed before the device registered again while it
    was on the wire: neither marks the device nor voids its other rows."""
    from reminders_pipeline.devices.registration import DeviceSpec, put_device

    url = feeds.items("/a.json", [item("now", 3600), item("soon", 3660), item("later", 7200)])
    spec = DeviceSpec("dev-1", TOKEN, 3600, (), (url,))
    put_device(db, live, spec, now=at(-30))
    build(db, live, now=at(-30))
    stale_410 = SendResult(0, False, reason="Unregistered", status=410, token_invalid=True, token_invalid_at=at(-60))
    drain(
        db,
        live,
        RecordingSender(script={TOKEN: stale_410}).factory(),
        now=at(0),
        row_id=by_key(db)[("now", "lead:3600")]["id"],
    )

    def registered_again_meanwhile(n):
        put_device(db, live, spec, now=at(61))  # while the send claimed at 60 is on the wire
        return SendResult(n.row_id, False, reason="BadDeviceToken", status=400, token_invalid=True)

    drain(db, live, RecordingSender(script={TOKEN: registered_again_meanwhile}).factory(), now=at(60))
    with db.read() as conn:
        dev = ledger.get_device(conn, "dev-1")
    assert dev.token_invalid_at is None
    got = by_key(db)
    assert [got[(k, "lead:3600")]["outcome"] for k in ("now", "soon", "later")] == ["failed", "failed", None]


def test_config_fault_stops_claiming_and_leaves_the_rest_pending(db, live, feeds):
    url = feeds.items("/a.json", [item(f"e{i}", 3600) for i in range(10)])
    device(db, live, sources=[url])
    build(db, live, now=NOW)
    sender = RecordingSender(
        script={TOKEN: SendResult(0, False, reason="InvalidProviderToken", status=403, config_fault=True)}
    )
    summary = drain(db, live.with_(claim_batch_size=3), sender.factory(), now=at(0))
    assert summary.halted == "InvalidProviderToken"
    assert summary.claimed == 3 and summary.outcomes == {"failed": 3}
    assert Counter(r["status"] for r in rows(db)) == {"settled": 3, "pending": 7}


def test_sender_that_raises_still_settles_every_claimed_row(db, live, feeds):
    queue_one(db, live, feeds)

    class Broken(RecordingSender):
        async def send_many(self, notifications):
            raise RuntimeError("bug")

    drain(db, live, Broken().factory(), now=at(3600))
    row = by_key(db)[("e", "lead:3600")]
    assert (row["outcome"], row["outcome_detail"]) == ("failed", "sender_error:RuntimeError")


def test_every_claimed_row_is_settled_with_mixed_outcomes(db, live, feeds):
    url = feeds.items("/a.json", [item("started", 600), item("ok", 3600), item("late", 5500), item("now", 4500)])
    device(db, live, sources=[url], lead=600, rules=("lead:3600", "lead:0@expiry"))
    build(db, live, now=NOW)
    summary = drain(db, live, RecordingSender().factory(), now=at(4000))
    outcomes = {(r["item_id"].split(":")[1], r["rule"]): r["outcome"] for r in rows(db)}
    assert outcomes == {
        ("started", "lead:600"): "event_expired",
        ("started", "lead:3600"): "event_expired",
        ("started", "lead:0@expiry"): "sent",
        ("ok", "lead:600"): "event_started",
        ("ok", "lead:3600"): "event_started",
        ("ok", "lead:0@expiry"): None,
        ("late", "lead:3600"): "too_late",
        ("late", "lead:600"): None,
        ("late", "lead:0@expiry"): None,
        ("now", "lead:3600"): "too_late",
        ("now", "lead:600"): "sent",
        ("now", "lead:0@expiry"): None,
    }
    assert summary.claimed == sum(1 for o in outcomes.values() if o)
    assert {r["status"] for r in rows(db) if r["outcome"] is None} == {"pending"}


def test_batches_are_bounded():
    assert batches_of([], 10, 5) == []
    assert [len(b) for b in batches_of(list(range(25)), 10, 5)] == [9, 9, 7]
    big = batches_of(list(range(10_000)), 100, 40)
    assert len(big) == 40 and sum(map(len, big)) == 10_000


def test_apns_credentials_missing_fail_fast_before_any_claim(db, live, feeds):
    queue_one(db, live, feeds)
    with pytest.raises(ValueError, match="REMINDERS_APNS_KEY_FILE"):
        drain(db, live, checked_sender_factory(db, live), now=at(3600))
    assert {r["status"] for r in rows(db)} == {"pending"}


def test_bad_tokens_of_many_devices_mark_each_device_and_halt_nothing(db, live, feeds):
    """Seven devices whose tokens APNs rejects, due together, are seven faults of their own: each
    device is marked, its row fails with APNs' reason, and the drain sends everyone else's."""
    url = feeds.items("/a.json", [item("e", 3600), item("later", 7200)])
    bad_tokens = [f"{i:064x}" for i in range(1, 8)]
    for i, tok in enumerate(bad_tokens):
        device(db, live, f"d{i}", sources=[url], token=tok)
    device(db, live, "good", sources=[feeds.items("/b.json", [item("e", 3630), item("later", 7200)])])
    build(db, live, now=NOW)
    bad = SendResult(0, False, reason="BadDeviceToken", status=400, token_invalid=True)
    sender = RecordingSender(script={tok: bad for tok in bad_tokens})
    summary = drain(db, live, sender.factory(), now=at(0))
    assert summary.halted is None and summary.tokens_invalidated == 7
    assert summary.outcomes == {"failed": 7} and summary.details == {"failed:BadDeviceToken": 7}
    assert drain(db, live, sender.factory(), now=at(30)).outcomes == {"sent": 1}  # the good device's, due 30 s later
    with db.read() as conn:
        marked = {d.id: d.token_invalid_reason for d in ledger.list_devices(conn)}
    assert marked == {**{f"d{i}": "BadDeviceToken" for i in range(7)}, "good": None}
    later = {r["device_id"]: (r["outcome"], r["outcome_detail"]) for r in rows(db) if r["item_id"].endswith(":later")}
    assert later == {**{f"d{i}": ("voided", "token_invalid") for i in range(7)}, "good": (None, None)}
    assert drain(db, live, sender.factory(), now=at(3600)).outcomes == {"sent": 1}  # only the good device's
    assert [n.device_id for n in sender.sent].count("good") == 2 and len(sender.sent) == 9


def test_registering_again_clears_the_mark_even_with_the_same_token(db, live, feeds):
    """Apple: stop sending to an unregistered token unless the device registered again since. The
    device's next PUT is that registration; its voided rows come back with the next build."""
    url = feeds.items("/a.json", [item("e", 3600), item("later", 7200)])
    device(db, live, sources=[url])
    build(db, live, now=NOW)
    gone = SendResult(0, False, reason="Unregistered", status=410, token_invalid=True, token_invalid_at=at(5))
    drain(db, live, RecordingSender(script={TOKEN: gone}).factory(), now=at(10))
    device(db, live, sources=[url])  # the same token, registered again
    with db.read() as conn:
        dev = ledger.get_device(conn, "dev-1")
    assert (dev.token_invalid_at, dev.token_invalid_reason) == (None, None)
    build(db, live, now=at(60))
    sender = RecordingSender()
    assert drain(db, live, sender.factory(), now=at(3600)).outcomes == {"sent": 1}
    assert [n.payload["reminder"]["item_id"] for n in sender.sent] == [by_key(db)[("later", "lead:3600")]["item_id"]]


def test_429s_to_one_token_are_its_backoff_never_an_outage_halt(db, live, feeds):
    """APNs throttling one device token (429 TooManyRequests) says nothing about APNs or our
    configuration: however many in a row, the drain goes on sending the others."""
    url = feeds.items("/a.json", [item(f"e{i}", 3600) for i in range(20)])
    device(db, live, "noisy", sources=[url], token="cd" * 32)  # its 20 rows are claimed first (lower ids)
    device(db, live, "other", sources=[url])
    build(db, live, now=NOW)
    throttled = SendResult(0, False, reason="TooManyRequests", status=429, retry=True)
    live = live.with_(send_halt_after=5, claim_batch_size=10)
    summary = drain(db, live, RecordingSender(script={"cd" * 32: throttled}).factory(), now=at(0))
    assert summary.halted is None and summary.outcomes == {"sent": 20} and summary.returned_to_pending == 20


def test_an_outage_of_500s_still_halts(db, live, feeds):
    url = feeds.items("/a.json", [item(f"e{i}", 3600) for i in range(10)])
    device(db, live, sources=[url])
    build(db, live, now=NOW)
    down = SendResult(0, False, reason="InternalServerError", status=500, retry=True)
    summary = drain(
        db,
        live.with_(send_halt_after=3, claim_batch_size=3),
        RecordingSender(script={TOKEN: down}).factory(),
        now=at(0),
    )
    assert summary.halted.startswith("apns_unreachable: 3 sends in a row")


def test_a_few_bad_tokens_are_just_dead_tokens(db, live, feeds):
    url = feeds.items("/a.json", [item("e", 3600)])
    device(db, live, "dead", sources=[url], token="cd" * 32)
    device(db, live, "alive", sources=[url])
    build(db, live, now=NOW)
    sender = RecordingSender(
        script={"cd" * 32: SendResult(0, False, reason="BadDeviceToken", status=400, token_invalid=True)}
    )
    summary = drain(db, live, sender.factory(), now=at(0))
    assert summary.halted is None and summary.tokens_invalidated == 1 and summary.outcomes == {"sent": 1, "failed": 1}


def test_a_row_whose_text_cannot_be_encoded_fails_alone(live):
    """Neither database stores a lone surrogate, but a row that cannot become a payload must fail
    by itself after the claim, not abort the slice and leave its neighbours claimed."""
    from reminders_pipeline.sending.settlement import decide_all

    def row(i, title):
        return {
            "id": i,
            "device_id": f"d{i}",
            "item_id": "e",
            "rule": "lead:3600",
            "title": title,
            "body": None,
            "send_after": at(3600),
            "event_at": at(7200),
            "expires_at": at(9000),
            "target": TOKEN,
            "token_invalid_at": None,
            "last_tz_offset_seconds": 0,
        }

    plan = decide_all([row(1, "bad \ud800"), row(2, "Standup")], at(3600), live)
    assert plan.settlements == [{"id": 1, "outcome": "failed", "outcome_detail": "invalid:UnicodeEncodeError"}]
    assert [n.row_id for n in plan.to_send] == [2]


def _due_items(db, live, feeds, n):
    url = feeds.items("/a.json", [item(f"e{i}", 3600) for i in range(n)])
    device(db, live, sources=[url])
    build(db, live, now=NOW)
    return find_due(db, at(0))


FORBIDDEN = SendResult(0, False, reason="InvalidProviderToken", status=403, config_fault=True)


def test_a_halt_stops_every_other_batch_of_its_scope_in_any_process_without_a_second_alert(db, live, feeds, db_url):
    live = live.with_(alert_webhook_url=feeds.url("/hook"), claim_batch_size=3)
    ids = _due_items(db, live, feeds, 9)
    first = send_batch(
        db,
        live,
        ids[:3],
        RecordingSender(script={TOKEN: FORBIDDEN}).factory(),
        now=at(0),
        claimer="run-1:b0",
        halt_scope="run-1",
    )
    assert first.halted == "InvalidProviderToken" and len(feeds.posts["/hook"]) == 1
    # another process of the same run: nothing of the first batch's is in its memory
    code = (
        "import json, sys\n"
        "from reminders_pipeline.ledger.db import Database\n"
        "from reminders_pipeline.sending.drain import send_batch\n"
        "from reminders_pipeline.providers.base import RecordingSender\n"
        "from reminders_pipeline.config.settings import Settings\n"
        "from reminders_pipeline.domain.times import Instant\n"
        "sender = RecordingSender()\n"
        f"s = send_batch(Database({db_url!r}), Settings(database_url={db_url!r}, enabled=True), {ids[3:6]!r}, sender.factory(),"
        f" now=Instant.from_stored({at(0).stored!r}), claimer='run-1:b1', halt_scope='run-1')\n"
        "print(json.dumps({'halted': s.halted, 'claimed': s.claimed, 'sent': len(sender.sent)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "halted": "InvalidProviderToken",
        "claimed": 0,
        "sent": 0,
    }
    same_process = send_batch(
        db, live, ids[6:], RecordingSender().factory(), now=at(0), claimer="run-1:b2", halt_scope="run-1"
    )
    assert (same_process.halted, same_process.claimed) == ("InvalidProviderToken", 0)
    assert len(feeds.posts["/hook"]) == 1  # alerted once, by the batch that met the fault
    assert Counter(r["status"] for r in rows(db)) == {"settled": 3, "pending": 6}
    other_run = send_batch(
        db, live, ids[3:], RecordingSender().factory(), now=at(0), claimer="run-2:b0", halt_scope="run-2"
    )
    assert other_run.outcomes == {"sent": 6} and other_run.halted is None


def test_a_row_returned_to_pending_is_still_bounded_by_max_lateness(db, live, feeds):
    ids = _due_items(db, live, feeds, 1)
    unavailable = SendResult(0, False, reason="ServiceUnavailable", status=503, retry=True)
    summary = drain(db, live, RecordingSender(script={TOKEN: unavailable}).factory(), now=at(0))
    assert (
        summary.returned_to_pending == 1 and find_due(db, at(0)) == [] and find_due(db, at(10)) == ids
    )  # after its backoff
    late = at(live.max_lateness_seconds + 1)  # the event starts at at(3600): only lateness stops it
    assert drain(db, live, RecordingSender().factory(), now=late).outcomes == {"too_late": 1}


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite has no notifications: its dispatchers poll
def test_rows_returned_to_pending_wake_listening_dispatchers_on_postgresql(db, live, feeds, db_url):
    import psycopg
    from sqlalchemy.engine import make_url

    ids = _due_items(db, live, feeds, 1)
    dsn = make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {ledger.DUE_CHANNEL}")
        unavailable = SendResult(0, False, reason="ServiceUnavailable", status=503, retry=True)
        assert (
            drain(db, live, RecordingSender(script={TOKEN: unavailable}).factory(), now=at(0)).returned_to_pending == 1
        )
        notes = list(listener.notifies(timeout=5, stop_after=1))
    (row,) = rows(db)
    assert [(n.channel, n.payload) for n in notes] == [
        (ledger.DUE_CHANNEL, row["not_before"].stored)
    ]  # when it is due again
    assert find_due(db, row["not_before"]) == ids


def test_a_rows_sent_at_is_when_its_own_answer_came_on_the_drains_clock():
    """Each row's lateness is its own answer's, not its slice's end (``settlement._answered_at``)."""
    from reminders_pipeline.sending.settlement import _answered_at

    started, done = (Instant.from_unix(1000), 5000.0), Instant.from_unix(1010)
    answered = SendResult(1, True, status=200, answered_at=5002.5)
    assert _answered_at(answered, done, started) == Instant.from_unix(1002.5)
    assert _answered_at(SendResult(1, True, status=200), done, started) == done  # no answer time: the slice's end


def test_once_fcms_streak_is_an_outage_its_answers_spent_attempts_come_back_and_its_rows_spend_none(caplog):
    from reminders_pipeline.sending.faults import Outages, return_undelivered
    from reminders_pipeline.sending.settlement import Settlement

    def busy(row_id: int) -> SendResult:
        return SendResult(row_id, False, reason="UNAVAILABLE", status=503, retry=True)

    def slice_of(ids: list[int], at: Instant) -> tuple[Settlement, list[dict]]:
        rows = [{"id": i, "outcome_detail": "UNAVAILABLE"} for i in ids]
        return Settlement(at, rows, [], providers=dict.fromkeys(ids, "fcm")), [
            {"id": i, "device_id": f"droid{i}", "attempts": 0} for i in ids
        ]

    throttled = SendResult(4, False, reason="QUOTA_EXCEEDED", status=429, retry=True)  # one target's, no outage
    outages, settings = Outages(limit=3), Settings()
    first, rows = slice_of([4, 1, 2], Instant.from_unix(1000))
    return_undelivered(first, rows, [throttled, busy(1), busy(2)], settings, outages, DrainResult(first.at))
    assert [r["spent"] for r in first.returned] == [True, True, True] and first.refunds == {}
    second, rows = slice_of([3], Instant.from_unix(1001))
    summary = DrainResult(second.at)
    with caplog.at_level("ERROR", logger="reminders_pipeline.sending.faults"):
        return_undelivered(second, rows, [busy(3)], settings, outages, summary)
    assert second.refunds == {1: 1, 2: 1} and list(summary.halts) == ["fcm"]
    assert [r.getMessage() for r in caplog.records] == [
        f"FCM unreachable ({summary.halts['fcm']}): stopped claiming its rows; they stay pending"
    ]
    assert second.returned == [{"id": 3, "outcome_detail": "UNAVAILABLE", "spent": False, "not_before": None}]


def test_a_runs_halts_are_named_by_provider_in_one_line():
    """What the Dagster drain logs and fails with: each halted provider by its name, in a fixed order."""
    from reminders_pipeline.sending.faults import describe_halts

    halts = {"webpush": "webpush_unreachable: 3 sends", "apns": "InvalidProviderToken"}
    assert describe_halts(halts) == "APNs: InvalidProviderToken; Web Push: webpush_unreachable: 3 sends"


def test_a_halts_alert_names_its_provider_and_what_ends_it(monkeypatch):
    """An outage's alert says its rows wait for the provider; a configuration fault's names what to
    mend. Each carries the run's failed count."""
    from reminders_pipeline.sending import faults

    alerts: list[tuple[str, str, int]] = []
    monkeypatch.setattr(
        faults, "raise_alert", lambda settings, title, text, *, claimer, failed: alerts.append((title, text, failed))
    )
    summary = DrainResult(Instant(0))
    summary.outcomes["failed"] = 2
    outage = "webpush_unreachable: 3 sends in a row not delivered (last: http_503)"
    for provider, reason in [("webpush", outage), ("fcm", "fcm:SENDER_ID_MISMATCH"), ("webpush", "sender_error:X"),
                             ("apns", "InvalidProviderToken")]:  # fmt: skip
        faults.alert_halt(Settings(), provider, reason, "run-1", summary)
    pending = "Its rows not yet claimed stay pending; the other providers' are sent on."
    assert alerts == [
        (
            "Web Push unreachable: drain stopped claiming its rows",
            f"{outage}. Those rows are pending again, no attempt spent; the other providers' rows are sent on, "
            "and Web Push rows go once it answers (each bounded by MAX_LATENESS).",
            2,
        ),
        (
            "FCM configuration fault: drain stopped claiming its rows",
            "FCM answered fcm:SENDER_ID_MISMATCH: the service-account key (REMINDERS_FCM_CREDENTIALS_FILE) or its "
            f"project is refused, not the row. {pending}",
            2,
        ),
        (
            "Web Push configuration fault: drain stopped claiming its rows",
            "Web Push failed with sender_error:X: the VAPID key (REMINDERS_VAPID_PRIVATE_KEY_FILE) or subject is "
            f"refused, not the row. {pending}",
            2,
        ),
        (
            "APNs configuration fault: drain stopped claiming its rows",
            f"APNs answered InvalidProviderToken: the credentials, key id, team or topic are wrong, not the row. {pending}",
            2,
        ),
    ]


def test_a_fault_found_while_the_next_claim_waits_still_halts_and_records_the_halt(db, live, feeds, monkeypatch):
    """On SQLite the next slice's claim waits for the write lock in a thread while sends are on
    the wire. A configuration fault answered meanwhile must not be overwritten by the ledger's
    "no halt" of that claim: the drain stops, records the halt, and gives back what it claimed."""
    import asyncio
    import threading
    import time as _time

    live = live.with_(claim_batch_size=1, apns_concurrency=2)
    ids = _due_items(db, live, feeds, 6)
    real_claim = ledger.claim
    fault_answered = threading.Event()
    claims = []

    def claim(conn, *args, **kwargs):  # the write lock held elsewhere for a while
        claims.append(args)
        if db.dialect == "sqlite" and len(claims) == 3:
            # The third claim (in its thread) waits until the second send's fault is back: the
            # overlap under test, by event instead of a 0.3 s wait racing a 0.1 s send.
            assert fault_answered.wait(60), "the second send never answered"
        else:  # PostgreSQL claims run on the loop: a wait for the loop would deadlock
            _time.sleep(0.3)
        return real_claim(conn, *args, **kwargs)

    monkeypatch.setattr(ledger, "claim", claim)
    calls = []

    class FaultOnSecond(RecordingSender):
        async def send_many(self, notifications):
            calls.append([n.row_id for n in notifications])
            if len(calls) == 2:
                await asyncio.sleep(0.1)
                fault_answered.set()  # the drain sees these results before the loop turns again
                return [
                    SendResult(n.row_id, False, reason="InvalidProviderToken", status=403, config_fault=True)
                    for n in notifications
                ]
            return await super().send_many(notifications)

    summary = send_batch(db, live, ids, FaultOnSecond().factory(), now=at(0), claimer="c", halt_scope="scope-1")
    assert summary.halted == "InvalidProviderToken"
    with db.read() as conn:
        assert ledger.halts_of(conn, "scope-1") == {"apns": "InvalidProviderToken"}  # for every batch of the scope
    statuses = Counter(r["status"] for r in rows(db))
    assert statuses["claimed"] == 0, statuses  # nothing stranded
    if db.dialect == "sqlite":  # the fault came in while the third claim waited in its thread: it is given back
        assert len(calls) == 2 and statuses["pending"] == 4, (calls, statuses)


def test_a_voided_row_that_comes_back_keeps_its_attempts(db, live, feeds):
    """Attempts bound the sends of one row; a feed that flaps the item (voided, then back) buys it
    no fresh ones: the third send that does not deliver fails the row (REMINDERS_SEND_MAX_ATTEMPTS 3).
    Only a settled row re-armed because its item moved starts afresh."""
    (row_id,) = _due_items(db, live, feeds, 1)
    unavailable = SendResult(0, False, reason="ServiceUnavailable", status=503, retry=True)
    for now in (at(0), at(60)):  # the second after the first's backoff
        drain(db, live, RecordingSender(script={TOKEN: unavailable}).factory(), now=now)
    (row,) = rows(db)
    assert (row["status"], row["attempts"]) == ("pending", 2)
    with db.write() as conn:
        ledger.void_rows(conn, [row_id], "left_feed", at(1))
    build(db, live, now=at(2))  # the item is still in the feed: the voided row comes back
    (back,) = rows(db)
    assert (back["status"], back["attempts"], back["outcome_detail"]) == ("pending", 2, None)
    assert drain(db, live, RecordingSender(script={TOKEN: unavailable}).factory(), now=at(120)).outcomes == {
        "failed": 1
    }


class PausedMidSend(RecordingSender):
    """A sender frozen between claim and write, for as long as ``meanwhile`` runs: the process's
    monotonic clock jumps by ``paused_for``, and another process acts while it is stopped."""

    def __init__(self, clock: list[float], paused_for: float, meanwhile) -> None:
        super().__init__(monotonic=lambda: clock[0])
        self.clock, self.paused_for, self.meanwhile = clock, paused_for, meanwhile

    async def send_many(self, notifications):
        frozen = threading.Thread(target=self.meanwhile)  # joined on the loop's thread: nothing here runs
        frozen.start()
        frozen.join()
        self.clock[0] += self.paused_for
        return await super().send_many(notifications)


def test_a_sender_paused_past_its_claims_fence_never_sends_a_row_another_claimer_sent(db, live, feeds):
    """Issue 19 item 9: frozen past the abandon threshold between claim and send, a drain's claim is
    failed as abandoned, a rebuild re-arms the moved item and another claimer sends it; the resumed
    drain must not send it again, and leaves the row as the other claimer settled it."""
    queue_one(db, live, feeds)
    claimed_at = 3605
    woke_at = claimed_at + live.abandon_after_seconds + 30
    other = RecordingSender()

    def meanwhile() -> None:
        assert fail_abandoned(db, live, at(woke_at - 20)) == 1
        feeds.items("/a.json", [item("e", 7200 + 600)])  # moved 10 minutes later: the settled row re-arms
        build(db, live, now=at(woke_at - 15))
        assert drain(db, live, other.factory(), now=at(woke_at - 10)).outcomes == {"sent": 1}

    clock = [1000.0]
    paused = PausedMidSend(clock, live.abandon_after_seconds + 30, meanwhile)
    ids = find_due(db, at(claimed_at))
    summary = asyncio.run(
        send_batch_async(
            db, live, ids, paused.factory(), now=at(claimed_at), claimer="paused", monotonic=lambda: clock[0]
        )
    )
    assert (len(other.sent), paused.sent, summary.outcomes) == (1, [], {})
    (row,) = rows(db)  # the claim was no longer ours: the row stays as the other claimer settled it
    assert (row["status"], row["outcome"], row["attempts"], row["claimed_by"] != "paused") == (
        "settled",
        "sent",
        0,
        True,
    )


def test_a_row_whose_fence_passed_goes_back_to_pending_while_the_claim_is_still_ours(db, live, feeds):
    """Paused past the fence but not past the abandon threshold: nobody took the claim, so the row
    (certainly never sent) is pending again and the next drain sends it once."""
    queue_one(db, live, feeds)
    fence = live.abandon_after_seconds - live.send_timeout_seconds - live.fence_margin_seconds
    clock = [1000.0]
    paused = PausedMidSend(clock, fence, lambda: None)
    ids = find_due(db, at(3605))
    summary = asyncio.run(
        send_batch_async(db, live, ids, paused.factory(), now=at(3605), claimer="paused", monotonic=lambda: clock[0])
    )
    assert (paused.sent, summary.returned_to_pending, dict(summary.details)) == (
        [],
        1,
        {"pending:not-sent:fence_expired": 1},
    )
    (row,) = rows(db)
    assert (row["status"], row["claimed_by"]) == ("pending", None)
    sender = RecordingSender()
    assert drain(db, live, sender.factory(), now=at(3610)).outcomes == {"sent": 1} and len(sender.sent) == 1


def test_the_abandon_threshold_must_exceed_the_send_timeout_and_the_fence_margin():
    env = {
        "REMINDERS_ABANDON_AFTER_SECONDS": "70",
        "REMINDERS_SEND_TIMEOUT_SECONDS": "10",
        "REMINDERS_FENCE_MARGIN_SECONDS": "60",
    }
    with pytest.raises(SettingsError, match="REMINDERS_ABANDON_AFTER_SECONDS must exceed"):
        Settings.from_env(env)
    assert Settings.from_env({**env, "REMINDERS_ABANDON_AFTER_SECONDS": "71"}).abandon_after_seconds == 71


def test_a_retry_waits_its_backoff_in_the_ledger_for_every_drainer(db, live, feeds):
    """A 503 gives the row back with a not-before: no second drainer (cron drain, another
    dispatcher) retries it at once, ``send_after`` stays the rule's time, and the wake-up time
    every dispatcher reads is the end of the backoff."""
    (row_id,) = _due_items(db, live, feeds, 1)
    unavailable = SendResult(0, False, reason="ServiceUnavailable", status=503, retry=True)
    drain(db, live, RecordingSender(script={TOKEN: unavailable}).factory(), now=at(0))
    (row,) = rows(db)
    assert row["send_after"] == at(0) and at(0) < row["not_before"] and at(2.5) <= row["not_before"] <= at(5)
    other = RecordingSender()
    assert drain(db, live, other.factory(), now=at(2)).claimed == 0 and other.sent == []
    with db.read() as conn:
        assert ledger.next_send_after(conn) == row["not_before"]
    assert drain(db, live, other.factory(), now=row["not_before"]).outcomes == {"sent": 1}


def test_a_rebuild_of_a_pending_row_keeps_its_attempts_and_backoff(db, live, feeds):
    """Retitling the event between retries must not hand the row a fresh set of attempts."""
    url = feeds.items("/a.json", [item("e", 3600)])
    device(db, live, sources=[url])
    build(db, live, now=NOW)
    unavailable = SendResult(0, False, reason="ServiceUnavailable", status=503, retry=True)
    for now in (at(0), at(60)):
        drain(db, live, RecordingSender(script={TOKEN: unavailable}).factory(), now=now)
    feeds.items("/a.json", [item("e", 3600, title="Retitled")])
    build(db, live, now=at(61))
    (row,) = rows(db)
    assert (row["title"], row["attempts"], row["outcome_detail"]) == ("Retitled", 2, "ServiceUnavailable")
    assert row["not_before"] > at(61)
    drain(db, live, RecordingSender(script={TOKEN: unavailable}).factory(), now=at(120))
    (row,) = rows(db)
    assert (row["outcome"], row["outcome_detail"]) == (
        "failed",
        "ServiceUnavailable",
    )  # the third of REMINDERS_SEND_MAX_ATTEMPTS


def test_backoff_doubles_per_attempt_with_jitter_down_to_half_and_a_cap(settings):
    from reminders_pipeline.sending.faults import retry_not_before

    s = settings.with_(send_retry_base_seconds=5, send_retry_max_seconds=30)
    lowest, highest = (lambda a, b: a), (lambda a, b: b)
    assert [retry_not_before(at(0), n, s, highest) for n in (1, 2, 3, 4, 5)] == [at(5), at(10), at(20), at(30), at(30)]
    assert [retry_not_before(at(0), n, s, lowest) for n in (1, 2, 3)] == [at(2.5), at(5), at(10)]


def _quiet_device(db, live, feeds, starts_in, lead):
    """Quiet hours 10:05-11:00 UTC; NOW is 08:00."""
    from reminders_pipeline.devices.registration import DeviceSpec, put_device

    url = feeds.items("/a.json", [item("e", starts_in)])
    put_device(
        db, live, DeviceSpec("dev-1", TOKEN, lead, (), (url,), tz_name="UTC", quiet_hours="10:05-11:00"), now=NOW
    )
    build(db, live, now=NOW)
    (row,) = rows(db)
    assert row["send_after"] == at(7200)  # 10:00, before the window: the build holds nothing


def test_a_row_claimed_late_inside_quiet_hours_is_held_to_their_end_then_sent(db, live, feeds):
    """Due 10:00, quiet hours from 10:05, the event at 12:00: a drain at 10:06 holds the row to
    11:00 instead of settling it quiet_hours for good, and at 11:00 it is on time."""
    _quiet_device(db, live, feeds, starts_in=4 * 3600, lead=7200)
    sender = RecordingSender()
    summary = drain(db, live, sender.factory(), now=at(7200 + 360))
    (row,) = rows(db)
    assert summary.outcomes == {} and sender.sent == []
    assert (row["status"], row["not_before"], row["outcome_detail"], row["attempts"]) == (
        "pending",
        at(3 * 3600),
        "quiet_hours",
        0,
    )
    assert drain(db, live, sender.factory(), now=at(3 * 3600 - 1)).claimed == 0
    assert drain(db, live, sender.factory(), now=at(3 * 3600)).outcomes == {
        "sent": 1
    }  # 60 min after send_after: not too_late


def _held_to_eleven(db, live, feeds):
    """A row held at 10:06 to the end of quiet hours (11:00); returns the device's spec."""
    from reminders_pipeline.devices.registration import DeviceSpec

    _quiet_device(db, live, feeds, starts_in=4 * 3600, lead=7200)
    drain(db, live, RecordingSender().factory(), now=at(7200 + 360))
    (row,) = rows(db)
    assert (row["not_before"], row["held_until"]) == (at(3 * 3600), at(3 * 3600))
    return DeviceSpec("dev-1", TOKEN, 7200, (), (feeds.url("/a.json"),), tz_name="UTC", quiet_hours="10:05-11:00")


def test_a_held_row_retried_at_its_hold_end_is_still_counted_from_it(db, live, feeds):
    """Held to 11:00; at 11:00 APNs answers 500 and the row backs off: its lateness still counts
    from 11:00, so the retry a minute later is sent, not dropped too_late (send_after was 10:00)."""
    from dataclasses import replace

    from reminders_pipeline.devices.registration import put_device

    spec = _held_to_eleven(db, live, feeds)
    failing = RecordingSender(
        script={TOKEN: lambda n: SendResult(n.row_id, False, status=500, reason="InternalServerError", retry=True)}
    )
    assert drain(db, live, failing.factory(), now=at(3 * 3600)).returned_to_pending == 1
    (row,) = rows(db)
    assert (row["outcome_detail"], row["held_until"], row["not_before"] > at(3 * 3600)) == (
        "InternalServerError",
        at(3 * 3600),
        True,
    )
    backoff = row["not_before"]
    put_device(db, live, replace(spec, tz_name="Asia/Tokyo"), now=at(3 * 3600 + 1))  # a backoff is no hold: it stays
    assert rows(db)[0]["not_before"] == backoff
    sender = RecordingSender()
    assert drain(db, live, sender.factory(), now=at(3 * 3600 + 60)).outcomes == {"sent": 1}


def test_a_hold_ends_when_the_device_changes_its_quiet_hours_or_zone(db, live, feeds):
    """Held to 11:00 under quiet hours 10:05-11:00. Removing the quiet hours at 10:10 ends the hold:
    the row is sent at once, counted from the change."""
    from dataclasses import replace

    from reminders_pipeline.devices.registration import put_device

    spec = _held_to_eleven(db, live, feeds)
    put_device(db, live, replace(spec, quiet_hours=None), now=at(7800))
    (row,) = rows(db)
    assert (row["status"], row["not_before"], row["held_until"]) == ("pending", None, at(7800))
    assert drain(db, live, RecordingSender().factory(), now=at(7860)).outcomes == {"sent": 1}


def test_a_hold_ends_when_the_device_changes_zone(db, live, feeds):
    from dataclasses import replace

    from reminders_pipeline.devices.registration import put_device

    spec = _held_to_eleven(db, live, feeds)
    put_device(db, live, replace(spec, tz_name="Asia/Tokyo"), now=at(7800))  # 19:10 in Tokyo: not quiet
    assert drain(db, live, RecordingSender().factory(), now=at(7860)).outcomes == {"sent": 1}


def test_a_rebuild_that_rewrites_a_held_row_ends_its_hold(db, live, feeds):
    """Held to 11:00; the event is retitled at 10:10 and the rebuild rewrites the row: the hold
    ends, and the next claim, still inside quiet hours, holds it again to 11:00 from the new terms."""
    _held_to_eleven(db, live, feeds)
    feeds.items("/a.json", [item("e", 4 * 3600, title="Retitled")])
    assert build(db, live, now=at(7800)).rows_updated == 1
    (row,) = rows(db)
    assert (row["not_before"], row["held_until"]) == (None, at(7800))
    sender = RecordingSender()
    assert drain(db, live, sender.factory(), now=at(7860)).outcomes == {} and sender.sent == []
    (row,) = rows(db)
    assert (row["status"], row["not_before"], row["held_until"]) == ("pending", at(3 * 3600), at(3 * 3600))


def test_a_row_claimed_inside_quiet_hours_whose_event_begins_before_their_end_settles_quiet_hours(db, live, feeds):
    _quiet_device(db, live, feeds, starts_in=2 * 3600 + 1800, lead=1800)  # the event at 10:30, inside the window
    summary = drain(db, live, RecordingSender().factory(), now=at(7200 + 360))
    assert summary.outcomes == {"quiet_hours": 1}


def test_a_send_failing_before_its_write_goes_again_spending_its_attempts(db, live, feeds):
    """A send that failed before its write for another reason than reaching APNs is certainly not
    delivered: it goes back to pending after a backoff, but spends an attempt each time, so a row
    that fails that way on every try ends failed (REMINDERS_SEND_MAX_ATTEMPTS 3), while an
    unreachable APNs spends none."""
    _due_items(db, live, feeds, 1)
    broken = SendResult(0, False, reason="not-written:RuntimeError", retry=True)
    unreachable = SendResult(0, False, reason="not-sent:ConnectionRefusedError", retry=True)
    assert drain(db, live, RecordingSender(script={TOKEN: unreachable}).factory(), now=at(0)).returned_to_pending == 1
    assert rows(db)[0]["attempts"] == 0
    for n, now in enumerate((at(60), at(120)), start=1):
        assert drain(db, live, RecordingSender(script={TOKEN: broken}).factory(), now=now).returned_to_pending == 1
        (row,) = rows(db)
        assert (row["status"], row["attempts"], row["outcome_detail"]) == ("pending", n, "not-written:RuntimeError")
    last = drain(db, live, RecordingSender(script={TOKEN: broken}).factory(), now=at(180))
    assert last.outcomes == {"failed": 1} and last.halted is None


def test_one_providers_configuration_fault_halts_its_rows_only(db, live, feeds):
    """Issue 38: APNs refusing our key halts APNs rows alone; the Web Push and FCM rows of the same
    drain are claimed and sent, APNs' stay pending unclaimed, and the halt names APNs. (Before:
    the whole drain stopped claiming at the first APNs answer.)"""
    from reminders_pipeline.devices.registration import DeviceSpec, put_device

    from .model_support import target_of

    live = live.with_(
        claim_batch_size=3,
        webpush_allow_networks=("127.0.0.0/8",),
        vapid_private_key_file="unread.pem",
        fcm_credentials_file="unread.json",
    )
    url = feeds.items("/a.json", [item(f"e{i}", 3600) for i in range(4)])
    for i, provider in enumerate(("apns", "webpush", "fcm")):
        put_device(db, live, DeviceSpec(f"dev-{provider}", source_urls=(url,), **target_of(provider, f"{i}" * 64)))
    build(db, live, now=NOW)

    class ApnsRefusesOurKey(RecordingSender):
        async def send_many(self, notes):
            apns = [n for n in notes if n.provider == "apns"]
            rest = await super().send_many([n for n in notes if n.provider != "apns"])
            return rest + [
                SendResult(n.row_id, False, reason="InvalidProviderToken", status=403, config_fault=True) for n in apns
            ]

    sender = ApnsRefusesOurKey()
    summary = drain(db, live, sender.factory(), now=at(0))
    assert summary.halts == {"apns": "InvalidProviderToken"} and summary.halted == "InvalidProviderToken"
    assert Counter(n.provider for n in sender.sent) == {"webpush": 4, "fcm": 4}
    got = Counter((r["device_id"], r["status"], r["outcome"]) for r in rows(db))
    assert got[("dev-webpush", "settled", "sent")] == 4 and got[("dev-fcm", "settled", "sent")] == 4
    # APNs' rows come first (lowest ids): the first slice met the fault, the fourth was never claimed
    assert got[("dev-apns", "settled", "failed")] == 3 and got[("dev-apns", "pending", None)] == 1, got


class _FlakyLedger(Database):
    """A ledger whose ``fail_at``-th write transaction fails with ``error``: before its COMMIT
    (nothing of it commits) or, with ``after_commit``, once the COMMIT went through (the server
    answered, but the answer was lost)."""

    def __init__(self, url: str, fail_at: int, error: Exception, after_commit: bool = False) -> None:
        super().__init__(url)
        self.fail_at, self.error, self.after_commit, self.writes = fail_at, error, after_commit, 0

    @contextmanager
    def write(self):
        self.writes += 1
        with super().write() as conn:
            yield conn
            if self.writes == self.fail_at and not self.after_commit:
                raise self.error
        if self.writes == self.fail_at and self.after_commit:
            raise self.error


LOST = OperationalError("COMMIT", {}, ConnectionError("server closed the connection unexpectedly"))


def test_a_claim_whose_commit_went_through_but_reported_failure_gives_its_rows_back(db, db_url, live, feeds):
    """Issue 38 (17): the COMMIT of "settle slice 1 + claim slice 2" succeeds but the drain hears
    a lost connection. Slice 2's rows were claimed and never sent: they go back to pending at once
    (no attempt spent), not left claimed to fail as abandoned; slice 1's settlement stands."""
    ids = _due_items(db, live, feeds, 30)
    sender = RecordingSender()
    flaky = _FlakyLedger(
        db_url, fail_at=3, error=LOST, after_commit=True
    )  # 1: sweep, 2: claim 1, 3: settle 1 + claim 2
    try:
        with pytest.raises(OperationalError):
            drain(flaky, live.with_(claim_batch_size=10, apns_concurrency=1), sender.factory(), now=at(0))
    finally:
        flaky.dispose()
    got = {r["id"]: r for r in rows(db)}
    sent = {n.row_id for n in sender.sent}
    assert len(sent) == 10 and {got[i]["outcome"] for i in sent} == {"sent"}
    assert [i for i in ids if got[i]["status"] == "claimed"] == []
    back = [got[i] for i in ids[10:20]]
    assert {(r["status"], r["outcome_detail"], r["attempts"]) for r in back} == {("pending", "claim_unconfirmed", 0)}
    assert len(find_due(db, at(0))) == 20  # every unsent row is due for the next drain


@pytest.mark.parametrize(
    "error",
    [
        SATimeoutError("QueuePool limit of size 5 overflow 10 reached, connection timed out, timeout 30.00"),
        InternalError("COMMIT", {}, Exception("cannot execute UPDATE in a read-only transaction")),
        OperationalError("COMMIT", {}, ConnectionError("server closed the connection unexpectedly")),
    ],
    ids=["pool_timeout", "read_only", "operational"],
)
def test_settlements_are_kept_through_every_transient_database_error(db, db_url, live, feeds, error):
    """Issue 38 (16): a batch whose last settlement meets a pool timeout (connects hanging in a
    partition) or a read-only server after a failover keeps its settlements for the caller to
    write again (``SettlementsNotWritten``), as it does for an OperationalError; written once the
    ledger answers, every sent row reads `sent`, nothing stays claimed. (Before: only an
    OperationalError was kept; the others dropped them, and the rows failed as abandoned.)"""
    ids = _due_items(db, live, feeds, 10)
    sender = RecordingSender()
    flaky = _FlakyLedger(db_url, fail_at=2, error=error)  # 1: claim, 2: settle
    try:
        with pytest.raises(SettlementsNotWritten) as kept:
            send_batch(flaky, live, ids, sender.factory(), now=at(0), claimer="c")
    finally:
        flaky.dispose()
    summary = DrainResult(now=at(0))
    for settlement in kept.value.settlements:
        write_settlement(db, settlement, "c", summary)
    assert summary.outcomes == {"sent": 10}
    assert {(r["status"], r["outcome"]) for r in rows(db)} == {("settled", "sent")}


def test_a_users_endpoint_that_cannot_be_reached_spends_its_attempts_and_then_fails(db, live, feeds):
    """Issue 38 (19): a dead Web Push endpoint (refused, NXDOMAIN) is a user's, not our provider's:
    each try spends an attempt, backing off, and the row fails after REMINDERS_SEND_MAX_ATTEMPTS
    instead of going back to pending every 2.5-5 s, with no attempt spent, until MAX_LATENESS.
    Our provider unreachable (APNs) still spends none."""
    url = feeds.items("/a.json", [item("e", 3600)])
    device(db, live, "dead-endpoint", sources=[url], token="cd" * 32)
    device(db, live, "apns-down", sources=[url])
    build(db, live, now=NOW)
    endpoint_gone = SendResult(0, False, reason="not-sent:connect_failed", retry=True, outage=False)
    apns_down = SendResult(0, False, reason="not-sent:ConnectionRefusedError", retry=True)
    sender = RecordingSender(script={"cd" * 32: endpoint_gone, TOKEN: apns_down})
    live = live.with_(send_halt_after=100)
    t = 0
    for _ in range(live.send_max_attempts):
        drain(db, live, sender.factory(), now=at(t))
        t += int(live.send_retry_max_seconds) + 1  # past any backoff
    got = {r["device_id"]: r for r in rows(db)}
    assert (got["dead-endpoint"]["outcome"], got["dead-endpoint"]["outcome_detail"]) == (
        "failed",
        "not-sent:connect_failed",
    )
    assert (got["apns-down"]["status"], got["apns-down"]["attempts"]) == ("pending", 0)
