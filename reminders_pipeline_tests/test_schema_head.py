"""A database not at this release's migration head: every command and route stops with one line.

Tried as a new user would: ``reminders queue list`` before ``reminders db upgrade``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import make_url

from reminders_pipeline.cli import main
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database

from .support import TOKEN
from .test_dagster_support import definitions_for, resources_for
from .test_http_support import error_of, http_settings

OLD = "0002"


@pytest.fixture(params=["sqlite", "postgresql"])
def blank_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database nobody has migrated: a new SQLite file, or a new database on the test PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'blank.sqlite3'}"
        return
    server = request.getfixturevalue("postgres_url")
    name = f"reminders_old_{uuid.uuid4().hex[:10]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield make_url(server).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def old_url(blank_url: str) -> str:
    """A database an earlier release migrated (revision 0002)."""
    db = Database(blank_url)
    migrate.upgrade(db, OLD)
    db.dispose()
    return blank_url


def blank(url: str) -> str:
    """The line for a database nobody migrated: SQLite's file is not there (and is not made)."""
    if url.startswith("sqlite"):
        return f"no ledger at {make_url(url).database}: run reminders db upgrade"
    return needs(None)


def needs(current: str | None) -> str:
    return f"database at revision {current or 'none'}, this release needs {migrate.head_revision()}: run reminders db upgrade"


COMMANDS = [
    ["queue", "list"],
    ["device", "list"],
    ["device", "put", "p", "--apns-token", TOKEN],
    ["device", "remove", "p"],
    ["device", "rechunk"],
    ["sources"],
    ["build", "--all"],
    ["drain"],
    ["prune"],
    ["check"],
]


def run(url: str, *args: str):
    env = {"REMINDERS_DATABASE_URL": url, "REMINDERS_ENABLED": "false"}
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_command_on_a_blank_database_stops_with_one_line(blank_url, args):
    result = run(blank_url, *args)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == f"Error: {blank(blank_url)}\n"


def test_a_database_behind_names_both_revisions_and_upgrade_fixes_it(old_url):
    result = run(old_url, "queue", "list")
    assert (result.exit_code, result.stderr) == (1, f"Error: {needs(OLD)}\n")
    upgraded = run(old_url, "db", "upgrade")
    assert upgraded.exit_code == 0 and json.loads(upgraded.stdout)["revision"] == migrate.head_revision()
    assert json.loads(run(old_url, "queue", "list").stdout) == []


def _as_if_a_newer_release_upgraded(db_url: str, oldest_head: str) -> None:
    """The ledger as a release with a revision 9999 leaves it, saying which head may still run."""
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
        conn.execute(text("UPDATE schema_readers SET oldest_head = :h"), {"h": oldest_head})
    engine.dispose()


def _back_to_this_release(db_url: str) -> None:
    head = migrate.head_revision()
    assert head is not None
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": head})
        conn.execute(text("UPDATE schema_readers SET oldest_head = :h"), {"h": migrate.oldest_reader(head)})
    engine.dispose()


def test_a_database_from_a_newer_release_says_so(db_url):
    """A newer release whose migrations since this one's head were not all additive: refused."""
    _as_if_a_newer_release_upgraded(db_url, "9999")
    try:
        result = run(db_url, "device", "list")
        assert result.exit_code == 1
        assert result.stderr == (
            f"Error: database at revision 9999, this release needs {migrate.head_revision()}: "
            "it was migrated by a newer release: upgrade this package\n"
        )
    finally:
        _back_to_this_release(db_url)


def test_a_newer_release_that_only_added_to_the_schema_leaves_this_one_running(db_url, caplog):
    """Issue 38 (18): a newer release whose migrations since this release's head are additive
    records this head in ``schema_readers``: this release (a dispatcher still running during a
    rolling upgrade, or the code rolled back) keeps using the ledger instead of refusing it."""
    head = migrate.head_revision()
    assert head is not None
    _as_if_a_newer_release_upgraded(db_url, head)
    try:
        with caplog.at_level(logging.WARNING, logger="reminders_pipeline.ledger.migrate"):
            result = run(db_url, "device", "list")
        assert (result.exit_code, json.loads(result.stdout)) == (0, []), result.stderr
        assert any("from a newer release that may run with" in m for m in caplog.messages)
    finally:
        _back_to_this_release(db_url)


def test_each_upgrade_records_the_oldest_head_that_may_run_on(db_url):
    """0020 only adds a table, so a release at 0019 may run against it (were it to look); 0021
    renames a column, so no release before it may."""
    assert migrate.oldest_reader("0020") == "0019"
    engine = create_engine(db_url)
    with engine.connect() as conn:
        assert conn.scalar(text("SELECT oldest_head FROM schema_readers")) == migrate.oldest_reader("0021") == "0021"
    engine.dispose()


def test_routes_answer_503_with_the_line_and_recover_after_the_upgrade(serve, old_url, caplog):
    db = Database(old_url)
    try:
        with caplog.at_level(logging.WARNING, logger="reminders_pipeline.http.app"):
            s = serve(http_settings(Settings(database_url=old_url)), database=db)
        assert f"{needs(OLD)}; every route but /metrics and /openapi.json answers 503 until then" in caplog.messages
        for response in (
            s.api.get("/v1/devices/p"),
            s.api.post("/internal/reminders/drain"),
            s.api.post("/internal/reminders/build"),
        ):
            assert response.status_code == 503
            assert error_of(response) == {"error": "schema_not_current", "detail": needs(OLD)}
        health = s.anon.get("/healthz")
        assert health.status_code == 503 and health.json()["detail"] == needs(OLD)
        metrics = s.anon.get("/metrics")
        assert metrics.status_code == 200
        assert "reminders_ledger_up 0.0" in metrics.text and "reminders_schema_at_head 0.0" in metrics.text
        assert s.anon.get("/v1/devices/p").status_code == 401  # credentials are still checked first

        migrate.upgrade(db)  # no restart needed
        assert s.api.get("/v1/devices/p").status_code == 404
        assert s.anon.get("/healthz").status_code == 200
    finally:
        db.dispose()


