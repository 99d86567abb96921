"""``/metrics`` after a build and a drain: ledger gauges at scrape time, drain counters and lateness."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from reminders_pipeline.db import Database
from reminders_pipeline.sender import RecordingSender, SendResult

from .test_http_support import APNS_TOKEN, http_settings, serve, served  # noqa: F401 - fixtures


def scrape(s) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = s.anon.get("/metrics")
    assert r.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
    }


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
    assert value(before, "reminders_queue_rows", status="pending", outcome="") == 0

    assert s.api.post("/internal/reminders/build", json={"device_id": "phone-1"}).json()["rows_inserted"] == 2
    built = scrape(s)
    assert value(built, "reminders_queue_rows", status="pending", outcome="") == 2
    assert value(built, "reminders_never_built_devices") == 0
    assert 0 <= value(built, "reminders_oldest_build_age_seconds") < 30
    assert 595 <= value(built, "reminders_oldest_due_pending_age_seconds") < 630
    assert value(built, "reminders_ledger_up") == 1

    summary = s.api.post("/internal/reminders/drain").json()
    assert summary["outcomes"] == {"sent": 1}
    drained = scrape(s)
    assert value(drained, "reminders_queue_rows", status="pending", outcome="") == 1
    assert value(drained, "reminders_queue_rows", status="settled", outcome="sent") == 1
    assert value(drained, "reminders_queue_rows", status="settled", outcome="too_late") == 0  # zeros stay visible
    assert value(drained, "reminders_oldest_due_pending_age_seconds") == 0
    assert value(drained, "reminders_sends_total", outcome="sent", reason="") == 1
    assert value(drained, "reminders_drained_rows_total", outcome="sent") == 1
    assert value(drained, "reminders_http_drains_total") == 1
    assert value(drained, "reminders_send_lateness_seconds_count") == 1
    assert value(drained, "reminders_send_lateness_seconds_bucket", le="300.0") == 0
    assert value(drained, "reminders_send_lateness_seconds_bucket", le="900.0") == 1
    assert 595 <= value(drained, "reminders_send_lateness_seconds_sum") < 630


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
    assert value(samples, "reminders_sends_total", outcome="failed", reason="BadDeviceToken") == 1
    assert value(samples, "reminders_sends_total", outcome="sent", reason="") == 1
    assert value(samples, "reminders_queue_rows", status="settled", outcome="failed") == 1


def test_each_app_has_its_own_registry(serve, settings):
    one, two = serve(http_settings(settings)), serve(http_settings(settings))
    one.api.post("/internal/reminders/drain")
    assert value(scrape(one), "reminders_http_drains_total") == 1
    assert value(scrape(two), "reminders_http_drains_total") == 0


def test_a_scrape_answers_when_the_ledger_does_not(serve, settings, tmp_path: Path):
    empty = Database(f"sqlite:///{tmp_path / 'never-migrated.sqlite3'}")
    try:
        samples = scrape(serve(http_settings(settings), database=empty))
        assert value(samples, "reminders_ledger_up") == 0
        assert not any(name == "reminders_queue_rows" for name, _ in samples)
    finally:
        empty.dispose()
