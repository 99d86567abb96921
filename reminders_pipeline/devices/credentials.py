"""A device's own credential: the bearer of its own routes (the widget's feed, Snooze and Done).

Each device gets its own, so the internal ``REMINDERS_TOKEN`` never sits on a phone. The secret is
32 random bytes, shown once when it is issued and stored only as its SHA-256: a leaked ledger does
not leak credentials, and a random secret that long needs no slow hash.
"""

from __future__ import annotations

import hashlib
import secrets

from reminders_pipeline import ledger
from reminders_pipeline.ledger.db import Database

CREDENTIAL_BYTES = 32


def credential_hash(secret: str | bytes) -> str:
    """What the ledger keeps of a credential, and what a presented one is compared against."""
    return hashlib.sha256(secret.encode("utf-8") if isinstance(secret, str) else secret).hexdigest()


def new_credential() -> tuple[str, str]:
    secret = secrets.token_urlsafe(CREDENTIAL_BYTES)
    return secret, credential_hash(secret)


class CredentialChanged(Exception):
    """The credential a rotation meant to replace was replaced meanwhile (a concurrent rotation)."""


def rotate_credential(db: Database, device_id: str, replacing: str | None = None) -> str | None:
    """A new credential for the device, replacing the old at once; None for an unknown device.

    A compare-and-swap on the old credential's hash (``replacing``: the one the caller presented;
    else the one stored when the rotation starts): of concurrent rotations one wins and the others
    raise ``CredentialChanged``, so no caller holds a credential that was silently replaced."""
    secret, digest = new_credential()
    with db.write() as conn:
        device = ledger.get_device(conn, device_id)
        if device is None:
            return None
        old = replacing if replacing is not None else ledger.device_credential_hash(conn, device_id)
        if not ledger.swap_device_credential(conn, device_id, old, digest):
            raise CredentialChanged(f"device {device_id!r}: its credential was rotated meanwhile; use the new one")
    return secret


def stored_credential_hash(db: Database, device_id: str) -> str | None:
    with db.read() as conn:
        return ledger.device_credential_hash(conn, device_id)
