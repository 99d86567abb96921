"""The ledger: devices, sources, subscriptions, notification_queue.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

IsoTime = sa.Text().with_variant(postgresql.TEXT(collation="C"), "postgresql")
RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def iso(column: str, nullable: bool = True) -> sa.CheckConstraint:
    shape = f"(length({column}) = 24 AND substr({column}, 11, 1) = 'T' AND substr({column}, 24, 1) = 'Z')"
    return sa.CheckConstraint(f"{column} IS NULL OR {shape}" if nullable else shape, name=f"ck_{column}_iso")


def upgrade() -> None:
    op.create_table(
        "devices",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("apns_token", sa.Text, nullable=False),
        sa.Column("reminder_lead_seconds", sa.Integer, nullable=False, server_default=sa.text("3600")),
        sa.Column("extra_rules", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("last_tz_offset_seconds", sa.Integer),
        sa.Column("reminders_built_at", IsoTime),
        sa.Column("chunk", sa.Integer, nullable=False),
        sa.Column("token_invalid_at", IsoTime),
        sa.Column("token_invalid_reason", sa.Text),
        sa.Column("created_at", IsoTime, nullable=False),
        sa.Column("updated_at", IsoTime, nullable=False),
        iso("reminders_built_at"),
        iso("token_invalid_at"),
        iso("created_at", False),
        iso("updated_at", False),
        sa.CheckConstraint("reminder_lead_seconds >= 0", name="ck_lead_nonnegative"),
    )
    op.create_index("ix_devices_chunk_built", "devices", ["chunk", "reminders_built_at"])
    op.create_index("ix_devices_built", "devices", ["reminders_built_at"])

    op.create_table(
        "sources",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("url", sa.Text, nullable=False, unique=True),
        sa.Column("kind", sa.Text, nullable=False, server_default=sa.text("'json'")),
        sa.Column("last_read_at", IsoTime),
        sa.Column("last_success_at", IsoTime),
        sa.Column("last_error_at", IsoTime),
        sa.Column("last_error", sa.Text),
        sa.Column("consecutive_failures", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("last_item_count", sa.Integer),
        sa.Column("last_rejected_count", sa.Integer),
        sa.Column("created_at", IsoTime, nullable=False),
        iso("last_read_at"),
        iso("last_success_at"),
        iso("last_error_at"),
        iso("created_at", False),
    )

    op.create_table(
        "device_sources",
        sa.Column("device_id", sa.Text, sa.ForeignKey("devices.id", ondelete="CASCADE"), nullable=False),
        sa.Column("source_id", RowId, sa.ForeignKey("sources.id", ondelete="CASCADE"), nullable=False),
        sa.PrimaryKeyConstraint("device_id", "source_id"),
    )
    op.create_index("ix_device_sources_source", "device_sources", ["source_id"])

    op.create_table(
        "notification_queue",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("device_id", sa.Text, nullable=False),
        sa.Column("source_id", RowId),
        sa.Column("item_id", sa.Text, nullable=False),
        sa.Column("rule", sa.Text, nullable=False),
        sa.Column("send_after", IsoTime, nullable=False),
        sa.Column("event_at", IsoTime, nullable=False),
        sa.Column("expires_at", IsoTime, nullable=False),
        sa.Column("title", sa.Text, nullable=False),
        sa.Column("body", sa.Text),
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'pending'")),
        sa.Column("outcome", sa.Text),
        sa.Column("outcome_detail", sa.Text),
        sa.Column("payload", sa.Text),
        sa.Column("apns_id", sa.Text),
        sa.Column("claimed_by", sa.Text),
        sa.Column("claimed_at", IsoTime),
        sa.Column("settled_at", IsoTime),
        sa.Column("sent_at", IsoTime),
        sa.Column("created_at", IsoTime, nullable=False),
        sa.Column("updated_at", IsoTime, nullable=False),
        sa.UniqueConstraint("device_id", "item_id", "rule", name="uq_queue_device_item_rule"),
        sa.CheckConstraint("status IN ('pending', 'claimed', 'settled')", name="ck_queue_status"),
        sa.CheckConstraint(
            "outcome IS NULL OR outcome IN ('sent', 'failed', 'voided', 'disabled', "
            "'event_started', 'event_expired', 'too_late')",
            name="ck_queue_outcome",
        ),
        sa.CheckConstraint("(status = 'settled') = (outcome IS NOT NULL)", name="ck_queue_settled_has_outcome"),
        *(iso(c, False) for c in ("send_after", "event_at", "expires_at")),
        *(iso(c) for c in ("claimed_at", "settled_at", "sent_at")),
        iso("created_at", False),
        iso("updated_at", False),
    )
    pending, claimed, settled = (sa.text(f"status = '{s}'") for s in ("pending", "claimed", "settled"))
    op.create_index(
        "ix_queue_due", "notification_queue", ["send_after", "id"], sqlite_where=pending, postgresql_where=pending
    )
    op.create_index(
        "ix_queue_claimed", "notification_queue", ["claimed_at"], sqlite_where=claimed, postgresql_where=claimed
    )
    op.create_index(
        "ix_queue_settled", "notification_queue", ["settled_at"], sqlite_where=settled, postgresql_where=settled
    )
    if op.get_bind().dialect.name == "postgresql":
        # Every claim and settlement changes an indexed column (no HOT update), so each leaves a
        # dead tuple: vacuum the queue early rather than at the default 20% of the table.
        op.execute(
            "ALTER TABLE notification_queue SET (autovacuum_vacuum_scale_factor = 0.01, "
            "autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_limit = 2000, fillfactor = 85)"
        )


def downgrade() -> None:
    op.drop_table("notification_queue")
    op.drop_table("device_sources")
    op.drop_table("sources")
    op.drop_table("devices")
