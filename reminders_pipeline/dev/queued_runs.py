"""The run history ``reminders dev`` leaves behind when it stops."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime

WHY = "reminders dev stopped before the run queue launched this run"


@contextmanager
def queued_runs_canceled_at_exit(env: Mapping[str, str]) -> Iterator[None]:
    """Around ``dagster dev``: at the end, cancel what it queued and never launched."""
    since = datetime.now(UTC)
    try:
        yield
    finally:
        cancel_queued_runs(env, since)


def cancel_queued_runs(env: Mapping[str, str], since: datetime) -> int:
    """Mark canceled every run queued since ``since`` and still QUEUED once ``dagster dev`` has ended.

    A schedule's drain submitted while the run queue waited for a slot would otherwise show as
    QUEUED in the run history until the next ``reminders dev``, and then launch late. Only the dev
    instance under ./var/ is touched: with DAGSTER_POSTGRES_URL the instance may be shared with
    other processes whose queued runs are theirs. A failure here is one line, never a traceback at
    the end of a clean stop. Returns how many were canceled."""
    if env.get("DAGSTER_POSTGRES_URL") or not env.get("DAGSTER_HOME"):
        return 0
    try:
        import dagster as dg  # only when stopping: the rest of ``reminders dev`` never loads Dagster

        with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
            queued = dg.RunsFilter(statuses=[dg.DagsterRunStatus.QUEUED], created_after=since)
            runs = instance.get_runs(filters=queued)
            for run in runs:
                instance.report_run_canceled(run, message=WHY)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the stop itself has succeeded
        print(f"reminders dev: queued runs not checked ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 0
    if runs:
        print(f"reminders dev: canceled {len(runs)} run(s) still queued", file=sys.stderr)
    return len(runs)
