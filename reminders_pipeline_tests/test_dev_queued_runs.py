"""A run still queued when ``reminders dev`` stops is canceled, saying why, not left QUEUED."""

from __future__ import annotations

import dagster as dg

from reminders_pipeline.dev.queued_runs import WHY, cancel_queued_runs

from .test_dagster_queue import add_run


def test_runs_still_queued_when_dev_stops_are_canceled_and_the_others_left_alone(tmp_path, monkeypatch, capsys):
    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.delenv("DAGSTER_POSTGRES_URL", raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "elsewhere"))  # the env handed in wins
    with dg.DagsterInstance.from_config(str(home)) as instance:
        queued = add_run(instance, "drain", dg.DagsterRunStatus.QUEUED, {})
        done = add_run(instance, "drain", dg.DagsterRunStatus.SUCCESS, {})

    assert cancel_queued_runs({"DAGSTER_HOME": str(home)}) == 1

    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_run_by_id(queued).status == dg.DagsterRunStatus.CANCELED
        assert instance.get_run_by_id(done).status == dg.DagsterRunStatus.SUCCESS
        assert any(WHY in e.message for e in instance.all_logs(queued))
    assert "canceled 1 run(s) still queued" in capsys.readouterr().err
    assert cancel_queued_runs({"DAGSTER_HOME": str(home)}) == 0
