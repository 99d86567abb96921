"""The world the model test (test_model.py) drives: calendars it edits, the HTTP layer their reads
cross (with the faults it injects), and an APNs double that answers per token and records sends.

Nothing here knows how the build turns items into rows: the feeds are plain data the machine
edits, rendered as the wire formats (JSON items, iCalendar) a real source serves.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import httpx
from aioapns.common import NotificationResult
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Notification
from reminders_pipeline.providers import fcm, webpush
from reminders_pipeline.providers.apns import result_from_apns, result_from_error
from reminders_pipeline.providers.base import SenderFactory, SendResult, fence_expired
from reminders_pipeline.sources.ics_items import MAX_ALARM_REPEATS, _occurrence_id

JSON_URL = "http://feeds.model.test/items.json"
ICS_URL = "http://feeds.model.test/calendar.ics"
ATTENDEE = "ann@model.test"  # the person some devices name (``Device.attendee``)

# What a read can meet on its way (the model chooses): every one of them is a failed or partial read.
FAULTS = ("timeout", "http_500", "http_503", "http_404", "http_403", "malformed", "partial", "dropped")

# What APNs answers a token (the model chooses). Only these two may have reached the phone.
ANSWERS = ("200", "400", "403", "410", "410_stale", "429", "500", "503", "dropped", "not_sent", "not_written", "bad")
# What a provider may answer every target for a while (``ApnsDouble.outages``): its outage (500,
# 503, unreachable), its configuration fault (403), its throttling (429), or connections it drops.
PROVIDER_ANSWERS = ("503", "500", "not_sent", "403", "429", "dropped")
# A 410 whose timestamp is this long before the send: older than any registration in a run.
STALE_410_SECONDS = 30 * 86400
MAY_HAVE_DELIVERED = frozenset({"200", "dropped"})
RETRIED = frozenset({"429", "500", "503", "not_sent", "not_written"})  # certainly not delivered: back to pending
OUTAGE = frozenset({"500", "503", "not_sent"})  # answers that may add up to an outage, which halts everyone's sends
# Who delivers a device's alerts. Web Push and FCM answer in their own words; the double says the
# same thing in them, through the senders' own mapping (``webpush.answer``, ``fcm.answer``). A 410
# older than the registration is APNs' alone (the others say nothing of when a target died), and a
# send that fails before its write for another reason than the provider is APNs' transport's.
PROVIDERS = ("apns", "webpush", "fcm")
_IN_OTHER_WORDS = {"410_stale": "410", "not_written": "not_sent"}
_WEBPUSH = {"200": 201, "400": 404, "403": 401, "410": 410, "429": 429, "500": 500, "503": 503}
_FCM = {
    "200": (200, ""),
    "400": (404, "UNREGISTERED"),
    "403": (401, ""),
    "410": (404, "UNREGISTERED"),
    "429": (429, "QUOTA_EXCEEDED"),
    "500": (500, "INTERNAL"),
    "503": (503, "UNAVAILABLE"),
}
_BROWSER_KEY = ec.generate_private_key(ec.SECP256R1()).public_key()
_KEYS = {
    "p256dh": base64.urlsafe_b64encode(
        _BROWSER_KEY.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    )
    .decode()
    .rstrip("="),
    "auth": base64.urlsafe_b64encode(bytes(range(16))).decode().rstrip("="),
}


def target_of(provider: str, token: str) -> dict[str, Any]:
    """``DeviceSpec``'s target for a device of ``provider`` whose model token is ``token``."""
    if provider == "webpush":
        return {"apns_token": "", "webpush": {"endpoint": f"https://127.0.0.1/wp/{token}", "keys": _KEYS}}
    if provider == "fcm":
        return {"apns_token": "", "fcm_token": token}
    return {"apns_token": token}


def token_in(stored: str) -> str:
    """The model's token for a stored target (a Web Push subscription names it in its endpoint)."""
    return str(json.loads(stored)["endpoint"]).rsplit("/", 1)[1] if stored.startswith("{") else stored


_APNS = {
    "400": ("400", "BadDeviceToken"),
    "403": ("403", "InvalidProviderToken"),
    "410": ("410", "Unregistered"),
    "410_stale": ("410", "Unregistered"),
    "429": ("429", "TooManyRequests"),
    "500": ("500", "InternalServerError"),
    "503": ("503", "ServiceUnavailable"),
}


