"""Web Push as a ``Sender``: RFC 8030 delivery, RFC 8291 payload encryption (``aes128gcm``) and
RFC 8292 VAPID, through http-ece and py-vapid, over one shared HTTP/2-capable httpx client.

A device's target is the browser's ``PushSubscription``: an endpoint URL on its push service and
two keys (``p256dh``, ``auth``). The endpoint comes from a user, so it passes the egress guard
twice: at registration (``push_subscription.check_reachable``, from ``registration.put_device``) and at every connection
(``egress.GuardedBackend``).
Requests to one push service (one origin, ``push_subscription.origin_of``: ``HTTPS://Push.Example:443`` is
``https://push.example``) are bounded (``REMINDERS_WEBPUSH_PER_HOST``); what is kept per origin
(its slots, its VAPID header) is forgotten least recently used first past ``MAX_PUSH_SERVICES``.
What goes wrong with one row (a stored endpoint that no longer parses, a bug) fails that row alone.

Each alert is encrypted to the subscription's key with a fresh sender key, so the push service
sees nothing but its size; the browser's service worker reads ``{"title", "body", "tag",
"category", "reminder"}`` (``web_payload``). Headers: ``TTL`` the seconds to the event's start (or
end), so a browser offline until then never shows it; ``Topic`` one per item (a later alert
replaces an earlier undelivered one); ``Urgency: high``.

Answers (docs/operations.md, "Every Web Push answer"): 200-202 sent; 404 and 410 the subscription
is gone (the device is marked, as for APNs' ``Unregistered``); 413 too large; 429, 500 and 503 back
off (``Retry-After`` honoured, up to a day); any other answer fails the row, 401 (VAPID refused)
included, and so does any other 5xx, 502 and 504 first: a gateway's answer may come after the
push service took the message, and sending it again could show it twice. The endpoint is a
user's choice, so nothing it answers halts the drain or counts toward the outage breaker, and it
is given a few kilobytes of answer at most. A request never written (a connect or TLS handshake
that stalls, a wait for a connection or for its push service's slot, each given the send timeout)
goes back to pending (``not-sent:…``); only one whose headers began to leave, and whose answer
did not come within the send timeout from then, fails ``timeout`` (``request_trace``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import http_ece
import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from py_vapid import Vapid02
from py_vapid import jwt as vapid_jwt

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain import b64url
from reminders_pipeline.domain.wire import WEBPUSH_MAX_PAYLOAD_BYTES as MAX_PAYLOAD_BYTES
from reminders_pipeline.domain.wire import Notification, web_payload
from reminders_pipeline.providers import request_trace
from reminders_pipeline.providers.base import SendResult, fence_expired
from reminders_pipeline.providers.push_subscription import Subscription
from reminders_pipeline.providers.request_trace import NOT_SENT, Attempt, FencePassed
from reminders_pipeline.sources.egress import GuardedTransport, parse_networks

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_SECONDS = 86400  # a longer Retry-After is read as a day: a wait no reminder outlives
MAX_PUSH_SERVICES = 1000  # origins whose state is kept once idle (most recently used)
MAX_ANSWER_BYTES = 4096  # of an answer's body read; a push service's answers are short
VAPID_SECONDS = 12 * 3600  # a VAPID JWT's life (RFC 8292 allows up to 24 h); re-signed per audience before
# Answers that say the push service did not take the message: throttled (429), or failed or
# unavailable itself (500, 503). Any other 5xx, 502 and 504 from a gateway first, may come after
# the message was handed on: failed, never sent again.
NOT_PROCESSED = frozenset({429, 500, 503})
GONE = "subscription_gone"


def generate_key(path: str) -> str:
    """Write a new VAPID key pair's private key (PEM) to ``path``; returns the public key as the
    browser's ``applicationServerKey`` (base64url of the uncompressed point)."""
    vapid = Vapid02()
    vapid.generate_keys()
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # its owner's alone, from the start
    vapid.save_key(path)
    return public_key_text(vapid)


def public_key_text(vapid: Vapid02) -> str:
    raw = vapid.public_key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    return b64url.encode(raw)


def served_public_key(settings: Settings) -> str | None:
    """The VAPID public key web clients subscribe with, when Web Push is configured and its key
    reads; one that does not read is logged, and no web client can subscribe."""
    if not settings.vapid_private_key_file:
        return None
    try:
        return public_key_text(load_key(settings))
    except RuntimeError as exc:
        log.error("no VAPID public key to serve: %s", exc)
        return None


