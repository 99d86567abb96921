"""Base64url without padding: how VAPID, the Push API's keys and an APNs token's JWT write bytes."""

from __future__ import annotations

import base64
import binascii
import re

_TEXT = re.compile(r"[A-Za-z0-9_-]*={0,2}")


def encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def decode(text: str) -> bytes:
    """Base64url, padding optional; ``ValueError`` on anything else (a stray character is refused,
    not skipped, as the standard library would)."""
    if not _TEXT.fullmatch(text):
        raise ValueError("not base64url")
    stripped = text.rstrip("=")
    try:
        return base64.urlsafe_b64decode(stripped + "=" * (-len(stripped) % 4))
    except binascii.Error as exc:
        raise ValueError(str(exc)) from exc
