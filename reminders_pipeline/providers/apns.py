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

Its configuration checks, key loading and the shared provider token are ``apns_config.py``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from aioapns import APNs, NotificationRequest, PushType
from aioapns.common import NotificationResult
from aioapns.exceptions import ConnectionClosed, MaxAttemptsExceeded
from aioapns.exceptions import ConnectionError as ApnsConnectionError
from h2.exceptions import NoAvailableStreamIDError, ProtocolError

from reminders_pipeline.config.log_throttle import RepeatFilter
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.outcomes import TIMEOUT, transport
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Notification
from reminders_pipeline.providers.apns_config import (
    ProviderToken,
    endpoint,
    load_signing_key,
    read_key_text,
    ssl_context,
    validate_apns_settings,
)
from reminders_pipeline.providers.apns_transport import (
    FenceExpired,
    NotProcessed,
    Wire,
    enabled_speed_patches,
    protocol_class,
)
from reminders_pipeline.providers.base import NOT_WRITTEN, SenderFactory, SendResult, fence_expired

logging.getLogger("aioapns").addFilter(RepeatFilter())  # every send's outcome is settled and summarised by the drain

# APNs takes at most 4 KB of JSON body (``Notification.body``, compact as the transport sends it).

TOKEN_INVALID_REASONS = frozenset({"BadDeviceToken", "DeviceTokenNotForTopic", "Unregistered", "ExpiredToken"})
# 403 is always about our credentials; these other answers fail every send of the run alike.
CONFIG_FAULT_REASONS = frozenset({"TopicDisallowed", "BadTopic", "MissingTopic", "TooManyProviderTokenUpdates"})
DEVICE_TOKEN = re.compile(r"[0-9a-fA-F]{16,400}")
COLLAPSE_ID = re.compile(r"[\x21-\x7e]{1,64}")  # a header value: printable ASCII, APNs' 64 bytes
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
    return SendResult(row_id, False, reason=transport(exc))


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