def load_key(settings: Settings) -> Vapid02:
    """The VAPID key; ``RuntimeError`` saying what is wrong when it cannot be read."""
    if not settings.vapid_private_key_file:
        raise RuntimeError("Web Push needs REMINDERS_VAPID_PRIVATE_KEY_FILE (reminders vapid generate)")
    try:
        return Vapid02.from_file(settings.vapid_private_key_file)
    except Exception as exc:  # py-vapid raises its own kinds, and OSError, for a file it cannot use
        raise RuntimeError(
            f"REMINDERS_VAPID_PRIVATE_KEY_FILE is not a readable VAPID key ({type(exc).__name__})"
        ) from None


def signing_key(settings: Settings) -> tuple[Vapid02, str]:
    """The VAPID key and subject a sender signs with, checked before any claim."""
    if not settings.vapid_subject:
        raise RuntimeError("Web Push needs REMINDERS_VAPID_SUBJECT (a mailto: or https: contact)")
    return load_key(settings), settings.vapid_subject


def topic(collapse_id: str) -> str:
    """RFC 8030's Topic: at most 32 characters of base64url, one per item."""
    return b64url.encode(hashlib.sha256(collapse_id.encode()).digest()[:24])


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta seconds or an HTTP date), at most
    ``MAX_RETRY_AFTER_SECONDS``; None for a header that is neither."""
    text = (value or "").strip()
    if not text:
        return None
    try:
        wait = float(text) if text.isascii() and text.isdigit() else parsedate_to_datetime(text).timestamp() - now
    except (TypeError, ValueError, OverflowError):
        return None
    return min(max(0.0, wait), MAX_RETRY_AFTER_SECONDS)


@dataclass
class PushService:
    """What the sender keeps per push service (one origin): its slots and its VAPID header."""

    slots: asyncio.Semaphore
    users: int = 0  # rows holding or waiting for a slot: the entry is in use, never evicted
    authorization: tuple[float, str] | None = None  # (expiry, Authorization header)


class PushServices:
    """Per-origin state, at most ``limit`` entries once the idle ones are evicted, least recently
    used first: endpoints are users' choices, so their origins are unbounded."""

    def __init__(self, per_host: int, limit: int = MAX_PUSH_SERVICES) -> None:
        self.per_host, self.limit = per_host, limit
        self.entries: OrderedDict[str, PushService] = OrderedDict()

    @contextmanager
    def use(self, origin: str) -> Iterator[PushService]:
        """The origin's entry, held (not evictable) until the block ends."""
        entry = self.entries.get(origin)
        if entry is None:
            entry = self.entries[origin] = PushService(asyncio.Semaphore(self.per_host))
        self.entries.move_to_end(origin)
        entry.users += 1
        try:
            self._evict()
            yield entry
        finally:
            entry.users -= 1

    def _evict(self) -> None:
        if len(self.entries) <= self.limit:
            return
        idle = [origin for origin, entry in self.entries.items() if entry.users == 0]
        for origin in idle[: len(self.entries) - self.limit]:
            del self.entries[origin]


