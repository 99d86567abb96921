"""What each provider's service receives of an alert, and the size beyond which it refuses it.

A ``Notification`` is the alert composed once from its row (``notification.compose``); each provider
sends it in its own shape: APNs the JSON body itself, Web Push a smaller JSON its service worker
reads (then encrypted), FCM a v1 message. The shapes live here, beside the limits they are measured
against, so composing an alert fits it to its provider's limit without importing the provider.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Any


class Provider(StrEnum):
    """Who delivers a device's alerts (``devices.provider``): each its own wire shape, limit and sender."""

    APNS = "apns"
    WEBPUSH = "webpush"
    FCM = "fcm"

    @property
    def display(self) -> str:
        """The provider's name as people write it."""
        return {"apns": "APNs", "webpush": "Web Push", "fcm": "FCM"}[self.value]


WEBPUSH_MAX_PAYLOAD_BYTES = 4096  # RFC 8291: one record; what the push service accepts at most
# RFC 8291's aes128gcm header (salt 16, record size 4, key id length 1, the sender's 65-byte
# key) and its one record's padding delimiter (1) and tag (16) leave this much for the plaintext.
WEBPUSH_MAX_PLAINTEXT_BYTES = WEBPUSH_MAX_PAYLOAD_BYTES - (16 + 4 + 1 + 65) - (1 + 16)
FCM_MAX_TTL_SECONDS = 28 * 86400  # FCM refuses a longer android.ttl
FCM_MAX_MESSAGE_BYTES = 4096  # FCM refuses a larger payload ("Message is too big")
APNS_MAX_PAYLOAD_BYTES = 4096  # APNs refuses a larger body (PayloadTooLarge)


@dataclass(frozen=True)
class Notification:
    row_id: int
    device_id: str
    device_token: str
    payload: dict[str, Any]  # the APNs JSON body
    collapse_id: str  # apns-collapse-id: a later alert for the same item replaces the earlier one
    expiration: int  # apns-expiration, Unix seconds: when the reminder stops being useful
    priority: int = 10
    push_type: str = "alert"
    provider: str = Provider.APNS  # who delivers it (``devices.provider``)
    # time.monotonic() after which the request must not leave: the claim's fence (base.fence_deadline).
    send_by: float | None = None

    def fenced(self, send_by: float) -> Notification:
        """This notification, sent only before ``send_by``; the body already serialised is kept.
        Its fields copied as they are: ``dataclasses.replace`` and ``copy.copy`` take several
        times as long, a noticeable share of the drain's time per row."""
        out = object.__new__(Notification)
        out.__dict__.update(self.__dict__, send_by=send_by)
        return out

    def past_deadline(self, now: float) -> bool:
        """True once the claim may be taken as abandoned elsewhere: sending now could duplicate."""
        return self.send_by is not None and now >= self.send_by

    @cached_property
    def body(self) -> bytes:
        """The payload as sent: compact UTF-8 JSON, the bytes APNs' 4 KB limit counts. Serialised
        once, for the size check, the request and the ledger alike; so ``payload`` is not changed
        once ``body`` has been read (``notification._fit`` makes a new instance per truncation)."""
        return json.dumps(self.payload, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass(frozen=True)
class PayloadLimit:
    """What one provider's service accepts of an alert: at most ``max_bytes`` of ``wire(note)``,
    the bytes its limit counts (APNs: the JSON body; Web Push: the plaintext it encrypts; FCM:
    the message)."""

    max_bytes: int
    wire: Callable[[Notification], bytes]


def web_payload(note: Notification) -> bytes:
    """What the browser's service worker reads: the alert, its tag (one per item) and the row."""
    aps = note.payload["aps"]
    out = {
        "title": aps["alert"]["title"],
        "body": aps["alert"]["body"],
        "tag": note.collapse_id,
        "category": aps.get("category"),
        "reminder": note.payload["reminder"],
    }
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()


def fcm_message(note: Notification, now: float) -> dict[str, Any]:
    """The FCM v1 message for one alert."""
    aps = note.payload["aps"]
    data = {"reminder": json.dumps(note.payload["reminder"], separators=(",", ":")), "tag": note.collapse_id}
    if aps.get("category"):
        data["category"] = aps["category"]
    return {
        "message": {
            "token": note.device_token,
            "notification": {"title": aps["alert"]["title"], "body": aps["alert"]["body"]},
            "data": data,
            "android": {
                "ttl": f"{min(FCM_MAX_TTL_SECONDS, max(0, note.expiration - math.ceil(now)))}s",  # never past it
                "collapse_key": note.collapse_id,
                "priority": "HIGH",
            },
        }
    }


def fcm_message_bytes(note: Notification) -> bytes:
    """The request body as httpx sends it (compact UTF-8 JSON), its ``android.ttl`` the longest it
    can be: all of it counted, so a message fitted to it fits FCM's limit whenever it is sent."""
    body = fcm_message(note, note.expiration - FCM_MAX_TTL_SECONDS)
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


PAYLOAD_LIMITS: dict[str, PayloadLimit] = {
    Provider.APNS: PayloadLimit(APNS_MAX_PAYLOAD_BYTES, lambda note: note.body),
    Provider.WEBPUSH: PayloadLimit(WEBPUSH_MAX_PLAINTEXT_BYTES, web_payload),  # fitted before encryption
    Provider.FCM: PayloadLimit(FCM_MAX_MESSAGE_BYTES, fcm_message_bytes),
}


def payload_limit(provider: str) -> PayloadLimit:
    """The payload limit of ``provider`` (``devices.provider``); APNs' for a row of no known provider."""
    return PAYLOAD_LIMITS.get(provider, PAYLOAD_LIMITS[Provider.APNS])
