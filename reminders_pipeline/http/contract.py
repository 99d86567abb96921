"""The HTTP contract: every request and response body once, as a pydantic model, and every
operation (method and path) once, with its credential, its body and its answers.

``app.py`` serves each operation: its handler enforces the declared credential and validates the
declared body before the endpoint runs. ``document`` walks the same operations, as the routes
the app serves carry them, into ``/openapi.json``, with schemas generated from the same models:
what the document states is what the app enforces, by construction.

Every bound is the core's own constant (``devices``, ``rules``, ``zones``, ``times``, ``schema``),
imported, never copied; the core's ``validate`` still has the last word on what only code can
judge (a rule that parses, a zone the zone database knows, an http(s) URL).

Models are strict (``"3600"`` is not a number, ``1`` is not ``true``) and refuse unknown keys (a
misspelt optional field would otherwise be silently ignored); an integral float (``3600.0``) is
a JSON Schema integer, so it is accepted as one. Two request shapes depend on the settings (the
chunk range follows ``REMINDERS_CHUNK_COUNT``; ``now`` is listed only where it is accepted), so
``Contract`` is built per app.

Response models list the fields clients rely on and allow more, so the core can add summary
fields without breaking the contract; ``test_http_schemathesis.py`` checks every answer against them.

Longer than 350 lines because it declares every body and the whole OpenAPI document once: apart, the
models and the paths that name them could drift.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, create_model
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema

from reminders_pipeline.config.settings import Settings
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
PretendTime = Annotated[str | Annotated[float, Field(ge=MIN_NOW_UNIX, le=MAX_NOW_UNIX)], AfterValidator(_pretend_time)]
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
    chunk: int | None = None  # bounded per deployment: see Contract


class DrainRequest(Request):
    id: RowId | None = Field(None, description="Same as `?id=`.")


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


class DoneRequest(Request):
    token: Annotated[str, ACTION_TOKEN]


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


# ---------------------------------------------------------------- per deployment

TAKES_NOW = (
    BuildRequest,
    DrainRequest,
    SnoozeRequest,
    DoneRequest,
)  # the bodies that may carry ``now``, where a deployment accepts it


class Contract:
    """The request models this deployment validates with, and the schemas they generate."""

    def __init__(self, settings: Settings) -> None:
        now: dict[str, Any] = {"now": (PretendTime | None, NOW_FIELD)} if settings.http_accept_now else {}
        chunk = Annotated[int, Field(ge=0, le=settings.chunk_count - 1), INTEGRAL] | None
        build: dict[str, Any] = {"chunk": (chunk, None), **now}
        self.models: dict[type[Request], type[Request]] = {
            BuildRequest: create_model("BuildRequest", __base__=BuildRequest, __doc__=BuildRequest.__doc__, **build),
            DrainRequest: create_model("DrainRequest", __base__=DrainRequest, **now),
            SnoozeRequest: create_model("SnoozeRequest", __base__=SnoozeRequest, __doc__=SnoozeRequest.__doc__, **now),
            DoneRequest: create_model("DoneRequest", __base__=DoneRequest, **now),
            DeviceRegistration: DeviceRegistration,
        }
        self.default_lead_seconds = settings.default_lead_seconds

    def model(self, body: type[Request]) -> type[Request]:
        """The model this deployment validates ``body`` with: a subclass, or the class itself."""
        return self.models[body]


class _Generator(GenerateJsonSchema):
    """Field titles ("Device Id") only repeat the property names."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


# ---------------------------------------------------------------- operations

Auth = Literal["open", "internal", "device"]  # none; REMINDERS_TOKEN; the device's own credential or REMINDERS_TOKEN
SECURITY: dict[Auth, list[dict[str, list[str]]]] = {
    "internal": [{"bearer": []}],
    "device": [{"deviceCredential": []}, {"bearer": []}],
}
PATH_PARAMETERS: dict[str, Any] = {"device_id": DeviceId, "row_id": RowId}


