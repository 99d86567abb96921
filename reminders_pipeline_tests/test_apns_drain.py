"""What each APNs answer does to the ledger: the drain, the real aioapns sender and the mock APNs.

Every row of the APNs table in docs/guide.md, on SQLite and PostgreSQL. Times are real (the sender sets
``apns-expiration`` from the wall clock), so items start shortly after the real now.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import pytest

from reminders_pipeline import ledger
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.apns import AioApnsSender
from reminders_pipeline.providers.routing import default_sender_factory
from reminders_pipeline.sending.drain import drain, fail_abandoned, send_batch_async

from .support import device, rows

TOKENS = [f"{i:064x}" for i in range(1, 9)]


pytestmark = pytest.mark.usefixtures("fresh_mock")  # conftest: one mock APNs per module, reset per test


@pytest.fixture
def live_on_mock(live, mock):
    """conftest's live settings, sending to this module's mock APNs."""
    # 5 s: a first send's TLS handshake and token signing on a loaded 2-core runner stay well inside it.
    # No backoff: a retried row is due again at once on the real clock (test_drain times the backoff).
    return live.with_(send_timeout_seconds=5, send_retry_base_seconds=0, **mock.apns_settings())


def queue(db, settings, feeds, *, devices=1, items=1, starts_in=1200, lead=1800):
    """Devices each with ``items`` due rows (send_after 10 minutes ago, event in 20 minutes)."""
    now = Instant.now().whole_seconds
    url = feeds.items(
        "/a.json",
        [
            {"id": f"e{i}", "title": f"Event {i}", "startsAt": now + starts_in + i, "expiresAt": now + starts_in + 1800}
            for i in range(items)
        ],
    )
    for d in range(devices):
        device(db, settings, f"dev-{d}", sources=[url], lead=lead, token=TOKENS[d])
    build(db, settings)
    return now


def run_drain(db, settings):
    return drain(db, settings, default_sender_factory(settings))


def test_200_sends_once_with_the_right_headers_and_stores_the_apns_id(db, live_on_mock, feeds, mock):
    now = queue(db, live_on_mock, feeds, items=3)
    summary = run_drain(db, live_on_mock)
    assert summary.outcomes == {"sent": 3}
    requests = mock.requests
    assert len(requests) == 3 and Counter(r.token for r in requests) == {TOKENS[0]: 3}
    settled = {r["id"]: r for r in rows(db)}
    for req in requests:
        assert req.headers["apns-push-type"] == "alert" and req.headers["apns-priority"] == "10"
        assert req.headers["apns-topic"] == mock.topic
        assert len(req.headers["apns-collapse-id"].encode()) <= 64
        assert int(req.headers["apns-expiration"]) in range(now + 1200, now + 1203)  # the event's start
        assert req.payload["aps"]["interruption-level"] == "time-sensitive"
    stored = sorted(r["apns_id"] for r in settled.values())
    assert stored == sorted(r.headers["apns-id"] for r in requests)  # the id APNs echoed back
    assert {r["outcome"] for r in settled.values()} == {"sent"}
    assert run_drain(db, live_on_mock).claimed == 0 and len(mock.requests) == 3  # never twice


@pytest.mark.parametrize(
    "status, reason", [(410, "Unregistered"), (400, "BadDeviceToken"), (400, "DeviceTokenNotForTopic")]
)
def test_dead_token_fails_the_row_marks_the_device_and_voids_its_other_rows(
    db, live_on_mock, feeds, mock, status, reason
):
    queue(db, live_on_mock, feeds, items=1, devices=2)
    feeds_url = feeds.url("/a.json")
    ts_ms = 1_800_000_000_123
    mock.script(TOKENS[0], status=status, reason=reason, timestamp_ms=ts_ms if status == 410 else None)
    # dev-0 also has a reminder that is not due yet: the dead token must void it.
    device(db, live_on_mock, "dev-0", sources=[feeds_url], lead=1800, rules=("lead:60",), token=TOKENS[0])
    build(db, live_on_mock)
    summary = run_drain(db, live_on_mock)
    dev0 = {r["rule"]: r for r in rows(db, device_id="dev-0")}
    assert (dev0["lead:1800"]["outcome"], dev0["lead:1800"]["outcome_detail"]) == ("failed", reason)
    assert (dev0["lead:60"]["outcome"], dev0["lead:60"]["outcome_detail"]) == (
        "voided",
        "unregistered" if status == 410 else "token_invalid",
    )
    assert [r["outcome"] for r in rows(db, device_id="dev-1")] == ["sent"]
    with db.read() as conn:
        record = ledger.get_device(conn, "dev-0")
    assert record.token_invalid_reason == reason
    if status == 410:
        assert record.token_invalid_at == Instant.from_stored("2027-01-15T08:00:00.123Z")
    assert summary.tokens_invalidated == 1
    assert build(db, live_on_mock).devices_built == 1  # dev-0 is skipped until it registers again
    device(db, live_on_mock, "dev-0", sources=[feeds_url], lead=1800, token=TOKENS[5])
    assert build(db, live_on_mock).devices_built == 2


@pytest.mark.parametrize(
    "status, reason",
    [
        (403, "InvalidProviderToken"),
        (403, "ExpiredProviderToken"),
        (403, "MissingProviderToken"),
        (400, "TopicDisallowed"),
        (400, "BadTopic"),
    ],
)
def test_configuration_fault_stops_claiming_and_alerts(db, live_on_mock, feeds, mock, status, reason):
    hook = feeds.url("/hook")
    live_on_mock = live_on_mock.with_(alert_webhook_url=hook, claim_batch_size=2)
    queue(db, live_on_mock, feeds, items=6)
    mock.script_default(status=status, reason=reason)
    summary = run_drain(db, live_on_mock)
    assert summary.halted == reason
    statuses = Counter((r["status"], r["outcome"]) for r in rows(db))
    assert statuses == {("settled", "failed"): 2, ("pending", None): 4}
    assert len(feeds.posts["/hook"]) == 1 and reason in feeds.posts["/hook"][0]["text"]
    mock.script_default(status=200)
    assert run_drain(db, live_on_mock).outcomes == {"sent": 4}  # the next tick, credentials fixed


@pytest.mark.parametrize(
    "answer, detail",
    [
        ({"delay": 8.0}, "timeout"),  # 3 s past the live_on_mock fixture's 5 s send timeout
        ({"drop_connection": True}, "transport:"),
    ],
)
def test_a_send_that_may_have_reached_apns_fails_the_row_and_it_is_never_sent_again(
    db, live_on_mock, feeds, mock, answer, detail
):
    queue(db, live_on_mock, feeds, items=1)
    mock.script(TOKENS[0], **answer)
    run_drain(db, live_on_mock)
    (row,) = rows(db)
    assert row["outcome"] == "failed" and row["outcome_detail"].startswith(detail)
    mock.script(TOKENS[0], status=200)
    run_drain(db, live_on_mock)
    assert len([r for r in mock.requests if r.token == TOKENS[0]]) == 1
    assert rows(db)[0]["outcome"] == "failed"


CERTAIN_NON_DELIVERY = [
    ({"status": 429, "reason": "TooManyRequests"}, "TooManyRequests"),
    ({"status": 500, "reason": "InternalServerError"}, "InternalServerError"),
    ({"status": 503, "reason": "ServiceUnavailable"}, "ServiceUnavailable"),
    ({"refuse_stream": True}, "not-sent:REFUSED_STREAM"),
    ("goaway", "not-sent:GOAWAY"),
    ("connect", "not-sent:MaxAttemptsExceeded"),
    ("tls", "not-sent:MaxAttemptsExceeded"),
]


def fault(mock, token, answer):
    """Make the next send to ``token`` certainly not delivered, in the way ``answer`` names."""
    if answer == "goaway":
        mock.goaway_after = 0  # the first request on each connection gets GOAWAY(last stream 0)
    elif answer in ("connect", "tls"):
        mock.refuse(answer)
    else:
        mock.script(token, times=1, **answer)


def heal(mock):
    mock.goaway_after = None
    mock.refuse(None)


@pytest.mark.parametrize("answer, detail", CERTAIN_NON_DELIVERY, ids=[d for _, d in CERTAIN_NON_DELIVERY])
def test_certain_non_delivery_returns_the_row_to_pending_and_it_is_then_delivered_once(
    db, live_on_mock, feeds, mock, answer, detail
):
    """A row goes back to pending; an APNs answer (429, 500, 503) spends one of its attempts, a send
    that never reached APNs none: only APNs' own answers count against a row."""
    spent = 0 if detail.startswith("not-sent") else 1
    queue(db, live_on_mock, feeds, items=1)
    fault(mock, TOKENS[0], answer)
    summary = run_drain(db, live_on_mock)
    (row,) = rows(db)
    assert (row["status"], row["attempts"], row["outcome_detail"], summary.returned_to_pending) == (
        "pending",
        spent,
        detail,
        1,
    )
    assert summary.outcomes == {} and summary.halted is None
    heal(mock)
    assert run_drain(db, live_on_mock).outcomes == {"sent": 1}
    (row,) = rows(db)
    assert (row["outcome"], row["outcome_detail"], row["attempts"]) == ("sent", None, spent)
    assert [r.status for r in mock.requests if r.status == 200] == [200]  # delivered exactly once


