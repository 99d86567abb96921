"""The HTTP contract: every request and response body once, as a pydantic model.

``app.py`` hands each route its body model; FastAPI validates the body with it and generates
``/openapi.json`` from the same models, so the document cannot drift from what the app enforces.

Every bound is the core's own constant (``devices``, ``rules``, ``zones``, ``times``, ``schema``),
imported, never copied; the core's ``validate`` still has the last word on what only code can
judge (a rule that parses, a zone the zone database knows, an http(s) URL).

Models are strict (``"3600"`` is not a number, ``1`` is not ``true``) and refuse unknown keys (a
misspelt optional field would otherwise be silently ignored); an integral float (``3600.0``) is
a JSON Schema integer, so it is accepted as one. ``now`` is on every body that may carry it; a
deployment that does not accept it refuses it before validation and leaves it out of its document
(``app.py``), as it does the chunk range, which follows ``REMINDERS_CHUNK_COUNT``.

Response models list the fields clients rely on and allow more, so the core can add summary
fields without breaking the contract; ``test_http_schemathesis.py`` checks every answer against them.

Longer than 400 lines because it declares every body once: apart, the request and response models
would only move the length.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator

from reminders_pipeline.devices.actions import MAX_SNOOZE_SECONDS
from reminders_pipeline.devices.registration import (
    APNS_TOKEN_PATTERN,
    DEVICE_ID_PATTERN,
    FCM_TOKEN_PATTERN,
    MAX_ATTENDEES,
    MAX_DEVICE_ID,
    MAX_EXTRA_RULES,
    MAX_SOURCES,
    MAX_URL_LENGTH,
)
from reminders_pipeline.domain.calendar_settings import MAX_CALENDAR_RULES
from reminders_pipeline.domain.items import ADDRESS_TEXT_LENGTH
from reminders_pipeline.domain.phrases import LOCALE_SHAPE, MAX_LOCALE_LENGTH
from reminders_pipeline.domain.rules import DEFAULT_ALL_DAY_RULES, MAX_LEAD_SECONDS, MAX_TRAVEL_SECONDS
from reminders_pipeline.domain.times import MAX_NOW_UNIX, MIN_NOW_UNIX, Instant
from reminders_pipeline.domain.wire import Provider
from reminders_pipeline.domain.zones import MAX_TZ_OFFSET_SECONDS, MAX_ZONE_NAME, QUIET_HOURS_PATTERN, ZONE_NAME_PATTERN
from reminders_pipeline.ledger.schema import MAX_ROW_ID
from reminders_pipeline.providers.push_subscription import MAX_ENDPOINT_LENGTH
from reminders_pipeline.sources.urls import shown_url

# The one bound of the shell's own: a device with MAX_SOURCES long URLs fits with room to spare.
MAX_BODY_BYTES = 256 * 1024


def anchored(pattern: Any) -> str:
    """A core pattern (used with ``fullmatch``) for JSON Schema, whose ``pattern`` searches."""
    return f"^{getattr(pattern, 'pattern', pattern)}$"


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# JSON Schema's integer: ``3600.0`` is one too; ``true`` and ``"3600"`` are not.
INTEGRAL = BeforeValidator(_integral)


def _usable_url(url: str) -> str:
    """A URL the source reader can fetch at all; scheme and host are the core's ``validate``.

    Printable ASCII only (an IRI must be percent-encoded): a NUL or control character cannot be
    stored in PostgreSQL text, and an unparseable URL would fail every build that reads it.
    """
    if not all(0x21 <= ord(c) < 0x7F for c in url):
        raise ValueError(f"not a URL of printable ASCII up to {MAX_URL_LENGTH} characters: {shown_url(url)}")
    try:
        urlsplit(url).port  # noqa: B018 - raises ValueError for a bad or out-of-range port
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL):  # their text quotes the URL
        raise ValueError(f"not a usable URL: {shown_url(url)}") from None
    return url


EARLIEST_NOW, LATEST_NOW = Instant.from_unix(MIN_NOW_UNIX), Instant.from_unix(MAX_NOW_UNIX)


def _pretend_time(value: str | float) -> Instant:
    """``now`` as an instant, inside the range the core can shift without leaving 1970..9999."""
    try:
        now = Instant.parse(str(value))
    except (ValueError, OverflowError) as exc:
        raise ValueError(str(exc)) from None
    if not EARLIEST_NOW <= now <= LATEST_NOW:
        raise ValueError(f"a time from {EARLIEST_NOW} to {LATEST_NOW}")
    return now


DeviceId = Annotated[str, Field(pattern=anchored(DEVICE_ID_PATTERN), max_length=MAX_DEVICE_ID)]
RowId = Annotated[int, Field(ge=1, le=MAX_ROW_ID), INTEGRAL]
TzOffset = Annotated[int, Field(ge=-MAX_TZ_OFFSET_SECONDS, le=MAX_TZ_OFFSET_SECONDS), INTEGRAL]
LeadSeconds = Annotated[int, Field(ge=0, le=MAX_LEAD_SECONDS), INTEGRAL]
LocaleTag = Annotated[str, Field(pattern=anchored(LOCALE_SHAPE), max_length=MAX_LOCALE_LENGTH)]
ZoneName = Annotated[str, Field(pattern=anchored(ZONE_NAME_PATTERN), max_length=MAX_ZONE_NAME)]
SourceUrl = Annotated[
    str,
    Field(max_length=MAX_URL_LENGTH, description="http(s) URL of a JSON or iCalendar feed"),
    AfterValidator(_usable_url),
]
PretendTime = Annotated[
    Instant,
    PlainValidator(
        _pretend_time, json_schema_input_type=str | Annotated[float, Field(ge=MIN_NOW_UNIX, le=MAX_NOW_UNIX)]
    ),
]
StoredTime = Annotated[str | None, Field(description="Stored time, ISO-8601 UTC: 2026-09-10T08:30:00.000Z")]
Counts = dict[str, int]

NOW_FIELD = Field(
    None,
    description="Pretend it is this time (like `--now`): ISO-8601 with a zone, or Unix seconds; "
    f"{EARLIEST_NOW.stored[:10]} to {LATEST_NOW.stored[:10]}. "
    "Listed only when `REMINDERS_HTTP_ACCEPT_NOW=true` (tests); otherwise `now` is refused (422).",
    examples=["2026-09-10T08:00:00Z", 1788940800],
)
CREDENTIAL = (
    "The device's own bearer for its own routes, shown only in the answer that issues it; the ledger keeps its "
    "SHA-256. A registration that replaces a device keeps its credential (absent here)."
)


class Request(BaseModel):
    """A request body: strict types, no unknown keys."""

    model_config = ConfigDict(strict=True, extra="forbid")


# ---------------------------------------------------------------- request bodies


class BuildRequest(Request):
    """Empty: every device. `device_id`: the immediate rebuild of one device. `chunk`: one partition,
    at most `REMINDERS_CHUNK_SIZE` stalest devices (what the Dagster asset does). Not both."""

    model_config = ConfigDict(json_schema_extra={"not": {"required": ["device_id", "chunk"]}})
    device_id: DeviceId | None = None
    chunk: Annotated[int, Field(ge=0), INTEGRAL] | None = Field(None, description="Below `REMINDERS_CHUNK_COUNT`.")
    now: PretendTime | None = NOW_FIELD


class DrainRequest(Request):
    id: RowId | None = Field(None, description="Same as `?id=`.")
    now: PretendTime | None = NOW_FIELD


ACTION_TOKEN = Field(
    min_length=1,
    max_length=64,
    description="The alert's `reminder.token`, as it came: proves the action names an alert sent here, and names "
    "the event's start the alert showed (after the dot, Unix seconds).",
)


class SnoozeRequest(Request):
    """`seconds` from now, or at `until` (Unix seconds): not both, and before the event's end."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["seconds"]}, {"required": ["until"]}]})
    token: Annotated[str, ACTION_TOKEN]
    seconds: Annotated[int, Field(ge=1, le=MAX_SNOOZE_SECONDS), INTEGRAL] | None = None
    until: Annotated[int, Field(ge=MIN_NOW_UNIX, le=MAX_NOW_UNIX), INTEGRAL] | None = None
    now: PretendTime | None = NOW_FIELD


