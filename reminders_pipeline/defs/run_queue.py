"""Every run's kind, limit and runtime, wherever it was launched from.

``dagster.yaml`` limits concurrent runs per ``reminders/kind``, and run monitoring fails a run past
its ``dagster/max_runtime``. Our jobs, schedules and sensors carry both tags, but a materialization
or a backfill launched from an asset's page runs as ``__ASSET_JOB`` with only Dagster's own tags:
asset tags never become run tags. ``TaggingRunCoordinator`` gives such a run the tags of the kind
its selection makes it, before it enters the queue, so the queue's limits, the in-flight build
guard and run monitoring count it like any other.

The limits add up to ``max_concurrent_runs`` at most, so the dispatcher's two slots (one run, two
during a handover) are always free for it, and its ``dagster/priority`` puts its successor first
when a slot frees up. docs/dagster.md has the table; ``test_dagster_queue.py`` drives Dagster's
own queue daemon with this file's ``dagster.yaml``.

Reads ``SubmitRunContext`` from ``dagster._core.run_coordinator`` (no public path exports it):
Dagster is pinned exactly, and a canary test checks the override still runs.
"""

from collections.abc import Mapping

import dagster as dg
from dagster._core.run_coordinator import SubmitRunContext

RUN_KIND_TAG = "reminders/kind"
MAX_RUNTIME_TAG = "dagster/max_runtime"
PRIORITY_TAG = "dagster/priority"
BUILD_ASSET = dg.AssetKey("notification_queue")

BUILD_MAX_RUNTIME_SECONDS = 3600
CHECK_MAX_RUNTIME_SECONDS = 600
OTHER_MAX_RUNTIME_SECONDS = 3600
DISPATCH_PRIORITY = 10  # above every other run (default 0): a dispatcher's successor is dequeued first

BUILD_TAGS = {RUN_KIND_TAG: "build", MAX_RUNTIME_TAG: str(BUILD_MAX_RUNTIME_SECONDS)}
CHECK_TAGS = {RUN_KIND_TAG: "check", MAX_RUNTIME_TAG: str(CHECK_MAX_RUNTIME_SECONDS)}
OTHER_TAGS = {RUN_KIND_TAG: "other", MAX_RUNTIME_TAG: str(OTHER_MAX_RUNTIME_SECONDS)}


KINDS = ("build", "drain", "check", "other", "dispatch")  # each limited in every dagster.yaml


def tags_for(run: dg.DagsterRun) -> Mapping[str, str]:
    """The tags a run lacks: a build's when it materializes ``notification_queue``, a check's when
    it only evaluates checks, else ``other``'s; none for a run that has a known kind already (one
    edited in the launchpad to a kind no limit names is given its own)."""
    if run.tags.get(RUN_KIND_TAG) in KINDS:
        return {}
    if run.asset_selection and BUILD_ASSET in run.asset_selection:
        kind = BUILD_TAGS
    elif run.asset_check_selection and not run.asset_selection:
        kind = CHECK_TAGS
    else:
        kind = OTHER_TAGS
    return {k: v for k, v in kind.items() if k == RUN_KIND_TAG or k not in run.tags}


class TaggingRunCoordinator(dg.QueuedRunCoordinator):
    """Dagster's queued run coordinator, with a run's missing kind tags added as it is queued."""

    def submit_run(self, context: SubmitRunContext) -> dg.DagsterRun:
        run = context.dagster_run
        extra = tags_for(run)
        if extra:
            self._instance.add_run_tags(run.run_id, dict(extra))
            tagged = self._instance.get_run_by_id(run.run_id)
            if tagged is None:  # deleted while being queued: there is nothing left to submit
                raise dg.DagsterRunNotFoundError(f"run {run.run_id} vanished while queued", invalid_run_id=run.run_id)
            context = SubmitRunContext(tagged, context.workspace)
        return super().submit_run(context)
