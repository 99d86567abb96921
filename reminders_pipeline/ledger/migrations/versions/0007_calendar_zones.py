"""Calendars as people keep them: a device's IANA zone, all-day rules, quiet hours, the calendar's
alarms; outcome quiet_hours.

Revision ID: 0007
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from reminders_pipeline.ledger.migrations.checks import replace_check

revision = "0007"
down_revision = "0005"
branch_labels = None
depends_on = None

IsoTime = sa.Text().with_variant(postgresql.TEXT(collation="C"), "postgresql")
RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

OLD_OUTCOMES = "'sent', 'failed', 'voided', 'disabled', 'event_started', 'event_expired', 'too_late'"
NEW_OUTCOMES = OLD_OUTCOMES + ", 'quiet_hours'"


def iso(column: str, nullable: bool = True) -> sa.CheckConstraint:
    shape = f"(length({column}) = 24 AND substr({column}, 11, 1) = 'T' AND substr({column}, 24, 1) = 'Z')"
    return sa.CheckConstraint(f"{column} IS NULL OR {shape}" if nullable else shape, name=f"ck_{column}_iso")


def _queue(outcomes: str) -> sa.Table:
    """The queue as 0001 and 0005 made it, but for the outcome list: SQLite changes a CHECK by copying the table."""
    pending, claimed, settled = (sa.text(f"status = '{s}'") for s in ("pending", "claimed", "settled"))
    return sa.Table(
        "notification_queue",
        sa.MetaData(),
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
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),  # from 0005
        sa.UniqueConstraint("device_id", "item_id", "rule", name="uq_queue_device_item_rule"),
        sa.CheckConstraint("status IN ('pending', 'claimed', 'settled')", name="ck_queue_status"),
        sa.CheckConstraint(f"outcome IS NULL OR outcome IN ({outcomes})", name="ck_queue_outcome"),
        sa.CheckConstraint("(status = 'settled') = (outcome IS NOT NULL)", name="ck_queue_settled_has_outcome"),
        *(iso(c, False) for c in ("send_after", "event_at", "expires_at")),
        *(iso(c) for c in ("claimed_at", "settled_at", "sent_at")),
        iso("created_at", False),
        iso("updated_at", False),
        sa.Index("ix_queue_due", "send_after", "id", sqlite_where=pending),
        sa.Index("ix_queue_claimed", "claimed_at", sqlite_where=claimed),
        sa.Index("ix_queue_settled", "settled_at", sqlite_where=settled),
    )


def _outcomes(outcomes: str) -> None:
    if op.get_bind().dialect.name == "postgresql":
        replace_check("notification_queue", "ck_queue_outcome", f"outcome IS NULL OR outcome IN ({outcomes})")
    else:
        with op.batch_alter_table("notification_queue", copy_from=_queue(outcomes), recreate="always"):
            pass


def upgrade() -> None:
    # Plain ADD COLUMNs: a batch rebuild of ``devices`` on SQLite would drop the table under
    # device_sources' ON DELETE CASCADE.
    op.add_column("devices", sa.Column("tz_name", sa.Text))  # IANA zone, e.g. Europe/Berlin
    op.add_column(
        "devices", sa.Column("all_day_rules", sa.Text, nullable=False, server_default=sa.text("'day:0@09:00'"))
    )
    op.add_column("devices", sa.Column("quiet_hours", sa.Text))  # "22:00-07:00" in the device's zone
    op.add_column(
        "devices", sa.Column("use_alarms", sa.Integer, nullable=False, server_default=sa.text("0"))
    )  # 1: VALARMs
    _outcomes(NEW_OUTCOMES)


def downgrade() -> None:
    op.execute("UPDATE notification_queue SET outcome = 'too_late' WHERE outcome = 'quiet_hours'")
    _outcomes(OLD_OUTCOMES)
    for column in ("use_alarms", "quiet_hours", "all_day_rules", "tz_name"):
        op.drop_column("devices", column)
