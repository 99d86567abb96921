"""Fixtures: the ledger on SQLite and on a real PostgreSQL, and sources served over real HTTP.

PostgreSQL: ``REMINDERS_TEST_POSTGRES_URL`` (a server URL whose user may CREATE DATABASE) or the
machine's local server. One throwaway database per test session, emptied between tests. Under
``CI=true`` a PostgreSQL that cannot be reached fails the run instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from reminders_pipeline import migrate
from reminders_pipeline.db import Database
from reminders_pipeline.settings import Settings, normalize_database_url

from .http_sources import FeedServer
from .mock_apns import MockApns

DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
LEDGER_TABLES = "notification_queue, device_sources, sources, devices, dispatchers"


def _pg_server_url() -> str:
    return normalize_database_url(os.environ.get("REMINDERS_TEST_POSTGRES_URL") or DEFAULT_PG)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, migrated database on the PostgreSQL server, dropped at the end of the session."""
    server = _pg_server_url()
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    name = f"reminders_test_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any failure to reach PostgreSQL
        admin.dispose()
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL unavailable under CI=true: {exc}")
        pytest.skip(f"PostgreSQL unavailable: {exc}")
    url = make_url(server).set(database=name).render_as_string(hide_password=False)
    db = Database(url)
    migrate.upgrade(db)
    db.dispose()
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "ledger.sqlite3"
    db = Database(f"sqlite:///{path}")
    migrate.upgrade(db)
    with db.engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    db.dispose()
    return path


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty ledger database URL on each backend."""
    if request.param == "sqlite":
        target = tmp_path / "ledger.sqlite3"
        shutil.copy(request.getfixturevalue("sqlite_template"), target)
        return f"sqlite:///{target}"
    url = request.getfixturevalue("postgres_url")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {LEDGER_TABLES} RESTART IDENTITY CASCADE"))
    engine.dispose()
    return url


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database(db_url)
    yield database
    database.dispose()


@pytest.fixture
def settings(db_url: str) -> Settings:
    return Settings(database_url=db_url)


@pytest.fixture
def feeds() -> Iterator[FeedServer]:
    server = FeedServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockApns]:
    """A mock APNs (HTTP/2 over TLS) per test module; its key and CA are made when it starts."""
    with MockApns(workdir=tmp_path_factory.mktemp("mock-apns")) as server:
        yield server


@pytest.fixture
def fresh_mock(mock: MockApns) -> Iterator[MockApns]:
    """Each test starts with no connections, no scripts and no recorded requests."""
    mock.drop_all_connections()
    mock.wait_idle(10)  # a killed drainer's half-open connection may linger; reset() forgets it anyway
    mock.reset()
    yield mock
    mock.raised_max_streams = 1000
    mock.min_token_refresh_seconds = None


@pytest.fixture(autouse=True)
def _dispose_shared_engines() -> Iterator[None]:
    """Dagster resources keep one engine per process (``db.shared``); each test's ledger is new."""
    yield
    from reminders_pipeline.db import dispose_shared

    dispose_shared()
