"""The run queue: every run kind tagged and limited, the limits inside ``max_concurrent_runs``, the
dispatcher's successor dequeued first. Dagster's own queue daemon (``QueuedRunCoordinatorDaemon``)
runs one pass over an instance made from the repository's ``dagster.yaml``; its launcher records
the runs handed to it instead of launching them."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.instance.config import dagster_instance_config
from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteRepositoryOrigin
from dagster._core.run_coordinator import SubmitRunContext
from dagster._core.test_utils import create_run_for_test, create_test_daemon_workspace_context, instance_for_test
from dagster._core.workspace.load_target import EmptyWorkspaceTarget
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

from reminders_pipeline.definitions import defs
from reminders_pipeline.defs.build import builds_in_flight, notification_queue
from reminders_pipeline.defs.dispatch import dispatch_check_job, dispatcher_job
from reminders_pipeline.defs.run_queue import (
    BUILD_ASSET,
    KINDS,
    MAX_RUNTIME_TAG,
    PRIORITY_TAG,
    RUN_KIND_TAG,
    TaggingRunCoordinator,
)
from reminders_pipeline.dev.demo import DEV_INSTANCE_YAML

ROOT = Path(__file__).resolve().parent.parent
REPO = RemoteRepositoryOrigin(
    code_location_origin=RegisteredCodeLocationOrigin(location_name="reminders"), repository_name="__repository__"
)


def instance_files(tmp_path: Path) -> dict[str, dict]:
    (tmp_path / "dagster.yaml").write_text(DEV_INSTANCE_YAML)
    homes = {"production": ROOT, "k8s": ROOT / "deploy" / "k8s", "celery": ROOT / "deploy" / "celery", "dev": tmp_path}
    return {name: dagster_instance_config(str(home))[0] for name, home in homes.items()}


def kind_limits(config: dict) -> dict[str, int]:
    limits = config["concurrency"]["runs"]["tag_concurrency_limits"]
    assert all(limit["key"] == RUN_KIND_TAG for limit in limits), "a limit on another tag would count a run twice"
    return {limit["value"]: limit["limit"] for limit in limits}


def test_every_instance_file_limits_every_kind_within_its_run_slots(tmp_path):
    """A run of a kind with no limit, or limits adding up past ``max_concurrent_runs``, can take
    the dispatcher's slot (8648d3c: 4 + 2 + 2 + 4 = 12 against 10, checks unlimited)."""
    kinds = run_kinds()
    for name, config in instance_files(tmp_path).items():
        limits = kind_limits(config)
        assert set(limits) == kinds, name
        assert sum(limits.values()) <= config["concurrency"]["runs"]["max_concurrent_runs"], name
        assert limits["dispatch"] == 2, name  # one in flight, two during a handover
        assert config["run_coordinator"] == {
            "module": "reminders_pipeline.defs.run_queue",
            "class": "TaggingRunCoordinator",
        }, name
        assert config["run_monitoring"]["enabled"] and config["run_monitoring"]["max_runtime_seconds"] > 0, name


def run_kinds() -> set[str]:
    """Every kind a run can have: each job's, each schedule's, and the coordinator's own."""
    repo = defs().get_repository_def()
    tagged = [job.tags for job in repo.get_all_jobs() if not job.name.startswith("__")]
    tagged += [schedule.tags for schedule in repo.schedule_defs if schedule.job_name.startswith("__")]
    for tags in tagged:
        assert RUN_KIND_TAG in tags and int(tags[MAX_RUNTIME_TAG]) > 0, tags
    kinds = {tags[RUN_KIND_TAG] for tags in tagged} | {"build", "check", "other"}
    assert kinds == set(KINDS)
    return kinds


