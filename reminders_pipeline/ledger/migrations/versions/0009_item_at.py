"""A settled row is re-armed only when its item moved: ``notification_queue.item_at``.

A floating or all-day item's own time at the row's anchor, as wall time read as UTC, before any
device's zone; NULL for an item fixed in time (whose ``event_at``/``expires_at`` are its own). A
zone change moves a floating item's ``event_at`` without moving the item; ``item_at`` tells the
two apart. NULL for fixed items keeps the common row its size. Rows written before this revision
have NULL and are compared by their anchor instant alone until the build next writes them.
Catalog-only (its CHECK ``NOT VALID`` on PostgreSQL): the upgrade takes no time whatever the
queue holds.

Revision ID: 0009
Revises: 0008
"""

from alembic import op

from reminders_pipeline.ledger.migrations.checks import add_iso_column

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_iso_column("notification_queue", "item_at")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_column("notification_queue", "item_at")  # drops its CHECK with it
    else:
        op.execute("ALTER TABLE notification_queue DROP COLUMN item_at")
