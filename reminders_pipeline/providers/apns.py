"""The APNs sender: aioapns 4.0 with token auth, plus what aioapns lacks for at-most-once reminders.

This module is the drain's ``Sender`` adapter: its configuration, the provider token and the
mapping of every answer and failure to a ``SendResult``. What it changes inside aioapns, h2 and
hpack (stream slots, flow control, resets, header indexing, TLS writes, header checks) lives in
``apns_transport.py``, whose docstring lists each patch, the upstream bug it answers and its test.
Around aioapns' public API this module adds, each for a reason found against the mock APNs
(reminders_pipeline_testing/mock_apns.py):

* one provider JWT for every connection, sender and process (``ProviderToken``): aioapns signs one
  per connection, and APNs answers 429 TooManyProviderTokenUpdates when the token changes too often;
* which failures certainly never reached APNs (no connection, TLS failed, REFUSED_STREAM, a stream
  above a GOAWAY's last stream id, a stream refused on a connection APNs just closed, one stopped
  by its claim's fence; ``not-sent``), and which failed before the write for another reason
  (``not-written``, spending an attempt): ``SendResult.retry``, so the drain can return those rows
  to pending, while one that may have arrived stays failed;
* the exact ``apns-expiration`` (aioapns only takes a relative TTL) and compact JSON bodies, each
  serialised once (``Wire``);
* a shielded response timeout: aioapns has none, and a plain ``wait_for`` breaks the connection;
* no retries: ``max_connection_attempts=1``, so a request that may have reached APNs is never resent.

Longer than 350 lines because it is the whole adapter between the ``Sender`` interface and aioapns:
configuration checks, key loading, the shared provider token and the mapping of every answer and
failure, each short and used only here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import ssl
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aioapns import APNs, NotificationRequest, PushType
from aioapns.common import NotificationResult
from aioapns.connection import APNsDevelopmentClientProtocol, APNsProductionClientProtocol, AuthorizationHeaderProvider
from aioapns.exceptions import ConnectionClosed, MaxAttemptsExceeded
from aioapns.exceptions import ConnectionError as ApnsConnectionError
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from h2.exceptions import NoAvailableStreamIDError, ProtocolError

from reminders_pipeline.config.log_throttle import RepeatFilter
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain import b64url
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Notification
from reminders_pipeline.providers.apns_transport import (
    Endpoint,
    FenceExpired,
    NotProcessed,
    Wire,
    enabled_speed_patches,
    protocol_class,
)
from reminders_pipeline.providers.base import NOT_WRITTEN, SenderFactory, SendResult, fence_expired

logging.getLogger("aioapns").addFilter(RepeatFilter())  # every send's outcome is settled and summarised by the drain

REQUIRED = (
    ("apns_key_file", "REMINDERS_APNS_KEY_FILE"),
    ("apns_key_id", "REMINDERS_APNS_KEY_ID"),
    ("apns_team_id", "REMINDERS_APNS_TEAM_ID"),
    ("apns_topic", "REMINDERS_APNS_TOPIC"),
)
# APNs takes at most 4 KB of JSON body (``Notification.body``, compact as the transport sends it).

TOKEN_INVALID_REASONS = frozenset({"BadDeviceToken", "DeviceTokenNotForTopic", "Unregistered", "ExpiredToken"})
# 403 is always about our credentials; these other answers fail every send of the run alike.
CONFIG_FAULT_REASONS = frozenset({"TopicDisallowed", "BadTopic", "MissingTopic", "TooManyProviderTokenUpdates"})
DEVICE_TOKEN = re.compile(r"[0-9a-fA-F]{16,400}")
COLLAPSE_ID = re.compile(r"[\x21-\x7e]{1,64}")  # a header value: printable ASCII, APNs' 64 bytes
TOPIC = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")  # a bundle id, maybe with .voip/.complication
TIMEOUT = "timeout"  # sent, no answer in time: it may still be delivered (once)
TIMEOUT_NOT_SENT = "timeout:not-sent"  # never left this process (no connection in time)
NOT_SENT = "not-sent"  # reason prefix: certainly never processed by APNs (SendResult.retry)
# What failing to reach APNs raises before a request is written: no connection, TLS, DNS, a pool
# out of attempts or stream ids, GOAWAY and REFUSED_STREAM (NotProcessed is a ConnectionError),
# and h2 refusing to open a stream on a connection APNs has just closed.
UNREACHED = (
    OSError,
    ApnsConnectionError,
    ConnectionClosed,
    MaxAttemptsExceeded,
    NoAvailableStreamIDError,
    ProtocolError,
)
# APNs declined to process the request for now: nothing was delivered, the row may go again.
TRANSIENT_STATUSES = frozenset({429, 500, 503})


class ApnsConfigError(ValueError):
    """APNs settings that cannot work; the message names the environment variable."""


# -- configuration ---------------------------------------------------------------------------


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


# -- the provider token ----------------------------------------------------------------------


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


# -- answers ---------------------------------------------------------------------------------


def result_from_apns(row_id: int, answer: NotificationResult, answered_at: float | None = None) -> SendResult:
    """APNs' answer as a SendResult; the table is spelled out in test_apns_sender.py."""
    status = int(answer.status) if str(answer.status).isdigit() else None
    if status == 200:
        return SendResult(row_id, True, status=200, provider_message_id=answer.notification_id, answered_at=answered_at)
    reason = answer.description or f"HTTP {answer.status}"
    invalid_at = None
    if status == 410 and answer.timestamp is not None:
        invalid_at = _instant_from_ms(answer.timestamp)
    config_fault = status == 403 or reason in CONFIG_FAULT_REASONS
    return SendResult(
        row_id,
        False,
        reason=reason,
        status=status,
        provider_message_id=answer.notification_id,
        token_invalid=status == 410 or reason in TOKEN_INVALID_REASONS,
        token_invalid_at=invalid_at,
        config_fault=config_fault,
        retry=status in TRANSIENT_STATUSES and not config_fault,
        answered_at=answered_at,
    )


