"""What the drain hands a push provider, what it gets back, and which provider it hands it to.

The drain builds a sender inside its running event loop (``SenderFactory``), because aioapns binds
its connection pool to the loop that exists when it is constructed. ``send_fenced`` is the one way
the drain sends: no request leaves after its claim's fence (``fence_deadline``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any, Protocol

from .times import Instant

if TYPE_CHECKING:
    from .settings import Settings

log = logging.getLogger(__name__)


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
    provider: str = "apns"  # who delivers it (``devices.provider``): apns, webpush or fcm
    # time.monotonic() after which the request must not leave: the claim's fence (sender.fence_deadline).
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
class SendResult:
    """One answer. ``ok`` settles the row ``sent``; anything else settles it ``failed`` with ``reason``,
    except that ``retry`` (certainly not delivered) returns it to pending while attempts remain."""

    row_id: int
    ok: bool
    reason: str | None = None  # APNs reason ("Unregistered"), or a transport error ("timeout")
    status: int | None = None  # HTTP status, when there was one
    apns_id: str | None = None
    token_invalid: bool = False  # stop sending to this token (410, BadDeviceToken, ...)
    token_invalid_at: Instant | None = None  # APNs' timestamp for 410
    config_fault: bool = False  # our credentials/topic are wrong: stop claiming in this run
    # time.monotonic() when the answer arrived: the row's sent_at. Not part of what the answer *is*.
    answered_at: float | None = field(default=None, compare=False)
    retry: bool = False  # certainly not delivered (never reached APNs, or 429/500/503): may go again
    retry_after: float | None = None  # the provider's Retry-After, seconds: the row waits at least this long
    outage: bool = True  # counts toward the outage breaker; not an answer a user's own endpoint chose
    # The device's fault or ours, told apart only across devices (FCM's SENDER_ID_MISMATCH: a token
    # of another app, or our key of another project): the row goes again as ``retry`` does, and its
    # provider halts as for a configuration fault once several devices in a row answer it.
    maybe_ours: bool = False


class Sender(Protocol):
    async def send_many(self, notifications: Sequence[Notification]) -> list[SendResult]:
        """Send each notification once (never retried here); one result per notification, any order."""

    async def aclose(self) -> None: ...


SenderFactory = Callable[[], Sender]

# The reason a send was refused at the last moment because its claim's fence had passed: it
# certainly never left this process, and the row goes back to pending if the claim is still ours.
FENCE_EXPIRED = "not-sent:fence_expired"
# The reason prefix of a send that failed before its write for a reason other than reaching APNs:
# certainly not delivered, so it may go again, but spending an attempt (it may fail the same way),
# and saying nothing of whether APNs is out.
NOT_WRITTEN = "not-written"
# What a request that waited out its send timeout for a pooled connection fails as (``not-sent:``
# it): a wait other rows' connections caused, so it spends none of the row's attempts.
POOL_WAIT = "pool_timeout"


def fence_expired(row_id: int) -> SendResult:
    return SendResult(row_id, False, reason=FENCE_EXPIRED, retry=True)


@dataclass(frozen=True)
class PayloadLimit:
    """What one provider's service accepts of an alert: at most ``max_bytes`` of ``wire(note)``,
    the bytes its limit counts (APNs: the JSON body; Web Push: the plaintext it encrypts; FCM:
    the message). Each provider's module states its own (``PAYLOAD_LIMIT``)."""

    max_bytes: int
    wire: Callable[[Notification], bytes]


@cache
def payload_limit(provider: str) -> PayloadLimit:
    """The payload limit of ``provider`` (``devices.provider``), from its own module: imported
    here, on first use, as ``default_sender_factory`` imports its sender, so what composes an
    alert depends on no provider. Cached: every row of a drain asks."""
    if provider == "webpush":
        from .webpush import PAYLOAD_LIMIT as webpush_limit  # noqa: PLC0415

        return webpush_limit
    if provider == "fcm":
        from .fcm import PAYLOAD_LIMIT as fcm_limit  # noqa: PLC0415

        return fcm_limit
    from .apns import PAYLOAD_LIMIT as apns_limit  # noqa: PLC0415

    return apns_limit


