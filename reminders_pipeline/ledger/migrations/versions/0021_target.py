"""``devices.target``: each device's delivery target, renamed from ``apns_token``.

Since 0018 the column holds whichever provider's target the device has (an APNs token, a Web Push
subscription, an FCM token); its name now says so. The CLI's ``--apns-token`` and the HTTP
``apns_token`` field are unchanged. Not additive: a release before this one reads ``apns_token``,
so it refuses a ledger upgraded past it, and every process moves to this release together.

Revision ID: 0021
Revises: 0020
"""

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE devices RENAME COLUMN apns_token TO target")


def downgrade() -> None:
    op.execute("ALTER TABLE devices RENAME COLUMN target TO apns_token")
