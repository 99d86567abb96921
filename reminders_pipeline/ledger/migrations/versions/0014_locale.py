"""A device's language and clock: ``devices.locale`` (a BCP 47 tag, ``de-DE``) and
``devices.clock`` (``12h``/``24h``; NULL: the locale's own). NULL locale: alerts read as before
(English, 24-hour clock).

Catalog-only on both databases.

Revision ID: 0014
Revises: 0013
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE devices ADD COLUMN locale TEXT")
    op.execute("ALTER TABLE devices ADD COLUMN clock TEXT")


def downgrade() -> None:
    for column in ("locale", "clock"):
        op.execute(f"ALTER TABLE devices DROP COLUMN {column}")
