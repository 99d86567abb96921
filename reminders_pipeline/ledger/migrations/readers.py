"""Which release heads may run against the ledger's schema (``schema_readers``, 0020): a newer
release whose migrations since an older head are all ``ADDITIVE`` leaves that head recorded, and
the older release accepts the ledger (``migrate.schema_problem``) instead of refusing it."""

from __future__ import annotations

from alembic.script import ScriptDirectory
from sqlalchemy import inspect, select

from reminders_pipeline.ledger.db import Database
from reminders_pipeline.ledger.schema import schema_readers


def oldest_reader(scripts: ScriptDirectory, revision: str) -> str:
    """The oldest head that may run against a schema at ``revision``: back past every migration
    that says it is ``ADDITIVE``."""
    floor = revision
    for script in scripts.iterate_revisions(revision, "base"):
        if not getattr(script.module, "ADDITIVE", False) or not isinstance(script.down_revision, str):
            break
        floor = script.down_revision
    return floor


def record(db: Database, scripts: ScriptDirectory, current: str | None) -> None:
    """Keep ``schema_readers`` at ``oldest_reader(current)``, where the ledger has the table."""
    if current is None or not _has_table(db):
        return
    with db.write() as conn:
        conn.execute(schema_readers.delete())
        conn.execute(schema_readers.insert().values(oldest_head=oldest_reader(scripts, current)))


def oldest_head(db: Database) -> str | None:
    """The oldest head the ledger's own release said may run against it, where it says."""
    if not _has_table(db):
        return None
    with db.engine.connect() as conn:
        found = conn.scalar(select(schema_readers.c.oldest_head))
    return None if found is None else str(found)


def _has_table(db: Database) -> bool:
    with db.engine.connect() as conn:
        return inspect(conn).has_table(schema_readers.name)
