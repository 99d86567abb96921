"""The exact-time dispatcher under Dagster's eyes: one long-running op, kept in flight by a sensor.

Dagster is not a timer (sensors tick every 30 s at best and a run takes seconds to start), so the
timing lives in the core's loop (``reminders_pipeline.sending.dispatch``). Dagster keeps it alive and shows
it: one run at a time for ``REMINDERS_DISPATCH_RUN_SECONDS``, a log line per batch, lateness
percentiles as run metadata, run monitoring (``dagster/max_runtime``) for a run that hangs. The
sensor requests the successor shortly before the current run ends, so there is no gap; the overlap
is harmless because the claim is the only lock. A second sensor watches the due rows and, when
they start to wait (or stop waiting), runs the ``dispatch_on_time`` check, which alerts.
"""

import json
import time
from collections.abc import Sequence

import dagster as dg

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.defs.build import IN_FLIGHT, LOAD_SETTINGS, notification_queue
from reminders_pipeline.defs.drain import summary_metadata
from reminders_pipeline.defs.monitoring import check_result
from reminders_pipeline.defs.resources import AlertingResource, LedgerResource, SenderResource, core_settings, in_use
from reminders_pipeline.defs.run_queue import CHECK_TAGS, DISPATCH_PRIORITY, MAX_RUNTIME_TAG, PRIORITY_TAG, RUN_KIND_TAG
from reminders_pipeline.defs.sensors import running_sensor
from reminders_pipeline.defs.signals import stop_on_signals
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ops.check import dispatch_health
from reminders_pipeline.sending.dispatch import Dispatcher, batch_line

MAX_RUNTIME_MARGIN_SECONDS = 600  # run monitoring fails a dispatcher run this long past its planned end


class DispatchConfig(dg.Config):
    """``run_seconds``: how long this run dispatches (default REMINDERS_DISPATCH_RUN_SECONDS)."""

    run_seconds: int | None = None


@dg.op(description="Send each due row at its own send_after until the run's planned end.")
async def dispatch(
    context: dg.OpExecutionContext,
    config: DispatchConfig,
    ledger: LedgerResource,
    sender: SenderResource,
    alerting: AlertingResource,
) -> dict:
    settings = core_settings(ledger, sender, alerting)
    if not settings.dispatch_enabled:
        context.log.warning("REMINDERS_DISPATCH_ENABLED is false: nothing dispatched (the cron drain sends)")
        return {}
    seconds = config.run_seconds or settings.dispatch_run_seconds
    until = Instant.now() + seconds
    with stop_on_signals() as stop:
        await ledger.wait_until_ready(time.monotonic() + seconds, stop)
        with ledger.open() as db:
            factory = sender.factory(in_use(db, settings))  # every provider in use checked before any claim
            dispatcher = Dispatcher(
                db, settings, factory, name=context.run_id, on_batch=lambda s: context.log.info(batch_line(s))
            )
            summary = await dispatcher.run(until=until, stop=stop)
    meta = summary_metadata(summary, batches=0)
    meta.pop("batches")
    context.log.info(f"dispatcher: {summary.as_dict()}")
    if stop.is_set():
        _stopped(context, meta)
    context.add_output_metadata(meta)
    return summary.as_dict()


def _stopped(context: dg.OpExecutionContext, meta: dict) -> None:
    """A signal stopped the run before its planned end, after the sends on the wire were answered
    and settled. Stopped from outside Dagster (Ctrl-C on ``reminders dev``, a pod's SIGTERM) while
    the run is still STARTED: nothing went wrong, so it ends as a success that says it stopped
    early, and the next run picks up the rows still pending. Any other status means Dagster ended
    it (the UI's Terminate: CANCELING; run monitoring past max_runtime: already FAILURE), and the
    step fails so that status stands rather than being overwritten by a success."""
    why = "stopped by a signal; sends on the wire were answered and settled first"
    run = context.instance.get_run_by_id(context.run_id)
    if run is None or run.status != dg.DagsterRunStatus.STARTED:
        raise dg.Failure(why, metadata=meta)
    context.log.info(f"{why}; the rows still due stay pending for the next dispatcher")
    meta["stopped_early"] = why


@dg.job(
    name="dispatcher",
    executor_def=dg.in_process_executor,  # one op that runs for an hour: nothing to spread
    tags={
        RUN_KIND_TAG: "dispatch",
        MAX_RUNTIME_TAG: str(LOAD_SETTINGS.dispatch_run_seconds + MAX_RUNTIME_MARGIN_SECONDS),
        PRIORITY_TAG: str(DISPATCH_PRIORITY),
    },
    description="The exact-time dispatcher for REMINDERS_DISPATCH_RUN_SECONDS; dispatcher_sensor keeps one in flight.",
)
def dispatcher_job() -> None:
    dispatch()


