"""Settings per calendar subscription (``device_sources``): ``rules`` (space-separated; NULL: the
device's), ``interruption_level`` (NULL: the deployment's), ``breakthrough`` and ``muted``.
Existing subscriptions take the defaults, so their reminders are as before.

``notification_queue.sent_format``: alerts now carry ``thread-id`` per calendar, where earlier
releases sent it per item. A row that keeps only its body re-renders the rest, so it records which
(NULL: before 0015, per item), and every row settled earlier keeps showing what it sent.

Catalog-only on both databases (constant defaults).

Revision ID: 0015
Revises: 0014
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

COLUMNS = {
    "rules": "TEXT",
    "interruption_level": "TEXT",
    "breakthrough": "INTEGER NOT NULL DEFAULT 0",
    "muted": "INTEGER NOT NULL DEFAULT 0",
}


def upgrade() -> None:
    for column, kind in COLUMNS.items():
        op.execute(f"ALTER TABLE device_sources ADD COLUMN {column} {kind}")
    op.execute("ALTER TABLE notification_queue ADD COLUMN sent_format INTEGER")


def downgrade() -> None:
    for column in COLUMNS:
        op.execute(f"ALTER TABLE device_sources DROP COLUMN {column}")
    op.execute("ALTER TABLE notification_queue DROP COLUMN sent_format")
