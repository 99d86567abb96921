"""``/metrics`` reads the ledger: every process's drains show, in a bounded window; ages never go negative."""

from __future__ import annotations

import math
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from reminders_pipeline import ledger
from reminders_pipeline.http.metrics import Metrics
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.planning.build import build, queue_rows
from reminders_pipeline.providers.base import RecordingSender, SendResult
from reminders_pipeline.sending.drain import drain

from .support import NOW, device
from .test_dagster_support import definitions_for, resources_for
from .test_http_support import APNS_TOKEN, http_settings

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(s) -> Samples:
    r = s.anon.get("/metrics")
    assert r.status_code == 200
    return parse(r.text)


def scrape_at(db: Database, settings, now: str) -> Samples:
    """The collector with its clock pinned: ages and the window are measured against ``now``."""
    return parse(Metrics(db, settings, clock=lambda: now).render().decode())


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def live_item(item_id: str, starts_in: int) -> dict:
    """Real-clock items: the gauges measure ages against the real clock."""
    now = int(time.time())
    return {"id": item_id, "title": item_id, "startsAt": now + starts_in, "expiresAt": now + starts_in + 1800}


def test_metrics_after_a_build_and_a_drain(serve, settings, feeds):
    sender = RecordingSender()
    s = serve(http_settings(settings, enabled=True), sender.factory())
    # lead 3600 before a start 3000 s away: due since 600 s; the other is 2 hours out.
    url = feeds.items("/a.json", [live_item("due", 3000), live_item("later", 7200 + 3600)])
    s.put_device("phone-1", source_urls=[url])

    before = scrape(s)
    assert value(before, "reminders_never_built_devices") == 1
    assert value(before, "reminders_due_pending_rows") == 0
    assert value(before, "reminders_metrics_window_seconds") == 900

    assert s.api.post("/internal/reminders/build", json={"device_id": "phone-1"}).json()["rows_inserted"] == 2
    built = scrape(s)
    assert value(built, "reminders_due_pending_rows") == 1  # the later one is pending, not due
    assert value(built, "reminders_never_built_devices") == 0
    assert 0 <= value(built, "reminders_oldest_build_age_seconds") < 30
    assert 595 <= value(built, "reminders_oldest_due_pending_age_seconds") < 630
    assert value(built, "reminders_ledger_up") == 1 and value(built, "reminders_schema_at_head") == 1

    summary = s.api.post("/internal/reminders/drain").json()
    assert summary["outcomes"] == {"sent": 1}
    drained = scrape(s)
    assert value(drained, "reminders_due_pending_rows") == 0 and value(drained, "reminders_claimed_rows") == 0
    assert value(drained, "reminders_window_settled_rows", outcome="sent", detail="") == 1
    assert value(drained, "reminders_oldest_due_pending_age_seconds") == 0
    assert value(drained, "reminders_http_drains_total") == 1
    assert value(drained, "reminders_window_send_lateness_seconds_gcount") == 1
    assert value(drained, "reminders_window_send_lateness_seconds_bucket", le="300.0") == 0
    assert value(drained, "reminders_window_send_lateness_seconds_bucket", le="900.0") == 1
    assert 595 <= value(drained, "reminders_window_send_lateness_seconds_gsum") < 630
    assert all(
        value(drained, "reminders_clock_faults", kind=k) == 0
        for k in ("reminders_built_at_in_future", "settled_at_in_future", "sent_before_send_after", "beat_at_in_future")
    )


def test_failed_sends_are_counted_by_apns_reason(serve, settings, feeds):
    dead = "cd" * 32
    sender = RecordingSender(script={dead: SendResult(0, False, reason="BadDeviceToken", status=400)})
    s = serve(http_settings(settings, enabled=True), sender.factory())
    url = feeds.items("/a.json", [live_item("due", 3000)])
    s.put_device("ok", source_urls=[url], apns_token=APNS_TOKEN)
    s.put_device("dead", source_urls=[url], apns_token=dead)
    s.api.post("/internal/reminders/build", json={})
    assert s.api.post("/internal/reminders/drain").json()["outcomes"] == {"sent": 1, "failed": 1}
    samples = scrape(s)
    assert value(samples, "reminders_window_settled_rows", outcome="failed", detail="BadDeviceToken") == 1
    assert value(samples, "reminders_window_settled_rows", outcome="sent", detail="") == 1