@dataclass(frozen=True)
class Answer:
    """One status of an operation: a model (a schema of the document) or another type (inline)."""

    description: str
    body: Any = Error
    media_type: str = "application/json"


@dataclass(frozen=True)
class Query:
    """A query parameter, typed with a contract type."""

    name: str
    type: Any
    description: str


@dataclass(frozen=True)
class Operation:
    """One method of one route: what it takes, who may call it, and what it answers.

    ``app.py`` serves each operation by enforcing ``auth`` and validating ``body`` before its
    endpoint runs; ``document`` states the same. Answers every operation of its kind may give
    (401 for a protected one, 400/413/422 for a body, 503 for one that reads the ledger) are
    implied; ``answers`` lists the rest and may override them.
    """

    method: str
    path: str
    operation_id: str
    auth: Auth
    answers: dict[int, Answer]
    summary: str | None = None
    body: type[Request] | None = None
    body_required: bool = False
    query: tuple[Query, ...] = ()
    reads_ledger: bool = True


UNAUTHORIZED = Answer("`REMINDERS_TOKEN` unset, or a missing or wrong `Authorization: Bearer` token.")
DEVICE_UNAUTHORIZED = Answer(
    "A missing or wrong `Authorization: Bearer`: neither this device's own credential nor the internal token."
)
MALFORMED = Answer("The body is not JSON.")
TOO_LARGE = Answer(f"The body is larger than {MAX_BODY_BYTES} bytes.")
INVALID = Answer("Validation error; `field` names the offending field.")
NO_DEVICE = Answer("No such device.")
UNAVAILABLE = Answer(
    "The database is not at this release's migration head (`schema_not_current`, `detail` is the one line "
    "naming both revisions), or it is unreachable or timed out (`database_unavailable`)."
)

