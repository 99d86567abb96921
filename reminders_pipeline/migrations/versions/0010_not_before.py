"""A queue row's not-before: retries back off in the ledger, and a quiet-hours hold at send time.

* ``notification_queue.not_before``: a pending row is not due before it (a retry's backoff after
  an answer that certainly did not deliver, or the end of quiet hours when a row is claimed late
  inside them). ``send_after`` stays the rule's time. NULL for every existing row: due as before.
* ``ix_queue_not_before``: partial, over the few pending rows that carry one, so the dispatcher's
  next wake-up reads it without scanning the pending rows.

The column is added in place (with its CHECK) on both databases: catalog-only, no table rewrite.

Revision ID: 0010
Revises: 0009
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

SHAPE = "not_before IS NULL OR (length(not_before) = 24 AND substr(not_before, 11, 1) = 'T' AND substr(not_before, 24, 1) = 'Z')"
WHERE = "status = 'pending' AND not_before IS NOT NULL"


def upgrade() -> None:
    collate = ' COLLATE "C"' if op.get_bind().dialect.name == "postgresql" else ""
    op.execute(f"ALTER TABLE notification_queue ADD COLUMN not_before TEXT{collate} CONSTRAINT ck_not_before_iso CHECK ({SHAPE})")
    op.create_index(
        "ix_queue_not_before", "notification_queue", ["not_before"], sqlite_where=sa.text(WHERE), postgresql_where=sa.text(WHERE)
    )


def downgrade() -> None:
    op.drop_index("ix_queue_not_before", table_name="notification_queue")
    op.execute("ALTER TABLE notification_queue DROP COLUMN not_before")