def test_attempts_are_bounded_then_the_row_fails(db, live_on_mock, feeds, mock):
    live_on_mock = live_on_mock.with_(send_max_attempts=2)
    queue(db, live_on_mock, feeds, items=1)
    mock.script(TOKENS[0], status=503, reason="ServiceUnavailable")
    assert run_drain(db, live_on_mock).returned_to_pending == 1
    assert run_drain(db, live_on_mock).outcomes == {"failed": 1}
    (row,) = rows(db)
    assert (row["outcome"], row["outcome_detail"], row["attempts"]) == ("failed", "ServiceUnavailable", 1)
    assert run_drain(db, live_on_mock).claimed == 0 and len(mock.requests) == 2


def test_an_outage_halts_the_drain_and_alerts_once_instead_of_failing_every_due_row(db, live_on_mock, feeds, mock):
    live_on_mock = live_on_mock.with_(alert_webhook_url=feeds.url("/hook"), send_halt_after=3, claim_batch_size=3)
    queue(db, live_on_mock, feeds, items=12)
    mock.refuse("connect")
    summary = run_drain(db, live_on_mock)
    assert summary.halted.startswith("apns_unreachable: 3 sends in a row")
    assert summary.claimed == 3 and summary.returned_to_pending == 3 and summary.outcomes == {}
    assert Counter((r["status"], r["attempts"]) for r in rows(db)) == {("pending", 0): 12}  # no attempt spent
    assert len(feeds.posts["/hook"]) == 1 and "APNs unreachable" in feeds.posts["/hook"][0]["text"]
    mock.refuse(None)
    assert run_drain(db, live_on_mock).outcomes == {"sent": 12}


