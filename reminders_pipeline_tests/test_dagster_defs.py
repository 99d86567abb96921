"""All definitions load, ``dagster definitions validate``, ``dg list defs`` and ``dg check defs`` pass, and both
instance files are valid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
from dagster._core.instance.config import dagster_instance_config

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.definitions import defs
from reminders_pipeline.dev.demo import DEV_INSTANCE_YAML

ROOT = Path(__file__).resolve().parent.parent


def test_all_definitions_load():
    loaded = defs()
    repo = loaded.get_repository_def()
    assert {"build_notification_queue", "drain_job", "dispatcher", "dispatch_on_time_check"} <= set(repo.job_names)
    assert {s.name for s in repo.schedule_defs} == {"build_schedule", "drain_schedule", "queue_checks_schedule"}
    assert {s.name for s in repo.sensor_defs} == {
        "sweep_period_sensor",
        "run_failure_alert",
        "dispatcher_sensor",
        "dispatch_on_time_sensor",
    }
    assert set(loaded.resources or {}) == {"ledger", "sender", "sources", "alerting"}
    queue = repo.assets_defs_by_key[dg.AssetKey("notification_queue")]
    assert queue.partitions_def.get_partition_keys() == [f"{c:03d}" for c in range(Settings().chunk_count)]
    checks = {key.name for key in repo.asset_graph.asset_check_keys}
    assert checks == {"sweep_period_invariant", "drain_backlog", "dispatch_on_time"}


def test_schedules_run_on_the_crons_reminders_check_reads():
    """``reminders check`` derives both cadences from these same Settings fields."""
    repo = defs().get_repository_def()
    settings = Settings.from_env()
    assert repo.get_schedule_def("build_schedule").cron_schedule == settings.build_cron
    assert repo.get_schedule_def("drain_schedule").cron_schedule == settings.drain_cron
    assert all(s.execution_timezone == "UTC" for s in repo.schedule_defs)


LOADED_CRONS = """
import json
from reminders_pipeline.definitions import defs
repo = defs().get_repository_def()
print(json.dumps({name: repo.get_schedule_def(name).cron_schedule for name in ("drain_schedule", "queue_checks_schedule")}))
"""


def loaded_crons(**env: str) -> dict:
    """The schedules' crons as a fresh code location loads them (settings are read at import)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("REMINDERS_")}
    done = subprocess.run(
        [sys.executable, "-c", LOADED_CRONS], env={**environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_check_schedule_follows_reminders_drain_cron_five_minutes_behind():
    """Before, the check schedule was hard-coded to "10,25,40,55 * * * *" whatever the drain cron."""
    assert loaded_crons()["queue_checks_schedule"] == "10,25,40,55 * * * *"  # the default drain cron's
    moved = loaded_crons(REMINDERS_DRAIN_CRON="7,37 * * * *")
    assert moved == {"drain_schedule": "7,37 * * * *", "queue_checks_schedule": "12,42 * * * *"}
    hourly = loaded_crons(REMINDERS_DRAIN_CRON="0,58 */6 * * *")  # 05:58 + 5 min is 06:03: two hour sets
    assert hourly["queue_checks_schedule"] == ["5 0,6,12,18 * * *", "3 1,7,13,19 * * *"]


def test_dagster_definitions_validate_on_the_workspace(tmp_path):
    (tmp_path / "dagster.yaml").write_text("")  # not the repository's production instance file
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path)}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-w", str(ROOT / "workspace.yaml")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Validation successful for code location reminders_pipeline" in done.stderr + done.stdout


EXECUTORS = """
import json
from reminders_pipeline.definitions import defs
from reminders_pipeline.domain.times import Instant
print(json.dumps({job.name: job.executor_def.name for job in defs().get_repository_def().get_all_jobs()}))
"""


def test_one_executor_setting_reaches_every_job_but_the_dispatchers():
    """REMINDERS_DAGSTER_EXECUTOR is read once, in definitions.py; the dispatcher's two jobs pin in-process."""
    env = {**os.environ, "REMINDERS_DAGSTER_EXECUTOR": "multiprocess"}
    done = subprocess.run(
        [sys.executable, "-c", EXECUTORS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    executors = json.loads(done.stdout.splitlines()[-1])
    pinned = {"dispatcher", "dispatch_on_time_check"}
    assert {executors[name] for name in pinned} == {"in_process"}
    others = {name: executor for name, executor in executors.items() if name not in pinned}
    assert {"__ASSET_JOB", "build_notification_queue", "drain_job"} <= set(others)  # UI materializations too
    assert set(others.values()) == {"multiprocess"}


def run_dg(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``dg ARGS`` as a developer runs it: in the repository root, the venv's bin first on PATH.

    DAGSTER_HOME is a throwaway instance: without one, Dagster would read the root dagster.yaml
    (PostgreSQL from DAGSTER_POSTGRES_URL). VIRTUAL_ENV names the running venv, which dg compares
    with a ``.venv`` in the root.
    """
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
        "VIRTUAL_ENV": sys.prefix,
        "DAGSTER_HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(["dg", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_dg_list_defs_lists_every_definition(tmp_path):
    done = run_dg(tmp_path, "list", "defs", "--json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    listed = json.loads(done.stdout)
    repo = defs().get_repository_def()
    expected = {
        "assets": {key.to_user_string() for key in repo.asset_graph.get_all_asset_keys()},
        "asset_checks": {key.to_user_string() for key in repo.asset_graph.asset_check_keys},
        "jobs": {name for name in repo.job_names if not name.startswith("__")},  # not Dagster's implicit ones
        "schedules": {s.name for s in repo.schedule_defs},
        "sensors": {s.name for s in repo.sensor_defs},
    }
    assert all(expected.values()), expected
    field = {"assets": "asset_key", "asset_checks": "key"}
    assert {kind: {d[field.get(kind, "name")] for d in listed[kind]} for kind in expected} == expected


def test_dg_check_defs_passes(tmp_path):
    done = run_dg(tmp_path, "check", "defs")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "All definitions loaded successfully." in done.stdout


def test_production_and_dev_instance_files_are_valid_instance_config(tmp_path):
    prod, _ = dagster_instance_config(str(ROOT))  # validated against the instance schema; env kept unresolved
    assert prod["storage"]["postgres"]["postgres_url"] == {"env": "DAGSTER_POSTGRES_URL"}
    limits = {
        (lim["key"], lim.get("value")): lim["limit"] for lim in prod["concurrency"]["runs"]["tag_concurrency_limits"]
    }
    assert limits[("reminders/kind", "build")] > limits[("reminders/kind", "drain")]
    # The dispatcher's own slots (one run in flight, two during a handover); test_dagster_queue checks the sum.
    assert limits[("reminders/kind", "dispatch")] == 2 and prod["concurrency"]["runs"]["max_concurrent_runs"] == 10
    assert prod["run_monitoring"]["enabled"] and prod["retention"]["sensor"]["purge_after_days"]["skipped"] == 7

    (tmp_path / "dagster.yaml").write_text(DEV_INSTANCE_YAML)
    dev, _ = dagster_instance_config(str(tmp_path))
    assert "storage" not in dev  # SQLite under DAGSTER_HOME
