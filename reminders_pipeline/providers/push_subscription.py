"""A browser's Web Push subscription as a device registers it: its shape checked, its endpoint's
host checked against the egress guard, and its origin (one push service, whatever the spelling).
Plain data and checks: the sender (``webpush.py``) encrypts to it and signs for its origin."""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from cryptography.hazmat.primitives.asymmetric import ec

from reminders_pipeline.domain import b64url
from reminders_pipeline.sources.egress import Network, is_allowed

MAX_ENDPOINT_LENGTH = 2048
DEFAULT_PORTS = {"https": 443, "http": 80}


class PushSubscriptionError(ValueError):
    """A Web Push subscription that cannot be used; the message says why."""


@dataclass(frozen=True)
class Subscription:
    """A browser's push subscription, as it registered: its endpoint and its two keys."""

    endpoint: str
    p256dh: str  # base64url of the browser's P-256 public key, uncompressed (65 bytes)
    auth: str  # base64url of its 16-byte authentication secret

    @property
    def canonical(self) -> str:
        """How the ledger keeps it (``devices.target`` of a ``webpush`` device): compact JSON."""
        return json.dumps({"endpoint": self.endpoint, "p256dh": self.p256dh, "auth": self.auth}, separators=(",", ":"))

    @classmethod
    def stored(cls, text: str) -> Subscription:
        data = json.loads(text)
        return cls(data["endpoint"], data["p256dh"], data["auth"])

    @property
    def origin(self) -> str:
        """The endpoint's origin (``origin_of``): the VAPID ``aud``, and the key of per-host state."""
        return origin_of(self.endpoint)


def origin_of(url: str) -> str:
    """``url``'s origin as RFC 6454 serializes it: scheme and host in lowercase, an IPv6 literal
    in brackets, the port only when not the scheme's default. So ``HTTPS://Push.Example:443/x``
    and ``https://push.example/y`` are one push service. ``ValueError`` for a URL without a host
    or with a malformed port."""
    parts = urlsplit(url)
    scheme, host, port = parts.scheme.lower(), parts.hostname, parts.port
    if not host:
        raise ValueError("no host")
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}" if port is None or port == DEFAULT_PORTS.get(scheme) else f"{scheme}://{shown}:{port}"


def parse_subscription(data: object) -> Subscription:
    """The browser's ``PushSubscription.toJSON()`` (``{"endpoint", "keys": {"p256dh", "auth"}}``)
    checked for shape: an https endpoint, a P-256 point and a 16-byte secret."""
    if not isinstance(data, Mapping):
        raise PushSubscriptionError("a JSON object with endpoint and keys (the browser's PushSubscription)")
    endpoint, keys = data.get("endpoint"), data.get("keys")
    if not isinstance(endpoint, str) or len(endpoint) > MAX_ENDPOINT_LENGTH or any(ord(c) < 33 for c in endpoint):
        raise PushSubscriptionError(f"endpoint: an https URL of at most {MAX_ENDPOINT_LENGTH} characters")
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise PushSubscriptionError("endpoint: not a URL") from None
    if parts.scheme != "https" or not parts.hostname or parts.username or parts.password:
        raise PushSubscriptionError("endpoint: an https URL without user or password")
    if (
        not isinstance(keys, Mapping)
        or not isinstance(keys.get("p256dh"), str)
        or not isinstance(keys.get("auth"), str)
    ):
        raise PushSubscriptionError("keys: p256dh and auth, base64url text")
    try:
        point = b64url.decode(keys["p256dh"])
        ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
        secret = b64url.decode(keys["auth"])
    except (ValueError, TypeError):
        raise PushSubscriptionError("keys.p256dh: not a P-256 public key") from None
    if len(point) != 65 or len(secret) != 16:
        raise PushSubscriptionError("keys: p256dh an uncompressed P-256 point (65 bytes), auth 16 bytes")
    return Subscription(endpoint, b64url.encode(point), b64url.encode(secret))


def check_reachable(endpoint: str, allow: Sequence[Network]) -> None:
    """Refuse an endpoint whose host resolves only to internal addresses (the egress guard, at
    registration; it checks again at every connection, so a later DNS answer cannot slip by)."""
    parts = urlsplit(endpoint)
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 443, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise PushSubscriptionError("endpoint: its host does not resolve") from None
    addresses = {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}
    if not any(is_allowed(a, allow) for a in addresses):
        raise PushSubscriptionError("endpoint: its host is not reachable from here (internal address)")