@pytest.fixture
def queue():
    """(instance, workspace context, daemon) with the production dagster.yaml's coordinator and limits."""
    production = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    overrides = {
        "run_coordinator": production["run_coordinator"],
        "concurrency": production["concurrency"],
        "run_launcher": {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"},
    }
    with instance_for_test(overrides=overrides) as instance:
        with create_test_daemon_workspace_context(EmptyWorkspaceTarget(), instance) as context:
            yield instance, context, QueuedRunCoordinatorDaemon(interval_seconds=5)


def add_run(instance, job_name: str, status: dg.DagsterRunStatus, tags: dict[str, str], **kwargs) -> str:
    run = create_run_for_test(
        instance, job_name=job_name, status=status, tags=tags, remote_job_origin=REPO.get_job_origin(job_name), **kwargs
    )
    return run.run_id


def queued(instance, job_name: str, tags: dict[str, str], **kwargs) -> str:
    """A run submitted as the webserver, a schedule or a sensor submits one: through the coordinator."""
    run_id = add_run(instance, job_name, dg.DagsterRunStatus.NOT_STARTED, tags, **kwargs)
    instance.run_coordinator.submit_run(SubmitRunContext(instance.get_run_by_id(run_id), workspace=None))
    return run_id


def dequeue_once(instance, context, daemon) -> list[str]:
    before = len(instance.run_launcher.queue())
    list(daemon.run_iteration(context))
    return [run.run_id for run in instance.run_launcher.queue()[before:]]


def fill(instance) -> list[str]:
    """10 runs in progress, every kind at its limit (the dispatcher's two during a handover)."""
    limits = kind_limits(yaml.safe_load((ROOT / "dagster.yaml").read_text()))
    return [
        add_run(instance, f"{kind}_job", dg.DagsterRunStatus.STARTED, {RUN_KIND_TAG: kind})
        for kind, n in limits.items()
        for _ in range(n)
    ]


def test_the_dispatchers_successor_is_dequeued_first_with_ten_runs_in_flight(queue):
    """The issue's bar: 10 runs in flight, an older check and a UI build queued, then the
    dispatcher's successor. The current dispatcher ends: its slot goes to the successor, not to
    the older runs (8648d3c gave it to the check, and no dispatcher was left running)."""
    instance, context, daemon = queue
    running = fill(instance)
    assert len(running) == 10
    check = queued(instance, dispatch_check_job.name, dict(dispatch_check_job.tags))
    ui_build = queued(instance, "__ASSET_JOB", {"dagster/from_ui": "true"}, asset_selection=frozenset({BUILD_ASSET}))
    successor = queued(instance, dispatcher_job.name, dict(dispatcher_job.tags))
    assert dequeue_once(instance, context, daemon) == []  # full: nothing moves
    instance.report_run_failed(instance.get_run_by_id(running[-1]))  # the current dispatcher ends
    assert dequeue_once(instance, context, daemon) == [successor]
    assert {instance.get_run_by_id(r).status for r in (check, ui_build)} == {dg.DagsterRunStatus.QUEUED}


def test_the_successor_goes_first_when_runs_from_outside_the_queue_take_slots(queue):
    """A run started outside the queue (``dagster asset materialize`` in a terminal) takes a slot
    but no kind's: then two older runs whose kinds have room could take the last two slots. The
    dispatcher's ``dagster/priority`` puts its successor first."""
    instance, context, daemon = queue
    for kind, n in (("build", 4), ("drain", 2), ("dispatch", 1)):
        for _ in range(n):
            add_run(instance, f"{kind}_job", dg.DagsterRunStatus.STARTED, {RUN_KIND_TAG: kind})
    add_run(instance, "__ASSET_JOB", dg.DagsterRunStatus.STARTED, {})  # 8 in progress: 2 slots left
    check = queued(instance, dispatch_check_job.name, dict(dispatch_check_job.tags))
    queued(instance, "__ASSET_JOB", {"dagster/from_ui": "true"})  # an "other" run
    successor = queued(instance, dispatcher_job.name, dict(dispatcher_job.tags))
    assert dequeue_once(instance, context, daemon) == [successor, check]


def test_a_build_from_the_ui_is_tagged_limited_and_seen_by_the_in_flight_guard(queue):
    """A materialization or backfill from the asset's page runs as ``__ASSET_JOB`` with none of our
    tags (8648d3c: no limit, no max_runtime, the schedule built the same chunks beside it)."""
    instance, context, daemon = queue
    assert notification_queue.key == BUILD_ASSET
    assert builds_in_flight(instance) == 0
    ui = [
        queued(instance, "__ASSET_JOB", {"dagster/from_ui": "true"}, asset_selection=frozenset({BUILD_ASSET}))
        for _ in range(5)
    ]
    tags = instance.get_run_by_id(ui[0]).tags
    assert tags[RUN_KIND_TAG] == "build" and int(tags[MAX_RUNTIME_TAG]) == 3600 and tags["dagster/from_ui"] == "true"
    assert builds_in_flight(instance) == 1
    check_only = queued(
        instance, "__ASSET_JOB", {}, asset_check_selection=frozenset({dg.AssetCheckKey(BUILD_ASSET, "drain_backlog")})
    )
    assert instance.get_run_by_id(check_only).tags[RUN_KIND_TAG] == "check"
    started = dequeue_once(instance, context, daemon)
    assert sorted(started) == sorted(ui[:4] + [check_only])  # builds at their limit of 4; the check beside them


def test_a_run_with_its_kind_keeps_its_tags():
    from reminders_pipeline.defs.run_queue import tags_for

    run = dg.DagsterRun(job_name="drain_job", tags={RUN_KIND_TAG: "drain", MAX_RUNTIME_TAG: "1800"})
    assert tags_for(run) == {}
    assert tags_for(dg.DagsterRun(job_name="__ASSET_JOB", tags={MAX_RUNTIME_TAG: "60"})) == {RUN_KIND_TAG: "other"}
    assert (
        tags_for(dg.DagsterRun(job_name="__ASSET_JOB", tags={RUN_KIND_TAG: "x"}))[RUN_KIND_TAG] == "other"
    )  # no limit names "x"
    assert issubclass(TaggingRunCoordinator, dg.QueuedRunCoordinator)
    assert int(dispatcher_job.tags[PRIORITY_TAG]) > 0