def test_sends_of_a_dagster_run_and_of_another_process_appear(serve, settings, db, db_url, feeds):
    """The drains that matter run in Dagster workers and the CLI, never in the server being scraped."""
    s = serve(http_settings(settings))
    url = feeds.items("/a.json", [live_item("one", 3000), live_item("two", 3300)])
    s.put_device("phone-1", source_urls=[url])
    build(db, settings)
    run = definitions_for(resources_for(db_url, live=True)).resolve_job_def("drain_job").execute_in_process()
    assert run.success
    cli_db = Database(db_url)  # another engine: what a CLI drain in another process would write
    try:
        s.put_device("phone-2", source_urls=[url], apns_token="ef" * 32)
        build(cli_db, settings, device_ids=["phone-2"])
        drain(cli_db, settings.with_(enabled=True), RecordingSender().factory())
    finally:
        cli_db.dispose()
    samples = scrape(s)
    assert value(samples, "reminders_window_settled_rows", outcome="sent", detail="") == 4
    assert value(samples, "reminders_window_send_lateness_seconds_gcount") == 4
    assert value(samples, "reminders_window_send_lateness_seconds_bucket", le="300.0") == 0  # due 600 and 300 s ago
    assert value(samples, "reminders_window_send_lateness_seconds_bucket", le="900.0") == 4
    assert value(samples, "reminders_http_drains_total") == 0


def _sent(
    db: Database,
    device_id: str,
    send_after: str,
    sent_at: str,
    settled_at: str,
    outcome: str = "sent",
    detail: str | None = None,
) -> None:
    """One row through the real claim and settle, with every time chosen."""
    row = {
        "device_id": device_id,
        "source_id": None,
        "item_id": f"i-{device_id}-{send_after}",
        "rule": "lead:3600",
        "send_after": send_after,
        "event_at": (send_after + 3600),
        "expires_at": (send_after + 5400),
        "title": "t",
        "body": None,
    }
    with db.write() as conn:
        (row_id,) = queue_rows(conn, [row], (send_after - 60))
        ledger.claim(conn, [row_id], send_after, "c")
        ledger.settle(
            conn,
            [
                {
                    "id": row_id,
                    "outcome": outcome,
                    "outcome_detail": detail,
                    "sent_at": sent_at if outcome == "sent" else None,
                }
            ],
            "c",
            settled_at,
        )


def test_the_window_bounds_what_is_counted_and_the_histogram(db, settings):
    _sent(db, "old", (NOW - 1000), (NOW - 997), (NOW - 997))  # settled before the 900 s window
    _sent(db, "b", (NOW - 600), (NOW - 560), (NOW - 560))  # 40 s late
    _sent(db, "c", (NOW - 500), (NOW - 498), (NOW - 498))  # 2 s late
    _sent(db, "d", (NOW - 100), "", (NOW - 99), outcome="failed", detail="BadDeviceToken")
    samples = scrape_at(db, settings, NOW)
    assert value(samples, "reminders_window_settled_rows", outcome="sent", detail="") == 2
    assert value(samples, "reminders_window_settled_rows", outcome="failed", detail="BadDeviceToken") == 1
    assert value(samples, "reminders_window_send_lateness_seconds_gcount") == 2
    assert value(samples, "reminders_window_send_lateness_seconds_gsum") == 42
    buckets = {
        le: value(samples, "reminders_window_send_lateness_seconds_bucket", le=le)
        for le in ("1.0", "5.0", "30.0", "60.0", "+Inf")
    }
    assert buckets == {"1.0": 0, "5.0": 1, "30.0": 1, "60.0": 2, "+Inf": 2}
    wider = scrape_at(db, settings.with_(metrics_window_seconds=1800), NOW)
    assert value(wider, "reminders_window_settled_rows", outcome="sent", detail="") == 3


