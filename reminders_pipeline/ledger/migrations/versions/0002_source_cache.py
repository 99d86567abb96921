"""Sources: conditional GET validators, the cached parsed feed, failure streaks.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

IsoTime = sa.Text().with_variant(postgresql.TEXT(collation="C"), "postgresql")


def iso(column: str) -> sa.CheckConstraint:
    shape = f"(length({column}) = 24 AND substr({column}, 11, 1) = 'T' AND substr({column}, 24, 1) = 'Z')"
    return sa.CheckConstraint(f"{column} IS NULL OR {shape}", name=f"ck_{column}_iso")


def upgrade() -> None:
    with op.batch_alter_table("sources") as batch:
        batch.add_column(sa.Column("etag", sa.Text))
        batch.add_column(sa.Column("last_modified", sa.Text))
        batch.add_column(sa.Column("feed_cache", sa.Text))
        for column in ("cache_until", "failing_since", "alerted_at"):
            batch.add_column(sa.Column(column, IsoTime))
            batch.create_check_constraint(f"ck_{column}_iso", iso(column).sqltext)


def downgrade() -> None:
    with op.batch_alter_table("sources") as batch:
        for column in ("cache_until", "failing_since", "alerted_at"):
            batch.drop_constraint(f"ck_{column}_iso", type_="check")
            batch.drop_column(column)
        for column in ("feed_cache", "last_modified", "etag"):
            batch.drop_column(column)
