"""Devices: the hash of each device's own credential (the widget's bearer for its own routes).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ADD COLUMN on both databases: a batch rebuild of ``devices`` on SQLite would drop the
    # table under device_sources' ON DELETE CASCADE.
    op.add_column("devices", sa.Column("credential_hash", sa.Text))


def downgrade() -> None:
    op.drop_column("devices", "credential_hash")  # SQLite 3.35+ drops a column in place
