"""The exact-time dispatcher on SQLite and PostgreSQL: on time, never early, at most once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from sqlalchemy import text

from reminders_pipeline import ledger
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.schema import dispatchers
from reminders_pipeline.planning.build import build, queue_rows
from reminders_pipeline.providers.base import RecordingSender, SendResult
from reminders_pipeline.sending.dispatch import Dispatcher
from reminders_pipeline.sending.drain import drain

from .dispatching import DrivenTimer
from .support import NOW_S, TOKEN, at, by_key, device, item
from .support import rows as rows_of

EVENT = 7200  # 10:00 UTC, two hours after NOW (08:00)
MORNING_RULES = ("lead:0", "lead:600", "lead:900")  # plus the device's lead:300


def queued(name: str, due: float, start: float) -> dict:
    """A ``lead:3600`` row of dev-1 for item ``1:<name>``, due at ``due`` (Unix seconds)."""
    return {"device_id": "dev-1", "source_id": None, "item_id": f"1:{name}", "rule": "lead:3600", "send_after": Instant.from_unix(due),
            "event_at": Instant.from_unix(due + 3600), "expires_at": Instant.from_unix(start + 5400), "title": name, "body": None}  # fmt: skip


def rows_due(db, live, **due_in: float) -> float:
    """dev-1 with one row per ``name=seconds after NOW``; returns NOW in Unix seconds."""
    device(db, live, sources=[], lead=3600)
    start = float(NOW_S)
    with db.write() as conn:
        queue_rows(conn, [queued(name, start + s, start) for name, s in due_in.items()], at(0))
    return start


def one_row_due(db, live, in_seconds: int) -> float:
    """dev-1 with one row, ``1:e``, due ``in_seconds`` after NOW; returns NOW in Unix seconds."""
    return rows_due(db, live, e=in_seconds)


def queue_the_morning(db, settings, feeds):
    """The issue's device: ``--lead 300 --rule lead:0 --rule lead:600 --rule lead:900``, a 10:00 event."""
    url = feeds.items("/morning.json", [item("standup", EVENT)])
    device(db, settings, sources=[url], lead=300, rules=MORNING_RULES)
    build(db, settings, now=at(EVENT - 1800))  # built at 09:30
    return {rule: r for (_, rule), r in by_key(db).items()}


def test_the_cron_drain_alone_sends_late_and_drops_the_five_minute_reminder(db, live, feeds):
    """The table that motivated the dispatcher: drains at :50 and :05 only."""
    queue_the_morning(db, live, feeds)
    sender = RecordingSender()
    for tick in (EVENT - 600, EVENT + 300):  # 09:50, 10:05
        drain(db, live, sender.factory(), now=at(tick))
    got = {rule: (r["outcome"], r["sent_at"]) for (_, rule), r in by_key(db).items()}
    assert got == {
        "lead:900": ("sent", at(EVENT - 600)),  # 5 minutes late
        "lead:600": ("sent", at(EVENT - 600)),
        "lead:300": ("event_started", None),  # never sent
        "lead:0": ("sent", at(EVENT + 300)),  # five minutes after the meeting began
    }


def test_the_dispatcher_sends_each_reminder_of_the_morning_at_its_send_after(db, live, feeds):
    rows = queue_the_morning(db, live, feeds)
    sender = RecordingSender()
    timer = DrivenTimer(at(EVENT - 1800))
    dispatcher = Dispatcher(db, live, sender.factory(), name="exact", timer=timer)
    asyncio.run(dispatcher.run(until=at(EVENT + 60)))

    got = {rule: r for (_, rule), r in by_key(db).items()}
    for rule, row in got.items():
        assert (row["outcome"], row["claimed_by"]) == ("sent", "exact"), rule
        assert row["sent_at"] == row["send_after"] == rows[rule]["send_after"], rule
    assert got["lead:300"]["sent_at"] == at(EVENT - 300) < got["lead:300"]["event_at"]
    assert [n.payload["reminder"]["rule"] for n in sender.sent] == ["lead:900", "lead:600", "lead:300", "lead:0"]
    # It slept until each send_after (or the poll backstop), never past one.
    assert dispatcher.summary.outcomes == {"sent": 4} and max(dispatcher.summary.lateness_seconds) == 0


