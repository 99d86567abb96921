"""Snooze and Done on a sent alert (``actions``).

* ``notification_queue.snoozed_from``: a ``snooze:N`` row's origin, the sent row the person
  snoozed; unique (``uq_queue_snoozed_from``, partial over the few rows that have one), so a
  repeated Snooze of one alert makes one row. On PostgreSQL ``migrate.upgrade`` builds the index
  after this revision commits, ``CONCURRENTLY``.
* Outcome ``acknowledged``: the pending reminders of an item the person marked Done. Settled, not
  voided, so a build does not queue them again; the item moving re-arms them as it does a sent row.

PostgreSQL: catalog-only (the outcome CHECK is swapped ``NOT VALID`` and validated afterwards).
SQLite changes a CHECK only by copying the table (``sqlite_replace_check``): one write transaction
that holds the ledger's write lock for the copy (about 4 s per 200,000 rows on the development
machine) and needs the table's size again in free disk while it runs; a downgrade copies it again.
Prune (``reminders prune``) before upgrading a large embedded ledger.

A downgrade deletes what 0016's release cannot read (snooze rows, agenda rows and ``agenda@``
rules) and settles ``acknowledged`` rows ``event_expired`` (detail ``acknowledged``).

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

from reminders_pipeline.ledger.migrations.checks import replace_check, sqlite_replace_check

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

OLD_OUTCOMES = "'sent', 'failed', 'voided', 'disabled', 'event_started', 'event_expired', 'too_late', 'quiet_hours'"
NEW_OUTCOMES = OLD_OUTCOMES + ", 'acknowledged'"
WHERE = "snoozed_from IS NOT NULL"


def _check(outcomes: str) -> str:
    return f"outcome IS NULL OR outcome IN ({outcomes})"


def _outcomes(old: str, new: str) -> None:
    if op.get_bind().dialect.name == "postgresql":
        replace_check("notification_queue", "ck_queue_outcome", _check(new))
    else:
        sqlite_replace_check("notification_queue", f"CHECK ({_check(old)})", f"CHECK ({_check(new)})")


def upgrade() -> None:
    op.execute("ALTER TABLE notification_queue ADD COLUMN snoozed_from BIGINT")
    _outcomes(OLD_OUTCOMES, NEW_OUTCOMES)
    if op.get_bind().dialect.name != "postgresql":  # PostgreSQL's is built by migrate, CONCURRENTLY
        op.create_index(
            "uq_queue_snoozed_from", "notification_queue", ["snoozed_from"], unique=True, sqlite_where=sa.text(WHERE)
        )


def downgrade() -> None:
    # What 0016's release cannot read: snooze and agenda rows and agenda rules go; an acknowledged
    # row becomes event_expired, settled as before (a voided one would be queued again).
    op.execute("DELETE FROM notification_queue WHERE snoozed_from IS NOT NULL OR rule = 'agenda'")
    op.execute(
        "UPDATE notification_queue SET outcome = 'event_expired', outcome_detail = 'acknowledged' "
        "WHERE outcome = 'acknowledged'"
    )
    bind = op.get_bind()
    devices = sa.table("devices", sa.column("id", sa.Text), sa.column("extra_rules", sa.Text))
    with_agenda = bind.execute(sa.select(devices).where(devices.c.extra_rules.like("%agenda@%"))).all()
    for device_id, rules in with_agenda:
        kept = " ".join(r for r in rules.split() if not r.startswith("agenda@"))
        bind.execute(sa.update(devices).where(devices.c.id == device_id).values(extra_rules=kept))
    op.execute("DROP INDEX IF EXISTS uq_queue_snoozed_from")
    _outcomes(NEW_OUTCOMES, OLD_OUTCOMES)
    op.execute("ALTER TABLE notification_queue DROP COLUMN snoozed_from")
