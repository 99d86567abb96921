"""Apply the packaged Alembic migrations (``reminders db upgrade``), and refuse a database behind them.

Every shell (CLI, HTTP, Dagster) calls ``require_head`` before it touches the ledger: a database
at another revision fails with one line naming both revisions, instead of a traceback from the
first query that meets a missing column. The answer is cached on the ``Database`` once it is
current, so the check costs one query per engine, not per request.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Iterator

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError

from .db import Database

MIGRATIONS = Path(__file__).parent / "migrations"


class SchemaNotCurrent(RuntimeError):
    """The database is not at this release's migration head; the message is the one line to show."""


def _config(connection=None) -> Config:  # type: ignore[no-untyped-def]
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


LOCK_TIMEOUT_SECONDS = 0.2  # how long one attempt waits for a table lock: what claims queued behind it wait at most
LOCK_ATTEMPTS = 30
LOCK_BACKOFF_MAX_SECONDS = 10.0


class MigrationBlocked(RuntimeError):
    """A migration could not take its table locks within its attempts; it changed nothing."""


def upgrade(
    db: Database, revision: str = "head", *, lock_timeout: float = LOCK_TIMEOUT_SECONDS, attempts: int = LOCK_ATTEMPTS
) -> None:
    """Apply the migrations up to ``revision`` in one transaction.

    On PostgreSQL each attempt waits at most ``lock_timeout`` for a table lock (``SET LOCAL
    lock_timeout``): a migration's ALTER waits behind any open transaction on its table, and every
    claim and build would queue behind the ALTER for as long. An attempt that times out rolls back
    whole and is retried after a backoff (0.5 s doubling, at most ``LOCK_BACKOFF_MAX_SECONDS``), so
    claims run between attempts; after ``attempts`` it raises ``MigrationBlocked``."""
    for attempt in range(1, attempts + 1):
        try:
            with _migrating(db, lock_timeout) as conn:
                command.upgrade(_config(conn), revision)
            break
        except OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                raise
            if attempt == attempts:
                raise MigrationBlocked(
                    f"could not take a table lock within {lock_timeout}s in {attempts} attempts: a long-running transaction "
                    "holds one (see pg_stat_activity); the upgrade changed nothing, run it again once it ends"
                ) from None
            time.sleep(min(0.5 * 2 ** (attempt - 1), LOCK_BACKOFF_MAX_SECONDS))
    db.at_head = False  # checked again on next use


LOCK_NOT_AVAILABLE = "55P03"


@contextmanager
def _migrating(db: Database, lock_timeout: float | None = None) -> Iterator[Connection]:
    """A migration's transaction. On SQLite, foreign keys are off while it runs: SQLite alters a
    table by copying and dropping it, and with foreign keys on the drop would cascade (0002's
    rebuild of ``sources`` deleted every ``device_sources`` row). They are checked afterwards."""
    with db.engine.connect() as conn:
        sqlite = db.dialect == "sqlite"
        raw = conn.connection.dbapi_connection  # the pragma works only outside a transaction:
        if sqlite:  # on the driver connection, SQLAlchemy does not begin one first
            raw.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
        try:
            with conn.begin():
                if lock_timeout is not None and not sqlite:
                    conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(lock_timeout * 1000)}ms'")
                yield conn
                if sqlite and conn.exec_driver_sql("PRAGMA foreign_key_check").first() is not None:
                    raise RuntimeError("the migration left rows that break a foreign key; rolled back")
        finally:
            if sqlite:
                raw.execute("PRAGMA foreign_keys=ON")  # type: ignore[union-attr]


def current_revision(db: Database) -> str | None:
    with db.engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


@cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())


def head_revision() -> str | None:
    return _scripts().get_current_head()


def schema_problem(current: str | None, head: str | None) -> str | None:
    """The one line for a database at ``current`` when this release needs ``head``; None when they match."""
    if current == head:
        return None
    known = current is None or current in {s.revision for s in _scripts().walk_revisions()}
    advice = "run reminders db upgrade" if known else "it was migrated by a newer release: upgrade this package"
    return f"database at revision {current or 'none'}, this release needs {head}: {advice}"


def require_head(db: Database) -> None:
    """Raise ``SchemaNotCurrent`` unless the database is at the head; only the first success is cached,
    so a server started before the upgrade recovers as soon as it is applied."""
    if db.at_head:
        return
    problem = schema_problem(current_revision(db), head_revision())
    if problem:
        raise SchemaNotCurrent(problem)
    db.at_head = True


def downgrade(db: Database, revision: str) -> None:
    """Back to ``revision`` (tests of a migration's data path; operators use ``alembic`` directly)."""
    with _migrating(db) as conn:
        command.downgrade(_config(conn), revision)