def test_dry_run_never_connects_and_records_the_payload(db, settings, feeds, mock):
    dry = settings.with_(**mock.apns_settings())  # enabled=False, credentials present
    queue(db, dry, feeds, items=2)
    summary = run_drain(db, dry)
    assert summary.outcomes == {"disabled": 2}
    assert mock.stats()["connections_opened"] == 0 and mock.requests == []
    payload = json.loads(rows(db)[0]["payload"])
    assert payload["payload"]["aps"]["alert"]["title"].startswith("Event")


def test_many_devices_all_delivered_exactly_once(db, live_on_mock, feeds, mock):
    queue(db, live_on_mock.with_(claim_batch_size=7), feeds, items=40, devices=5)
    summary = run_drain(db, live_on_mock.with_(claim_batch_size=7))
    assert summary.outcomes == {"sent": 200}
    sent = Counter((r.token, r.payload["reminder"]["item_id"]) for r in mock.requests)
    assert len(sent) == 200 and set(sent.values()) == {1}


def test_1500_error_answers_on_one_connection_settle_with_apns_reason_and_mark_every_token(
    db, live_on_mock, feeds, mock
):
    now = Instant.now().whole_seconds
    url = feeds.items("/one.json", [{"id": "e", "title": "Event", "startsAt": now + 1200, "expiresAt": now + 3000}])
    tokens = [f"{i:064x}" for i in range(1000, 2500)]
    with db.write() as conn:
        for i, token in enumerate(tokens):
            ledger.upsert_device(
                conn,
                {
                    "id": f"dev-{i:04d}",
                    "target": token,
                    "reminder_lead_seconds": 1800,
                    "extra_rules": "",
                    "chunk": 0,
                },
                Instant.now(),
            )
            ledger.set_subscriptions(conn, f"dev-{i:04d}", [url], Instant.now())
    build(db, live_on_mock)
    mock.script_default(status=410, reason="Unregistered")
    summary = run_drain(db, live_on_mock)
    assert summary.outcomes == {"failed": 1500} and summary.details == {"failed:Unregistered": 1500}
    assert summary.tokens_invalidated == 1500
    assert mock.connections_opened == 1
    with db.read() as conn:
        assert all(d.token_invalid_reason == "Unregistered" for d in ledger.list_devices(conn))


