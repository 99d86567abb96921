"""What the APNs sender needs before its first send: the credentials the settings must name, the
.p8 signing key, the endpoint and its TLS context, each checked at start so a bad setting names its
variable instead of failing every send; and the provider token every connection shares."""

from __future__ import annotations

import json
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aioapns.connection import APNsDevelopmentClientProtocol, APNsProductionClientProtocol, AuthorizationHeaderProvider
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain import b64url
from reminders_pipeline.providers.apns_transport import (
    Endpoint,
)

REQUIRED = (
    ("apns_key_file", "REMINDERS_APNS_KEY_FILE"),
    ("apns_key_id", "REMINDERS_APNS_KEY_ID"),
    ("apns_team_id", "REMINDERS_APNS_TEAM_ID"),
    ("apns_topic", "REMINDERS_APNS_TOPIC"),
)


TOPIC = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # a bundle id, maybe with .voip/.complication


class ApnsConfigError(ValueError):
    """APNs settings that cannot work; the message names the environment variable."""


@dataclass(frozen=True)
class Credentials:
    """The ``REQUIRED`` settings, each known to be set (the settings allow None until sending)."""

    apns_key_file: str
    apns_key_id: str
    apns_team_id: str
    apns_topic: str


def required_credentials(settings: Settings) -> Credentials:
    """The ``REQUIRED`` settings, or ApnsConfigError naming the first variable not set."""
    values: dict[str, str] = {}
    for field_name, variable in REQUIRED:
        value: str | None = getattr(settings, field_name)
        if not value:
            raise ApnsConfigError(f"{variable} is not set (required when REMINDERS_ENABLED=true)")
        values[field_name] = value
    return Credentials(**values)


def validate_apns_settings(settings: Settings) -> Credentials:
    """Fail before any row is claimed, naming the variable, rather than on the first send."""
    credentials = required_credentials(settings)
    if not TOPIC.fullmatch(credentials.apns_topic):
        raise ApnsConfigError(f"REMINDERS_APNS_TOPIC must be an app bundle id, got {credentials.apns_topic!r}")
    load_signing_key(credentials.apns_key_file)
    endpoint(settings)
    ssl_context(settings)
    return credentials


def read_key_text(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ApnsConfigError(f"REMINDERS_APNS_KEY_FILE {path!r} is not readable: {exc}") from None


def load_signing_key(path: str) -> ec.EllipticCurvePrivateKey:
    """The .p8 key; APNs takes only EC P-256 (ES256)."""
    text = read_key_text(path)
    try:
        key = serialization.load_pem_private_key(text.encode(), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ApnsConfigError(f"REMINDERS_APNS_KEY_FILE {path!r} is not a PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise ApnsConfigError(f"REMINDERS_APNS_KEY_FILE {path!r} is not an EC P-256 key (an APNs .p8 key)")
    return key


def endpoint(settings: Settings) -> Endpoint:
    """Apple's production or sandbox host, or REMINDERS_APNS_URL (a proxy or a mock)."""
    if not settings.apns_url:
        base = APNsDevelopmentClientProtocol if settings.apns_environment == "sandbox" else APNsProductionClientProtocol
        return Endpoint(base.APNS_SERVER, base.APNS_PORT, base)
    url = urlsplit(settings.apns_url)
    try:
        port = url.port or 443
    except ValueError:
        port = 0
    if url.scheme != "https" or not url.hostname or not port or url.path not in ("", "/"):
        raise ApnsConfigError(f"REMINDERS_APNS_URL must look like https://host:port, got {settings.apns_url!r}")
    return Endpoint(url.hostname, port, APNsProductionClientProtocol)


def ssl_context(settings: Settings) -> ssl.SSLContext:
    """System trust, or REMINDERS_APNS_CA_FILE's (token auth ignores aioapns' no_cert_validation)."""
    try:
        ctx = ssl.create_default_context(cafile=settings.apns_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ApnsConfigError(
            f"REMINDERS_APNS_CA_FILE {settings.apns_ca_file!r} is not a readable CA bundle: {exc}"
        ) from None
    ctx.set_alpn_protocols(["h2"])
    return ctx


class ProviderToken(AuthorizationHeaderProvider):
    """One ES256 provider JWT per key and 30-minute window, the same in every process.

    ``iat`` is the start of the current window and the signature is deterministic (RFC 6979), so
    every connection, every sender and every drain run signs the identical token: it changes
    exactly once per window, inside Apple's 20-60 minute rule, whatever the run cadence.
    """

    REFRESH_SECONDS = 30 * 60
    SKEW_SECONDS = 120  # iat a little in the past, so a clock ahead of Apple's is not "in the future"

    def __init__(
        self, key: ec.EllipticCurvePrivateKey, key_id: str, team_id: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.key = key
        self.key_id = key_id
        self.team_id = team_id
        self.clock = clock
        self._iat: int | None = None
        self._header = ""

    def issued_at(self) -> int:
        window = self.REFRESH_SECONDS
        return int((self.clock() - self.SKEW_SECONDS) // window) * window

    def get_header(self) -> str:
        iat = self.issued_at()
        if iat != self._iat:
            self._header = f"bearer {self.sign(iat)}"
            self._iat = iat
        return self._header

    def sign(self, iat: int) -> str:
        header = b64url.encode(json.dumps({"alg": "ES256", "kid": self.key_id}, separators=(",", ":")).encode())
        claims = b64url.encode(json.dumps({"iss": self.team_id, "iat": iat}, separators=(",", ":")).encode())
        signing_input = f"{header}.{claims}".encode()
        r, s = decode_dss_signature(self.key.sign(signing_input, _ecdsa()))
        return f"{header}.{claims}.{b64url.encode(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def _ecdsa() -> ec.ECDSA:
    """RFC 6979 signing (``deterministic_signing``, cryptography 43+, the floor in pyproject.toml)."""
    try:
        return ec.ECDSA(hashes.SHA256(), deterministic_signing=True)
    except UnsupportedAlgorithm:  # an OpenSSL older than 3.2 under cryptography: shared per process only
        return ec.ECDSA(hashes.SHA256())