def test_a_row_is_never_sent_before_its_send_after(db, live, feeds):
    """Rows due 1 ms apart, the clock 0.6 ms past the first: only the first may go now. A claim
    clock rounded to the nearest millisecond (not down) would take the second 0.4 ms early."""
    device(db, live, sources=[], lead=1800)
    first = (at(EVENT - 1800)).unix
    with db.write() as conn:
        queue_rows(conn, [
            {"device_id": "dev-1", "source_id": None, "item_id": f"1:e{k}", "rule": "lead:1800", "send_after": Instant.from_unix(first + k / 1000),
             "event_at": at(EVENT), "expires_at": at(EVENT + 1800), "title": "E", "body": None}
            for k in range(3)
        ], at(0))  # fmt: skip
    timer = DrivenTimer(first + 0.0006)
    handed: dict[str, Instant] = {}

    def record(note):
        handed[note.payload["reminder"]["item_id"]] = timer.now()
        return SendResult(note.row_id, True, status=200, provider_message_id="x")

    asyncio.run(
        Dispatcher(db, live, RecordingSender(script={TOKEN: record}).factory(), timer=timer).run(
            until=Instant.from_unix(first + 10)
        )
    )
    sent = {r["item_id"]: r for r in rows_of(db)}
    assert len(handed) == 3
    for item_id, row in sent.items():
        assert row["outcome"] == "sent" and handed[item_id] >= row["send_after"], item_id


def test_a_dry_run_dispatcher_settles_disabled_on_time_and_never_builds_a_sender(db, settings, feeds):
    rows = queue_the_morning(db, settings, feeds)

    def no_sender():
        raise AssertionError("a dry run must not build a sender")

    timer = DrivenTimer(at(EVENT - 1800))
    asyncio.run(Dispatcher(db, settings, no_sender, timer=timer).run(until=at(EVENT + 60)))
    got = by_key(db)
    assert {r["outcome"] for r in got.values()} == {"disabled"}
    assert {r["rule"]: r["claimed_at"] for r in got.values()} == {rule: r["send_after"] for rule, r in rows.items()}


def test_the_dispatcher_beats_and_records_its_stop(db, live):
    timer = DrivenTimer(float(NOW_S))
    dispatcher = Dispatcher(
        db, live.with_(dispatch_heartbeat_seconds=15), RecordingSender().factory(), name="beating", timer=timer
    )
    asyncio.run(dispatcher.run(until=Instant.from_unix(NOW_S + 100)))
    with db.read() as conn:
        (row,) = ledger.live_dispatchers(conn, at(-1)) or [None]
    assert row is None  # stopped: no longer live
    with db.read() as conn:
        assert ledger.latest_beat(conn) is None
        (rec,) = conn.execute(dispatchers.select()).mappings().all()
    assert rec["name"] == "beating" and rec["started_at"] == at(0) and rec["ends_at"] == at(100)
    assert rec["stopped_at"] == at(100) and rec["beat_at"] == at(100)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"REMINDERS_DISPATCH_POLL_SECONDS": "nan"}, "REMINDERS_DISPATCH_POLL_SECONDS must be at least 0.05"),
        ({"REMINDERS_DISPATCH_POLL_SECONDS": "soon"}, "REMINDERS_DISPATCH_POLL_SECONDS must be a number of seconds"),
        ({"REMINDERS_DISPATCH_ENABLED": "yes"}, "REMINDERS_DISPATCH_ENABLED must be 'true' or 'false'"),
        (
            {"REMINDERS_DISPATCH_RUN_SECONDS": "120", "REMINDERS_DISPATCH_HANDOVER_SECONDS": "120"},
            "must be shorter than",
        ),
    ],
)
def test_dispatcher_settings_refuse_what_cannot_work(env, message):
    from reminders_pipeline.config.settings import Settings, SettingsError

    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)
    assert (
        Settings.from_env(
            {"REMINDERS_DISPATCH_ENABLED": "FALSE", "REMINDERS_DISPATCH_POLL_SECONDS": "0.5"}
        ).dispatch_poll_seconds
        == 0.5
    )