# -- calendars -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One event as its calendar states it. ``kind``: ``utc`` (a fixed instant), ``floating`` (a
    wall time, no zone) or ``all_day`` (a date). ``start``/``end``: Unix seconds for ``utc``, wall
    seconds (the wall time read as UTC) otherwise."""

    uid: str
    title: str
    start: int
    end: int
    kind: str = "utc"
    cancelled: bool = False
    alarm_lead: int | None = None  # a VALARM this many seconds before the start
    alarm_repeat: tuple[int, int] = (0, 0)  # its REPEAT and DURATION (seconds), when it repeats
    declined: bool | None = None  # an invitation to ATTENDEE: True, declined; False, accepted; None, no invitation
    travel: int | None = None  # X-APPLE-TRAVEL-DURATION, seconds: a ``leave`` reminder at start - travel


def alarm_leads(e: Event) -> tuple[str, ...]:
    """The rules an event's alarm asks for (RFC 5545): its trigger, then each repetition
    ``DURATION`` later, at most ``MAX_ALARM_REPEATS`` of them and none after the start."""
    if e.alarm_lead is None:
        return ()
    count, every = e.alarm_repeat
    leads = (e.alarm_lead - k * every for k in range(min(count, MAX_ALARM_REPEATS) + 1))
    return tuple(f"lead:{lead}" for lead in leads if lead >= 0)


@dataclass(frozen=True)
class Occurrence:
    """An item as a device should understand it: the id a read gives it and the calendar's times."""

    id: str
    title: str
    start: int
    end: int
    kind: str
    cancelled: bool
    alarms: tuple[str, ...]
    series: bool = False  # an instance of the feed's recurring series
    declined: bool = False  # ATTENDEE declined it
    url: str = ""  # the source it came from
    travel: int = 0  # its travel time (timed items only): a ``leave`` reminder

    def instant(self, wall_or_unix: int, tz: str | None) -> int:
        """The instant of one of this item's times on a device in ``tz`` (RFC 5545: fold 0)."""
        return wall_or_unix if self.kind == "utc" else wall_to_unix(wall_or_unix, tz)


def wall_to_unix(wall: int, tz: str | None) -> int:
    if tz is None:
        return wall
    naive = datetime(1970, 1, 1) + timedelta(seconds=wall)
    return int(naive.replace(tzinfo=ZoneInfo(tz), fold=0).timestamp())


def unix_to_wall(unix: float, tz: str | None) -> int:
    if tz is None:
        return int(unix)
    local = datetime.fromtimestamp(unix, ZoneInfo(tz))
    return int(unix + local.utcoffset().total_seconds())  # type: ignore[union-attr]


@dataclass(frozen=True)
class Series:
    """A daily series of ``count`` occurrences, with deleted instances (EXDATE) and moved,
    retitled or cancelled ones (RECURRENCE-ID overrides keyed by the original start)."""

    uid: str
    title: str
    start: int  # Unix seconds, UTC
    duration: int
    count: int = 3
    exdates: frozenset[int] = frozenset()
    overrides: tuple[tuple[int, int, str, bool], ...] = ()  # (original start, new start, title, cancelled)
    runaway: bool = False  # served as FREQ=SECONDLY: a series the build must drop alone

    def originals(self) -> list[int]:
        return [self.start + 86400 * k for k in range(self.count)]


