"""A queue row's not-before: retries back off in the ledger, and a quiet-hours hold at send time.

* ``notification_queue.not_before``: a pending row is not due before it (a retry's backoff after
  an answer that certainly did not deliver, or the end of quiet hours when a row is claimed late
  inside them). ``send_after`` stays the rule's time. NULL for every existing row: due as before.
* ``ix_queue_not_before``: partial, over the few pending rows that carry one, so the dispatcher's
  next wake-up reads it without scanning the pending rows. On PostgreSQL ``migrate.upgrade``
  builds it after this revision commits, ``CONCURRENTLY``: building it here would block every
  write to the queue for a whole scan.

The column is added in place on both databases, its CHECK ``NOT VALID`` on PostgreSQL:
catalog-only, no table rewrite, no scan.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

from reminders_pipeline.ledger.migrations.checks import add_iso_column

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

WHERE = "status = 'pending' AND not_before IS NOT NULL"


def upgrade() -> None:
    add_iso_column("notification_queue", "not_before")
    if op.get_bind().dialect.name != "postgresql":  # PostgreSQL's is built by migrate, CONCURRENTLY
        op.create_index("ix_queue_not_before", "notification_queue", ["not_before"], sqlite_where=sa.text(WHERE))


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS ix_queue_not_before")
    op.execute("ALTER TABLE notification_queue DROP COLUMN not_before")