def test_the_dispatchers_reads_wait_off_the_loop_that_reads_apns_answers(db, live):
    """Issue 19 item 11: the dispatcher's own reads of the queue (the earliest send_after, the due
    ids) may wait too, e.g. behind a migration's ACCESS EXCLUSIVE lock on PostgreSQL (SQLite: the
    write lock, which WAL readers pass). While one is held, the loop keeps running (a heartbeat on
    it ticks), and the dispatcher goes on after it is released."""
    live = live.with_(dispatch_poll_seconds=0.1)
    locked, held = threading.Event(), 2.0

    def hold_the_queue() -> None:
        with db.write() as conn:
            if db.dialect == "postgresql":
                conn.execute(text("LOCK TABLE notification_queue IN ACCESS EXCLUSIVE MODE"))
            locked.set()
            time.sleep(held)

    async def scenario() -> tuple[float, DrainResult]:
        stop = asyncio.Event()
        running = asyncio.ensure_future(Dispatcher(db, live, RecordingSender().factory(), name="reader").run(stop=stop))
        await asyncio.sleep(0.5)  # its first pass (heartbeat, abandoned sweep) is done; next only polls
        holder = threading.Thread(target=hold_the_queue)
        holder.start()
        await asyncio.to_thread(locked.wait, 10)
        beats = [time.monotonic()]
        while beats[-1] - beats[0] < held + 0.5:
            await asyncio.sleep(0.05)
            beats.append(time.monotonic())
        await asyncio.to_thread(holder.join)
        stop.set()
        return max(b - a for a, b in zip(beats, beats[1:])), await asyncio.wait_for(running, 10)

    longest_gap, summary = asyncio.run(scenario())
    assert longest_gap < 1.0, f"the loop stood still for {longest_gap:.2f}s"
    assert summary.claimed == 0 and summary.halted is None


def test_an_apns_outage_halts_once_loses_nothing_and_sends_everything_when_apns_returns(db, live, feeds):
    """Issue 20's bar, on a driven clock: APNs unreachable for 2 minutes, 50 reminders coming due
    2.4 s apart through it, each in a batch of its own. None fails, no attempt is spent on a send
    that never reached APNs, one alert is raised, and every reminder goes within 5 s of APNs'
    return. (Before: the streak began afresh in each one-row batch, so nothing halted, and rows
    spent their attempts on the outage: some failed, the rest went with 1 or 2 spent.)"""
    live = live.with_(alert_webhook_url=feeds.url("/hook"))
    device(db, live, sources=[], lead=3600)
    start = float(NOW_S)
    outage_end = start + 120
    due = {k: start + 2.4 * k for k in range(50)}
    with db.write() as conn:
        queue_rows(conn, [
            {"device_id": "dev-1", "source_id": None, "item_id": f"1:e{k}", "rule": "lead:3600", "send_after": Instant.from_unix(t),
             "event_at": Instant.from_unix(t + 3600), "expires_at": Instant.from_unix(t + 5400), "title": f"E{k}", "body": None}
            for k, t in due.items()
        ], at(0))  # fmt: skip
    timer = DrivenTimer(start)
    refused = []

    def answer(note):
        if timer.t < outage_end:
            refused.append(timer.t)
            return SendResult(note.row_id, False, reason="not-sent:ConnectionRefusedError", retry=True)
        return SendResult(note.row_id, True, status=200, provider_message_id="x")

    asyncio.run(
        Dispatcher(db, live, RecordingSender(script={TOKEN: answer}).factory(), timer=timer).run(
            until=Instant.from_unix(outage_end + 60)
        )
    )
    # once halted, each probe (every 5 s) sends one row, not every row due by then
    assert len(refused) <= live.send_halt_after + 2 * 120 / 5, len(refused)  # before: 593
    rows = rows_of(db)
    assert {(r["status"], r["outcome"], r["attempts"]) for r in rows} == {("settled", "sent", 0)}
    late = max(r["sent_at"].unix - max(r["send_after"].unix, outage_end) for r in rows)
    assert late <= 5.0, late
    alerts = [p["text"] for p in feeds.posts["/hook"]]
    assert len(alerts) == 1 and "APNs unreachable" in alerts[0]


def test_a_database_outage_logs_a_few_lines_and_the_dispatcher_recovers(db, live, feeds, caplog):
    """Issue 20: every read of the queue fails for 2 minutes (polling every second, on a driven
    clock): the dispatcher logs when it began, a summary a minute, and when it works again, no
    traceback (a033bef: a traceback per poll, 120 of them), then sends what came due meanwhile."""
    import logging

    from sqlalchemy.exc import OperationalError

    live = live.with_(dispatch_poll_seconds=1.0)
    start = one_row_due(db, live, in_seconds=30)
    timer = DrivenTimer(start)
    dispatcher = Dispatcher(db, live, RecordingSender().factory(), name="quiet", timer=timer)
    real = dispatcher._read_due

    def read_due(clock, busy, after=None, skip=frozenset()):
        if clock.unix < start + 120:
            raise OperationalError("SELECT ...", {}, ConnectionRefusedError("connection refused"))
        return real(clock, busy, after, skip)

    real_beat = dispatcher._beat

    def beat(now):
        if now.unix < start + 120:
            raise OperationalError("UPDATE dispatchers ...", {}, ConnectionRefusedError("connection refused"))
        return real_beat(now)

    dispatcher._read_due = read_due  # type: ignore[method-assign]
    dispatcher._beat = beat  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="reminders_pipeline.sending.dispatch"):
        asyncio.run(dispatcher.run(until=Instant.from_unix(start + 180)))
    lines = [
        r for r in caplog.records if r.name == "reminders_pipeline.sending.dispatch" and r.levelno >= logging.WARNING
    ]
    assert 4 <= len(lines) <= 8, [r.getMessage() for r in lines]
    assert not any(r.exc_info for r in lines)
    reads = [r.getMessage() for r in lines if "reading the queue" in r.getMessage()]
    assert "reading the queue failed" in reads[0] and "works again" in reads[-1]
    chores = [r.getMessage() for r in lines if "heartbeat" in r.getMessage()]
    # a pass with no chore due says nothing of the database (fixed: "works again after 1 failure" while it was down)
    assert "failed" in chores[0] and [c for c in chores if "works again" in c] == chores[-1:], chores
    assert int(chores[-1].split("works again after ")[1].split(" ")[0]) > 1, chores
    (row,) = rows_of(db)
    assert row["outcome"] == "sent" and row["sent_at"].unix <= start + 121


