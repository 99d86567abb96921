"""Apply the packaged Alembic migrations (``reminders db upgrade``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from .db import Database

MIGRATIONS = Path(__file__).parent / "migrations"


def _config(connection) -> Config:  # type: ignore[no-untyped-def]
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(db: Database, revision: str = "head") -> None:
    with db.engine.begin() as conn:
        command.upgrade(_config(conn), revision)


def current_revision(db: Database) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with db.engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(cfg).get_current_head()


def downgrade(db: Database, revision: str) -> None:
    """Back to ``revision`` (tests of a migration's data path; operators use ``alembic`` directly)."""
    with db.engine.begin() as conn:
        command.downgrade(_config(conn), revision)
