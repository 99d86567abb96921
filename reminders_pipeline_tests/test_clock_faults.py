"""A ``reminders_built_at`` in the future is a fault in every sweep check, never an age of 0 (or less).

Every later build skips such a device (a build never writes over a newer stamp), so its reminders
stop queueing exactly as if the sweep had fallen behind.
"""

from __future__ import annotations

import dagster as dg
from click.testing import CliRunner

from reminders_pipeline import ledger
from reminders_pipeline.cli import main
from reminders_pipeline.defs.monitoring import queue_checks_schedule, sweep_status
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ops.check import check

from .support import device
from .test_dagster_support import AlertReceiver, definitions_for, resources_for


def stamp(db, device_id: str, at: Instant) -> None:
    with db.write() as conn:
        ledger.stamp_built(conn, [device_id], at)


def test_check_fails_on_a_build_in_the_future(db, settings, db_url):
    device(db, settings, "ok", sources=[])
    stamp(db, "ok", Instant.now())
    assert all(f.ok for f in check(db, settings))
    device(db, settings, "forged", sources=[])
    stamp(db, "forged", Instant.from_stored("2999-01-01T00:00:00.000Z"))
    (finding,) = [f for f in check(db, settings) if f.name == "no_build_in_the_future"]
    assert not finding.ok and finding.detail.startswith("1 device(s) have reminders_built_at later than now")
    result = CliRunner().invoke(main, ["check"], env={"REMINDERS_DATABASE_URL": db_url})
    assert result.exit_code == 1 and "FAIL no_build_in_the_future" in result.stdout


def test_sweep_status_is_breached_and_has_no_age_when_the_oldest_build_is_in_the_future(db, settings):
    device(db, settings, "forged", sources=[])
    stamp(db, "forged", Instant.from_stored("2999-01-01T00:00:00.000Z"))
    status = sweep_status(db, settings, Instant.now())
    assert status.age_seconds is None  # not a negative age, not 0
    assert status.built_in_future == 1 and status.breached
    assert status.fields()["devices_built_in_future"] == 1
    assert "later than now" in status.describe()


def test_the_sweep_check_fails_and_alerts_on_a_build_in_the_future(db, settings, db_url):
    device(db, settings, "fresh", sources=[])
    stamp(db, "fresh", (Instant.now() - 60))
    device(db, settings, "forged", sources=[])
    stamp(db, "forged", (Instant.now() + 86400))
    with AlertReceiver() as receiver, dg.instance_for_test() as instance:
        defs = definitions_for(resources_for(db_url, webhook=receiver.url))
        job = defs.resolve_job_def(queue_checks_schedule.job_name)
        result = job.execute_in_process(instance=instance)
        evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
        sweep = evaluations["sweep_period_invariant"]
        assert not sweep.passed
        assert sweep.metadata["devices_built_in_future"].value == 1
        assert 55 <= sweep.metadata["oldest_build_age_seconds"].value < 120
        assert receiver.titles() == ["[reminders] check sweep_period_invariant failed"]