HEALTHZ = Operation(
    "GET",
    "/healthz",
    "healthz",
    "open",
    {200: Answer("Healthy.", Health), 503: Answer("The database is unavailable.", Health)},
    summary="Open. Checks the database (a connection and the migrated schema).",
)
METRICS = Operation(
    "GET",
    "/metrics",
    "metrics",
    "open",
    {200: Answer("Metrics.", str, "text/plain")},
    summary="Open. Prometheus text format.",
    reads_ledger=False,
)
OPENAPI = Operation(
    "GET",
    "/openapi.json",
    "openapi",
    "open",
    {200: Answer("The OpenAPI document.", dict[str, Any])},
    summary="Open. This document.",
    reads_ledger=False,
)
BUILD = Operation(
    "POST",
    "/internal/reminders/build",
    "build",
    "internal",
    {200: Answer("The build summary.", BuildSummary), 404: NO_DEVICE},
    summary="Compose feeds and make queue rows match them (the build cron, or an immediate rebuild).",
    body=BuildRequest,
)
DRAIN = Operation(
    "POST",
    "/internal/reminders/drain",
    "drain",
    "internal",
    {
        200: Answer("The drain summary; `due: 0` when the row is not due or already settled.", DrainSummary),
        503: Answer("REMINDERS_ENABLED=true but APNs credentials are missing or unreadable; nothing was claimed."),
    },
    summary="Claim and send every due row, or only row `id` if it is due. At most once per row.",
    body=DrainRequest,
    query=(Query("id", RowId, "Drain only this queue row (an exact-time scheduler's call)."),),
)
GET_DEVICE = Operation(
    "GET", "/v1/devices/{device_id}", "getDevice", "internal", {200: Answer("The device.", Device), 404: NO_DEVICE}
)
PUT_DEVICE = Operation(
    "PUT",
    "/v1/devices/{device_id}",
    "putDevice",
    "internal",
    {200: Answer("The stored device; `credential` when this call issued one.", Registration)},
    summary="Create or replace a device.",
    body=DeviceRegistration,
    body_required=True,
)
DELETE_DEVICE = Operation(
    "DELETE",
    "/v1/devices/{device_id}",
    "deleteDevice",
    "internal",
    {200: Answer("Removed.", Removed), 404: NO_DEVICE},
    summary="Delete a device; its pending rows are voided (`device_removed`).",
)
ROTATE_CREDENTIAL = Operation(
    "POST",
    "/v1/devices/{device_id}/credential",
    "rotateDeviceCredential",
    "device",
    {
        200: Answer("The new credential.", Credential),
        404: NO_DEVICE,
        409: Answer("`credential_changed`: a concurrent rotation replaced the credential this one meant to replace."),
    },
    summary="Issue the device a new credential (shown once); the one it replaces stops working at once.",
)
FEED = Operation(
    "GET",
    "/v1/devices/{device_id}/feed",
    "getFeed",
    "device",
    {200: Answer("The composed feed.", Feed), 404: NO_DEVICE},
    summary="The widget's feed, item bounds in Unix seconds; stores `tz` only when it changed (best-effort).",
    query=(
        Query(
            "tz",
            ZoneName | TzOffset,
            "The widget's IANA time zone (`Europe/Berlin`), or (old widgets) its UTC offset in seconds.",
        ),
        Query(
            "locale",
            LocaleTag,
            "The widget's locale (`de-DE`): the language and clock of the device's alerts, stored only when it "
            "changed; one CLDR does not know is ignored.",
        ),
    ),
)
VAPID_PUBLIC_KEY = Operation(
    "GET",
    "/v1/vapid-public-key",
    "vapidPublicKey",
    "open",
    {
        200: Answer("The deployment's VAPID public key.", VapidPublicKey),
        404: Answer("`webpush_not_configured`: this deployment sends no Web Push."),
    },
    summary="Open. The `applicationServerKey` a web client passes to `PushManager.subscribe`.",
    reads_ledger=False,
)
ACTION_ANSWERS = {
    404: Answer("`no_reminder`: this device has no such reminder (another device's row is not found either)."),
    409: Answer(
        "`not_sent` (the row sent no alert), `event_ended`, `event_changed` (cancelled, declined or muted; "
        "an agenda: its day left with no event), `unsubscribed`, `event_moved` (snooze only: the event moved since this alert; snooze its newer one), "
        "`snooze_limit` (12 snoozes already) or `busy` (try again). Nothing was changed."
    ),
}
ACTION_UNAUTHORIZED = Answer(
    "`unauthorized`: not this device's own credential (nor the internal token); `wrong_action_token`: "
    "not the token of this reminder's alert."
)
SNOOZE = Operation(
    "POST",
    "/v1/devices/{device_id}/reminders/{row_id}/snooze",
    "snoozeReminder",
    "device",
    {200: Answer("The snooze's row.", Snoozed), 401: ACTION_UNAUTHORIZED, **ACTION_ANSWERS},
    summary="Snooze a sent alert: one `snooze:N` row, however often asked, sent at its time with the same guards.",
    body=SnoozeRequest,
    body_required=True,
)
DONE = Operation(
    "POST",
    "/v1/devices/{device_id}/reminders/{row_id}/done",
    "doneReminder",
    "device",
    {200: Answer("How many pending reminders were settled.", Acknowledged), 401: ACTION_UNAUTHORIZED, **ACTION_ANSWERS},
    summary="Done on a sent alert: the event's other pending reminders on this device are settled `acknowledged`.",
    body=DoneRequest,
    body_required=True,
)


# ---------------------------------------------------------------- the document


def implied_answers(op: Operation) -> dict[int, Answer]:
    """Every answer ``op`` may give: those of its kind, then its own."""
    implied: dict[int, Answer] = {}
    if op.auth != "open":
        implied[401] = UNAUTHORIZED if op.auth == "internal" else DEVICE_UNAUTHORIZED
    if op.body is not None:
        implied |= {400: MALFORMED, 413: TOO_LARGE, 422: INVALID}
    if op.query:
        implied[422] = INVALID
    if op.reads_ledger:
        implied[503] = UNAVAILABLE
    return implied | op.answers