def _instant_from_ms(timestamp: Any) -> Instant | None:
    """APNs' ``timestamp`` (Unix milliseconds) of a 410, if it is one."""
    try:
        return Instant(int(timestamp))
    except (TypeError, ValueError):
        return None


def result_from_error(row_id: int, exc: BaseException, written: bool) -> SendResult:
    """A failed send: certainly not delivered when APNs could not be reached before the write or
    said it did not process it (it may go again, spending no attempt), or when anything else failed
    before the write (``NOT_WRITTEN``: it may go again, spending one); otherwise it may have reached
    APNs (the connection died after the write)."""
    if isinstance(exc, FenceExpired):
        return fence_expired(row_id)
    if isinstance(exc, NotProcessed):
        return SendResult(row_id, False, reason=f"{NOT_SENT}:{exc}", retry=True)
    if not written and isinstance(exc, UNREACHED):
        return SendResult(row_id, False, reason=f"{NOT_SENT}:{type(exc).__name__}", retry=True)
    if not written:  # anything else before the write: it may fail the same way, and says nothing of APNs
        return SendResult(row_id, False, reason=f"{NOT_WRITTEN}:{type(exc).__name__}", retry=True)
    return SendResult(row_id, False, reason=f"transport:{type(exc).__name__}")


def wire_for(n: Notification, now: float) -> Wire:
    """APNs' ``0`` means "try once, do not store": the right thing for an already stale alert."""
    expiration = n.expiration if n.expiration > now else 0
    return Wire(str(expiration), n.body, send_by=n.send_by)


# -- the sender ------------------------------------------------------------------------------


def default_max_connections(concurrency: int) -> int:
    """One connection carries ~1000 streams once APNs trusts the token; a second adds resilience."""
    return max(1, min(8, math.ceil(concurrency / 100)))