class PausedApns:
    """The real APNs sender in a process frozen between its claim and the write: ``meanwhile`` runs
    (another process's work) and the clock passes the claim's fence before the send goes on."""

    def __init__(self, settings, meanwhile) -> None:
        self.settings, self.meanwhile, self.inner = settings, meanwhile, None

    async def send_many(self, notifications):
        other = threading.Thread(target=self.meanwhile)  # joined on the loop's thread: nothing here runs
        other.start()
        other.join()
        fence = max(n.send_by for n in notifications)
        while time.monotonic() <= fence:
            time.sleep(0.05)  # noqa: ASYNC251 - holds the loop past every deadline, on purpose
        self.inner = AioApnsSender(self.settings)
        return await self.inner.send_many(notifications)

    async def aclose(self) -> None:
        if self.inner is not None:
            await self.inner.aclose()


def test_a_paused_sender_never_sends_a_row_another_claimer_sent(db, live_on_mock, feeds, mock):
    """Issue 19 item 9, against the mock APNs: frozen past the abandon threshold after claiming, a
    drain's claim is failed as abandoned, a rebuild re-arms the moved item and another drain sends
    it. The resumed drain's request is stopped where its bytes would leave: APNs gets one request."""
    now = queue(db, live_on_mock, feeds)
    paused_settings = live_on_mock.with_(abandon_after_seconds=4, send_timeout_seconds=1, fence_margin_seconds=1)

    def meanwhile() -> None:
        assert fail_abandoned(db, paused_settings, (Instant.now() + paused_settings.abandon_after_seconds + 1)) == 1
        moved = now + 1200 + 400  # the event moved: its settled row re-arms, due again at once
        feeds.items("/a.json", [{"id": "e0", "title": "Event 0", "startsAt": moved, "expiresAt": moved + 1800}])
        build(db, live_on_mock)
        outcomes.update(run_drain(db, live_on_mock).outcomes)

    outcomes = Counter()
    paused = PausedApns(paused_settings, meanwhile)
    summary = drain(db, paused_settings, lambda: paused)
    assert (outcomes, summary.outcomes, paused.inner is not None) == ({"sent": 1}, {}, True)
    (request,) = mock.requests
    (row,) = rows(db)
    assert (row["status"], row["outcome"], row["apns_id"]) == ("settled", "sent", request.headers["apns-id"])


def test_a_settlement_waiting_on_a_device_lock_never_stalls_the_answers_on_the_wire(db, live_on_mock, feeds, mock):
    """Issue 19 item 11: a build holds dev-0's device row (PostgreSQL) or the write lock (SQLite)
    while two batches share one sender and one loop. dev-0's 410 must lock that device to settle;
    the wait runs off the loop, so a heartbeat on it keeps ticking and dev-1's answer, arriving
    during the lock, is recorded sent rather than timed out. Every row settles once it is released."""
    live_on_mock = live_on_mock.with_(send_timeout_seconds=3)
    queue(db, live_on_mock, feeds, devices=2)
    mock.script(TOKENS[0], status=410, reason="Unregistered")
    mock.script(TOKENS[1], delay=0.3)
    (dead,), (slow,) = (rows(db, device_id=d) for d in ("dev-0", "dev-1"))
    locked = threading.Event()

    def build_holding_the_device(seconds: float = 5.0) -> None:
        with db.write() as conn:  # SQLite: BEGIN IMMEDIATE, the whole database's write lock
            ledger.lock_devices(conn, ["dev-0"])
            locked.set()
            time.sleep(seconds)

    async def scenario() -> tuple[DrainResult, DrainResult, float]:
        sender, beats, done = AioApnsSender(live_on_mock), [time.monotonic()], asyncio.Event()

        async def heartbeat() -> None:
            while not done.is_set():
                await asyncio.sleep(0.05)
                beats.append(time.monotonic())

        ticking = asyncio.ensure_future(heartbeat())
        try:
            batches = [
                send_batch_async(db, live_on_mock, [r["id"]], lambda: sender, sender=sender) for r in (dead, slow)
            ]
            first, second = await asyncio.gather(*batches)
        finally:
            done.set()
            await ticking
            await sender.aclose()
        return first, second, max(b - a for a, b in zip(beats, beats[1:]))

    holder = threading.Thread(target=build_holding_the_device)
    holder.start()
    try:
        assert locked.wait(10)
        first, second, longest_gap = asyncio.run(scenario())
    finally:
        holder.join()
    assert longest_gap < 1.0, f"the loop stood still for {longest_gap:.2f}s"
    assert (first.outcomes, second.outcomes) == ({"failed": 1}, {"sent": 1})
    settled = {r["device_id"]: (r["status"], r["outcome"], r["outcome_detail"]) for r in rows(db)}
    assert settled == {"dev-0": ("settled", "failed", "Unregistered"), "dev-1": ("settled", "sent", None)}
    with db.read() as conn:
        assert ledger.get_device(conn, "dev-0").token_invalid_at is not None