class DoneRequest(Request):
    token: Annotated[str, ACTION_TOKEN]
    now: PretendTime | None = NOW_FIELD


class Calendar(Request):
    """A subscribed source's own settings (its URL among `source_urls`); omitted fields are the defaults."""

    url: SourceUrl
    rules: list[Annotated[str, Field(description="`lead:N`, `lead:N@expiry` or `day:N@HH:MM`")]] | None = Field(
        None,
        max_length=MAX_CALENDAR_RULES,
        description="Its items take these instead of the device's rules, kind by kind (lead rules for timed "
        "items, day rules for all-day ones); null: the device's. An event's own alarms, for a device that uses "
        "them, come first.",
    )
    interruption_level: Literal["passive", "active", "time-sensitive"] | None = Field(
        None, description="Its alerts' `interruption-level`; null: the deployment's (`REMINDERS_INTERRUPTION_LEVEL`)."
    )
    breakthrough: bool = Field(False, description="Its reminders are sent during the device's quiet hours.")
    muted: bool = Field(False, description="It alerts nothing; muting voids its pending reminders (`muted`).")
    travel_seconds: int | None = Field(
        None,
        ge=1,
        le=MAX_TRAVEL_SECONDS,
        description='Each timed item gets a `leave` reminder ("Leave now for …") this long before its start, '
        "unless the event states its own travel time (`X-APPLE-TRAVEL-DURATION`); null: none.",
    )


