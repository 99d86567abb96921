"""One engine per process, its pool sized by a setting, and PostgreSQL's statement_timeout."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.defs.resources import LedgerResource
from reminders_pipeline.http import create_app
from reminders_pipeline.ledger import db as db_module
from reminders_pipeline.ledger.db import Database
from reminders_pipeline_testing.stack import free_port

from .test_dagster_support import definitions_for, resources_for
from .test_http_support import error_of, http_settings


def test_the_settings_are_read_from_the_environment():
    s = Settings.from_env(
        {
            "REMINDERS_DB_POOL_SIZE": "3",
            "REMINDERS_DB_STATEMENT_TIMEOUT_MS": "250",
            "REMINDERS_METRICS_WINDOW_SECONDS": "600",
        }
    )
    assert (s.db_pool_size, s.db_statement_timeout_ms, s.metrics_window_seconds) == (3, 250, 600)
    defaults = Settings.from_env({})
    assert (defaults.db_pool_size, defaults.db_statement_timeout_ms, defaults.metrics_window_seconds) == (
        10,
        60_000,
        900,
    )


def test_ledger_resource_keeps_one_engine_across_ops_and_ticks(db_url):
    resource = LedgerResource(database_url=db_url)
    with resource.open() as first:
        with first.read() as conn:
            conn.exec_driver_sql("SELECT 1")
    with resource.open() as second:
        pass
    assert second is first
    assert first.engine.pool.checkedin() == 1  # the connection stayed pooled: nothing was disposed


def test_a_dagster_run_makes_one_engine(db_url, monkeypatch):
    made: list[str] = []
    real = db_module.make_engine

    def counting(url: str, **kwargs):  # type: ignore[no-untyped-def]
        made.append(url)
        return real(url, **kwargs)

    monkeypatch.setattr(db_module, "make_engine", counting)
    defs = definitions_for(resources_for(db_url))
    with dg.instance_for_test() as instance:
        for _ in range(2):  # fail_abandoned, find_due, summarize; twice
            assert defs.resolve_job_def("drain_job").execute_in_process(instance=instance).success
        with dg.build_sensor_context(instance=instance, resources=resources_for(db_url)) as context:
            from reminders_pipeline.defs.monitoring import sweep_period_sensor

            sweep_period_sensor.evaluate_tick(context)
    assert made == [db_url]


def test_the_pool_size_comes_from_the_setting(db_url):
    settings = Settings(database_url=db_url, db_pool_size=3)
    database = Database.for_settings(settings)
    try:
        assert database.engine.pool.size() == 3
        assert database.engine.pool._max_overflow == 3  # noqa: SLF001 - no public reader for the overflow
    finally:
        database.dispose()
    app = create_app(settings)
    try:
        assert app.state.api.db.engine.pool.size() == 3
    finally:
        app.state.api.db.dispose()


def test_statement_timeout_on_postgresql(db_url):
    database = Database.for_settings(Settings(database_url=db_url, db_statement_timeout_ms=200))
    try:
        with database.read() as conn:
            if database.dialect != "postgresql":  # SQLite has no statement timeout; the setting is ignored
                assert conn.exec_driver_sql("SELECT 1").scalar() == 1
                return
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "200ms"
        with pytest.raises(OperationalError, match="statement timeout"):
            with database.read() as conn:
                conn.exec_driver_sql("SELECT pg_sleep(2)")
    finally:
        database.dispose()
    unbounded = Database.for_settings(Settings(database_url=db_url, db_statement_timeout_ms=0))
    try:
        with unbounded.read() as conn:
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "0"
    finally:
        unbounded.dispose()


def test_an_unreachable_database_answers_503_not_500(serve, db_url, tmp_path: Path):
    if db_url.startswith("sqlite"):
        (tmp_path / "dir").mkdir()
        url = f"sqlite:///{tmp_path / 'dir'}"  # a directory: SQLite cannot open it
    else:  # a port nothing listens on: no server at all, whichever PostgreSQL the session uses
        url = make_url(db_url).set(host="127.0.0.1", port=free_port(), query={}).render_as_string(hide_password=False)
    database = Database(url)
    try:
        s = serve(http_settings(Settings(database_url=url)), database=database)
        response = s.api.get("/v1/devices/p")
        assert response.status_code == 503
        assert error_of(response)["error"] == "database_unavailable"
    finally:
        database.dispose()


def test_a_lost_listen_connection_logs_once_while_it_stays_lost(caplog, monkeypatch):
    """The dispatcher's LISTEN connection retrying against a server that is down logs one line,
    not one per attempt (a 2-minute PostgreSQL outage logged 40), and the event is set on every
    attempt so the listener keeps polling."""
    import asyncio
    import logging

    monkeypatch.setattr(db_module, "LISTEN_RETRY_SECONDS", (0.05,))
    port = free_port()  # nothing listens on it
    wakes = 0

    async def run() -> None:
        nonlocal wakes
        async with Database(f"postgresql+psycopg://postgres@127.0.0.1:{port}/none").notifications(
            "reminders_due"
        ) as heard:
            assert heard is not None
            for _ in range(10):
                await asyncio.wait_for(heard.wait(), 5)
                heard.clear()
                wakes += 1

    with caplog.at_level(logging.INFO, logger="reminders_pipeline.ledger.db"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.name == "reminders_pipeline.ledger.db"]
    assert wakes == 10
    assert len(lines) == 1 and "LISTEN reminders_due" in lines[0] and "failed" in lines[0], lines


def _hold_write_lock(path: Path, pauses: list[float]) -> threading.Thread:
    """Another process's writer, as a thread with its own connection: holds the write lock for
    each pause in turn, with a 2 ms gap between (a build's next transaction)."""
    ready = threading.Event()

    def run() -> None:
        other = sqlite3.connect(path, isolation_level=None)
        for n, pause in enumerate(pauses):
            other.execute("BEGIN IMMEDIATE")
            if n == 0:
                ready.set()
            time.sleep(pause)
            other.execute("COMMIT")
            time.sleep(0.002)
        other.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(5)
    return thread


def test_a_sqlite_writer_takes_the_lock_in_the_first_gap_between_another_writers_transactions(tmp_path: Path):
    """SQLite's own busy handler tries once per 100 ms after its first second, so it meets a 2 ms
    gap between 40 ms transactions by luck alone; the write lock is taken in the first one."""
    db = Database(f"sqlite:///{tmp_path / 'l.sqlite3'}")
    with db.write() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    holder = _hold_write_lock(tmp_path / "l.sqlite3", [0.04] * 50)  # 2 s of back-to-back writes
    started = time.monotonic()
    with db.write() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    waited = time.monotonic() - started
    holder.join(10)
    db.dispose()
    assert waited < 0.5, f"waited {waited:.3f}s for a gap in 40 ms transactions"


def test_a_sqlite_writer_gives_up_after_the_busy_timeout_with_sqlalchemys_error_around_sqlites(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Through ``Database.write()``: the error callers catch to keep settlements or answer 503 is
    SQLAlchemy's ``OperationalError``, with SQLite's "database is locked" inside; the connection's
    own busy timeout is as it was."""
    path = tmp_path / "l.sqlite3"
    db = Database(f"sqlite:///{path}")
    with db.write() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    monkeypatch.setattr(db_module, "SQLITE_BUSY_TIMEOUT_MS", 200)
    holder = _hold_write_lock(path, [1.0])
    started = time.monotonic()
    with pytest.raises(OperationalError, match="locked") as raised:
        with db.write() as conn:
            conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    assert isinstance(raised.value.orig, sqlite3.OperationalError)
    assert 0.2 <= time.monotonic() - started < 0.9
    holder.join(5)
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
    with db.write() as conn:
        conn.exec_driver_sql("INSERT INTO t VALUES (2)")
    db.dispose()


def test_take_write_lock_leaves_the_connections_busy_timeout_as_it_found_it(tmp_path: Path):
    path = tmp_path / "l.sqlite3"
    sqlite3.connect(path).close()
    holder = _hold_write_lock(path, [0.5])
    mine = sqlite3.connect(path, isolation_level=None)
    mine.execute("PRAGMA busy_timeout=5000")
    with pytest.raises(OperationalError):
        db_module.take_write_lock(mine, timeout_ms=50)
    assert mine.execute("PRAGMA busy_timeout").fetchone() == (5000,)
    holder.join(5)
    db_module.take_write_lock(mine)
    mine.execute("ROLLBACK")
    mine.close()