def test_settlements_the_database_failed_under_are_written_once_it_answers(db, live, monkeypatch):
    """The database fails while a batch writes what APNs answered (its claim committed, the send
    went). The dispatcher keeps those settlements and writes them on its next pass once the
    database answers: the row ends ``sent``, sent once, instead of staying claimed until the
    abandoned sweep fails it (a sent reminder recorded as failed; an unsent one lost)."""
    from sqlalchemy.exc import OperationalError

    from reminders_pipeline.sending import settlement as settlement_mod

    start = one_row_due(db, live, in_seconds=5)
    real, failures = settlement_mod._write_returned, []

    def write_returned(conn, returned, claimer):
        if returned and len(failures) < 3:  # the claim's transaction and the batch's last write, then the first retry
            failures.append(len(returned))
            raise OperationalError(
                "UPDATE notification_queue ...", {}, ConnectionResetError("server closed the connection")
            )
        return real(conn, returned, claimer)

    monkeypatch.setattr(settlement_mod, "_write_returned", write_returned)
    sender = RecordingSender()
    dispatcher = Dispatcher(db, live, sender.factory(), name="kept", timer=DrivenTimer(start))
    asyncio.run(dispatcher.run(until=Instant.from_unix(start + 30)))
    (row,) = rows_of(db)
    assert (row["status"], row["outcome"], row["claimed_by"]) == ("settled", "sent", "kept")
    assert len(failures) == 3
    assert len(sender.sent) == 1
    assert dispatcher.summary.outcomes["sent"] == 1


def test_a_kept_settlement_never_lands_on_a_later_claim_of_its_row(db, live, monkeypatch):
    """A batch's last write commits but is reported lost (its settlement is kept), and settlement
    writes then fail for 15 s while reads and claims work. The dispatcher does not claim that row
    again until its kept settlement is written: claimed again and sent, the late "back to pending"
    would land on the new claim, and the row would go a second time."""
    from sqlalchemy.exc import OperationalError

    from reminders_pipeline.sending import dispatch as dispatch_mod
    from reminders_pipeline.sending import drain as drain_mod

    start = one_row_due(db, live, in_seconds=5)
    timer = DrivenTimer(start)
    answers = iter([SendResult(0, False, reason="ConnectionRefusedError", retry=True)])  # 1st send: never reached APNs

    def answer(n):
        r = next(answers, None)
        return (
            SendResult(n.row_id, True, status=200, provider_message_id="ok")
            if r is None
            else SendResult(n.row_id, **{k: v for k, v in vars(r).items() if k != "row_id"})
        )

    sender = RecordingSender(script={TOKEN: answer})
    state = {"ambiguous": 0}
    real_wol = drain_mod.waiting_off_the_loop

    def flapping() -> bool:  # settlement writes fail for 15 s; reads and claims work
        return start + 5 <= timer.t < start + 20

    async def wol(db_, transaction, *args):
        name = getattr(transaction, "__name__", "")
        if name == "settle_last" and state["ambiguous"] == 0:
            state["ambiguous"] = 1
            await real_wol(db_, transaction, *args)  # committed...
            raise OperationalError(
                "COMMIT", {}, ConnectionResetError("server closed the connection")
            )  # ...but reported lost
        if name in ("settle_last", "write_settlement") and flapping():
            raise OperationalError("UPDATE ...", {}, ConnectionResetError("server closed the connection"))
        return await real_wol(db_, transaction, *args)

    monkeypatch.setattr(drain_mod, "waiting_off_the_loop", wol)
    monkeypatch.setattr(dispatch_mod, "waiting_off_the_loop", wol)
    d = Dispatcher(db, live, sender.factory(), name="kept", timer=timer)
    asyncio.run(d.run(until=Instant.from_unix(start + 60)))
    (row,) = rows_of(db)
    delivered = len(sender.sent) - 1  # the first never reached APNs
    assert delivered == 1, f"delivered {delivered} times"
    assert (row["status"], row["outcome"]) == ("settled", "sent") and not d._kept


