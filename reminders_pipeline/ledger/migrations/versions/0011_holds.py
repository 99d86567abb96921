"""Holds a change must not lose, nor a stale answer reimpose.

* ``notification_queue.held_until``: a quiet-hours hold kept apart from a retry's backoff.
  Lateness counts from the end of a hold at send time; a retry after it writes its backoff into
  ``not_before`` and must not move that base back to ``send_after``. Rows held by the drain before
  this revision (pending, ``outcome_detail`` ``quiet_hours``) take their ``not_before`` as the
  hold; the backfill reads the few pending rows that carry a not-before, through
  ``ix_queue_not_before`` (built before this revision runs: see ``migrate.upgrade``).
* ``devices.registered_at``: when the device last registered. APNs' "stop sending unless the
  device registered again since" needs it: a dead-token answer older than it marks nothing.
  NULL for existing devices (unknown): marked as before.

Both columns are added in place, their CHECKs ``NOT VALID`` on PostgreSQL: catalog-only.

Revision ID: 0011
Revises: 0010
"""

from alembic import op

from reminders_pipeline.ledger.migrations.checks import add_iso_column

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_iso_column("notification_queue", "held_until")
    add_iso_column("devices", "registered_at")
    op.execute(
        "UPDATE notification_queue SET held_until = not_before "
        "WHERE status = 'pending' AND not_before IS NOT NULL AND outcome_detail = 'quiet_hours'"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE notification_queue DROP COLUMN held_until")
    op.execute("ALTER TABLE devices DROP COLUMN registered_at")
