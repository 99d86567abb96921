"""The drain half as a Dagster job: fail abandoned claims -> find due rows -> send per batch -> summary.

The fan-out is to a bounded number of batches (``REMINDERS_DRAIN_MAX_BATCHES``, tens), never to rows:
each mapped step costs about 9 Dagster events, so a run's events grow with batches, not with due rows
(docs/dagster.md has the measurement). Inside a batch the core claims each claim-sized slice
immediately before dispatching it, so overlapping drains and repeated triggers stay harmless.
"""

from typing import Any

import dagster as dg

from reminders_pipeline.defs.build import LOAD_SETTINGS
from reminders_pipeline.defs.resources import AlertingResource, LedgerResource, SenderResource, core_settings, in_use
from reminders_pipeline.defs.run_queue import MAX_RUNTIME_TAG, RUN_KIND_TAG
from reminders_pipeline.defs.signals import stop_on_signals
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.schema import OUTCOMES
from reminders_pipeline.sending import drain as core
from reminders_pipeline.sending.faults import describe_halts


class FindDueConfig(dg.Config):
    """``row_id`` drains just that row if it is due: the exact-time trigger by row id."""

    row_id: int | None = None


@dg.op(description="Fail claims left by a run that died mid-send: at most once, never retried.")
def fail_abandoned(context: dg.OpExecutionContext, ledger: LedgerResource) -> int:
    with ledger.open() as db:
        return core.fail_abandoned(db, ledger.settings())


@dg.op(
    out={"due": dg.Out(int), "batches": dg.DynamicOut(list)},
    description="Due = pending and send_after has passed; split into at most REMINDERS_DRAIN_MAX_BATCHES batches.",
)
def find_due(context: dg.OpExecutionContext, config: FindDueConfig, ledger: LedgerResource, abandoned: int) -> Any:
    settings = ledger.settings()
    with ledger.open() as db:
        ids = core.find_due(db, row_id=config.row_id)
    yield dg.Output(len(ids), "due")
    for i, batch in enumerate(core.batches_of(ids, settings.drain_batch_size, settings.drain_max_batches)):
        yield dg.DynamicOutput(batch, output_name="batches", mapping_key=f"batch_{i:03d}")


@dg.op(description="Claim each slice of the batch right before sending it; decide, send, settle.")
async def send_batch(
    context: dg.OpExecutionContext,
    ledger: LedgerResource,
    sender: SenderResource,
    alerting: AlertingResource,
    batch: list,
) -> DrainResult:
    """A provider's halt (its configuration fault or outage) found by any batch of this run, in any
    process, is in the ledger under the run id: every claim reads it, so later batches skip that
    provider's rows without probing it again or alerting again, whichever executor runs them, and
    send the other providers' rows on."""
    settings = core_settings(ledger, sender, alerting)  # the core alerts on APNs faults itself
    claimer = f"{context.run_id}:{context.get_mapping_key()}"  # a claim names the run that made it
    with ledger.open() as db, stop_on_signals() as stop:
        factory = sender.factory(in_use(db, settings))  # every provider in use checked before any claim
        summary = await core.send_batch_async(
            db, settings, batch, factory, claimer=claimer, halt_scope=context.run_id, stop=stop
        )
    if stop.is_set():  # terminated: the rows not yet claimed stay pending for the next drain
        raise dg.Failure("stopped by a signal; sends on the wire were answered and settled first")
    if summary.halted and not summary.claimed:
        context.log.warning(f"skipped: this run halted {describe_halts(summary.halts)}")
    return summary


def summary_metadata(summary: DrainResult, batches: int) -> dict[str, Any]:
    """Counts per outcome (every outcome, zeros included, so plots line up) and lateness percentiles."""
    meta: dict[str, Any] = {
        "due": summary.due,
        "claimed": summary.claimed,
        "abandoned_failed": summary.abandoned,
        "batches": batches,
        **{f"outcome_{o}": summary.outcomes.get(o, 0) for o in OUTCOMES},
        "outcome_details": dg.MetadataValue.json(dict(summary.details)),
        "outcomes_by_rule_kind": dg.MetadataValue.json(dict(summary.kinds)),
        "outcomes_by_provider": dg.MetadataValue.json(dict(summary.providers)),
        "tokens_invalidated": summary.tokens_invalidated,
        "voided_by_token": summary.voided_by_token,
        "returned_to_pending": summary.returned_to_pending,
    }
    for name, value in summary.lateness_percentiles().items():
        if value is not None:
            meta[f"lateness_{name}_seconds"] = value
    if summary.halts:
        meta["halted"] = describe_halts(summary.halts)
    return meta


@dg.op(description="Counts per outcome and lateness percentiles of the whole run.")
def summarize(context: dg.OpExecutionContext, abandoned: int, due: int, summaries: list) -> dict[str, Any]:
    summary = DrainResult(now=Instant.now(), abandoned=abandoned, due=due)
    for part in summaries:
        summary.merge(part)
    meta = summary_metadata(summary, len(summaries))
    context.log.info(f"drain: {summary.as_dict()}")
    if summary.halted:  # the core has alerted; a red run is what the UI should show for it
        raise dg.Failure(
            f"drain halted for {describe_halts(summary.halts)}; their remaining rows stay pending", metadata=meta
        )
    context.add_output_metadata(meta)
    return summary.as_dict()


@dg.job(
    tags={RUN_KIND_TAG: "drain", MAX_RUNTIME_TAG: str(LOAD_SETTINGS.max_lateness_seconds)},
    description="Claim every due row (or the one row_id) and send it; at most once.",
)
def drain_job() -> None:
    abandoned = fail_abandoned()
    due, batches = find_due(abandoned)
    summarize(abandoned, due, batches.map(send_batch).collect())


drain_schedule = dg.ScheduleDefinition(
    name="drain_schedule",
    job=drain_job,
    cron_schedule=LOAD_SETTINGS.drain_cron,
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Drain on its own cadence (REMINDERS_DRAIN_CRON); lateness is bounded by it plus slack.",
)