def test_a_database_outage_retries_the_abandoned_sweep_once_a_heartbeat_not_once_a_poll(db, live, monkeypatch):
    """Issue 20: the sweep for abandoned claims failing for 2 minutes, polling every second: it is
    tried again at the heartbeat's pace (a033bef tried it on every poll, 120 times)."""
    from sqlalchemy.exc import OperationalError

    import reminders_pipeline.sending.dispatch as dispatch_module

    live = live.with_(dispatch_poll_seconds=1.0, dispatch_heartbeat_seconds=15)
    start = float(NOW_S)
    calls = []

    def fail_abandoned(db, settings, now):
        calls.append(now)
        if now.unix < start + 120:
            raise OperationalError("UPDATE ...", {}, ConnectionRefusedError("connection refused"))
        return 0

    monkeypatch.setattr(dispatch_module, "fail_abandoned", fail_abandoned)
    dispatcher = Dispatcher(db, live, RecordingSender().factory(), name="sweep", timer=DrivenTimer(start))
    asyncio.run(dispatcher.run(until=Instant.from_unix(start + 180)))
    during = [t for t in calls if t.unix < start + 120]
    assert 2 <= len(during) <= 120 / 15 + 1, len(during)
    assert any(t.unix >= start + 120 for t in calls)  # tried again, and working, once it is back


class SlowSender(RecordingSender):
    """Answers each slice after ``delay`` seconds of real time: a burst that stays on the wire."""

    delay: float = 0.2

    async def send_many(self, notifications):
        await asyncio.sleep(self.delay)
        return await super().send_many(notifications)


