"""A quiet-hours hold kept apart from a retry's backoff: ``notification_queue.held_until``.

Lateness counts from the end of a hold at send time; a retry after it writes its backoff into
``not_before`` and must not move that base back to ``send_after``. Rows held by the drain before
this revision (pending, ``outcome_detail`` ``quiet_hours``) take their ``not_before`` as the hold.
The column is added in place; the backfill reads the few pending rows that carry a not-before.

Revision ID: 0011
Revises: 0010
"""
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

SHAPE = "held_until IS NULL OR (length(held_until) = 24 AND substr(held_until, 11, 1) = 'T' AND substr(held_until, 24, 1) = 'Z')"


def upgrade() -> None:
    collate = ' COLLATE "C"' if op.get_bind().dialect.name == "postgresql" else ""
    op.execute(f"ALTER TABLE notification_queue ADD COLUMN held_until TEXT{collate} CONSTRAINT ck_held_until_iso CHECK ({SHAPE})")
    op.execute(
        "UPDATE notification_queue SET held_until = not_before "
        "WHERE status = 'pending' AND not_before IS NOT NULL AND outcome_detail = 'quiet_hours'"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE notification_queue DROP COLUMN held_until")