class PushKeys(Request):
    p256dh: str = Field(max_length=128, description="The browser's P-256 public key, base64url.")
    auth: str = Field(max_length=64, description="Its 16-byte authentication secret, base64url.")


class WebPushSubscription(Request):
    """The browser's `PushSubscription.toJSON()`."""

    endpoint: str = Field(max_length=MAX_ENDPOINT_LENGTH, description="The push service's https URL for this browser.")
    expirationTime: int | None = Field(None, description="Ignored; as the browser sends it.")  # noqa: N815
    keys: PushKeys


class DeviceRegistration(Request):
    """Replaces the device: exactly these rules and sources. Omitted optional fields take their
    defaults. Exactly one delivery target: `apns_token`, `webpush_subscription` or `fcm_token`."""

    apns_token: str | None = Field(
        None, pattern=anchored(APNS_TOKEN_PATTERN), description="Hex APNs device token: deliver by APNs."
    )
    webpush_subscription: WebPushSubscription | None = Field(
        None,
        description="The browser's PushSubscription: deliver by Web Push (its endpoint must not be an internal "
        "address). `GET /v1/vapid-public-key` gives the key to subscribe with.",
    )
    fcm_token: str | None = Field(
        None, pattern=anchored(FCM_TOKEN_PATTERN), description="An FCM registration token: deliver by FCM."
    )
    reminder_lead_seconds: LeadSeconds | None = Field(None, description="The lead of rule `lead:N`.")
    extra_rules: list[Annotated[str, Field(description="`lead:N`, `lead:N@expiry`, or one `agenda@HH:MM`")]] | None = (
        Field(None, max_length=MAX_EXTRA_RULES)
    )
    source_urls: list[SourceUrl] | None = Field(None, max_length=MAX_SOURCES)
    all_day_rules: (
        list[Annotated[str, Field(description="`day:N@HH:MM`: N days before the day, at that local time")]] | None
    ) = Field(
        None,
        max_length=MAX_EXTRA_RULES,
        description=f"Rules for all-day items; default `{json.dumps(DEFAULT_ALL_DAY_RULES)}`, `[]` for none.",
    )
    tz: ZoneName | None = Field(
        None,
        description="IANA time zone (`Europe/Berlin`); omitted or null keeps the stored one (the widget reports it too).",
    )
    # The core parses quiet hours (it also takes blank for none); the document states the shape.
    quiet_hours: str | None = Field(
        None,
        json_schema_extra={"pattern": anchored(QUIET_HOURS_PATTERN)},
        description="`22:00-07:00` in the device's zone; reminders due inside are held to its end.",
    )
    alarms: bool | None = Field(
        None, description="Use each calendar event's own alarms (VALARM) as its rules; default false."
    )
    attendees: list[Annotated[str, Field(max_length=ADDRESS_TEXT_LENGTH)]] | None = Field(
        None,
        max_length=MAX_ATTENDEES,
        description="The person's own addresses (`ann@example.org`, `mailto:` optional): an invitation one of "
        "them declined (`PARTSTAT=DECLINED`) alerts nothing, and a decline after the build voids its "
        "pending reminders (`declined`) at the next read.",
    )
    locale: LocaleTag | None = Field(
        None,
        description="The alerts' language and clock convention, a BCP 47 tag (`de-DE`): times and relative phrases "
        "from CLDR; words in en, de, fr, es and ja, English for other languages. Omitted or null keeps the stored "
        "one (the widget reports it too); never set: English, 24-hour clock.",
    )
    clock: Literal["12h", "24h"] | None = Field(
        None, description="Overrides the locale's clock; null: the locale's own."
    )
    calendars: list[Calendar] | None = Field(None, max_length=MAX_SOURCES, description="Settings per source.")


