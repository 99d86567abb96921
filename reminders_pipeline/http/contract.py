"""The HTTP contract: every request body once, as a pydantic model (the answers are ``answers.py``).

``app.py`` hands each route its body model; FastAPI validates the body with it and generates
``/openapi.json`` from the same models, so the document cannot drift from what the app enforces.

Every bound is the core's own constant (``devices``, ``rules``, ``zones``, ``times``, ``schema``),
imported, never copied; the core's ``validate`` still has the last word on what only code can
judge (a rule that parses, a zone the zone database knows, an http(s) URL).

Models are strict (``"3600"`` is not a number, ``1`` is not ``true``) and refuse unknown keys (a
misspelt optional field would otherwise be silently ignored); an integral float (``3600.0``) is
a JSON Schema integer, so it is accepted as one. ``now`` is on every body that may carry it; a
deployment that does not accept it refuses it before validation (``parsing.refuse_now``) and
leaves it out of its document (``routes.document``), where the chunk range follows
``REMINDERS_CHUNK_COUNT`` too.

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

NOW_FIELD = Field(
    None,
    description="Pretend it is this time (like `--now`): ISO-8601 with a zone, or Unix seconds; "
    f"{EARLIEST_NOW.stored[:10]} to {LATEST_NOW.stored[:10]}. "
    "Listed only when `REMINDERS_HTTP_ACCEPT_NOW=true` (tests); otherwise `now` is refused (422).",
    examples=["2026-09-10T08:00:00Z", 1788940800],
)


class Request(BaseModel):
    """A request body: strict types, no unknown keys."""

    model_config = ConfigDict(strict=True, extra="forbid")


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


TAKES_NOW = (BuildRequest, DrainRequest, SnoozeRequest, DoneRequest)  # where a deployment may accept ``now``
