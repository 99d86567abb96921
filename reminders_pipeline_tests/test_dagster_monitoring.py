"""Schedules, the sweep-period sensor, the two checks and the one alert path (a local webhook)."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import UTC, datetime

import dagster as dg
import pytest
from dagster._utils.schedules import cron_string_iterator

from reminders_pipeline import ledger
from reminders_pipeline.config import alerts
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.defs.build import RANGE_END_TAG, RANGE_START_TAG, build_job, build_schedule, contiguous_ranges
from reminders_pipeline.defs.drain import drain_schedule
from reminders_pipeline.defs.monitoring import queue_checks_schedule, sweep_period_sensor
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.routing import checked_sender_factory

from .test_dagster_support import AlertReceiver, add_device, definitions_for, device_in_chunk, live_item, resources_for

SCHEDULES = (build_schedule, drain_schedule, queue_checks_schedule)


@pytest.fixture
def receiver():
    with AlertReceiver() as r:
        yield r


def at_minute(minute: int) -> datetime:
    return datetime(2026, 9, 10, 8, minute, tzinfo=UTC)


def fires_at(schedule: dg.ScheduleDefinition, when: datetime) -> bool:
    """What the daemon does: the schedule's next tick at or after ``when`` is ``when`` itself."""
    ticks = cron_string_iterator(when.timestamp(), schedule.cron_schedule, schedule.execution_timezone)
    return next(ticks) == when


def evaluate(schedule: dg.ScheduleDefinition, when: datetime, instance, db_url: str):
    with dg.build_schedule_context(
        instance=instance, scheduled_execution_time=when, resources=resources_for(db_url)
    ) as context:
        return schedule.evaluate_tick(context)


@pytest.mark.parametrize(
    "minute, expected",
    [(0, {"build_schedule"}), (5, {"drain_schedule"}), (15, {"build_schedule"}), (7, set())],
)
def test_schedule_ticks_by_minute(minute, expected, db, settings, db_url, feeds, instance):
    add_device(db, settings, device_in_chunk(2), [feeds.items("/a.json", [])])
    when = at_minute(minute)
    assert {s.name for s in SCHEDULES if fires_at(s, when)} == expected
    if "build_schedule" in expected:  # every chunk, one run: a single range 000...015
        (request,) = evaluate(build_schedule, when, instance, db_url).run_requests
        assert (request.tags[RANGE_START_TAG], request.tags[RANGE_END_TAG]) == ("000", "015")
    if "drain_schedule" in expected:
        (request,) = evaluate(drain_schedule, when, instance, db_url).run_requests
        assert request.run_config == {}  # a sweep: no row_id


def test_build_schedule_with_chunks_per_tick_requests_the_stalest_as_ranges(
    db, settings, db_url, feeds, instance, monkeypatch
):
    url = feeds.items("/a.json", [])
    for chunk in (1, 2, 9, 12):
        add_device(db, settings, device_in_chunk(chunk), [url])
    build(db, settings, chunks=[12], now=(Instant.now() - 60))  # chunk 12 is the freshest
    monkeypatch.setenv("REMINDERS_CHUNKS_PER_TICK", "3")
    requests = evaluate(build_schedule, at_minute(0), instance, db_url).run_requests
    assert [(r.tags[RANGE_START_TAG], r.tags[RANGE_END_TAG]) for r in requests] == [("001", "002"), ("009", "009")]


def test_build_schedule_skips_while_a_build_is_in_flight(db_url, instance):
    tags = dict(build_job.tags)  # a job's tags are its runs' (a UI build gets them as it is queued: test_dagster_queue)
    instance.add_run(
        dg.DagsterRun(job_name=build_job.name, run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED, tags=tags)
    )
    result = evaluate(build_schedule, at_minute(0), instance, db_url)
    assert not result.run_requests and "still queued or running" in result.skip_message


def test_contiguous_ranges():
    assert contiguous_ranges([14, 15, 0, 1, 7]) == [(0, 1), (7, 7), (14, 15)]
    assert contiguous_ranges([]) == []


def sense(instance, db_url: str, cursor: str | None, webhook: str):
    with dg.build_sensor_context(
        instance=instance, cursor=cursor, resources=resources_for(db_url, webhook=webhook)
    ) as context:
        return sweep_period_sensor.evaluate_tick(context)