@dg.asset_check(asset=notification_queue, name="dispatch_on_time", blocking=False)
def dispatch_on_time(
    context: dg.AssetCheckExecutionContext, ledger: LedgerResource, alerting: AlertingResource
) -> dg.AssetCheckResult:
    """Due rows wait at most REMINDERS_DISPATCH_LATE_SECONDS past send_after while the dispatcher is on."""
    settings = ledger.settings()
    with ledger.open() as db:
        health = dispatch_health(db, settings, Instant.now())
    return check_result(context, alerting, "dispatch_on_time", health.on_time, health.detail(), health.metadata())


dispatch_check_job = dg.define_asset_job(
    "dispatch_on_time_check",
    selection=dg.AssetSelection.checks(dispatch_on_time),
    executor_def=dg.in_process_executor,
    tags=CHECK_TAGS,
    description="Evaluate dispatch_on_time now (requested by dispatcher_sensor when due rows start or stop waiting).",
)


FAILURE_BACKOFF_SECONDS = (30, 60, 120, 300, 900)


def successor_request(
    in_flight: Sequence[tuple[str, float | None]],
    newest: tuple[str, int, float | None] | None,
    now: float,
    settings: Settings,
) -> dg.RunRequest | None:
    """The run to request so exactly one dispatcher is in flight (two only during a handover).

    ``in_flight``: (run id, start time or None while queued/starting) of dispatcher runs not yet
    finished. ``newest``: the newest dispatcher run (id, how many runs in a row have failed up to
    it, when it ended). The run key names the newest run, so repeated ticks request one successor
    each time the newest run changes. After failures the next attempt waits 30 s, 1, 2, 5, then
    15 minutes: a dispatcher that cannot start (a missing APNs key) is not relaunched, and alerted
    on, every tick.
    """
    if not settings.dispatch_enabled:
        return None
    key = f"dispatcher-after:{newest[0] if newest else 'none'}"
    if not in_flight:
        if newest and newest[1]:
            _, failures, ended = newest
            wait = FAILURE_BACKOFF_SECONDS[min(failures, len(FAILURE_BACKOFF_SECONDS)) - 1]
            if ended is not None and now < ended + wait:
                return None
        return dg.RunRequest(run_key=key, job_name=dispatcher_job.name)
    if len(in_flight) > 1:
        return None
    _, started = in_flight[0]
    if started is not None and started + settings.dispatch_run_seconds - now <= settings.dispatch_handover_seconds:
        return dg.RunRequest(run_key=key, job_name=dispatcher_job.name)
    return None


def newest_dispatcher(instance: dg.DagsterInstance) -> tuple[str, int, float | None] | None:
    """(run id, failed runs in a row up to it, its end time) of the newest dispatcher run."""
    records = instance.get_run_records(
        dg.RunsFilter(job_name=dispatcher_job.name), limit=len(FAILURE_BACKOFF_SECONDS) + 1
    )
    if not records:
        return None
    failures = 0
    for record in records:
        if record.dagster_run.status != dg.DagsterRunStatus.FAILURE:
            break
        failures += 1
    return records[0].dagster_run.run_id, failures, records[0].end_time


@running_sensor(
    "dispatcher_sensor",
    dispatcher_job,
    30,
    "Keep exactly one dispatcher run in flight; request its successor before its planned end.",
)
def dispatcher_sensor(context: dg.SensorEvaluationContext, ledger: LedgerResource) -> dg.SensorResult:
    settings = ledger.settings()
    records = context.instance.get_run_records(dg.RunsFilter(job_name=dispatcher_job.name, statuses=IN_FLIGHT))
    in_flight = [(r.dagster_run.run_id, r.start_time) for r in records]
    successor = successor_request(in_flight, newest_dispatcher(context.instance), time.time(), settings)
    return dg.SensorResult(run_requests=[successor] if successor else [])


@running_sensor(
    "dispatch_on_time_sensor",
    dispatch_check_job,
    30,
    "Run the dispatch_on_time check when due rows start or stop waiting past send_after.",
)
def dispatch_on_time_sensor(context: dg.SensorEvaluationContext, ledger: LedgerResource) -> dg.SensorResult:
    """The check's schedule runs every 15 minutes; this notices a stalled dispatcher within 30 s and
    runs the check (which alerts) only on a transition, so it costs a run per incident, not per tick."""
    now = Instant.now()
    with ledger.open() as db:
        health = dispatch_health(db, ledger.settings(), now)
    was_on_time = json.loads(context.cursor or "{}").get("on_time", True)
    requests = [dg.RunRequest(run_key=f"dispatch-check:{now}")] if health.on_time != was_on_time else []
    return dg.SensorResult(run_requests=requests, cursor=json.dumps({"on_time": health.on_time}))
