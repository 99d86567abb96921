"""A calendar subscription's travel time (``device_sources.travel_seconds``): each timed item of it
gets a ``leave`` reminder that long before its start, unless the event states its own
(``X-APPLE-TRAVEL-DURATION``). NULL: none.

Catalog-only on both databases.

Revision ID: 0016
Revises: 0015
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE device_sources ADD COLUMN travel_seconds INTEGER")


def downgrade() -> None:
    op.execute("ALTER TABLE device_sources DROP COLUMN travel_seconds")
