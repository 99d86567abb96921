"""A settled row is re-armed only when its item moved: ``notification_queue.item_at``.

A floating or all-day item's own time at the row's anchor, as wall time read as UTC, before any
device's zone; NULL for an item fixed in time (whose ``event_at``/``expires_at`` are its own). A
zone change moves a floating item's ``event_at`` without moving the item; ``item_at`` tells the
two apart. NULL for fixed items keeps the common row its size. Rows written before this revision
have NULL and are compared by their anchor instant alone until the build next writes them.
Catalog-only: the upgrade takes no time whatever the queue holds.

Revision ID: 0009
Revises: 0008
"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

IsoTime = sa.Text().with_variant(postgresql.TEXT(collation="C"), "postgresql")
SHAPE = "item_at IS NULL OR (length(item_at) = 24 AND substr(item_at, 11, 1) = 'T' AND substr(item_at, 24, 1) = 'Z')"


def upgrade() -> None:
    op.add_column("notification_queue", sa.Column("item_at", IsoTime, sa.CheckConstraint(SHAPE, name="ck_item_at_iso")))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_column("notification_queue", "item_at")  # drops its CHECK with it
    else:
        op.execute("ALTER TABLE notification_queue DROP COLUMN item_at")