def _is_model(body: Any) -> bool:
    return isinstance(body, type) and issubclass(body, BaseModel)


def _schema(body: Any) -> JsonSchemaValue:
    """A model by reference to the document's schemas; any other type inline."""
    if _is_model(body):
        return {"$ref": f"#/components/schemas/{body.__name__}"}
    return TypeAdapter(body).json_schema()


def _content(body: Any, media_type: str = "application/json") -> dict[str, Any]:
    return {media_type: {"schema": _schema(body)}}


def _parameter(name: str, where: str, schema: Any, required: bool) -> dict[str, Any]:
    return {"name": name, "in": where, "required": required, "schema": TypeAdapter(schema).json_schema()}


def _operation(contract: Contract, op: Operation) -> dict[str, Any]:
    spec: dict[str, Any] = {"operationId": op.operation_id}
    if op.summary is not None:
        spec["summary"] = op.summary
    if op.auth != "open":
        spec["security"] = SECURITY[op.auth]
    if op.body is not None:
        spec["requestBody"] = {"required": op.body_required, "content": _content(contract.model(op.body))}
    if op.query:
        spec["parameters"] = [
            {**_parameter(q.name, "query", q.type, False), "description": q.description} for q in op.query
        ]
    spec["responses"] = {
        str(status): {"description": a.description, "content": _content(a.body, a.media_type)}
        for status, a in sorted(implied_answers(op).items())
    }
    return spec


def paths(contract: Contract, operations: Iterable[Operation]) -> dict[str, Any]:
    """The document's paths: each route's path parameters, then one entry per method."""
    items: dict[str, Any] = {}
    for op in operations:
        item = items.setdefault(op.path, {})
        names = re.findall(r"{(\w+)}", op.path)
        if names:
            item["parameters"] = [_parameter(name, "path", PATH_PARAMETERS[name], True) for name in names]
        item[op.method.lower()] = _operation(contract, op)
    return items


def schemas(contract: Contract, operations: Iterable[Operation]) -> dict[str, JsonSchemaValue]:
    """The schemas of every body the operations take or answer, and of the models those use."""
    models: dict[type[BaseModel], None] = {}
    for op in operations:
        if op.body is not None:
            models[contract.model(op.body)] = None
        models |= {a.body: None for a in implied_answers(op).values() if _is_model(a.body)}
    _, top = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}", schema_generator=_Generator
    )
    defs: dict[str, JsonSchemaValue] = top["$defs"]
    defs["DeviceRegistration"]["properties"]["reminder_lead_seconds"]["description"] += (
        f" Default {contract.default_lead_seconds}."
    )
    return defs


def document(contract: Contract, operations: Iterable[Operation]) -> dict[str, Any]:
    """``/openapi.json`` for the operations the app routes."""
    operations = list(operations)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "reminders_pipeline",
            "version": "1",
            "description": (
                "Internal build/drain routes, the device API and the widget feed. Internal and management routes "
                "need `Authorization: Bearer $REMINDERS_TOKEN` (or `$REMINDERS_TOKEN_PREVIOUS` while rotating it); "
                "with the variable unset they all answer 401. A device's own routes (its feed, its credential) "
                "also take that device's own credential, issued when it is registered. "
                "Errors are JSON `{error, detail, field?}`; a request the app cannot use is a 4xx, never a 500."
            ),
        },
        "paths": paths(contract, operations),
        "components": {
            "schemas": schemas(contract, operations),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "The internal token, REMINDERS_TOKEN."},
                "deviceCredential": {"type": "http", "scheme": "bearer", "description": "The device's own credential."},
            },
        },
    }