# ---------------------------------------------------------------- response bodies


class Error(BaseModel):
    error: str = Field(description="Stable code: unauthorized, invalid, malformed_json, not_found, ...")
    detail: str
    field: str | None = Field(None, description="The field at fault (validation errors).")


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    database: str
    detail: str | None = None


class SourceFailure(BaseModel):
    url: str
    error: str = Field(
        description="A short code, never text from the answer: `timeout`, `http_404`, `too_large`, "
        "`address_refused`, `insecure_redirect`, `not_json`, `not_icalendar`, ..."
    )


class BuildSummary(BaseModel):
    now: str
    devices_built: int
    devices_unchanged: int = Field(
        0,
        description="Of the devices built, those whose feeds and settings had not changed since their last "
        "build: only the rows the horizon moved over were planned.",
    )
    devices_items_replanned: int = Field(
        0,
        description="Of the devices built, those whose feeds had changed in some items since their last build: "
        "only those items were planned again and only their rows read; the rest as for an unchanged device.",
    )
    rows_inserted: int
    rows_updated: int
    rows_voided: Counts
    items_rejected: Counts = {}
    sources_read: int
    sources_failed: list[SourceFailure]
    oldest_built_at: StoredTime = None
    duration_seconds: float = 0.0


class Lateness(BaseModel):
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None


