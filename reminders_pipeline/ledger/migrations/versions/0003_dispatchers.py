"""Dispatchers: one row per exact-time dispatcher, its heartbeat and its planned end.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

IsoTime = sa.Text().with_variant(postgresql.TEXT(collation="C"), "postgresql")


def iso(column: str, nullable: bool = True) -> sa.CheckConstraint:
    shape = f"(length({column}) = 24 AND substr({column}, 11, 1) = 'T' AND substr({column}, 24, 1) = 'Z')"
    return sa.CheckConstraint(f"{column} IS NULL OR {shape}" if nullable else shape, name=f"ck_{column}_iso")


def upgrade() -> None:
    op.create_table(
        "dispatchers",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("started_at", IsoTime, nullable=False),
        sa.Column("beat_at", IsoTime, nullable=False),
        sa.Column("ends_at", IsoTime),
        sa.Column("stopped_at", IsoTime),
        sa.Column("sent", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("settled", sa.Integer, nullable=False, server_default=sa.text("0")),
        iso("started_at", False),
        iso("beat_at", False),
        iso("ends_at"),
        iso("stopped_at"),
    )
    op.create_index("ix_dispatchers_beat", "dispatchers", ["beat_at"])


def downgrade() -> None:
    op.drop_index("ix_dispatchers_beat", table_name="dispatchers")
    op.drop_table("dispatchers")
