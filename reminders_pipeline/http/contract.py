"""The HTTP contract: every request and response body once, as a pydantic model.

The request models validate what ``app.py`` accepts, and the same models generate the schemas
of ``/openapi.json``: what the document states is what the app enforces, by construction.
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
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, create_model
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema

from ..devices import APNS_TOKEN_PATTERN, DEVICE_ID_PATTERN, MAX_DEVICE_ID, MAX_EXTRA_RULES, MAX_SOURCES, MAX_URL_LENGTH
from ..rules import DEFAULT_ALL_DAY_RULES, MAX_LEAD_SECONDS
from ..schema import MAX_ROW_ID
from ..settings import Settings
from ..sources import shown_url
from ..times import MAX_NOW_UNIX, MIN_NOW_UNIX, iso_from_unix, parse_when, unix_from_iso
from ..zones import MAX_TZ_OFFSET_SECONDS, MAX_ZONE_NAME, QUIET_HOURS_PATTERN, ZONE_NAME_PATTERN

MAX_BODY_BYTES = (
    256 * 1024
)  # the one bound of the shell's own: a device with MAX_SOURCES long URLs fits with room to spare


def anchored(pattern: Any) -> str:
    """A core pattern (used with ``fullmatch``) for JSON Schema, whose ``pattern`` searches."""
    return f"^{getattr(pattern, 'pattern', pattern)}$"


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def whole(minimum: int, maximum: int) -> Any:
    """JSON Schema's integer in a range: ``3600.0`` is one too; ``true`` and ``"3600"`` are not."""
    return Annotated[int, Field(ge=minimum, le=maximum), BeforeValidator(_integral)]


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


def _pretend_time(value: str | float) -> str:
    """``now`` as stored text, inside the range the core can shift without leaving 1970..9999."""
    try:
        now = parse_when(str(value))
    except (ValueError, OverflowError) as exc:
        raise ValueError(str(exc)) from None
    if not MIN_NOW_UNIX <= unix_from_iso(now) <= MAX_NOW_UNIX:
        raise ValueError(f"a time from {iso_from_unix(MIN_NOW_UNIX)} to {iso_from_unix(MAX_NOW_UNIX)}")
    return now


DeviceId = Annotated[str, Field(pattern=anchored(DEVICE_ID_PATTERN), max_length=MAX_DEVICE_ID)]
RowId = whole(1, MAX_ROW_ID)
TzOffset = whole(-MAX_TZ_OFFSET_SECONDS, MAX_TZ_OFFSET_SECONDS)
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
    f"{iso_from_unix(MIN_NOW_UNIX)[:10]} to {iso_from_unix(MAX_NOW_UNIX)[:10]}. "
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