async def listening(db, seconds: float = 20) -> None:
    """Until a dispatcher's LISTEN connection is up (PostgreSQL; at once on SQLite, which has none)."""
    if db.dialect != "postgresql":
        return
    query = text("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with db.read() as conn:
            if conn.scalar(query):
                return
        await asyncio.sleep(0.05)
    raise AssertionError("the dispatcher never listened")


def test_rows_due_during_a_burst_go_at_their_time_and_the_burst_is_not_read_again(db, live, monkeypatch):
    """500 rows due at once stay on the wire for seconds (10 in flight, 0.2 s an answer). A row
    due 1 s into the burst, and one queued overdue 1.5 s into it (a late build), are sent at
    their time, before the burst ends, not after it. On PostgreSQL, where every row that comes
    back or moves is announced, the polls meanwhile read only what came due since the last one
    (one read of 500 ids per poll before, about 12,000 over the burst)."""
    live = live.with_(dispatch_poll_seconds=0.1, apns_concurrency=10, claim_batch_size=10)
    device(db, live, sources=[], lead=3600)
    read: list[int] = []
    real_due_ids = ledger.due_ids

    def counting_due_ids(*args, **kwargs):
        ids = real_due_ids(*args, **kwargs)
        read.append(len(ids))
        return ids

    monkeypatch.setattr(ledger, "due_ids", counting_due_ids)

    async def scenario() -> tuple[float, DrainResult]:
        stop = asyncio.Event()
        running = asyncio.ensure_future(Dispatcher(db, live, SlowSender().factory(), name="burst").run(stop=stop))
        await listening(db)
        await asyncio.sleep(0.3)  # its first pass is over
        read.clear()
        start = time.time()
        with db.write() as conn:
            queue_rows(conn, [queued(f"burst{k}", start, start) for k in range(500)] + [queued("soon", start + 1.0, start)], at(0))  # fmt: skip
        await asyncio.sleep(start + 1.5 - time.time())
        with db.write() as conn:
            queue_rows(conn, [queued("late", start - 10, start)], at(0))
        while not all(r["status"] == "settled" for r in rows_of(db)):
            await asyncio.sleep(0.1)
        stop.set()
        return start, await asyncio.wait_for(running, 30)

    start, summary = asyncio.run(scenario())
    rows = {r["title"]: r for r in rows_of(db)}
    assert summary.outcomes == {"sent": 502} and {r["outcome"] for r in rows.values()} == {"sent"}
    last_of_burst = max(r["sent_at"].unix for t, r in rows.items() if t.startswith("burst"))
    assert last_of_burst > start + 4  # the burst really was on the wire throughout
    assert rows["soon"]["sent_at"].unix - (start + 1.0) < 1.5 and rows["soon"]["sent_at"].unix < last_of_burst
    assert rows["late"]["sent_at"].unix - (start + 1.5) < 1.5 and rows["late"]["sent_at"].unix < last_of_burst
    if db.dialect == "postgresql":
        # the read after the burst's announcement and the one after the late row's; the rest, only what is new
        assert sum(read) <= 1100, read


def driven_dispatcher(db, live, name: str, **due_in: float) -> tuple[float, DrivenTimer, Dispatcher]:
    """dev-1 with one row per ``name=seconds after NOW`` (``rows_due``), and a dispatcher polling
    every 2 s on a driven clock starting at NOW."""
    live = live.with_(dispatch_poll_seconds=2.0)
    start = rows_due(db, live, **due_in)
    timer = DrivenTimer(start)
    return start, timer, Dispatcher(db, live, RecordingSender().factory(), name=name, timer=timer)


def once_after_housekeeping(dispatcher: Dispatcher, at_unix: float, action) -> dict:
    """Run ``await action(now)`` once, after the first housekeeping at or past ``at_unix``; returns
    ``{"at": that pass's now}`` once it has run."""
    housekeeping = dispatcher._housekeeping
    done: dict = {}

    async def then(now):
        await housekeeping(now)
        if now.unix >= at_unix and not done:
            done["at"] = now.unix
            await action(now)

    dispatcher._housekeeping = then  # type: ignore[method-assign]
    return done


def test_a_row_due_while_the_dispatcher_writes_its_heartbeat_is_sent(db, live):
    """The pass wakes 10 ms before a row's time and its heartbeat write takes 20 ms: the read that
    follows runs after the row came due, so it must send it or leave it unseen, never count it
    seen while returning early (it stayed pending for good)."""
    start, timer, dispatcher = driven_dispatcher(db, live, "beat", r=4.01)

    async def slow_write(now):
        await listening(db)
        timer.t += 0.02

    once_after_housekeeping(dispatcher, start + 4.0, slow_write)
    asyncio.run(dispatcher.run(until=Instant.from_unix(start + 60)))
    (row,) = rows_of(db)
    assert row["outcome"] == "sent" and row["sent_at"].unix - (start + 4.01) < 1.0, row


def test_a_failed_read_keeps_the_full_read_an_announcement_asked_for(db, live):
    """A late build queues an overdue row (announced), and the read that follows fails: the next
    read still reads every due row, so the overdue one goes (it waited for an unrelated full read)."""
    from sqlalchemy.exc import OperationalError

    start, _, dispatcher = driven_dispatcher(db, live, "blip", first=1)

    async def queue_late(now):
        with db.write() as conn:
            queue_rows(conn, [queued("late", start - 10, start)], at(0))
        await asyncio.sleep(0.5)  # the announcement is heard before this pass reads

    queued_at = once_after_housekeeping(dispatcher, start + 6, queue_late)
    read_due, failed = dispatcher._read_due, []

    def failing_once(clock, busy, after=None, skip=frozenset()):
        if queued_at and not failed:
            failed.append(clock)
            raise OperationalError("SELECT ...", {}, ConnectionRefusedError("connection refused"))
        return read_due(clock, busy, after, skip)

    dispatcher._read_due = failing_once  # type: ignore[method-assign]
    asyncio.run(dispatcher.run(until=Instant.from_unix(start + 25)))
    rows = {r["title"]: r for r in rows_of(db)}
    assert failed and {t: r["outcome"] for t, r in rows.items()} == {"first": "sent", "late": "sent"}
    assert rows["late"]["sent_at"].unix - queued_at["at"] < 5.0


def test_a_row_queued_unannounced_is_found_by_the_periodic_full_read(db, live):
    """A LISTEN connection that died silently hears nothing: an overdue row queued meanwhile
    (written here without its announcement) is still found, by the full read every
    ``FULL_READ_SECONDS``, while the polls in between read only what came due since."""
    from reminders_pipeline.ledger.schema import notification_queue
    from reminders_pipeline.sending.dispatch import FULL_READ_SECONDS

    start, _, dispatcher = driven_dispatcher(db, live, "deaf", first=1)

    async def queue_silently(now):
        late = {**queued("late", start - 10, start), "status": "pending", "created_at": now, "updated_at": now}
        with db.write() as conn:
            conn.execute(notification_queue.insert(), [late])

    queued_at = once_after_housekeeping(dispatcher, start + 6, queue_silently)
    asyncio.run(dispatcher.run(until=Instant.from_unix(start + 3 * FULL_READ_SECONDS)))
    rows = {r["title"]: r for r in rows_of(db)}
    assert {t: r["outcome"] for t, r in rows.items()} == {"first": "sent", "late": "sent"}
    assert rows["late"]["sent_at"].unix - queued_at["at"] <= FULL_READ_SECONDS + 2.0


class _ApnsDown:
    """A sender double: APNs out (``kind``: unreachable, or answering 503) until ``end`` on the
    driven clock, Web Push and FCM answering 201 throughout. Records what each provider accepted
    and every APNs send tried during the outage."""

    def __init__(self, timer: DrivenTimer, end: float, kind: str) -> None:
        self.timer, self.end, self.kind = timer, end, kind
        self.accepted: list[tuple[str, int, float]] = []
        self.refused: list[float] = []

    async def send_many(self, notes):
        out = []
        for n in notes:
            if n.provider == "apns" and self.timer.t < self.end:
                self.refused.append(self.timer.t)
                if self.kind == "503":
                    out.append(SendResult(n.row_id, False, reason="ServiceUnavailable", status=503, retry=True))
                else:
                    out.append(SendResult(n.row_id, False, reason="not-sent:ConnectionRefusedError", retry=True))
                continue
            self.accepted.append((n.provider, n.row_id, self.timer.t))
            out.append(SendResult(n.row_id, True, status=200 if n.provider == "apns" else 201, provider_message_id="x"))
        return out

    async def aclose(self):
        return None


@pytest.mark.parametrize("kind", ["unreachable", "503"])
def test_an_apns_outage_halts_apns_alone_while_web_push_and_fcm_send_on(db, live, feeds, kind):
    """Issue 38's bar, on a driven clock: APNs out for 2 minutes (unreachable, or answering 503)
    while Web Push and FCM answer 201, reminders of all three coming due throughout. No APNs row
    spends an attempt (the 503s before the streak was an outage are given back), APNs halts and
    alerts once, Web Push and FCM rows go at their own time throughout, and every APNs row goes
    within 5 s of APNs' return. (Before: one outage judge for every provider, so Web Push's
    successes reset APNs' streak: APNs rows spent their attempts and failed, and nothing halted.)"""
    from .model_support import target_of

    live = live.with_(
        alert_webhook_url=feeds.url("/hook"),
        webpush_allow_networks=("127.0.0.0/8",),
        vapid_private_key_file="unread.pem",
        fcm_credentials_file="unread.json",
    )
    from reminders_pipeline.devices.registration import DeviceSpec, put_device

    for i, provider in enumerate(("apns", "webpush", "fcm")):
        put_device(db, live, DeviceSpec(f"dev-{provider}", **target_of(provider, f"{i}" * 64)), now=at(0))
    start = float(NOW_S)
    outage_end = start + 120
    due = {(p, k): start + 2.4 * k + 0.8 * i for i, p in enumerate(("apns", "webpush", "fcm")) for k in range(75)}
    with db.write() as conn:
        queue_rows(conn, [
            {"device_id": f"dev-{p}", "source_id": None, "item_id": f"1:{p}{k}", "rule": "lead:3600",
             "send_after": Instant.from_unix(t), "event_at": Instant.from_unix(t + 3600),
             "expires_at": Instant.from_unix(t + 5400), "title": f"E{k}", "body": None}
            for (p, k), t in due.items()
        ], at(0))  # fmt: skip
    timer = DrivenTimer(start)
    sender = _ApnsDown(timer, outage_end, kind)
    asyncio.run(Dispatcher(db, live, lambda: sender, timer=timer).run(until=Instant.from_unix(outage_end + 90)))

    rows = rows_of(db)
    assert len(rows) == len(due)
    assert {(r["status"], r["outcome"], r["attempts"]) for r in rows} == {("settled", "sent", 0)}
    sent_at = {row_id: t for _, row_id, t in sender.accepted}
    for r in rows:
        provider = r["device_id"].removeprefix("dev-")
        late = sent_at[r["id"]] - r["send_after"].unix
        if provider == "apns":
            assert sent_at[r["id"]] - max(r["send_after"].unix, outage_end) <= 5.0, r
        else:
            assert late <= 1.0, (provider, late)  # on time throughout APNs' outage
    assert len(sender.refused) <= live.send_halt_after + 2 * 120 / 5  # one probe every 5 s once halted
    alerts = [p["text"] for p in feeds.posts["/hook"]]
    assert len(alerts) == 1 and "APNs unreachable" in alerts[0], alerts


class _SlowRefusals(_ApnsDown):
    """APNs unreachable, each refused send taking a second (aioapns waits one after a failed
    connect); APNs comes back half a second into the ``back_at``-th refusal, a probe's."""

    def __init__(self, timer: DrivenTimer, back_at: int) -> None:
        super().__init__(timer, float("inf"), "unreachable")
        self.back_at = back_at

    async def send_many(self, notes):
        out = []
        for n in notes:
            if n.provider == "apns" and self.timer.t < self.end:
                self.refused.append(self.timer.t)
                if len(self.refused) == self.back_at:
                    self.end = self.timer.t + 0.5
                self.timer.t += 1.0
                out.append(SendResult(n.row_id, False, reason="not-sent:ConnectionRefusedError", retry=True))
                continue
            out += await super().send_many([n])
        return out


def test_apns_back_during_a_slow_refused_probe_sends_its_rows_within_a_probe_interval(db, live, feeds):
    """Found by the outage drill under `reminders dispatch`: a refused probe takes a second, so
    probes counted from each probe's end ran 6 s apart, and APNs returning during one left its rows
    5.5 s; the probed rows also waited out a retry backoff. Probes now keep their pace from each
    probe's start, and a row the outage answered waits for no backoff of its own: every APNs row
    goes within 5 s of APNs' return."""
    device(db, live, sources=[], lead=3600)
    start = float(NOW_S)
    with db.write() as conn:
        queue_rows(conn, [
            {"device_id": "dev-1", "source_id": None, "item_id": f"1:e{k}", "rule": "lead:3600",
             "send_after": Instant.from_unix(start + 2.4 * k), "event_at": Instant.from_unix(start + 2.4 * k + 3600),
             "expires_at": Instant.from_unix(start + 2.4 * k + 5400), "title": f"E{k}", "body": None}
            for k in range(40)
        ], at(0))  # fmt: skip
    timer = DrivenTimer(start)
    sender = _SlowRefusals(timer, back_at=live.send_halt_after // 2 + 8)
    asyncio.run(Dispatcher(db, live, lambda: sender, timer=timer).run(until=Instant.from_unix(start + 180)))
    rows = rows_of(db)
    assert {(r["status"], r["outcome"], r["attempts"]) for r in rows} == {("settled", "sent", 0)}
    sent_at = {row_id: t for _, row_id, t in sender.accepted}
    late = max(sent_at[r["id"]] - max(r["send_after"].unix, sender.end) for r in rows)
    assert late <= 5.0, (late, sender.end)


def test_a_probe_row_settled_without_a_send_does_not_end_an_outage(db, live, feeds, caplog):
    """During an APNs outage, the row a probe claims may be settled by the policy without a send
    (its event started while it waited): APNs has not answered, so its rows stay halted and the
    next probe tries another row. (Before: such a probe ended the halt, and every APNs row due by
    then was sent into the outage, again and again.)"""
    device(db, live, sources=[], lead=3600)
    start = float(NOW_S)
    rows_due = [(start + 4 * k, 2) for k in range(15)]  # these start 2 s after they are due
    rows_due += [(start + 60 + 2.4 * k, 3600) for k in range(40)]  # these wait out the outage
    with db.write() as conn:
        queue_rows(conn, [
            {"device_id": "dev-1", "source_id": None, "item_id": f"1:e{k}", "rule": "lead:3600",
             "send_after": Instant.from_unix(t), "event_at": Instant.from_unix(t + lead),
             "expires_at": Instant.from_unix(t + lead + 1800), "title": f"E{k}", "body": None}
            for k, (t, lead) in enumerate(rows_due)
        ], at(0))  # fmt: skip
    timer = DrivenTimer(start)
    sender = _ApnsDown(timer, start + 120, "unreachable")
    with caplog.at_level("WARNING", logger="reminders_pipeline.sending.dispatch"):
        asyncio.run(Dispatcher(db, live, lambda: sender, timer=timer).run(until=Instant.from_unix(start + 200)))
    rows = rows_of(db)
    assert {(r["outcome"], r["attempts"]) for r in rows if r["event_at"].unix - r["send_after"].unix == 3600} == {
        ("sent", 0)
    }
    assert len(sender.refused) <= live.send_halt_after + 2 * 120 / 5, len(sender.refused)
    back = [r.created for r in caplog.records if "sending APNs rows again" in r.getMessage()]
    assert len(back) == 1 and {r["outcome"] for r in rows} == {"sent", "event_started"}
