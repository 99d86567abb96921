"""A device's push provider: ``devices.provider``, ``apns`` (every device before 0018), ``webpush``
or ``fcm``. ``devices.apns_token`` keeps the provider's target: an APNs device token, a Web Push
subscription (``webpush.canonical``: endpoint and keys as compact JSON) or an FCM registration
token.

Catalog-only on both databases (a constant default; SQLite keeps it in the table's definition).

Revision ID: 0018
Revises: 0017
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE devices ADD COLUMN provider TEXT NOT NULL DEFAULT 'apns'")


def downgrade() -> None:
    # 0017 knows APNs alone: a device of another provider has no token it could send to.
    op.execute(
        "UPDATE devices SET token_invalid_at = updated_at, token_invalid_reason = 'provider_removed' "
        "WHERE provider <> 'apns' AND token_invalid_at IS NULL"
    )
    op.execute("ALTER TABLE devices DROP COLUMN provider")
