"""The dispatcher under Dagster: the sensor keeps exactly one run in flight and hands over before its
end; it runs dispatch_on_time when due rows start or stop waiting; the op sends on time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.events import DagsterEvent, DagsterEventType

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.defs import dispatch as dispatch_defs
from reminders_pipeline.defs.dispatch import (
    dispatch_check_job,
    dispatch_on_time_sensor,
    dispatcher_job,
    dispatcher_sensor,
    successor_request,
)
from reminders_pipeline.ledger.schema import dispatchers
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.routing import checked_sender_factory

from .support import rows
from .test_dagster_support import (
    RECORDER,
    AlertReceiver,
    add_device,
    definitions_for,
    device_in_chunk,
    live_item,
    resources_for,
)

HOUR = Settings().dispatch_run_seconds
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "in_flight, newest, expected_key",
    [
        ([], None, "dispatcher-after:none"),  # none ever: start one
        ([], ("old", 0, 900.0), "dispatcher-after:old"),  # the last one ended as planned
        ([("a", None)], ("a", 0, None), None),  # queued or starting: wait for it
        ([("a", 1000.0)], ("a", 0, None), None),  # started a minute ago: runs for an hour
        ([("a", 1000.0 - HOUR + 119)], ("a", 0, None), "dispatcher-after:a"),  # within the handover: its successor
        ([("a", 1000.0 - HOUR + 119), ("b", None)], ("b", 0, None), None),  # the handover is under way: never a third
        ([("a", 1000.0 - HOUR + 119)], ("b", 1, 1050.0), "dispatcher-after:b"),  # the successor died: another one
        ([], ("c", 1, 1040.0), None),  # failed 20 s ago: wait 30 s before the next attempt
        ([], ("c", 1, 1020.0), "dispatcher-after:c"),
        ([], ("c", 4, 1000.0), None),  # four failures in a row: wait 5 minutes
        ([], ("c", 4, 1060.0 - 300), "dispatcher-after:c"),
    ],
)
def test_successor_request(in_flight, newest, expected_key):
    request = successor_request(in_flight, newest, 1060.0, Settings())
    assert (request.run_key if request else None) == expected_key
    assert request is None or request.job_name == dispatcher_job.name


def test_successor_request_none_when_the_dispatcher_is_disabled():
    assert successor_request([], None, 0.0, Settings(dispatch_enabled=False)) is None


def add_dispatcher_run(instance, *, started: bool) -> str:
    run = instance.create_run_for_job(job_def=dispatcher_job, run_id=str(uuid.uuid4()))
    if started:
        instance.handle_run_event(
            run.run_id, DagsterEvent(event_type_value=DagsterEventType.RUN_START.value, job_name=dispatcher_job.name)
        )
    return run.run_id


def sense(instance, db_url: str, cursor: str | None = None, sensor=dispatcher_sensor) -> dg.SensorResult:
    with dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources_for(db_url)) as context:
        return sensor.evaluate_tick(context)


def dispatcher_keys(result) -> list[str]:
    return [r.run_key for r in result.run_requests]


def test_sensor_starts_one_dispatcher_hands_over_before_the_end_and_never_runs_three(db_url, instance, monkeypatch):
    assert dispatcher_keys(sense(instance, db_url)) == ["dispatcher-after:none"]
    first = add_dispatcher_run(instance, started=True)
    assert dispatcher_keys(sense(instance, db_url)) == []  # one in flight for the next hour

    monkeypatch.setenv("REMINDERS_DISPATCH_RUN_SECONDS", "60")
    monkeypatch.setenv("REMINDERS_DISPATCH_HANDOVER_SECONDS", "59")
    time.sleep(1.1)  # the run is now within 59 s of its planned end
    assert dispatcher_keys(sense(instance, db_url)) == [f"dispatcher-after:{first}"]
    second = add_dispatcher_run(instance, started=False)
    assert dispatcher_keys(sense(instance, db_url)) == []  # two during the handover, never three

    instance.report_run_canceled(instance.get_run_by_id(first))
    assert dispatcher_keys(sense(instance, db_url)) == []  # the successor alone
    instance.report_run_failed(instance.get_run_by_id(second))
    assert dispatcher_keys(sense(instance, db_url)) == []  # not at once: a crash loop would relaunch every tick
    monkeypatch.setattr(dispatch_defs, "FAILURE_BACKOFF_SECONDS", (0,))
    assert dispatcher_keys(sense(instance, db_url)) == [f"dispatcher-after:{second}"]  # a dead one is replaced

    monkeypatch.setenv("REMINDERS_DISPATCH_ENABLED", "false")
    assert dispatcher_keys(sense(instance, db_url)) == []


def check_requests(instance, db_url: str, cursor: str | None) -> tuple[list, str]:
    result = sense(instance, db_url, cursor, sensor=dispatch_on_time_sensor)
    return result.run_requests, result.cursor


def test_sensor_runs_the_check_when_due_rows_start_and_stop_waiting(db, settings, db_url, feeds, instance):
    url = feeds.items("/a.json", [live_item("e", 3600 - 30)])  # lead:3600 came due 30 s ago
    add_device(db, settings, device_in_chunk(0), [url])
    assert check_requests(instance, db_url, None)[0] == []  # nothing due yet: on time, unchanged
    build(db, settings)

    late, cursor = check_requests(instance, db_url, json.dumps({"on_time": True}))
    assert len(late) == 1 and json.loads(cursor) == {"on_time": False}
    assert check_requests(instance, db_url, cursor)[0] == []  # still late: no second run

    from reminders_pipeline.sending.drain import drain

    drain(db, settings, checked_sender_factory(db, settings))  # the row is settled (disabled: a dry run)
    recovered, cursor = check_requests(instance, db_url, cursor)
    assert len(recovered) == 1 and json.loads(cursor) == {"on_time": True}


def test_the_dispatch_on_time_check_fails_with_severity_error_and_alerts(db, settings, db_url, feeds, instance):
    url = feeds.items("/a.json", [live_item("e", 3600 - 30)])
    add_device(db, settings, device_in_chunk(0), [url])
    build(db, settings)
    with AlertReceiver() as receiver:
        defs = definitions_for(resources_for(db_url, webhook=receiver.url))
        result = defs.resolve_job_def(dispatch_check_job.name).execute_in_process(instance=instance)
    (evaluation,) = result.get_asset_check_evaluations()
    assert evaluation.check_name == "dispatch_on_time" and not evaluation.passed
    assert evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert 25 <= evaluation.metadata["oldest_due_wait_seconds"].value <= 120
    assert receiver.titles() == ["[reminders] check dispatch_on_time failed"]


def test_the_dispatcher_op_sends_each_row_when_it_comes_due_and_records_lateness(
    db, settings, db_url, feeds, instance, monkeypatch
):
    # A 30 s poll: a dispatcher that only polled would send about 30 s late, so the 5 s bound below
    # tells "woken for it" apart with room for a loaded 2-core runner (it was 1.5 s beside a 2 s poll).
    monkeypatch.setenv("REMINDERS_DISPATCH_POLL_SECONDS", "30")
    starts = int(time.time()) + 10  # room for the build and the run's start on a loaded machine
    url = feeds.items("/soon.json", [{"id": "soon", "title": "Soon", "startsAt": starts, "expiresAt": starts + 600}])
    add_device(db, settings, device_in_chunk(0), [url], lead=0)
    build(db, settings)
    RECORDER.sent.clear()
    defs = definitions_for(resources_for(db_url, live=True))
    result = defs.resolve_job_def(dispatcher_job.name).execute_in_process(
        instance=instance, run_config={"ops": {"dispatch": {"config": {"run_seconds": 14}}}}
    )
    assert result.success
    (row,) = rows(db)
    assert row["outcome"] == "sent" and row["claimed_by"] == result.run_id
    assert row["claimed_at"] >= row["send_after"] and row["sent_at"].unix - starts < 5  # woken for it, not polled
    meta = result.output_for_node("dispatch")
    assert meta["outcomes"] == {"sent": 1}
    (materialization,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_OUTPUT]
    names = set(materialization.event_specific_data.metadata)
    assert {"lateness_p50_seconds", "lateness_p99_seconds", "lateness_max_seconds", "outcome_sent"} <= names
    logs = [e.message for e in instance.all_logs(result.run_id) if e.user_message.startswith("batch:")]
    assert len(logs) == 1 and "1 rows" in logs[0]


STOPPABLE_RUN = """
import json, os, signal, sys, threading, time
import dagster as dg
from reminders_pipeline.defs.resources import AlertingResource, LedgerResource, SenderResource, SourcesResource
from reminders_pipeline_tests.test_dagster_support import definitions_for

