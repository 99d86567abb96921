"""The build half as Dagster sees it: ``notification_queue`` partitioned by device chunk.

Each partition is one chunk (the stable hash stored on ``devices.chunk``), so the UI shows per-chunk
status and history and a backfill of any chunks rebuilds exactly those. One run per schedule tick
materializes a range of chunks (``BackfillPolicy.single_run()``): docs/dagster.md has the figures
that chose it over one run per chunk.
"""

from collections.abc import Sequence
from typing import Any

import dagster as dg
from sqlalchemy import Connection

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.defs.resources import AlertingResource, LedgerResource, SourcesResource, core_settings
from reminders_pipeline.defs.run_queue import BUILD_TAGS, RUN_KIND_TAG
from reminders_pipeline.domain.run_summary import BuildResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger import stalest_chunks
from reminders_pipeline.planning.build import build

# Read once when the code location loads: the partition keys and the cron strings are part of the
# definitions. The same Settings reads the same variables in every run process.
LOAD_SETTINGS = Settings.from_env()

RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def chunk_key(chunk: int) -> str:
    """Zero-padded so key order is chunk order (the UI sorts and ranges keys as text)."""
    return f"{chunk:03d}"


chunks_partitions = dg.StaticPartitionsDefinition([chunk_key(c) for c in range(LOAD_SETTINGS.chunk_count)])


def chunks_for_tick(settings: Settings, conn: Connection) -> list[int]:
    """Every chunk by default; with REMINDERS_CHUNKS_PER_TICK, the stalest that many."""
    if settings.effective_chunks_per_tick >= settings.chunk_count:
        return list(range(settings.chunk_count))
    return stalest_chunks(conn, limit=settings.effective_chunks_per_tick)


def chunk_metadata(summary: BuildResult) -> dict[str, Any]:
    """A chunk's build as UI metadata; the numbers are plotted per partition over time."""
    return {
        "devices_built": summary.devices_built,
        "devices_unchanged": summary.devices_unchanged,
        "devices_items_replanned": summary.devices_items_replanned,
        "rows_inserted": summary.rows_inserted,
        "rows_updated": summary.rows_updated,
        "rows_voided": sum(summary.rows_voided.values()),
        "rows_voided_by_reason": dg.MetadataValue.json(dict(summary.rows_voided)),
        "items_rejected": sum(summary.items_rejected.values()),
        "items_rejected_by_reason": dg.MetadataValue.json(dict(summary.items_rejected)),
        "sources_read": summary.sources_read,
        "sources_not_modified": summary.sources_not_modified,
        "sources_failed": len(summary.sources_failed),
        "sources_failed_detail": dg.MetadataValue.json(summary.sources_failed),
        "oldest_reminders_built_at": summary.oldest_built_at.stored if summary.oldest_built_at else "no devices",
        "duration_seconds": round(summary.duration_seconds, 3),
    }


@dg.asset(
    partitions_def=chunks_partitions,
    backfill_policy=dg.BackfillPolicy.single_run(),
    group_name="reminders",
    kinds={"sql"},
)
def notification_queue(
    context: dg.AssetExecutionContext, ledger: LedgerResource, sources: SourcesResource, alerting: AlertingResource
) -> dg.MaterializeResult:
    """Queue rows for every future item of the chunk's devices, stalest devices first.

    Materializing a chunk composes each of its devices' feeds (at most ``chunk_size`` devices per
    visit) and makes the chunk's ``notification_queue`` rows match: insert, update, void.
    """
    settings = core_settings(ledger, sources, alerting)  # the build alerts on failing sources
    reads: dict = {}  # each source read once per run, however many of the run's chunks share it
    with ledger.open() as db:
        for key in context.partition_keys:
            summary = build(db, settings, chunks=[int(key)], limit=settings.chunk_size, read_cache=reads)
            context.log.info(f"chunk {key}: {summary.as_dict()}")
            context.add_asset_metadata(chunk_metadata(summary), partition_key=key)
    return dg.MaterializeResult()


build_job = dg.define_asset_job(
    "build_notification_queue",
    selection=dg.AssetSelection.assets(notification_queue).without_checks(),
    tags=BUILD_TAGS,
    description="Build notification_queue for a range of device chunks (one run, chunks in turn).",
)


def contiguous_ranges(chunks: Sequence[int]) -> list[tuple[int, int]]:
    """``[14, 15, 0, 1, 7]`` -> ``[(0, 1), (7, 7), (14, 15)]``: one single-run range each."""
    ranges: list[tuple[int, int]] = []
    for c in sorted(set(chunks)):
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1] = (ranges[-1][0], c)
        else:
            ranges.append((c, c))
    return ranges


def split(ranges: list[tuple[int, int]], per_run: int) -> list[tuple[int, int]]:
    """Ranges cut to at most ``per_run`` chunks each (0 = uncut): per-chunk runs for a cluster."""
    if per_run <= 0:
        return ranges
    return [(a, min(a + per_run - 1, end)) for start, end in ranges for a in range(start, end + 1, per_run)]


def build_requests(chunks: Sequence[int], run_key: str | None = None, **tags: str) -> list[dg.RunRequest]:
    """Run requests materializing ``chunks``: one run per contiguous range of chunk keys, cut to
    ``REMINDERS_BUILD_CHUNKS_PER_RUN`` chunks when that is set."""
    requests = []
    for start, end in split(contiguous_ranges(chunks), LOAD_SETTINGS.build_chunks_per_run):
        span = f"{chunk_key(start)}...{chunk_key(end)}"
        requests.append(
            dg.RunRequest(
                run_key=f"{run_key}:{span}" if run_key else None,
                tags={RANGE_START_TAG: chunk_key(start), RANGE_END_TAG: chunk_key(end), **tags},
            )
        )
    return requests


def builds_in_flight(instance: dg.DagsterInstance) -> int:
    """Build runs queued or running, wherever launched (a UI materialization is tagged as one when
    queued, ``run_queue``): a new tick would only rebuild the same stalest chunks."""
    return len(instance.get_run_ids(dg.RunsFilter(tags={RUN_KIND_TAG: "build"}, statuses=IN_FLIGHT), limit=1))


@dg.schedule(
    name="build_schedule",
    cron_schedule=LOAD_SETTINGS.build_cron,
    execution_timezone="UTC",
    job=build_job,
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Sweep the stalest chunks on the build cadence (REMINDERS_BUILD_CRON).",
)
def build_schedule(context: dg.ScheduleEvaluationContext, ledger: LedgerResource) -> Any:
    if builds_in_flight(context.instance):
        return dg.SkipReason("a build run is still queued or running; building may run behind")
    settings = ledger.settings()
    with ledger.open() as db, db.read() as conn:
        chunks = chunks_for_tick(settings, conn)
    if not chunks:
        return dg.SkipReason("no devices registered")
    # A schedule returning several requests must key each; the key is scoped to this tick.
    tick = context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else Instant.now()
    return build_requests(chunks, run_key=f"tick:{tick}")
