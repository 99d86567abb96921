"""The quick start: the demo source, the dev instance layout, and ``dagster dev`` started the way
``reminders dev`` starts it, in a folder that also holds the production ``dagster.yaml`` (the layout
that makes a plain ``dagster dev`` warn)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import LOOPBACK_NETWORKS, Settings
from reminders_pipeline.dev.demo import DEMO_DEVICE_ID, DEV_INSTANCE_YAML, DemoSource, dev_environment, prepare_ledger
from reminders_pipeline.devices.registration import DeviceSpec, put_device
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.planning.build import build
from reminders_pipeline_testing.stack import answers, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent


def test_dev_environment_sqlite_by_default_and_postgres_by_switch(tmp_path):
    shutil.copyfile(ROOT / "dagster.yaml", tmp_path / "dagster.yaml")
    env, settings, home = dev_environment(tmp_path, {"PATH": "/usr/bin"})
    assert home == (tmp_path / "var" / "dagster").resolve() and env["DAGSTER_HOME"] == str(home)
    assert settings.database_url == f"sqlite:///{(tmp_path / 'var' / 'reminders.sqlite3').resolve()}"
    assert env["REMINDERS_DATABASE_URL"] == settings.database_url
    assert (home / "dagster.yaml").read_text() == DEV_INSTANCE_YAML
    assert settings.source_allow_networks == LOOPBACK_NETWORKS  # the demo feed is on 127.0.0.1
    assert settings.chunk_count == 1 and env["REMINDERS_CHUNK_COUNT"] == "1"  # the asset's one partition: the demo's
    assert dev_environment(tmp_path, {"REMINDERS_CHUNK_COUNT": "4"})[1].chunk_count == 4
    env, settings, home = dev_environment(tmp_path, {"REMINDERS_SOURCE_ALLOW_NETWORKS": "10.0.0.0/8"})
    assert settings.source_allow_networks == ("10.0.0.0/8", *LOOPBACK_NETWORKS)

    pg = "postgresql://postgres@127.0.0.1:5432/dagster"
    env, settings, home = dev_environment(
        tmp_path, {"DAGSTER_POSTGRES_URL": pg, "REMINDERS_DATABASE_URL": "postgresql://x@h/db"}
    )
    assert (home / "dagster.yaml").read_text() == (ROOT / "dagster.yaml").read_text()
    assert env["DAGSTER_POSTGRES_URL"] == "postgresql+psycopg2://postgres@127.0.0.1:5432/dagster"
    assert settings.database_url == "postgresql+psycopg://x@h/db"


def test_demo_source_serves_fixed_times_and_a_build_queues_reminders(tmp_path):
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", source_allow_networks=LOOPBACK_NETWORKS
    )
    with DemoSource(0) as source:
        first = httpx.get(source.url).json()
        time.sleep(0.01)
        assert httpx.get(source.url).json() == first  # anchored: a re-read never moves an item
        prepare_ledger(settings, source.url)
        prepare_ledger(settings, source.url)  # idempotent: the next `reminders dev` re-registers
        db = Database(settings.database_url)
        other = DeviceSpec("other-phone", "ab" * 32, 3600, (), (source.url,))
        put_device(db, settings, other)  # chunk 10 of 16
        prepare_ledger(settings.with_(chunk_count=1), source.url)  # `reminders dev` on that ledger: one chunk
        with db.write() as conn:
            assert {d.id: d.chunk for d in ledger.list_devices(conn)} == {DEMO_DEVICE_ID: 0, "other-phone": 0}
            ledger.delete_device(conn, "other-phone", Instant.now())
        prepare_ledger(settings, source.url)
        summary = build(db, settings)
        with db.read() as conn:
            (device,) = ledger.list_devices(conn)
            queued = ledger.list_queue(conn, device_id=DEMO_DEVICE_ID)
        db.dispose()
    assert device.id == DEMO_DEVICE_ID and device.source_urls == (source.url,)
    assert summary.devices_built == 1 and summary.rows_inserted == len(queued) > 20
    soonest = min(r["send_after"] for r in queued if r["rule"] == "lead:3600" and r["item_id"].endswith(":standup"))
    assert soonest > queued[0]["created_at"]  # due within minutes, not already


@pytest.mark.timeout(330)
def test_dev_command_starts_dagster_dev_without_warnings_builds_the_demo_and_dispatches_on_time(tmp_path):
    shutil.copyfile(ROOT / "dagster.yaml", tmp_path / "dagster.yaml")  # the trap: a production file here
    ui = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REMINDERS_", "DAGSTER_"))}
    log_path = tmp_path / "dev.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "reminders_pipeline.dev.demo",
                "--ui-port",
                str(ui),
                "--demo-port",
                str(free_port()),
            ],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            ledger_db = Database(f"sqlite:///{tmp_path / 'var' / 'reminders.sqlite3'}")

            def demo_built() -> bool:
                try:
                    with ledger_db.read() as conn:
                        return bool(ledger.list_queue(conn, device_id=DEMO_DEVICE_ID))
                except Exception:  # noqa: BLE001 - not migrated yet
                    return False

            def standup() -> dict:
                with ledger_db.read() as conn:
                    (row,) = [
                        r
                        for r in ledger.list_queue(conn, device_id=DEMO_DEVICE_ID)
                        if r["item_id"].endswith(":standup") and r["rule"] == "lead:3600"
                    ]
                return row

            try:
                wait_for("the sensor's first build of the demo device", demo_built, 120)
                wait_for("the UI", lambda: answers(f"http://127.0.0.1:{ui}/server_info"), 30)
                # The demo's first reminder comes due about two minutes after the start: the
                # dispatcher run (started by its sensor, out of the box) settles it then, not at a tick.
                wait_for("the standup reminder settled", lambda: standup()["status"] == "settled", 150)
            except AssertionError:
                raise AssertionError(log_path.read_text(errors="replace")[-6000:]) from None
            row = standup()
            ledger_db.dispose()
            assert row["outcome"] == "disabled" and not row["claimed_by"].startswith("drain-")
            # Claimed at its send_after (the 2 s poll at most, on SQLite), not at a drain tick (15
            # minutes apart): 30 s leaves room for a loaded 2-core runner (it was 5 s).
            assert row["send_after"] <= row["claimed_at"] and row["claimed_at"].unix - row["send_after"].unix < 30
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=60)
            finally:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    output = log_path.read_text(errors="replace")
    assert code == 0, output[-3000:]
    assert "warning" not in output.lower(), [line for line in output.splitlines() if "arn" in line]
    assert "Dagster services shut down" in output
    assert (tmp_path / "var" / "dagster" / "dagster.yaml").read_text() == DEV_INSTANCE_YAML