@dataclass
class Feed:
    """A source's content as the machine last edited it."""

    url: str
    events: dict[str, Event] = field(default_factory=dict)
    series: Series | None = None

    def occurrences(self) -> dict[str, Occurrence]:
        """Every item a complete read yields, by item id (cancelled ones marked, not dropped)."""
        out: dict[str, Occurrence] = {}
        for e in self.events.values():
            item_id = e.uid if self.url == JSON_URL else _occurrence_id(e.uid, _ics_value(e.start, e.kind))
            out[item_id] = Occurrence(
                item_id,
                e.title,
                e.start,
                e.end,
                e.kind,
                e.cancelled,
                alarm_leads(e),
                declined=bool(e.declined),
                url=self.url,
                travel=(e.travel or 0) if e.kind != "all_day" else 0,
            )
        if self.series is not None and not self.series.runaway:  # a flood is dropped alone: its read is partial
            s = self.series
            moved = {o[0]: o for o in s.overrides}
            for original in s.originals():
                if original in s.exdates:
                    continue
                _, start, title, cancelled = moved.get(original, (original, original, s.title, False))
                item_id = _occurrence_id(s.uid, _ics_value(original, "utc"))
                out[item_id] = Occurrence(
                    item_id, title, start, start + s.duration, "utc", cancelled, (), series=True, url=self.url
                )
        return out

    def body(self) -> tuple[bytes, str]:
        """The feed as served: (body, content type)."""
        if self.url == JSON_URL:
            items = [
                {"id": e.uid, "title": e.title, "startsAt": e.start, "expiresAt": e.end} for e in self.events.values()
            ]
            return json.dumps({"items": items}).encode(), "application/json"
        return ics_body(self).encode(), "text/calendar; charset=utf-8"


def _ics_value(t: int, kind: str) -> date | datetime:
    if kind == "all_day":
        return (datetime(1970, 1, 1) + timedelta(seconds=t)).date()
    if kind == "floating":
        return datetime(1970, 1, 1) + timedelta(seconds=t)
    return datetime.fromtimestamp(t, UTC)


def _ics_time(name: str, t: int, kind: str) -> str:
    value = _ics_value(t, kind)
    if kind == "all_day":
        return f"{name};VALUE=DATE:{value.strftime('%Y%m%d')}"
    return f"{name}:{value.strftime('%Y%m%dT%H%M%S')}{'Z' if kind == 'utc' else ''}"


def ics_body(feed: Feed) -> str:
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//reminders model//EN"]
    for e in feed.events.values():
        lines += ["BEGIN:VEVENT", f"UID:{e.uid}", "DTSTAMP:20260101T000000Z", _ics_time("DTSTART", e.start, e.kind)]
        lines += [_ics_time("DTEND", e.end, e.kind), f"SUMMARY:{e.title}"]
        if e.cancelled:
            lines.append("STATUS:CANCELLED")
        if e.travel:
            lines.append(f"X-APPLE-TRAVEL-DURATION;VALUE=DURATION:PT{e.travel}S")
        if e.declined is not None:
            lines.append(f"ATTENDEE;PARTSTAT={'DECLINED' if e.declined else 'ACCEPTED'}:mailto:{ATTENDEE}")
        if e.alarm_lead is not None:
            lines += [
                "BEGIN:VALARM",
                "ACTION:DISPLAY",
                "DESCRIPTION:alarm",
                f"TRIGGER:-PT{e.alarm_lead}S",
                *([f"REPEAT:{e.alarm_repeat[0]}", f"DURATION:PT{e.alarm_repeat[1]}S"] if e.alarm_repeat[0] else []),
                "END:VALARM",
            ]
        lines.append("END:VEVENT")
    s = feed.series
    if s is not None:
        lines += ["BEGIN:VEVENT", f"UID:{s.uid}", "DTSTAMP:20260101T000000Z", _ics_time("DTSTART", s.start, "utc")]
        lines += [
            _ics_time("DTEND", s.start + s.duration, "utc"),
            f"SUMMARY:{s.title}",
            "RRULE:FREQ=SECONDLY" if s.runaway else f"RRULE:FREQ=DAILY;COUNT={s.count}",
        ]
        lines += [_ics_time("EXDATE", x, "utc") for x in sorted(s.exdates)]
        lines.append("END:VEVENT")
        for original, start, title, cancelled in s.overrides:
            lines += [
                "BEGIN:VEVENT",
                f"UID:{s.uid}",
                "DTSTAMP:20260101T000000Z",
                _ics_time("RECURRENCE-ID", original, "utc"),
            ]
            lines += [
                _ics_time("DTSTART", start, "utc"),
                _ics_time("DTEND", start + s.duration, "utc"),
                f"SUMMARY:{title}",
            ]
            lines += ["STATUS:CANCELLED"] if cancelled else []
            lines.append("END:VEVENT")
    lines.append("END:VCALENDAR")
    return "\r\n".join(lines) + "\r\n"


# -- the HTTP layer source reads cross -----------------------------------------------------------


