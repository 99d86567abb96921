"""A run ``reminders dev`` queued and never launched is canceled when it stops, saying why."""

from __future__ import annotations

from datetime import UTC, datetime

import dagster as dg

from reminders_pipeline.dev.queued_runs import WHY, cancel_queued_runs, queued_runs_canceled_at_exit

from .test_dagster_queue import add_run


def dev_home(tmp_path):
    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    return home


def status(home, run_id):
    with dg.DagsterInstance.from_config(str(home)) as instance:
        return instance.get_run_by_id(run_id).status


def test_runs_queued_during_the_session_are_canceled_and_the_others_left_alone(tmp_path, capsys):
    home = dev_home(tmp_path)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        before = add_run(instance, "drain", dg.DagsterRunStatus.QUEUED, {})  # not this session's
    with queued_runs_canceled_at_exit({"DAGSTER_HOME": str(home)}):
        with dg.DagsterInstance.from_config(str(home)) as instance:
            queued = add_run(instance, "drain", dg.DagsterRunStatus.QUEUED, {})
            done = add_run(instance, "drain", dg.DagsterRunStatus.SUCCESS, {})

    assert status(home, queued) == dg.DagsterRunStatus.CANCELED
    assert status(home, done) == dg.DagsterRunStatus.SUCCESS
    assert status(home, before) == dg.DagsterRunStatus.QUEUED
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert any(WHY in e.message for e in instance.all_logs(queued))
    assert "canceled 1 run(s) still queued" in capsys.readouterr().err


def test_a_shared_instance_is_never_touched_and_a_failure_is_one_line(tmp_path, capsys):
    home = dev_home(tmp_path)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        since = datetime.now(UTC)
        queued = add_run(instance, "drain", dg.DagsterRunStatus.QUEUED, {})
    shared = {"DAGSTER_HOME": str(home), "DAGSTER_POSTGRES_URL": "postgresql+psycopg2://127.0.0.1/prod"}
    assert cancel_queued_runs(shared, since) == 0
    assert status(home, queued) == dg.DagsterRunStatus.QUEUED

    (home / "dagster.yaml").write_text("run_storage: [not, a, mapping]\n")
    assert cancel_queued_runs({"DAGSTER_HOME": str(home)}, since) == 0
    err = capsys.readouterr().err
    assert err.startswith("reminders dev: queued runs not checked (") and "Traceback" not in err
