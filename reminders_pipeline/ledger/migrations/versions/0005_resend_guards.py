"""Guards against sending twice or losing a send: attempts, notification history, shared drain halts.

* ``notification_queue.attempts``: how often a row went back to pending because it certainly
  never reached APNs (or APNs declined it for now); bounded by REMINDERS_SEND_MAX_ATTEMPTS.
* ``notification_history``: what a settled row recorded before the build re-armed it.
* ``drain_halts``: one row per drain scope (a Dagster run, a CLI/HTTP drain) that met an APNs
  fault, read by every batch and process of that scope before each claim.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

IsoTime = sa.Text().with_variant(postgresql.TEXT(collation="C"), "postgresql")
RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def iso(column: str, nullable: bool = True) -> sa.CheckConstraint:
    shape = f"(length({column}) = 24 AND substr({column}, 11, 1) = 'T' AND substr({column}, 24, 1) = 'Z')"
    return sa.CheckConstraint(f"{column} IS NULL OR {shape}" if nullable else shape, name=f"ck_{column}_iso")


def upgrade() -> None:
    with op.batch_alter_table("notification_queue") as batch:
        batch.add_column(sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")))
    op.create_table(
        "notification_history",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("queue_id", RowId, nullable=False),
        sa.Column("device_id", sa.Text, nullable=False),
        sa.Column("item_id", sa.Text, nullable=False),
        sa.Column("rule", sa.Text, nullable=False),
        sa.Column("send_after", IsoTime, nullable=False),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("outcome_detail", sa.Text),
        sa.Column("payload", sa.Text),
        sa.Column("apns_id", sa.Text),
        sa.Column("sent_at", IsoTime),
        sa.Column("settled_at", IsoTime, nullable=False),
        sa.Column("rearmed_at", IsoTime, nullable=False),
        sa.UniqueConstraint("queue_id", "settled_at", name="uq_history_queue_settled"),
        iso("send_after", False),
        iso("sent_at"),
        iso("settled_at", False),
        iso("rearmed_at", False),
    )
    op.create_index("ix_history_rearmed", "notification_history", ["rearmed_at"])
    op.create_table(
        "drain_halts",
        sa.Column("scope", sa.Text, primary_key=True),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("claimer", sa.Text, nullable=False),
        sa.Column("halted_at", IsoTime, nullable=False),
        iso("halted_at", False),
    )
    op.create_index("ix_drain_halts_halted", "drain_halts", ["halted_at"])


def downgrade() -> None:
    op.drop_index("ix_drain_halts_halted", table_name="drain_halts")
    op.drop_table("drain_halts")
    op.drop_index("ix_history_rearmed", table_name="notification_history")
    op.drop_table("notification_history")
    with op.batch_alter_table("notification_queue") as batch:
        batch.drop_column("attempts")