def test_the_head_is_checked_once_per_engine_not_per_request(serve, settings, db):
    versions: list[str] = []

    @event.listens_for(db.engine, "before_cursor_execute")
    def spy(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        if "FROM alembic_version" in statement:
            versions.append(statement)

    s = serve(http_settings(settings), database=db)
    for _ in range(3):
        assert s.api.get("/v1/devices/p").status_code == 404
        assert s.anon.get("/healthz").status_code == 200
        assert s.anon.get("/metrics").status_code == 200
    assert len(versions) == 1


def test_dagster_ops_fail_with_the_line(old_url):
    with dg.instance_for_test() as instance:
        result = (
            definitions_for(resources_for(old_url))
            .resolve_job_def("drain_job")
            .execute_in_process(instance=instance, raise_on_error=False)
        )
    assert not result.success
    (failure,) = result.get_step_failure_events()
    error = failure.step_failure_data.error
    assert error.message.strip().endswith(needs(OLD))
    assert "sqlalchemy" not in error.message.lower()


def test_a_device_route_on_a_missing_sqlite_ledger_answers_503_and_makes_no_file(serve, tmp_path):
    """A device's own route reads its credential from the ledger: the schema is checked first, so
    a server pointed at a SQLite file nobody created answers 503 with the line and creates nothing."""
    target = tmp_path / "never-made" / "ledger.sqlite3"
    url = f"sqlite:///{target}"
    db = Database(url)
    try:
        s = serve(http_settings(Settings(database_url=url)), database=db)
        response = s.anon.get("/v1/devices/phone-1/feed", headers={"Authorization": "Bearer whatever"})
        assert response.status_code == 503
        assert error_of(response) == {"error": "schema_not_current", "detail": blank(url)}
        assert not target.parent.exists()
    finally:
        db.dispose()


def upgrade_soon(url: str) -> subprocess.Popen[bytes]:
    """Another process (as an operator's upgrade is) upgrades the ledger at ``url`` in a second."""
    code = (
        "import sys, time; time.sleep(1); from reminders_pipeline.ledger import migrate; "
        "from reminders_pipeline.ledger.db import Database; migrate.upgrade(Database(sys.argv[1]))"
    )
    return subprocess.Popen([sys.executable, "-c", code, url])


def test_a_long_lived_process_waits_for_the_ledger_an_upgrade_brings_to_its_head(old_url, caplog):
    """Issue 38 (18): a dispatcher successor that starts while its ledger is behind (an upgrade
    under way) waits, saying so once, and starts as soon as the upgrade lands, instead of failing
    into the sensor's backoff of up to 15 minutes without a dispatcher."""
    import asyncio
    import time

    db = Database(old_url)
    upgrader = upgrade_soon(old_url)
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="reminders_pipeline.ledger.migrate"):
            asyncio.run(migrate.wait_for_head(db, time.monotonic() + 60, every=0.2))
    finally:
        assert upgrader.wait(60) == 0
        db.dispose()
    assert time.monotonic() - started < 30
    waits = [r.getMessage() for r in caplog.records if "waiting for the ledger" in r.getMessage()]
    assert len(waits) == 1 and OLD in waits[0], waits
    assert any("the ledger is ready" in r.getMessage() for r in caplog.records)


def test_a_wait_for_a_ledger_away_gives_up_with_its_reason_at_its_bound(tmp_path):
    """A ledger that never answers (nothing listens on the port) ends the wait at its bound with
    the database's own error; a stop asked for ends it at once."""
    import asyncio
    import time

    from sqlalchemy.exc import OperationalError

    db = Database("postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=1")
    try:
        with pytest.raises(OperationalError):
            asyncio.run(migrate.wait_for_head(db, time.monotonic() + 1.5, every=0.2))

        async def stopped(_: float) -> bool:
            return True

        with pytest.raises(migrate.SchemaNotCurrent, match="stopped while waiting"):
            asyncio.run(migrate.wait_for_head(db, time.monotonic() + 60, stopped, every=0.2))
    finally:
        db.dispose()


def test_a_dispatcher_run_started_behind_an_upgrade_waits_and_then_dispatches(old_url):
    """The Dagster dispatcher op on a ledger an upgrade has not reached yet waits for it and then
    runs to its planned end, green: no failed run, so no sensor backoff. (Before: it failed at
    once with the schema line, and the sensor waited 30 s, then up to 15 minutes, to try again.)"""
    upgrader = upgrade_soon(old_url)
    try:
        with dg.instance_for_test() as instance:
            result = (
                definitions_for(resources_for(old_url))
                .resolve_job_def("dispatcher")
                .execute_in_process(
                    instance=instance,
                    run_config={"ops": {"dispatch": {"config": {"run_seconds": 15}}}},
                    raise_on_error=False,
                )
            )
    finally:
        assert upgrader.wait(60) == 0
    assert result.success, [e.step_failure_data.error.message for e in result.get_step_failure_events()]