class DeviceRegistration(Request):
    """Replaces the device: exactly these rules and sources. Omitted optional fields take their defaults."""

    apns_token: str = Field(pattern=anchored(APNS_TOKEN_PATTERN), description="Hex APNs device token.")
    reminder_lead_seconds: whole(0, MAX_LEAD_SECONDS) | None = Field(None, description="The lead of rule `lead:N`.")
    extra_rules: list[Annotated[str, Field(description="`lead:N` or `lead:N@expiry`")]] | None = Field(
        None, max_length=MAX_EXTRA_RULES
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
    lateness_seconds: Lateness
    tokens_invalidated: int = 0
    voided_by_token: int = 0
    halted: str | None = Field(
        description="An APNs configuration fault or outage (`apns_unreachable: ...`) that stopped claiming."
    )
    returned_to_pending: int = Field(
        0, description="Rows whose send certainly never reached APNs, pending again (details: `pending:reason`)."
    )
    duration_seconds: float = 0.0


class Device(BaseModel):
    id: str
    apns_token: str
    reminder_lead_seconds: int
    extra_rules: list[str]
    source_urls: list[str]
    chunk: int
    last_tz_offset_seconds: int | None = None
    tz_name: str | None = None
    all_day_rules: list[str] = []
    quiet_hours: str | None = None
    use_alarms: bool = False
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


class Removed(BaseModel):
    device_id: str
    rows_voided: int


class FeedItem(BaseModel):
    id: str = Field(description="Namespaced by source: `7:standup`.")
    title: str
    body: str | None = None
    startsAt: int = Field(description="Unix seconds.")
    expiresAt: int = Field(description="Unix seconds.")


class Feed(BaseModel):
    device_id: str
    items: list[FeedItem]
    sources_failed: list[SourceFailure]


RESPONSES = (Error, Health, BuildSummary, DrainSummary, Device, Registration, Credential, Removed, Feed)


# ---------------------------------------------------------------- per deployment


class Contract:
    """The request models this deployment validates with, and the document they generate."""

    def __init__(self, settings: Settings) -> None:
        now = {"now": (PretendTime | None, NOW_FIELD)} if settings.http_accept_now else {}
        chunk = whole(0, settings.chunk_count - 1) | None
        self.build = create_model(
            "BuildRequest", __base__=BuildRequest, __doc__=BuildRequest.__doc__, chunk=(chunk, None), **now
        )
        self.drain = create_model("DrainRequest", __base__=DrainRequest, **now)
        self.device = DeviceRegistration
        self.default_lead_seconds = settings.default_lead_seconds
        self.document = document(self)


class _Generator(GenerateJsonSchema):
    """Field titles ("Device Id") only repeat the property names."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def schemas(contract: Contract) -> dict[str, JsonSchemaValue]:
    models = (contract.build, contract.drain, contract.device, *RESPONSES)
    _, top = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}", schema_generator=_Generator
    )
    defs = top["$defs"]
    defs["DeviceRegistration"]["properties"]["reminder_lead_seconds"]["description"] += (
        f" Default {contract.default_lead_seconds}."
    )
    return defs


# ---------------------------------------------------------------- paths


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _answer(description: str, name: str = "Error") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _body(name: str, required: bool = False) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": _ref(name)}}}


UNAUTHORIZED = _answer("`REMINDERS_TOKEN` unset, or a missing or wrong `Authorization: Bearer` token.")
DEVICE_UNAUTHORIZED = _answer(
    "A missing or wrong `Authorization: Bearer`: neither this device's own credential nor the internal token."
)
MALFORMED = _answer("The body is not JSON.")
TOO_LARGE = _answer(f"The body is larger than {MAX_BODY_BYTES} bytes.")
INVALID = _answer("Validation error; `field` names the offending field.")
NO_DEVICE = _answer("No such device.")
UNAVAILABLE = _answer(
    "The database is not at this release's migration head (`schema_not_current`, `detail` is the one line "
    "naming both revisions), or it is unreachable or timed out (`database_unavailable`)."
)
DEVICE_ID_PARAM = {"name": "device_id", "in": "path", "required": True, "schema": TypeAdapter(DeviceId).json_schema()}
BEARER = [{"bearer": []}]
DEVICE_OR_BEARER = [{"deviceCredential": []}, {"bearer": []}]
BODY_ERRORS = {"400": MALFORMED, "401": UNAUTHORIZED, "413": TOO_LARGE, "422": INVALID}


def _param(name: str, schema: Any, description: str) -> dict[str, Any]:
    """A query parameter whose schema is a contract type."""
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": TypeAdapter(schema).json_schema(),
        "description": description,
    }


def _paths() -> dict[str, Any]:
    return {
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Open. Checks the database (a connection and the migrated schema).",
                "responses": {
                    "200": _answer("Healthy.", "Health"),
                    "503": _answer("The database is unavailable.", "Health"),
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Open. Prometheus text format.",
                "responses": {
                    "200": {"description": "Metrics.", "content": {"text/plain": {"schema": {"type": "string"}}}}
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "Open. This document.",
                "responses": {
                    "200": {
                        "description": "The OpenAPI document.",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
        "/internal/reminders/build": {
            "post": {
                "operationId": "build",
                "security": BEARER,
                "requestBody": _body("BuildRequest"),
                "summary": "Compose feeds and make queue rows match them (the build cron, or an immediate rebuild).",
                "responses": {"200": _answer("The build summary.", "BuildSummary"), **BODY_ERRORS, "404": NO_DEVICE},
            }
        },
        "/internal/reminders/drain": {
            "post": {
                "operationId": "drain",
                "security": BEARER,
                "requestBody": _body("DrainRequest"),
                "summary": "Claim and send every due row, or only row `id` if it is due. At most once per row.",
                "parameters": [_param("id", RowId, "Drain only this queue row (an exact-time scheduler's call).")],
                "responses": {
                    "200": _answer(
                        "The drain summary; `due: 0` when the row is not due or already settled.", "DrainSummary"
                    ),
                    **BODY_ERRORS,
                    "503": _answer(
                        "REMINDERS_ENABLED=true but APNs credentials are missing or unreadable; nothing was claimed."
                    ),
                },
            }
        },
        "/v1/devices/{device_id}": {
            "parameters": [DEVICE_ID_PARAM],
            "get": {
                "operationId": "getDevice",
                "security": BEARER,
                "responses": {"200": _answer("The device.", "Device"), "401": UNAUTHORIZED, "404": NO_DEVICE},
            },
            "put": {
                "operationId": "putDevice",
                "summary": "Create or replace a device.",
                "security": BEARER,
                "requestBody": _body("DeviceRegistration", required=True),
                "responses": {
                    "200": _answer("The stored device; `credential` when this call issued one.", "Registration"),
                    **BODY_ERRORS,
                },
            },
            "delete": {
                "operationId": "deleteDevice",
                "summary": "Delete a device; its pending rows are voided (`device_removed`).",
                "security": BEARER,
                "responses": {"200": _answer("Removed.", "Removed"), "401": UNAUTHORIZED, "404": NO_DEVICE},
            },
        },
        "/v1/devices/{device_id}/credential": {
            "parameters": [DEVICE_ID_PARAM],
            "post": {
                "operationId": "rotateDeviceCredential",
                "security": DEVICE_OR_BEARER,
                "summary": "Issue the device a new credential (shown once); the one it replaces stops working at once.",
                "responses": {
                    "200": _answer("The new credential.", "Credential"),
                    "401": DEVICE_UNAUTHORIZED,
                    "404": NO_DEVICE,
                    "409": _answer(
                        "`credential_changed`: a concurrent rotation replaced the credential this one meant to replace."
                    ),
                },
            },
        },
        "/v1/devices/{device_id}/feed": {
            "parameters": [DEVICE_ID_PARAM],
            "get": {
                "operationId": "getFeed",
                "security": DEVICE_OR_BEARER,
                "summary": "The widget's feed, item bounds in Unix seconds; stores `tz` only when it changed (best-effort).",
                "parameters": [
                    _param(
                        "tz",
                        ZoneName | TzOffset,
                        "The widget's IANA time zone (`Europe/Berlin`), or (old widgets) its UTC offset in seconds.",
                    )
                ],
                "responses": {
                    "200": _answer("The composed feed.", "Feed"),
                    "401": DEVICE_UNAUTHORIZED,
                    "404": NO_DEVICE,
                    "422": INVALID,
                },
            },
        },
    }


def document(contract: Contract) -> dict[str, Any]:
    paths = _paths()
    for path, item in paths.items():  # every route that reads the ledger may answer 503
        for method, operation in item.items():
            if method != "parameters" and path not in ("/metrics", "/openapi.json"):
                operation["responses"].setdefault("503", UNAVAILABLE)
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
        "paths": paths,
        "components": {
            "schemas": schemas(contract),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "The internal token, REMINDERS_TOKEN."},
                "deviceCredential": {"type": "http", "scheme": "bearer", "description": "The device's own credential."},
            },
        },
    }