@dataclass
class RecordingSender:
    """Records what it would send; answers from a script keyed by device token (default: 200).

    Used by tests and by anything that wants a sender without a network. ``sent`` outlives the
    event loop, so a test can inspect it after the drain returns. Like the APNs sender, it refuses a
    notification whose fence has passed on ``monotonic`` (a test drives it to simulate a pause).
    """

    script: dict[str, SendResult | Callable[[Notification], SendResult]] = field(default_factory=dict)
    sent: list[Notification] = field(default_factory=list)
    monotonic: Callable[[], float] = time.monotonic
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def send_many(self, notifications: Sequence[Notification]) -> list[SendResult]:
        results = []
        for n in notifications:
            if n.past_deadline(self.monotonic()):
                results.append(fence_expired(n.row_id))
                continue
            self.sent.append(n)
            scripted = self.script.get(n.device_token)
            if scripted is None:
                results.append(SendResult(n.row_id, True, status=200, apns_id=f"recorded-{next(self._ids)}"))
            elif callable(scripted):
                results.append(scripted(n))
            else:
                results.append(SendResult(n.row_id, **{k: v for k, v in vars(scripted).items() if k != "row_id"}))
        return results

    async def aclose(self) -> None:
        return None

    def factory(self) -> SenderFactory:
        return lambda: self


def default_sender_factory(settings: Settings, in_use: Collection[str] = ()) -> SenderFactory:
    """Each configured provider's sender, credentials checked now, before any claim; no sender at
    all in a dry run. APNs is checked when any of its settings is set, or when nothing else is
    (so a deployment with no provider at all is refused). ``in_use``: the providers live devices
    use (``ledger.providers_in_use``); one of them this deployment has no credentials for is
    refused here (ValueError), before anything is claimed, rather than failing each of its rows.
    A ``RoutingSender`` hands each notification to its device's provider."""
    if not settings.enabled:

        def refuse() -> Sender:
            raise RuntimeError("REMINDERS_ENABLED is not 'true': a dry run never connects to APNs")

        return refuse
    factories: dict[str, SenderFactory] = {}
    if settings.vapid_private_key_file or settings.vapid_subject:
        from .webpush import WebPushSender, signing_key  # noqa: PLC0415

        signing_key(settings)
        factories["webpush"] = lambda: WebPushSender(settings)
    if settings.fcm_credentials_file:
        from .fcm import FcmSender, load_credentials  # noqa: PLC0415

        load_credentials(settings)
        factories["fcm"] = lambda: FcmSender(settings)
    if not factories or any(getattr(settings, name) for name in APNS_SETTINGS):
        from .apns import apns_sender_factory  # noqa: PLC0415

        factories["apns"] = apns_sender_factory(settings)
    missing = sorted(set(in_use) - set(factories))
    if missing:
        raise ValueError(
            f"devices are delivered by {', '.join(missing)}, which this deployment has no credentials for "
            f"(set {'; '.join(PROVIDER_SETTINGS[p] for p in missing)}): nothing was claimed"
        )
    return lambda: RoutingSender(factories)


APNS_SETTINGS = ("apns_key_file", "apns_key_id", "apns_team_id", "apns_topic")
PROVIDER_SETTINGS = {
    "apns": "REMINDERS_APNS_KEY_FILE, _KEY_ID, _TEAM_ID and _TOPIC",
    "webpush": "REMINDERS_VAPID_PRIVATE_KEY_FILE and REMINDERS_VAPID_SUBJECT",
    "fcm": "REMINDERS_FCM_CREDENTIALS_FILE",
}
NOT_CONFIGURED = "provider_not_configured"