def test_sensor_breach_unchanged_recovered_alerts_once_per_transition(db, settings, db_url, feeds, instance, receiver):
    url = feeds.items("/a.json", [live_item("e", 7200)])
    stale, fresh = device_in_chunk(4), device_in_chunk(6)
    add_device(db, settings, stale, [url])
    add_device(db, settings, fresh, [url])
    build(db, settings, device_ids=[fresh])
    build(db, settings, device_ids=[stale], now=(Instant.now() - 4000))  # budget: 3600 - 600 = 3000 s

    breached = sense(instance, db_url, None, receiver.url)
    assert json.loads(breached.cursor) == {"breached": True}
    (request,) = breached.run_requests  # catch-up of the stale chunk only, under a run key
    assert (request.tags[RANGE_START_TAG], request.tags[RANGE_END_TAG]) == ("004", "004")
    assert request.run_key.startswith("catch-up:") and request.tags["reminders/trigger"] == "catch-up"
    assert receiver.titles() == ["[reminders] sweep-period invariant breached"]
    assert "stale_chunks: [4]" in receiver.received[0]["text"]

    unchanged = sense(instance, db_url, breached.cursor, receiver.url)
    assert json.loads(unchanged.cursor) == {"breached": True}
    assert unchanged.run_requests[0].run_key == request.run_key  # same key: the daemon launches it once
    assert len(receiver.received) == 1  # no repeated alert

    build(db, settings, device_ids=[stale])
    recovered = sense(instance, db_url, unchanged.cursor, receiver.url)
    assert json.loads(recovered.cursor) == {"breached": False} and not recovered.run_requests
    assert receiver.titles()[1:] == ["[reminders] sweep-period invariant recovered"]

    quiet = sense(instance, db_url, recovered.cursor, receiver.url)
    assert not quiet.run_requests and len(receiver.received) == 2


def test_sensor_requests_a_build_for_never_built_devices_without_alerting(
    db, settings, db_url, feeds, instance, receiver
):
    add_device(db, settings, device_in_chunk(7), [feeds.items("/a.json", [])])
    result = sense(instance, db_url, None, receiver.url)
    (request,) = result.run_requests
    assert request.tags[RANGE_START_TAG] == "007" and receiver.received == []


def run_checks(db_url: str, instance, webhook: str) -> dict[str, dg.AssetCheckEvaluation]:
    defs = definitions_for(resources_for(db_url, webhook=webhook))
    job = defs.resolve_job_def(queue_checks_schedule.job_name)
    result = job.execute_in_process(instance=instance)
    assert result.success
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def test_checks_pass_fail_and_alert_on_transitions(db, settings, db_url, feeds, instance, receiver):
    url = feeds.items("/a.json", [live_item("late", 3600 - 2000), live_item("later", 7200)])
    device_id = device_in_chunk(3)
    add_device(db, settings, device_id, [url])
    build(db, settings)  # fresh build, but "late" came due 2000 s ago: beyond MAX_LATENESS (1800 s)

    first = run_checks(db_url, instance, receiver.url)
    assert first["sweep_period_invariant"].passed
    assert not first["drain_backlog"].passed
    assert first["drain_backlog"].severity == dg.AssetCheckSeverity.ERROR
    assert 1990 <= first["drain_backlog"].metadata["oldest_due_age_seconds"].value <= 2100
    # No dispatcher ran either: a row 2000 s past its send_after is far beyond its few seconds.
    assert not first["dispatch_on_time"].passed and first["dispatch_on_time"].severity == dg.AssetCheckSeverity.ERROR
    assert sorted(receiver.titles()) == [
        "[reminders] check dispatch_on_time failed",
        "[reminders] check drain_backlog failed",
    ]

    with db.write() as conn:  # now the build is stale (a back-dated build no longer rewinds the stamp)
        ledger.stamp_built(conn, [device_id], (Instant.now() - 4000))
    second = run_checks(db_url, instance, receiver.url)
    assert not second["sweep_period_invariant"].passed and not second["drain_backlog"].passed
    assert second["sweep_period_invariant"].metadata["budget_seconds"].value == 3000
    assert receiver.titles()[2:] == ["[reminders] check sweep_period_invariant failed"]  # the others: unchanged

    from reminders_pipeline.sending.drain import drain

    drain(db, settings, checked_sender_factory(db, settings))  # settles the late row too_late
    build(db, settings, device_ids=[device_id])
    third = run_checks(db_url, instance, receiver.url)
    assert third["sweep_period_invariant"].passed and third["drain_backlog"].passed and third["dispatch_on_time"].passed
    assert sorted(receiver.titles()[3:]) == [
        "[reminders] check dispatch_on_time passes again",
        "[reminders] check drain_backlog passes again",
        "[reminders] check sweep_period_invariant passes again",
    ]


def test_run_failure_sensor_alerts(db_url, instance, receiver, monkeypatch):
    monkeypatch.setenv("REMINDERS_DRAIN_BATCH_SIZE", "not-a-number")  # every op's Settings.from_env fails
    defs = definitions_for(resources_for(db_url, webhook=receiver.url))
    result = defs.resolve_job_def("drain_job").execute_in_process(instance=instance, raise_on_error=False)
    assert not result.success
    monkeypatch.delenv("REMINDERS_DRAIN_BATCH_SIZE")
    sensor = defs.resolve_sensor_def("run_failure_alert")
    context = dg.build_run_status_sensor_context(
        sensor_name="run_failure_alert",
        dagster_instance=instance,
        dagster_run=result.dagster_run,
        dagster_event=result.get_run_failure_event(),
        resources=resources_for(db_url, webhook=receiver.url),
    ).for_run_failure()
    sensor(context)
    assert receiver.titles() == ["[reminders] run failed: drain_job"]
    assert f"run_id: {result.run_id}" in receiver.received[0]["text"]


