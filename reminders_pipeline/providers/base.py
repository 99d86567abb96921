"""What a push provider gets back for a ``Notification``, and how the drain sends through one.

The drain builds a sender inside its running event loop (``SenderFactory``), because aioapns binds
its connection pool to the loop that exists when it is constructed. ``send_fenced`` is the one way
the drain sends: no request leaves after its claim's fence (``fence_deadline``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Notification

if TYPE_CHECKING:
    from reminders_pipeline.config.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendResult:
    """One answer. ``ok`` settles the row ``sent``; anything else settles it ``failed`` with ``reason``,
    except that ``retry`` (certainly not delivered) returns it to pending while attempts remain."""

    row_id: int
    ok: bool
    reason: str | None = None  # APNs reason ("Unregistered"), or a transport error ("timeout")
    status: int | None = None  # HTTP status, when there was one
    provider_message_id: str | None = (
        None  # the provider's id of the message (apns-id, FCM's name), kept as the row's apns_id
    )
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
                results.append(
                    SendResult(n.row_id, True, status=200, provider_message_id=f"recorded-{next(self._ids)}")
                )
            elif callable(scripted):
                results.append(scripted(n))
            else:
                results.append(SendResult(n.row_id, **{k: v for k, v in vars(scripted).items() if k != "row_id"}))
        return results

    async def aclose(self) -> None:
        return None

    def factory(self) -> SenderFactory:
        return lambda: self


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