@dataclass
class RoutingSender:
    """Hands each notification to its device's provider (``Notification.provider``), each
    provider's sender made on first use inside the running loop. A notification for a provider
    this deployment has no credentials for fails (``provider_not_configured:webpush``, logged):
    it can never be sent here, and the other providers' rows go on."""

    factories: dict[str, SenderFactory]
    senders: dict[str, Sender] = field(default_factory=dict)

    async def send_many(self, notifications: Sequence[Notification]) -> list[SendResult]:
        groups: dict[str, list[Notification]] = {}
        for n in notifications:
            groups.setdefault(n.provider, []).append(n)
        answers = await asyncio.gather(
            *(self._send(provider, notes) for provider, notes in groups.items()), return_exceptions=True
        )
        out: list[SendResult] = []
        for notes, part in zip(groups.values(), answers):
            if isinstance(part, BaseException):  # one provider's sender raised: only its rows fail
                log.error("the %s sender raised (%s); its %d row(s) fail", notes[0].provider, part, len(notes))
                out += [SendResult(n.row_id, False, reason=f"sender_error:{type(part).__name__}") for n in notes]
            else:
                out += part
        return out

    async def _send(self, provider: str, notes: list[Notification]) -> list[SendResult]:
        if provider not in self.factories:
            log.error("%d row(s) for %s, which this deployment has no credentials for: failed", len(notes), provider)
            return [SendResult(n.row_id, False, reason=f"{NOT_CONFIGURED}:{provider}") for n in notes]
        if provider not in self.senders:
            self.senders[provider] = self.factories[provider]()
        return await self.senders[provider].send_many(notes)

    async def aclose(self) -> None:
        for sender in self.senders.values():
            try:
                await sender.aclose()
            except Exception:  # noqa: BLE001 - one sender's close must not leave the others open
                log.exception("closing a sender failed")


def fence_deadline(settings: Settings, claimed_at: float) -> float:
    """When a claim taken at ``claimed_at`` (``time.monotonic()``, read before the claim's transaction)
    stops sending: no request of it may leave after this.

    No other process touches a claim younger than ``abandon_after_seconds`` (it is failed as
    abandoned only after that). A request written before this deadline is answered within the send
    timeout, and ``fence_margin_seconds`` covers clock skew between hosts and the settling commit,
    so the claim is settled by its owner before anyone may fail it. A process paused past the
    deadline (GC, SIGSTOP, a stalled VM) therefore never sends a row that may have been failed,
    re-armed and sent elsewhere meanwhile. A local clock, not a database round trip per send.
    """
    return claimed_at + settings.abandon_after_seconds - settings.send_timeout_seconds - settings.fence_margin_seconds


async def send_fenced(
    sender: Sender, notes: list[Notification], send_by: float, monotonic: Callable[[], float]
) -> tuple[list[SendResult], set[int]]:
    """Send ``notes`` fenced by ``send_by``; returns the answers and the ids refused by the fence.

    Checked here once for every sender, and again by the sender itself at the moment the bytes
    leave (the APNs transport, ``RecordingSender``), so a pause anywhere before the write is caught.
    A fenced row certainly never reached APNs: it goes back to pending, guarded by our claim, so if
    the claim was failed as abandoned meanwhile the row is left as the other process settled it.
    """
    if monotonic() >= send_by:
        results = [fence_expired(n.row_id) for n in notes]
    else:
        results = await _send(sender, [n.fenced(send_by) for n in notes])
    fenced = {r.row_id for r in results if r.reason == FENCE_EXPIRED}
    if fenced:
        log.error(
            "%d claimed row(s) not sent: the claim's fence passed (a paused process?); pending again if still ours",
            len(fenced),
        )
    return [r for r in results if r.reason != FENCE_EXPIRED], fenced


async def _send(sender: Sender, notes: list[Notification]) -> list[SendResult]:
    try:
        return await sender.send_many(notes)
    except Exception as exc:  # a sender bug must still settle every claimed row (failed, not retried)
        log.exception("sender raised; %d claimed row(s) settle failed", len(notes))
        return [SendResult(n.row_id, False, reason=f"sender_error:{type(exc).__name__}") for n in notes]
