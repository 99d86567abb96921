"""Watching the two invariants: a sensor on the oldest ``reminders_built_at``, two asset checks, and
an alert for every failed run. All alerts go through ``reminders_pipeline.config.alerts``.

Missing the sweep period does not make reminders late: they never queue. So the sensor watches the
oldest build, requests a catch-up build of the stale chunks (run keys bound it to one request per
chunk range per build cadence), and alerts only on transitions (breached, recovered), keeping the
last state in its cursor. The checks put the same numbers on the asset page, plotted over time, and
alert on their own transitions (the previous evaluation is in the instance).
"""

import json
from typing import Any

import dagster as dg
from dagster._core.storage.asset_check_execution_record import (  # no public name in 1.13
    AssetCheckExecutionRecordStatus as CheckStatus,
)

from reminders_pipeline.config.cadence import crons_after
from reminders_pipeline.defs.build import (
    LOAD_SETTINGS,
    RANGE_END_TAG,
    RANGE_START_TAG,
    build_job,
    build_requests,
    builds_in_flight,
    notification_queue,
)
from reminders_pipeline.defs.resources import AlertingResource, LedgerResource
from reminders_pipeline.defs.run_queue import CHECK_TAGS
from reminders_pipeline.defs.sensors import running_sensor
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ops.check import oldest_due_wait, stale_chunks, sweep_status

CATCH_UP_TAG = "reminders/trigger"
# The checks run this long after each drain tick (REMINDERS_DRAIN_CRON), so drain_backlog sees what
# the drain left rather than the rows it is about to send.
CHECKS_AFTER_DRAIN_MINUTES = 5


def transition(was_ok: bool, ok: bool) -> str | None:
    """ "breached" or "recovered" when the state changed, else None: alerts fire on changes only."""
    if was_ok and not ok:
        return "breached"
    if ok and not was_ok:
        return "recovered"
    return None


@running_sensor(
    "sweep_period_sensor",
    build_job,
    60,
    "Each device's reminders_built_at vs its own lead - margin: catch-up build and a transition alert.",
)
def sweep_period_sensor(
    context: dg.SensorEvaluationContext, ledger: LedgerResource, alerting: AlertingResource
) -> dg.SensorResult:
    settings = ledger.settings()
    now = Instant.now()
    with ledger.open() as db:
        status = sweep_status(db, settings, now)
        chunks = stale_chunks(db, status) if status.breached or status.never_built else []
    was_ok = not json.loads(context.cursor or "{}").get("breached", False)
    change = transition(was_ok, not status.breached)
    if change:
        title = "sweep-period invariant breached" if change == "breached" else "sweep-period invariant recovered"
        detail = (
            f"devices are not rebuilt within their lead - margin: their reminders may never queue ({status.describe()})"
            if change == "breached"
            else "every device has been rebuilt within its lead - margin again"
        )
        alerting.alert(title, detail, **status.fields(), stale_chunks=chunks or None)
    requests: list[dg.RunRequest] = []
    if chunks and not builds_in_flight(context.instance):
        bucket = now.whole_seconds // settings.build_cadence_seconds  # one retry per build cadence
        requests = build_requests(chunks, run_key=f"catch-up:{bucket}", **{CATCH_UP_TAG: "catch-up"})
    return dg.SensorResult(run_requests=requests, cursor=json.dumps({"breached": status.breached}))


def previous_passed(context: dg.AssetCheckExecutionContext, name: str) -> bool:
    """Whether this check's last completed evaluation passed (True when there is none)."""
    key = dg.AssetCheckKey(notification_queue.key, name)
    done = {CheckStatus.SUCCEEDED, CheckStatus.FAILED}  # this evaluation's own record is still PLANNED
    history = context.instance.event_log_storage.get_asset_check_execution_history(key, limit=1, status=done)
    return not history or history[0].status == CheckStatus.SUCCEEDED


def check_result(
    context: dg.AssetCheckExecutionContext,
    alerting: AlertingResource,
    name: str,
    passed: bool,
    detail: str,
    metadata: dict[str, Any],
) -> dg.AssetCheckResult:
    change = transition(previous_passed(context, name), passed)
    if change:
        alerting.alert(f"check {name} {'failed' if change == 'breached' else 'passes again'}", detail, **metadata)
    return dg.AssetCheckResult(
        passed=passed, severity=dg.AssetCheckSeverity.ERROR, metadata=metadata, description=detail
    )


@dg.asset_check(asset=notification_queue, name="sweep_period_invariant", blocking=False)
def sweep_period_invariant(
    context: dg.AssetCheckExecutionContext, ledger: LedgerResource, alerting: AlertingResource
) -> dg.AssetCheckResult:
    """Every device rebuilt within its own lead - margin (at least the sweep period and a build
    cadence): otherwise its reminders may never queue."""
    settings = ledger.settings()
    with ledger.open() as db:
        status = sweep_status(db, settings, Instant.now())
    metadata = {k: v for k, v in status.fields().items() if v is not None}
    return check_result(context, alerting, "sweep_period_invariant", not status.breached, status.describe(), metadata)


@dg.asset_check(asset=notification_queue, name="drain_backlog", blocking=False)
def drain_backlog(
    context: dg.AssetCheckExecutionContext, ledger: LedgerResource, alerting: AlertingResource
) -> dg.AssetCheckResult:
    """Oldest due pending row's age < MAX_LATENESS_SECONDS: otherwise due rows settle too_late."""
    settings = ledger.settings()
    now = Instant.now()
    with ledger.open() as db, db.read() as conn:
        oldest, age = oldest_due_wait(conn, now)
    metadata: dict[str, Any] = {
        "oldest_due_age_seconds": round(age, 1),
        "max_lateness_seconds": settings.max_lateness_seconds,
        "drain_cadence_seconds": settings.drain_cadence_seconds,
    }
    if oldest:
        metadata["oldest_due_send_after"] = oldest.stored
    detail = f"oldest due pending row waits {age:.0f}s; MAX_LATENESS_SECONDS is {settings.max_lateness_seconds}s"
    return check_result(context, alerting, "drain_backlog", age < settings.max_lateness_seconds, detail, metadata)


_check_crons = crons_after(LOAD_SETTINGS.drain_cron, CHECKS_AFTER_DRAIN_MINUTES)
queue_checks_schedule = dg.ScheduleDefinition(
    name="queue_checks_schedule",
    # The default drain cron gives "10,25,40,55 * * * *"; a list only when the delayed ticks'
    # hours differ by minute (an hour field other than "*").
    cron_schedule=_check_crons[0] if len(_check_crons) == 1 else list(_check_crons),
    execution_timezone="UTC",
    target=dg.AssetSelection.checks_for_assets(notification_queue),
    tags=CHECK_TAGS,
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Evaluate sweep_period_invariant and drain_backlog 5 minutes after each drain tick (REMINDERS_DRAIN_CRON).",
)


@dg.run_failure_sensor(
    name="run_failure_alert",
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Alert on every failed build, drain or check run.",
)
def run_failure_alert(context: dg.RunFailureSensorContext, alerting: AlertingResource) -> None:
    run = context.dagster_run
    alerting.alert(
        f"run failed: {run.job_name}",
        context.failure_event.message or "",
        run_id=run.run_id,
        partition=run.tags.get("dagster/partition"),
        chunks=_range(run.tags),
    )


def _range(tags: Any) -> str | None:
    start, end = tags.get(RANGE_START_TAG), tags.get(RANGE_END_TAG)
    return f"{start}...{end}" if start else None
