"""What a build needs to tell an unchanged tick from a changed one.

* ``sources.content_hash``: the body last parsed, and the item cap and format it was parsed
  under (``sources.content_hash``). A 200 with the same body is taken as a 304 (its cached parse
  reused), for servers that send no validators.
* ``devices.planned_key`` and ``devices.planned_until``: what the device's last build planned
  from (its planning columns and each source's content, ``plan.plan_key``) and up to which
  ``send_after``. NULL for existing devices: their next build plans in full, as before.

Catalog-only on both databases (the time column's CHECK ``NOT VALID`` on PostgreSQL).

Revision ID: 0012
Revises: 0011
"""

from alembic import op

from reminders_pipeline.ledger.migrations.checks import add_iso_column

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE sources ADD COLUMN content_hash TEXT")
    op.execute("ALTER TABLE devices ADD COLUMN planned_key TEXT")
    add_iso_column("devices", "planned_until")


def downgrade() -> None:
    for table, column in (("sources", "content_hash"), ("devices", "planned_key"), ("devices", "planned_until")):
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