class DrainSummary(BaseModel):
    now: str
    abandoned: int = Field(description="Claims failed as abandoned (never retried).")
    due: int
    claimed: int = Field(description="Rows this call's compare-and-swap won.")
    outcomes: Counts = Field(description="Settled rows by outcome: sent, failed, disabled, too_late, ...")
    details: Counts = Field(description="`outcome:detail` counts, e.g. `failed:BadDeviceToken`.")
    kinds: Counts = Field(
        default_factory=dict,
        description="`kind:outcome` counts by rule kind (lead, expiry, day, leave, snooze, agenda), e.g. `snooze:sent`.",
    )
    providers: Counts = Field(
        default_factory=dict, description="`provider:outcome` counts by provider (apns, webpush, fcm), e.g. `fcm:sent`."
    )
    lateness_seconds: Lateness
    tokens_invalidated: int = 0
    voided_by_token: int = 0
    halted: str | None = Field(
        description="The first provider's configuration fault or outage (`apns_unreachable: ...`) that stopped "
        "claiming its rows."
    )
    halts: dict[str, str] = Field(
        default_factory=dict,
        description="Each halted provider (apns, webpush, fcm) and why; the other providers' rows were sent on.",
    )
    returned_to_pending: int = Field(
        0, description="Rows whose send certainly never reached APNs, pending again (details: `pending:reason`)."
    )
    duration_seconds: float = 0.0


class CalendarShown(BaseModel):
    url: str
    rules: list[str] | None = None
    interruption_level: str | None = None
    breakthrough: bool = False
    muted: bool = False
    travel_seconds: int | None = None


class Device(BaseModel):
    id: str
    provider: Provider = Field(Provider.APNS, description="Who delivers its alerts.")
    apns_token: str | None = Field(None, description="An APNs device's token.")
    fcm_token: str | None = Field(None, description="An FCM device's registration token.")
    webpush_endpoint: str | None = Field(
        None, description="A Web Push device's push service, by its origin (the endpoint's path is its secret)."
    )
    reminder_lead_seconds: int
    extra_rules: list[str]
    source_urls: list[str]
    chunk: int
    last_tz_offset_seconds: int | None = None
    tz_name: str | None = None
    all_day_rules: list[str] = []
    quiet_hours: str | None = None
    use_alarms: bool = False
    attendees: list[str] = []
    locale: str | None = None
    clock: str | None = None
    calendars: list[CalendarShown] = Field([], description="The subscriptions with settings of their own.")
    reminders_built_at: StoredTime = None
    token_invalid_at: StoredTime = None
    token_invalid_reason: str | None = None
    created_at: StoredTime = None
    updated_at: StoredTime = None
    has_credential: bool = Field(False, description="The device has its own credential (only its hash is stored).")


class Registration(Device):
    credential: str | None = Field(None, description=CREDENTIAL)


class Credential(BaseModel):
    device_id: str
    credential: str = Field(description=CREDENTIAL)


class SnoozeRow(BaseModel):
    id: int = Field(description="The snooze's own queue row.")
    rule: str = Field(description="`snooze:N`: the event's N-th snooze on this device (at most 12).")
    send_after: int = Field(description="Unix seconds.")


class Snoozed(BaseModel):
    device_id: str
    row_id: int = Field(description="The snoozed alert's row.")
    snooze: SnoozeRow
    created: bool = Field(description="False: a repeated request, answered with the row the first one made.")


class Acknowledged(BaseModel):
    device_id: str
    row_id: int
    acknowledged: int = Field(description="The event's pending reminders on this device settled `acknowledged`.")


class VapidPublicKey(BaseModel):
    public_key: str = Field(description="The `applicationServerKey` to pass to `PushManager.subscribe`, base64url.")


class Removed(BaseModel):
    device_id: str
    rows_voided: int


class FeedItem(BaseModel):
    id: str = Field(description="Namespaced by source: `7:standup`.")
    title: str
    body: str | None = None
    startsAt: int = Field(description="Unix seconds.")
    expiresAt: int = Field(description="Unix seconds.")
    declined: bool = Field(
        False, description="An invitation one of the device's attendee addresses declined: it alerts nothing."
    )


class Feed(BaseModel):
    device_id: str
    items: list[FeedItem]
    sources_failed: list[SourceFailure]
    vapid_public_key: str | None = Field(
        None, description="The key a web client subscribes to Web Push with; null where Web Push is not configured."
    )


TAKES_NOW = (BuildRequest, DrainRequest, SnoozeRequest, DoneRequest)  # where a deployment may accept ``now``