class _Broken(httpx.AsyncByteStream):
    """A body that stops partway: the connection dropped after the headers."""

    def __init__(self, head: bytes) -> None:
        self.head = head

    async def __aiter__(self) -> Iterator[bytes]:  # type: ignore[override]
        yield self.head
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    async def aclose(self) -> None:
        return None


@dataclass
class FeedTransport(httpx.AsyncBaseTransport):
    """Serves the machine's feeds to ``SourceReader`` in place of the network transport, with an
    ETag (so 304 and the ledger's feed cache are exercised) and a one-shot fault per source."""

    feeds: dict[str, Feed]
    faults: dict[str, str] = field(default_factory=dict)
    reads: list[tuple[str, str]] = field(default_factory=list)  # (url, fault or "ok" / "not_modified")
    plain: set[str] = field(default_factory=set)  # served with no ETag: every read a 200, however unchanged
    # The next read of this url takes the feed as it is, then waits for ``release`` before it answers
    # (a build stalled on its read while the feed changes); ``held`` is set once it has its body.
    hold: str | None = None
    aside: int | None = None  # the thread of an overlapping build: its reads go to ``aside_reads``
    aside_reads: list[tuple[str, str]] = field(default_factory=list)
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __call__(self, *_: Any, **__: Any) -> FeedTransport:
        return self  # stands in for ``GuardedTransport(allow, limits)``

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        feed = self.feeds.get(url)
        fault = self.faults.pop(url, None)
        reads = self.aside_reads if threading.get_ident() == self.aside else self.reads
        reads.append((url, fault or "ok"))
        if feed is None:
            return httpx.Response(404, content=b"not found")
        body, content_type = feed.body()
        etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
        if self.hold == url:
            self.hold = None
            self.held.set()
            while not self.release.is_set():
                await asyncio.sleep(0.002)
        if fault == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        if fault is not None and fault.startswith("http_"):
            return httpx.Response(int(fault[5:]), content=b"<html>error</html>", headers={"content-type": "text/html"})
        if fault == "malformed":
            return httpx.Response(
                200, content=b"<html><body>Sign in</body></html>", headers={"content-type": "text/html"}
            )
        if fault == "partial":  # the body cut short, served as if whole
            return httpx.Response(
                200, content=body[: max(1, len(body) * 2 // 3)], headers={"content-type": content_type}
            )
        if fault == "dropped":
            return httpx.Response(200, stream=_Broken(body[: len(body) // 2]), headers={"content-type": content_type})
        if url in self.plain:
            return httpx.Response(200, content=body, headers={"content-type": content_type})
        if request.headers.get("if-none-match") == etag:
            reads[-1] = (url, "not_modified")
            return httpx.Response(304, headers={"etag": etag})
        return httpx.Response(200, content=body, headers={"content-type": content_type, "etag": etag})

    async def aclose(self) -> None:
        return None


# -- APNs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """One notification handed to APNs, with the answer the model chose and the drain's clock."""

    row_id: int
    device_id: str
    token: str
    item_id: str
    rule: str
    title: str
    starts_at: int
    # The drain's clock as the product reads it (``Instant.floor``, to the millisecond): a float a
    # ten-millionth of a second short of a due millisecond is that millisecond to the claim too.
    at: float
    answer: str
    action_token: str | None  # the alert's ``reminder.token``: what the app posts its Snooze and Done with


@dataclass
class ApnsDouble:
    """A ``Sender`` that answers each token as the machine chose (default 200) and records every send."""

    clock: Callable[[], float]
    answers: dict[str, str] = field(default_factory=dict)
    sent: list[Sent] = field(default_factory=list)
    monotonic: Callable[[], float] = time.monotonic  # the fence's clock, checked as each request leaves
    down_until: float = 0.0  # APNs unreachable for every token until then (the drain's clock)
    # One provider's answer to every target of its own until then: provider -> (answer, until).
    outages: dict[str, tuple[str, float]] = field(default_factory=dict)

    def answer_for(self, provider: str, token: str, at: float) -> str:
        """What the double answers ``token`` of ``provider`` at ``at`` (in APNs' words)."""
        if at < self.down_until:
            return "not_sent"
        answer, until = self.outages.get(provider, ("200", 0.0))
        return answer if at < until else self.answers.get(token, "200")

    async def send_many(self, notifications: Sequence[Notification]) -> list[SendResult]:
        return [self._one(n) for n in notifications]

    def _one(self, n: Notification) -> SendResult:
        if n.past_deadline(self.monotonic()):
            return fence_expired(n.row_id)
        token = token_in(n.device_token)
        answer = self.answer_for(n.provider, token, self.clock())
        if n.provider != "apns":
            answer = _IN_OTHER_WORDS.get(answer, answer)
        p = n.payload
        self.sent.append(
            Sent(n.row_id, n.device_id, token, p["reminder"]["item_id"], p["reminder"]["rule"],
                 p["aps"]["alert"]["title"], int(p["reminder"]["starts_at"]), Instant.floor(self.clock()).unix, answer,
                 p["reminder"].get("token"))
        )  # fmt: skip
        if answer == "bad":  # a target its sender cannot use (an endpoint it cannot sign or encrypt for)
            return SendResult(n.row_id, False, reason="sender_error:ValueError")
        if n.provider != "apns":
            return self._in_other_words(n, answer)
        if answer == "200":
            return result_from_apns(n.row_id, NotificationResult(str(uuid.uuid4()), "200"))
        if answer == "dropped":
            return result_from_error(n.row_id, ConnectionResetError(), written=True)
        if answer == "not_sent":
            return result_from_error(n.row_id, ConnectionRefusedError(), written=False)
        if answer == "not_written":  # failed before its write, not for want of APNs: spends an attempt
            return result_from_error(n.row_id, RuntimeError(), written=False)
        status, reason = _APNS[answer]
        stamp = {"410": int(self.clock() * 1000), "410_stale": int((self.clock() - STALE_410_SECONDS) * 1000)}.get(
            answer
        )
        return result_from_apns(n.row_id, NotificationResult(str(uuid.uuid4()), status, reason, stamp))

    def _in_other_words(self, n: Notification, answer: str) -> SendResult:
        """The answer as Web Push or FCM gives it, read by that sender's own mapping."""
        if answer in ("dropped", "not_sent"):
            failure = httpx.ReadTimeout("") if answer == "dropped" else httpx.ConnectError("")
            return (fcm if n.provider == "fcm" else webpush).transport_failure(n.row_id, failure, answer == "dropped")
        if n.provider == "webpush":
            return webpush.answer(n.row_id, _WEBPUSH[answer], {}, self.monotonic())
        status, code = _FCM[answer]
        body = {"name": "projects/p/messages/1"} if status == 200 else {
            "error": {"code": status, "details": [{"@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError",
                                                    "errorCode": code}] if code else []}}  # fmt: skip
        return fcm.answer(n.row_id, httpx.Response(status, json=body), self.monotonic())

    async def aclose(self) -> None:
        return None

    def factory(self) -> SenderFactory:
        return lambda: self


# -- another process, run while the machine waits ------------------------------------------------


class Aside:
    """A function run on a thread of its own while the caller waits (another process acting while
    this one is frozen). What it raised is kept and raised again by ``reraise``: an exception left
    on a thread is only a warning, and a broken promise found there must fail the test. Call
    ``reraise`` where no sender's error handling stands between it and the test."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.error: BaseException | None = None

    def run(self) -> None:
        self.start()
        self.join()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._main)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()

    def running(self) -> bool:
        return self.thread.is_alive()

    def _main(self) -> None:
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - kept for the waiting thread to raise
            self.error = exc

    def reraise(self) -> None:
        if self.error is not None:
            raise self.error


# -- what the model reached ----------------------------------------------------------------------

# The double's answers by kind, in each provider's words: what a provider does to a send.
ANSWER_KINDS = {
    "200": "ok",
    "dropped": "dropped",  # written, the connection lost: may have been delivered
    "429": "retryable",
    "not_written": "retryable",  # APNs' transport failed before the write, for another reason
    "500": "outage",
    "503": "outage",
    "not_sent": "unreachable",
    "400": "gone",
    "410": "gone",
    "410_stale": "gone",  # APNs' 410 older than the registration (which must mark nothing)
    "bad": "gone",  # a target its sender cannot use: that row fails, alone
    "403": "config",
}
FAULT_KINDS = ("ok", "retryable", "outage", "unreachable", "gone", "config", "dropped")


def answer_kind(provider: str, answer: str) -> str:
    """What the double answers a ``provider`` target scripted ``answer``, as a kind."""
    return ANSWER_KINDS[answer if provider == "apns" else _IN_OTHER_WORDS.get(answer, answer)]


@dataclass
class Reach:
    """How often the model ran each operation, and each sending operation while a provider was in
    each fault kind (the answer its targets get: one provider's outage, a device's scripted answer,
    or everyone unreachable), over a test's examples; and how many sends it checked. ``table`` is
    what the run prints.

    A pair is counted for a sending operation only (``sending``: one that may hand a notification
    to a provider): a provider's fault never meets the code of an operation that sends nothing (a
    feed edit, a device change, a build does the same whatever APNs answers); where its effect
    meets the fault is the next send, and that operation's pairs count it."""

    sending: frozenset[str] = frozenset()
    operations: Counter[str] = field(default_factory=Counter)
    pairs: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    sends_per_example: list[int] = field(default_factory=list)

    @property
    def examples(self) -> int:
        return len(self.sends_per_example)

    @property
    def sends_checked(self) -> int:
        return sum(self.sends_per_example)

    def ran(self, operation: str, faults: set[tuple[str, str]]) -> None:
        """``faults``: (provider, kind) for each provider a device uses, as the operation began."""
        self.operations[operation] += 1
        if operation in self.sending:
            for provider, kind in faults:
                self.pairs[(operation, provider, kind)] += 1

    def example_ended(self, sends_checked: int) -> None:
        self.sends_per_example.append(sends_checked)

    def sends_summary(self) -> str:
        """The mean hides that a few examples make most sends: the median and the share of
        examples that sent twice (where a second send can break a promise) say more."""
        n = sorted(self.sends_per_example) or [0]
        twice = sum(1 for k in n if k >= 2) / len(n)
        return (
            f"{self.sends_checked} checked sends ({self.sends_checked / len(n):.2f} per example, "
            f"median {n[len(n) // 2]}, {twice:.0%} of examples with two or more)"
        )

    def _pair_keys(self, operations: Sequence[str]) -> list[tuple[str, str, str]]:
        return [(op, p, k) for op in operations if op in self.sending for p in PROVIDERS for k in FAULT_KINDS]

    def under(self, floor: int, operations: Sequence[str]) -> list[str]:
        """Every operation and (sending operation, provider, kind) pair run fewer than ``floor`` times."""
        low = [op for op in operations if self.operations[op] < floor]
        return low + [f"{op}×{p}:{k}" for op, p, k in self._pair_keys(operations) if self.pairs[(op, p, k)] < floor]

    def as_json(self, operations: Sequence[str]) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "sends_checked": self.sends_checked,
            "sends_per_example": self.sends_per_example,
            "operations": {op: self.operations[op] for op in operations},
            "sending": sorted(self.sending),
            "pairs": {f"{op}|{p}|{k}": self.pairs[(op, p, k)] for op, p, k in self._pair_keys(operations)},
        }

    def table(self, operations: Sequence[str], floor: int = 20) -> list[str]:
        """One line per operation: its runs, then (a sending one) its runs per provider and fault kind."""
        kinds = [k[:5] for k in FAULT_KINDS]
        width = max(map(len, operations))
        head = "  ".join(f"{p:<{6 * len(kinds) - 1}}" for p in PROVIDERS)
        lines = [
            f"{'':<{width}}  {'':>5}  {head}",
            f"{'operation':<{width}}  {'runs':>5}  " + "  ".join(" ".join(f"{k:>5}" for k in kinds) for _ in PROVIDERS),
        ]
        for op in operations:
            counts = [
                f"{self.pairs[(op, p, k)]:>5}" if op in self.sending else f"{'-':>5}"
                for p in PROVIDERS
                for k in FAULT_KINDS
            ]
            cells = "  ".join(" ".join(counts[i : i + len(kinds)]) for i in range(0, len(counts), len(kinds)))
            lines.append(f"{op:<{width}}  {self.operations[op]:>5}  {cells}")
        low = self.under(floor, operations)
        lines.append(
            f"{self.examples} examples, {self.sends_summary()}; {len(low)} of "
            f"{len(operations) + len(self._pair_keys(operations))} operations and pairs under {floor}"
        )
        return lines
