"""An alert's action token: what lets the app's Snooze and Done act on the row it showed.

An HMAC of the device, the row and the instant of the event the alert shows, keyed by the device's
credential hash, with that instant after a dot (``devices.actions`` explains what it guards).
Pure, so composing an alert (``notification``) needs no database.
"""

from __future__ import annotations

import hashlib
import hmac

from reminders_pipeline.domain.times import MAX_UNIX, Instant

CATEGORY = "REMINDER"  # the app registers it with the actions below
ACTIONS = ("SNOOZE", "DONE")  # UNNotificationAction identifiers
TOKEN_BYTES = 16


def action_token(credential_hash: str, device_id: str, row_id: int, shown: Instant | None) -> str:
    """The alert's action token: keyed by what the ledger keeps of the device's credential, and
    naming the event's instant the alert shows (``shown``; None only for the tokens of old alerts)."""
    at = "" if shown is None else f"\x00{shown.whole_seconds}"
    message = f"reminder-action\x00{device_id}\x00{row_id}{at}".encode()
    digest = hmac.new(credential_hash.encode(), message, hashlib.sha256).hexdigest()[: TOKEN_BYTES * 2]
    return digest if shown is None else f"{digest}.{shown.whole_seconds}"


def shown_by(token: str) -> Instant | None:
    """The instant a token says its alert showed; None for an old token or one that names none."""
    _, dot, at = token.partition(".")
    if not dot or not at.isascii() or not at.isdigit() or int(at) > MAX_UNIX:
        return None
    return Instant.from_unix(int(at))
