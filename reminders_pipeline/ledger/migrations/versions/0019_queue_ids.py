"""A queue row's id is never used again: ``notification_queue.id`` is ``AUTOINCREMENT`` on SQLite.

An alert carries its row's id and an action token for that id (``actions``). Without
``AUTOINCREMENT`` SQLite gives a new row the highest id in the table plus one, so once the highest
rows are pruned their ids come back on the device's next rows, and Done or Snooze pressed on an
old alert still on screen acted on a reminder it never showed.

SQLite adds ``AUTOINCREMENT`` only by copying the table (``sqlite_copy_table``: its own DDL, rows
with their ids, indexes), one write transaction like 0017's (about 4 s per 200,000 rows on the
development machine, the table's size again in free disk). The counter (``sqlite_sequence``)
starts at the highest id the ledger still names: a row's, a snooze's origin or a re-armed row's
history. Ids of rows pruned before this revision above those are not known, and may be given once.

PostgreSQL: nothing to do; an identity sequence never gives an id twice.

Revision ID: 0019
Revises: 0018
"""

from alembic import op

from reminders_pipeline.ledger.migrations.checks import sqlite_copy_table

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

PLAIN = "\n\tid INTEGER NOT NULL, "
TABLE_KEY = "\n\tPRIMARY KEY (id), "
AUTOINCREMENT = "\n\tid INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT, "
PRIMARY = "\n\tid INTEGER NOT NULL PRIMARY KEY, "
HIGHEST = (
    "SELECT max(coalesce((SELECT max(id) FROM notification_queue), 0), "
    "coalesce((SELECT max(snoozed_from) FROM notification_queue), 0), "
    "coalesce((SELECT max(queue_id) FROM notification_history), 0))"
)


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def upgrade() -> None:
    if not _sqlite():
        return
    ddl = op.get_bind().exec_driver_sql("SELECT sql FROM sqlite_master WHERE name = 'notification_queue'").scalar_one()
    # As 0001 made it, the key a table constraint; as a downgrade of this revision left it, inline.
    changes = {PRIMARY: AUTOINCREMENT} if PRIMARY in ddl else {PLAIN: AUTOINCREMENT, TABLE_KEY: "\n\t"}
    sqlite_copy_table("notification_queue", changes)
    op.execute("DELETE FROM sqlite_sequence WHERE name = 'notification_queue'")
    op.execute(f"INSERT INTO sqlite_sequence (name, seq) SELECT 'notification_queue', ({HIGHEST})")


def downgrade() -> None:
    if _sqlite():
        sqlite_copy_table("notification_queue", {AUTOINCREMENT: PRIMARY})
