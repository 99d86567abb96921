"""CHECKs that a migration adds to a table already full of rows, without scanning it under lock.

PostgreSQL verifies a new CHECK by reading every row, and an ALTER holds ACCESS EXCLUSIVE for its
whole transaction: every claim, settlement and build would wait for that scan. So here a CHECK is
added ``NOT VALID`` (enforced on every write from then on, existing rows not read), and
``migrate.upgrade`` validates it afterwards in its own transaction, under SHARE UPDATE EXCLUSIVE,
which no claim waits for. SQLite has no such lock to hold anyone up: its CHECKs are added inline.
"""

from __future__ import annotations

from alembic import op


def iso_shape(column: str) -> str:
    """The stored-time shape of a nullable column: ``2026-09-10T08:30:00.000Z`` or NULL."""
    return f"{column} IS NULL OR (length({column}) = 24 AND substr({column}, 11, 1) = 'T' AND substr({column}, 24, 1) = 'Z')"


def _postgresql() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def add_iso_column(table: str, column: str) -> None:
    """A nullable time column with its shape CHECK ``ck_<column>_iso``: catalog-only on both databases."""
    check = f"CONSTRAINT ck_{column}_iso CHECK ({iso_shape(column)})"
    if _postgresql():
        op.execute(f'ALTER TABLE {table} ADD COLUMN {column} TEXT COLLATE "C", ADD {check} NOT VALID')
    else:
        op.execute(f"ALTER TABLE {table} ADD COLUMN {column} TEXT {check}")


def replace_check(table: str, name: str, condition: str) -> None:
    """PostgreSQL only: swap a CHECK for another of the same name in one ALTER, the new one NOT VALID."""
    op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}, ADD CONSTRAINT {name} CHECK ({condition}) NOT VALID")


def sqlite_replace_check(table: str, old: str, new: str) -> None:
    """SQLite only: a CHECK changed the one way SQLite allows, by copying the table
    (``sqlite_copy_table``); ``old`` is the constraint's exact text in the stored DDL."""
    sqlite_copy_table(table, {old: new})


def sqlite_copy_table(table: str, changes: dict[str, str]) -> None:
    """SQLite only: the table made again from its own stored DDL with each key of ``changes`` (a
    text found there exactly once) replaced by its value, so every other column and constraint
    stays exactly as earlier revisions left it; its rows are copied with their ids and its indexes
    made again from their own DDL. Foreign keys are off while a migration runs."""
    bind = op.get_bind()
    ddl = bind.exec_driver_sql(f"SELECT sql FROM sqlite_master WHERE type = 'table' AND name = '{table}'").scalar_one()
    indexes = bind.exec_driver_sql(
        f"SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = '{table}' AND sql IS NOT NULL"
    ).scalars()
    rest = ddl.split("(", 1)[1]
    for old, new in changes.items():
        if rest.count(old) != 1:
            raise RuntimeError(f"{table}: {old!r} is not in its DDL exactly once")
        rest = rest.replace(old, new)
    copy = f"{table}_copy"
    op.execute(f"CREATE TABLE {copy} ({rest}")
    op.execute(f"INSERT INTO {copy} SELECT * FROM {table}")
    kept = list(indexes)
    op.execute(f"DROP TABLE {table}")
    op.execute(f"ALTER TABLE {copy} RENAME TO {table}")
    for index in kept:
        op.execute(index)