def test_raise_alert_logs_and_never_raises_when_the_webhook_fails(caplog):
    caplog.set_level(logging.ERROR, logger="reminders_pipeline.config.alerts")
    dead = Settings(alert_webhook_url="http://127.0.0.1:9/hooks/secret-path")
    assert alerts.raise_alert(dead, "title", "detail", n=1) is False
    assert "[reminders] title\ndetail\nn: 1" in caplog.text
    assert "secret-path" not in caplog.text  # the webhook's path is its secret
    assert alerts.raise_alert(Settings(), "no webhook") is False


def test_one_short_lead_among_a_hundred_is_a_finding_not_a_breach(db, settings, db_url, feeds, instance, receiver):
    """Issue 20's bar: one device at ``lead:300`` among 100. After a build the sweep alert passes
    and requests no catch-up (a033bef: budget 300 - 600 = -300 s, breached forever, a catch-up on
    every tick); ``reminders check`` reports the short lead, and the check's metadata counts it."""
    from reminders_pipeline.ops.check import check

    url = feeds.items("/a.json", [])
    add_device(db, settings, "short", [url], lead=300)
    for n in range(99):
        add_device(db, settings, f"dev-{n}", [url])
    build(db, settings)
    result = sense(instance, db_url, None, receiver.url)
    assert json.loads(result.cursor) == {"breached": False} and not result.run_requests and receiver.received == []
    again = sense(instance, db_url, result.cursor, receiver.url)
    assert not again.run_requests and receiver.received == []
    (finding,) = [f for f in check(db, settings) if f.name == "sweep_period_within_lead"]
    assert not finding.ok and "min lead 300s" in finding.detail
    evaluation = run_checks(db_url, instance, receiver.url)["sweep_period_invariant"]
    assert evaluation.passed and evaluation.metadata["short_lead_devices"].value == 1


def test_two_hours_of_ticks_with_a_lead_900_device_breach_only_on_a_real_stall(db, settings, feeds):
    """Builds every 15 minutes, the alert judged every minute, one device at ``lead:900``: no breach
    in two hours (a033bef flapped 31 times: its budget, 300 s, was under the build cadence). Then
    the builds stop: one breach once the device is older than the sweep promises, and one recovery
    at the next build."""
    from reminders_pipeline.domain.times import Instant
    from reminders_pipeline.ops.check import sweep_status

    add_device(db, settings, "d900", [feeds.items("/a.json", [])], lead=900)
    add_device(db, settings, "d3600", [feeds.items("/b.json", [])])
    start = (Instant.now()).unix // 900 * 900 + 900
    states = []
    for minute in range(0, 4 * 60):
        now = Instant.from_unix(start + minute * 60)
        stalled = 120 <= minute < 180
        if minute % 15 == 0 and not stalled:
            build(db, settings, now=now)
        states.append(sweep_status(db, settings, now).breached)
    changes = [(i, b) for i, (a, b) in enumerate(zip(states, states[1:]), 1) if a != b]
    assert not any(states[:120])
    assert [b for _, b in changes] == [True, False]
    breached_at, recovered_at = changes[0][0], changes[1][0]
    assert 120 < breached_at < 180 and recovered_at == 180


def test_forty_thousand_distinct_leads_are_each_judged_against_their_own_budget(db, settings):
    """A device may choose any lead, so the sweep alert must not pass one value per distinct lead
    to the database (a CASE of 40,000 branches exceeds PostgreSQL's 65,535 parameters). Half the devices are a minute past their budget, half a minute short of it;
    leads run from under the floor budget to far above it."""
    from reminders_pipeline.domain.times import Instant
    from reminders_pipeline.ledger.schema import devices
    from reminders_pipeline.ops.check import device_budget, sweep_period_seconds, sweep_status

    count, now = 40_000, Instant.now()
    period = sweep_period_seconds(settings, {c: count // 16 for c in range(16)})
    rows, expected = [], {}
    for i in range(count):
        lead, chunk, late = 60 + 3 * i, i % 16, i % 2 == 0
        budget = device_budget(settings, lead, period)
        built = Instant.from_unix(int(now.unix) - budget + (-60 if late else 60))
        rows.append(
            {
                "id": f"d{i}",
                "target": "ab" * 32,
                "reminder_lead_seconds": lead,
                "chunk": chunk,
                "reminders_built_at": built,
                "created_at": now,
                "updated_at": now,
            }
        )
        if late:
            expected[chunk] = expected.get(chunk, 0) + 1
    with db.write() as conn:
        conn.execute(devices.insert(), rows)
    status = sweep_status(db, settings, now)
    assert status.sweep_period_seconds == period
    assert dict(status.stale) == expected and sum(expected.values()) == count // 2
    assert status.budget_seconds == device_budget(settings, 60, period)