class WebPushSender:
    """Sends each notification once, never retried here; one ``SendResult`` per notification."""

    def __init__(self, settings: Settings, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.vapid, self.subject = signing_key(settings)
        self.public_key = public_key_text(self.vapid)
        self.timeout = settings.send_timeout_seconds
        self.monotonic = monotonic
        context = ssl.create_default_context(cafile=settings.webpush_ca_file) if settings.webpush_ca_file else None
        limits = httpx.Limits(max_connections=settings.webpush_concurrency)
        transport = GuardedTransport(
            parse_networks(settings.webpush_allow_networks), limits, ssl_context=context, http2=True
        )
        self.client = httpx.AsyncClient(transport=transport, timeout=self.timeout, trust_env=False)
        self.services = PushServices(settings.webpush_per_host)

    def _authorization(self, origin: str, service: PushService) -> str:
        """One VAPID JWT per push service, signed again an hour before it expires. Signed by
        py-vapid's ES256 signer itself: ``Vapid02.sign`` refuses an IPv6 literal ``aud``
        (``https://[::1]:8443``) and an https ``sub`` with a path, both valid in RFC 8292; the
        ``aud`` here is a parsed origin and ``sub`` was checked when the settings were read."""
        now = time.time()
        cached = service.authorization
        if cached is None or cached[0] - now < 3600:
            exp = int(now) + VAPID_SECONDS
            token = vapid_jwt.sign({"aud": origin, "exp": exp, "sub": self.subject}, self.vapid.private_key)
            service.authorization = cached = (exp, f"vapid t={token},k={self.public_key}")
        return cached[1]

    async def send_many(self, notifications: Sequence[Notification]) -> list[SendResult]:
        """One result per notification: what goes wrong with one row, unforeseen included, fails
        that row alone, never the rows sent beside it."""
        answers = await asyncio.gather(*(self._one(n) for n in notifications), return_exceptions=True)
        return [
            a if isinstance(a, SendResult) else SendResult(n.row_id, False, reason=f"sender_error:{type(a).__name__}")
            for n, a in zip(notifications, answers)
        ]

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _one(self, note: Notification) -> SendResult:
        try:
            subscription = Subscription.stored(note.device_token)
            origin = subscription.origin
            body = http_ece.encrypt(
                web_payload(note),
                private_key=ec.generate_private_key(ec.SECP256R1()),
                dh=b64url.decode(subscription.p256dh),
                auth_secret=b64url.decode(subscription.auth),
                version="aes128gcm",
            )
        except (ValueError, KeyError, TypeError) as exc:
            return SendResult(note.row_id, False, reason=f"invalid:{type(exc).__name__}")
        if len(body) > MAX_PAYLOAD_BYTES:
            return SendResult(note.row_id, False, reason="PayloadTooLarge")
        with self.services.use(origin) as service:
            headers = {
                "TTL": str(max(0, note.expiration - math.ceil(time.time()))),  # never past the expiration
                "Topic": topic(note.collapse_id),
                "Urgency": "high",
                "Content-Encoding": "aes128gcm",
                "Content-Type": "application/octet-stream",
                "Authorization": self._authorization(origin, service),
            }
            if not await self._slot(service):
                return SendResult(note.row_id, False, reason=f"{NOT_SENT}:slot_timeout", retry=True, outage=False)
            try:
                if note.past_deadline(self.monotonic()):
                    return fence_expired(note.row_id)
                return await self._post(note, subscription.endpoint, headers, body)
            finally:
                service.slots.release()

    async def _slot(self, service: PushService) -> bool:
        """One of the push service's slots, waited for at most the send timeout (False: none came).
        A row queued behind its own push service's stalled requests is never written, and goes
        back to pending rather than holding its batch, and the rows to other push services in it,
        for each stall in turn."""
        try:
            async with asyncio.timeout(self.timeout):
                await service.slots.acquire()
        except TimeoutError:
            return False
        return True

    async def _post(self, note: Notification, endpoint: str, headers: dict[str, str], body: bytes) -> SendResult:
        """The request, and at most ``MAX_ANSWER_BYTES`` of its answer (httpx bounds each read, not
        the answer): the send timeout to write it, and again from then on for the answer
        (``request_trace.Attempt``). A slow endpoint holds its own row alone."""
        attempt = Attempt(self.timeout, note.send_by, self.monotonic)
        try:
            async with attempt.bounded() as extensions:
                async with self.client.stream(
                    "POST", endpoint, headers=headers, content=body, extensions=extensions
                ) as response:
                    read = 0
                    async for part in response.aiter_raw():
                        read += len(part)
                        if read >= MAX_ANSWER_BYTES:
                            break
        except (TimeoutError, FencePassed, httpx.HTTPError) as exc:
            return transport_failure(note.row_id, exc, attempt.written, attempt.connecting)
        return answer(note.row_id, response.status_code, response.headers, self.monotonic())


def transport_failure(row_id: int, exc: Exception, written: bool, connecting: bool = True) -> SendResult:
    """A request to a user's endpoint that got no answer (``request_trace.transport_failure``):
    nothing it does counts toward an outage."""
    return request_trace.transport_failure(row_id, exc, written=written, outage=False, connecting=connecting)


def answer(row_id: int, status: int, headers: Mapping[str, str], answered_at: float) -> SendResult:
    """A push service's answer as a ``SendResult`` (see the module docstring)."""
    if status in (200, 201, 202):
        return SendResult(row_id, True, status=status, answered_at=answered_at)
    if status in (404, 410):
        return SendResult(row_id, False, reason=GONE, status=status, token_invalid=True, answered_at=answered_at)
    if status == 413:
        return SendResult(row_id, False, reason="PayloadTooLarge", status=status, answered_at=answered_at)
    if status in NOT_PROCESSED:  # the endpoint is a user's choice: no outage of ours
        wait = retry_after(headers.get("retry-after"), time.time())
        return SendResult(
            row_id, False, reason=f"http_{status}", status=status, retry=True, retry_after=wait, outage=False,
            answered_at=answered_at,
        )  # fmt: skip
    if status >= 500:  # 502, 504 (a gateway's) and the rest: the message may have been taken on
        return SendResult(row_id, False, reason=f"http_{status}", status=status, outage=False, answered_at=answered_at)
    # 401 (VAPID refused) too fails the row alone: a user's endpoint may answer it to anyone.
    reason = "vapid_refused" if status == 401 else f"http_{status}"
    return SendResult(row_id, False, reason=reason, status=status, answered_at=answered_at)
