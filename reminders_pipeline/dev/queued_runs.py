"""The run history ``reminders dev`` leaves behind when it stops."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

INSTANCE_VARIABLES = ("DAGSTER_HOME", "DAGSTER_POSTGRES_URL")
WHY = "reminders dev stopped before the run queue launched this run"


def cancel_queued_runs(env: Mapping[str, str]) -> int:
    """Mark canceled every run still QUEUED in the dev instance once ``dagster dev`` has ended.

    A schedule's drain submitted while the run queue waited for a slot would otherwise show as
    QUEUED in the run history until the next ``reminders dev``, and then launch late. Returns how
    many were canceled."""
    import dagster as dg  # only when stopping: the rest of ``reminders dev`` never loads Dagster

    os.environ.update({name: env[name] for name in INSTANCE_VARIABLES if name in env})
    with dg.DagsterInstance.get() as instance:
        runs = instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.QUEUED]))
        for run in runs:
            instance.report_run_canceled(run, message=WHY)
    if runs:
        print(f"reminders dev: canceled {len(runs)} run(s) still queued", file=sys.stderr)
    return len(runs)
