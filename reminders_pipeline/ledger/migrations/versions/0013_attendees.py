"""A device's attendee addresses (``devices.attendees``, space-separated, lowercase): an invitation
one of them declined alerts nothing. Empty for existing devices.

Catalog-only on both databases (a constant default).

Revision ID: 0013
Revises: 0012
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE devices ADD COLUMN attendees TEXT NOT NULL DEFAULT ''")


def downgrade() -> None:
    op.execute("ALTER TABLE devices DROP COLUMN attendees")