def test_future_times_are_faults_never_zero_ages(db, settings):
    """A device stamped as built in the future (a forged now) is never rebuilt until then: a fault, not age 0."""
    device(db, settings, "forged", sources=[])
    with db.write() as conn:
        ledger.stamp_built(conn, ["forged"], (NOW + 86400 * 365))
        ledger.beat(conn, "dispatcher-a", (NOW + 120), started_at=(NOW - 60), ends_at=None, sent=0, settled=0)
    _sent(db, "early", (NOW - 300), (NOW - 360), (NOW - 300))  # sent "before" it was due
    _sent(db, "ahead", (NOW + 500), (NOW + 500), (NOW + 500))  # settled after the scrape's now
    samples = scrape_at(db, settings, NOW)
    assert math.isnan(value(samples, "reminders_oldest_build_age_seconds"))
    assert math.isnan(value(samples, "reminders_dispatcher_heartbeat_age_seconds"))
    assert value(samples, "reminders_clock_faults", kind="reminders_built_at_in_future") == 1
    assert value(samples, "reminders_clock_faults", kind="beat_at_in_future") == 1
    assert value(samples, "reminders_clock_faults", kind="sent_before_send_after") == 1
    assert value(samples, "reminders_clock_faults", kind="settled_at_in_future") == 1
    assert value(samples, "reminders_window_send_lateness_seconds_gcount") == 0  # no negative lateness in the buckets
    assert value(samples, "reminders_window_send_lateness_seconds_gsum") == 0


def test_dispatcher_heartbeat_age_and_live_count(db, settings):
    with db.write() as conn:
        ledger.beat(conn, "a", (NOW - 10), started_at=(NOW - 600), ends_at=None, sent=3, settled=4)
        ledger.beat(conn, "b", (NOW - 300), started_at=(NOW - 900), ends_at=None, sent=0, settled=0)
        ledger.beat(conn, "c", (NOW - 5), started_at=(NOW - 900), ends_at=None, sent=0, settled=0)
        ledger.dispatcher_stopped(conn, "c", (NOW - 5))
    samples = scrape_at(db, settings, NOW)
    assert value(samples, "reminders_dispatcher_heartbeat_age_seconds") == 10  # "c" stopped: not running
    assert value(samples, "reminders_dispatchers_live") == 1  # "b" beat 300 s ago: not live
    with db.write() as conn:
        ledger.dispatcher_stopped(conn, "a", (NOW - 1))
    none_running = scrape_at(db, settings, NOW)
    assert value(none_running, "reminders_dispatchers_live") == 0
    # "b" never recorded a stop (killed), but beat 300 s ago, past the liveness window: not running
    # either (before, its age grew until the record was pruned, seven days later).
    assert math.isnan(value(none_running, "reminders_dispatcher_heartbeat_age_seconds"))


def test_each_app_has_its_own_registry(serve, settings):
    one, two = serve(http_settings(settings)), serve(http_settings(settings))
    one.api.post("/internal/reminders/drain")
    assert value(scrape(one), "reminders_http_drains_total") == 1
    assert value(scrape(two), "reminders_http_drains_total") == 0


def test_a_scrape_answers_when_the_ledger_does_not(serve, settings, tmp_path: Path):
    missing = tmp_path / "a-directory"
    missing.mkdir()
    unreachable = Database(f"sqlite:///{missing}")  # a directory: SQLite cannot open it
    try:
        samples = scrape(serve(http_settings(settings), database=unreachable))
        assert value(samples, "reminders_ledger_up") == 0
        assert not any(name == "reminders_window_settled_rows" for name, _ in samples)
    finally:
        unreachable.dispose()


def test_a_busy_window_is_read_up_to_a_bound_and_says_what_it_covers(db, settings, monkeypatch):
    for i, ago in enumerate((600, 300, 100)):
        _sent(db, f"d{i}", (NOW + -ago - 10), (NOW - ago), (NOW - ago))
    calm = scrape_at(db, settings, NOW)
    assert value(calm, "reminders_metrics_window_seconds") == 900
    assert value(calm, "reminders_metrics_window_truncated") == 0
    monkeypatch.setattr("reminders_pipeline.http.metrics.WINDOW_MAX_ROWS", 2)
    busy = scrape_at(db, settings, NOW)
    assert value(busy, "reminders_metrics_window_truncated") == 1
    assert value(busy, "reminders_metrics_window_seconds") == 300  # the latest two rows: settled 300 and 100 s ago
    assert value(busy, "reminders_window_settled_rows", outcome="sent", detail="") == 2
    assert value(busy, "reminders_window_send_lateness_seconds_gcount") == 2
