"""Apply the packaged Alembic migrations (``reminders db upgrade``), and refuse a database behind them.

Every shell (CLI, HTTP, Dagster) calls ``require_head`` before it touches the ledger: a database
at another revision fails with one line naming both revisions, instead of a traceback from the
first query that meets a missing column. The answer is cached on the ``Database`` once it is
current, so the check costs one query per engine, not per request.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Iterator

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

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


def upgrade(db: Database, revision: str = "head") -> None:
    with _migrating(db) as conn:
        command.upgrade(_config(conn), revision)
    db.at_head = False  # checked again on next use


@contextmanager
def _migrating(db: Database) -> Iterator[Connection]:
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