resources = {"ledger": LedgerResource(database_url=sys.argv[1]), "sender": SenderResource(enabled="true"),
             "sources": SourcesResource(), "alerting": AlertingResource()}
with dg.instance_for_test() as instance:
    if sys.argv[2] != "signal":  # as the UI's Terminate, or run monitoring past max_runtime
        def terminate():
            while not os.path.exists(sys.argv[3]):
                time.sleep(0.05)
            (run,) = instance.get_runs()
            instance.report_run_canceling(run)
            if sys.argv[2] == "max_runtime":  # marked failed before the worker has settled
                instance.report_run_failed(run, "exceeded its maximum runtime")
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=terminate, daemon=True).start()
    result = definitions_for(resources).resolve_job_def("dispatcher").execute_in_process(
        instance=instance, run_config={"ops": {"dispatch": {"config": {"run_seconds": 120}}}}, raise_on_error=False)
    (run,) = instance.get_runs()
    failure = result.failure_data_for_node("dispatch")
    logs = [e.user_message for e in instance.all_logs(run.run_id)]
    print(json.dumps({"success": result.success, "status": run.status.value, "logs": logs,
                      "error": failure.error.message if failure else None}))
"""


@pytest.mark.parametrize("stop", ["signal", "terminate", "max_runtime"])
def test_a_dagster_dispatcher_run_stopped_mid_send_settles_what_is_on_the_wire(db_url, mock, tmp_path, stop):
    """A stop lands while sends are on the wire: the op stops claiming, lets them answer and settle,
    and records its stop. A SIGINT from outside Dagster (Ctrl-C on ``reminders dev``) ends the run
    as a success that says it stopped early; Dagster's Terminate (the run canceling, then SIGINT to
    the run worker) ends it canceled, and run monitoring past max_runtime (canceling, failed, then
    SIGINT) leaves it failed."""
    from reminders_pipeline.ledger.db import Database

    from .test_faults import ids_where, ledger_rows, load_due, wait_until

    mock.drop_all_connections()
    mock.reset()
    db = Database(db_url)
    load_due(db, n_devices=20, items_per_device=5)
    mock.script_default(delay=2.0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMINDERS_")}
    env.update(
        {
            **mock.env(),
            "REMINDERS_ENABLED": "true",
            "REMINDERS_CLAIM_BATCH_SIZE": "10",
            "REMINDERS_APNS_CONCURRENCY": "10",
        }
    )
    marker = tmp_path / "terminate"
    process = subprocess.Popen([sys.executable, "-c", STOPPABLE_RUN, db_url, stop, str(marker)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=(tmp_path / "run.stderr").open("w"), text=True,
                               start_new_session=True)  # fmt: skip
    try:
        wait_until("sends on the wire", lambda: len(mock.requests) > 0, 90)
        if stop != "signal":
            marker.touch()
        else:
            process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
        mock.script_default(status=200)
    final = ledger_rows(db)
    with db.read() as conn:
        (beat,) = conn.execute(dispatchers.select()).mappings().all()
    db.dispose()
    stderr = (tmp_path / "run.stderr").read_text()[-3000:]
    assert out.strip(), stderr
    result = json.loads(out.strip().splitlines()[-1])
    if stop == "signal":
        assert result["success"] is True and result["status"] == "SUCCESS", (result, stderr)
        assert any("stopped by a signal" in line for line in result["logs"]), result["logs"]
    else:
        status = {"terminate": "CANCELED", "max_runtime": "FAILURE"}[stop]
        assert result["success"] is False and result["status"] == status, (result, stderr)
        assert "stopped by a signal" in result["error"]
    assert not ids_where(final, status="claimed"), "the stop left claims behind"
    assert ids_where(final, outcome="sent") and ids_where(final, status="pending")
    assert beat["stopped_at"] is not None