class AioApnsSender:
    """The drain's Sender on aioapns. Build it inside the running loop (aioapns binds to it)."""

    def __init__(
        self, settings: Settings, *, max_connections: int | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        credentials = validate_apns_settings(settings)
        self.settings = settings
        self.clock = clock
        key_text = read_key_text(credentials.apns_key_file)
        self.token = ProviderToken(
            load_signing_key(credentials.apns_key_file), credentials.apns_key_id, credentials.apns_team_id, clock
        )
        self._wire: dict[str, Wire] = {}
        self._slots = asyncio.Semaphore(settings.apns_concurrency)
        self._tasks: dict[asyncio.Task[NotificationResult], str] = {}  # -> notification id
        self.apns = APNs(
            key=key_text,  # aioapns 4.0 wants the PEM text, not the path
            key_id=credentials.apns_key_id,
            team_id=credentials.apns_team_id,
            topic=credentials.apns_topic,
            max_connections=max_connections or default_max_connections(settings.apns_concurrency),
            max_connection_attempts=1,
            use_sandbox=settings.apns_environment == "sandbox",
            ssl_context=ssl_context(settings),
            err_func=_ignore_error,
        )
        self.apns.pool.protocol_class = protocol_class(endpoint(settings), self.token, self._wire)

    async def send_many(self, notifications: Sequence[Notification]) -> list[SendResult]:
        """One result per notification, in order. The first goes alone while no connection is open.

        APNs allows one stream per connection until it has seen a valid token; sending one first
        lets that connection be raised, instead of a burst opening every connection the pool may.
        """
        pending = list(notifications)
        results: list[SendResult] = []
        if pending and not self._has_open_connection():
            results.append(await self.send_one(pending.pop(0)))
        results.extend(await asyncio.gather(*(self.send_one(n) for n in pending)))
        return results

    def _has_open_connection(self) -> bool:
        return any(c.free_channels.bound > 1 for c in self.apns.pool.connections)

    async def send_one(self, n: Notification) -> SendResult:
        """Once, within the concurrency bound and the timeout; never raises for a failed send."""
        if not DEVICE_TOKEN.fullmatch(n.device_token):
            # APNs tokens are hex; anything else would break the :path or the h2 headers.
            return SendResult(n.row_id, False, reason="BadDeviceToken", token_invalid=True)
        if not COLLAPSE_ID.fullmatch(n.collapse_id):
            return SendResult(n.row_id, False, reason="invalid:collapse_id")
        try:
            request = self._request(n)
        except (TypeError, ValueError) as exc:  # payload not JSON, unknown push type
            return SendResult(n.row_id, False, reason=f"invalid:{type(exc).__name__}")
        wire = self._wire[request.notification_id]
        async with self._slots:
            task = self._start(request)
            try:
                answer = await asyncio.wait_for(asyncio.shield(task), self.settings.send_timeout_seconds)
            except TimeoutError:
                return self._abandon(n.row_id, task, request)
            except Exception as exc:  # noqa: BLE001 - any failure inside aioapns/h2 is a failed send
                return result_from_error(n.row_id, exc, wire.written)
        return result_from_apns(n.row_id, answer, time.monotonic())

    def _request(self, n: Notification) -> NotificationRequest:
        request = NotificationRequest(
            device_token=n.device_token,
            # the body sent is Wire.body; aioapns would serialise the payload and throw it away
            message={} if "one_serialisation" in enabled_speed_patches else n.payload,
            notification_id=str(uuid.uuid4()),
            time_to_live=0,  # makes aioapns emit the header; WireH2Connection sets its value
            priority=n.priority,
            collapse_key=n.collapse_id,
            push_type=PushType(n.push_type),
        )
        self._wire[request.notification_id] = wire_for(n, self.clock())
        return request

    def _start(self, request: NotificationRequest) -> asyncio.Task[NotificationResult]:
        task = asyncio.ensure_future(self.apns.send_notification(request))
        self._tasks[task] = request.notification_id
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[NotificationResult]) -> None:
        self._wire.pop(self._tasks.pop(task, ""), None)
        if not task.cancelled():
            task.exception()  # retrieved: an abandoned send's error is not "never retrieved"

    def _abandon(self, row_id: int, task: asyncio.Task[NotificationResult], request: NotificationRequest) -> SendResult:
        """A send not yet on the wire is cancelled (safe, and it may go again); one on the wire is
        left to finish.

        Cancelling a request aioapns has sent would make its late answer raise inside the
        connection and fail every other request on it.
        """
        if request.notification_id in self._wire:
            task.cancel()
            return SendResult(row_id, False, reason=TIMEOUT_NOT_SENT, retry=True)
        return SendResult(row_id, False, reason=TIMEOUT)

    async def aclose(self) -> None:
        """Close connections; sends still waiting for an answer end as transport failures."""
        for task, notification_id in list(self._tasks.items()):
            if notification_id in self._wire:
                task.cancel()
        self.apns.pool.close()
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        for task in pending:
            task.cancel()
        await self._connections_closed(timeout=1.0)

    async def _connections_closed(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.apns.pool.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


async def _ignore_error(request: NotificationRequest, result: NotificationResult) -> None:
    """aioapns logs every non-200 at ERROR; the drain records each answer in the ledger instead."""


def apns_sender_factory(settings: Settings) -> SenderFactory:
    """Validates now (no loop needed); the sender itself is built when the drain calls the factory."""
    validate_apns_settings(settings)
    return lambda: AioApnsSender(settings)
