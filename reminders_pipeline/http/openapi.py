"""The OpenAPI document served at ``/openapi.json``, written by hand to match ``app.py``.

Hand-written rather than generated because the routes are few and the document is a contract for
external schedulers: every bound it states (id range, tz range, lead cap, list sizes) is the bound
``app.py`` enforces, and ``test_http_schemathesis.py`` fuzzes the served app against it. The chunk
range depends on ``REMINDERS_CHUNK_COUNT``, hence a function of the settings.

Response schemas list the fields clients rely on and allow more, so the core can add summary
fields without breaking the contract.
"""

from __future__ import annotations

from typing import Any

from ..devices import APNS_TOKEN_PATTERN as _TOKEN, DEVICE_ID_PATTERN as _DEVICE_ID, MAX_SOURCES
from ..rules import MAX_LEAD_SECONDS
from ..zones import MAX_ZONE_NAME
from ..settings import Settings

# The bounds app.py enforces, stated once: the app imports them from its contract.
MAX_BODY_BYTES = 256 * 1024  # a device with MAX_SOURCES long URLs fits with room to spare
MAX_ROW_ID = 2**63 - 1  # BIGINT on PostgreSQL, INTEGER on SQLite: no larger id can exist
MAX_TZ_OFFSET_SECONDS = 18 * 3600  # +-18:00, the widest UTC offset any platform represents
MAX_EXTRA_RULES = 32
ZONE_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_+\-]*(/[A-Za-z0-9_+\-]+){0,2}$"  # zones.zone() then asks the zone database
QUIET_HOURS_PATTERN = r"^[0-9]{2}:[0-9]{2}-[0-9]{2}:[0-9]{2}$"
MAX_URL_LENGTH = 2048
# A pretend clock (``now``) must leave the core room to shift it by leads, horizons and cut-offs
# without leaving the storable 1970..9999 range: 2000-01-01 to 3000-01-01.
MIN_NOW_UNIX = 946684800
MAX_NOW_UNIX = 32503680000
# JSON Schema's "pattern" is unanchored (ECMA-262 search): the core's ^...$ anchors carry over.
DEVICE_ID_PATTERN = f"^{_DEVICE_ID.pattern}$"  # JSON Schema patterns search; anchor them
APNS_TOKEN_PATTERN = f"^{_TOKEN.pattern}$"

ISO_TIME = {"type": ["string", "null"], "description": "Stored time, ISO-8601 UTC: 2026-09-10T08:30:00.000Z"}
NOW = {
    "type": ["string", "number", "null"],
    "minimum": MIN_NOW_UNIX,
    "maximum": MAX_NOW_UNIX,
    "description": "Pretend it is this time (like `--now`): ISO-8601 with a zone, or Unix seconds; 2000-01-01 to 3000-01-01. "
    "Listed only when `REMINDERS_HTTP_ACCEPT_NOW=true` (tests); otherwise `now` is refused (422).",
    "examples": ["2026-09-10T08:00:00Z", 1788940800],
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


UNAUTHORIZED = _error("`REMINDERS_TOKEN` unset, or a missing or wrong `Authorization: Bearer` token.")
DEVICE_UNAUTHORIZED = _error(
    "A missing or wrong `Authorization: Bearer`: neither this device's own credential nor the internal token."
)
MALFORMED = _error("The body is not JSON.")
TOO_LARGE = _error(f"The body is larger than {MAX_BODY_BYTES} bytes.")
INVALID = _error("Validation error; `field` names the offending field.")
NO_DEVICE = _error("No such device.")

DEVICE_ID_PARAM = {
    "name": "device_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": DEVICE_ID_PATTERN, "maxLength": 128},
}


def _now(settings: Settings) -> dict[str, Any]:
    """The ``now`` property, where the deployment accepts it at all."""
    return {"now": NOW} if settings.http_accept_now else {}


_CREDENTIAL = {
    "type": "string",
    "description": "The device's own bearer for its own routes, shown only in the answer that issues it; "
    "the ledger keeps its SHA-256. A registration that replaces a device keeps its credential (absent here).",
}


def _schemas(settings: Settings) -> dict[str, Any]:
    counts = {"type": "object", "additionalProperties": {"type": "integer"}}
    return {
        "Error": {
            "type": "object",
            "required": ["error", "detail"],
            "properties": {
                "error": {"type": "string", "description": "Stable code: unauthorized, invalid, malformed_json, not_found, ..."},
                "detail": {"type": "string"},
                "field": {"type": "string", "description": "The field at fault (validation errors)."},
            },
        },
        "Health": {
            "type": "object",
            "required": ["status", "database"],
            "properties": {"status": {"enum": ["ok", "unavailable"]}, "database": {"type": "string"}, "detail": {"type": "string"}},
        },
        "BuildRequest": {
            "type": "object",
            "additionalProperties": False,
            "not": {"required": ["device_id", "chunk"]},
            "description": "Empty: every device. `device_id`: the immediate rebuild of one device. `chunk`: one partition, "
            "at most `REMINDERS_CHUNK_SIZE` stalest devices (what the Dagster asset does). Not both.",
            "properties": {
                "device_id": {"type": ["string", "null"], "pattern": DEVICE_ID_PATTERN, "maxLength": 128},
                "chunk": {"type": ["integer", "null"], "minimum": 0, "maximum": settings.chunk_count - 1},
                **_now(settings),
            },
        },
        "BuildSummary": {
            "type": "object",
            "required": ["now", "devices_built", "rows_inserted", "rows_updated", "rows_voided", "sources_read", "sources_failed"],
            "properties": {
                "now": {"type": "string"},
                "devices_built": {"type": "integer"},
                "rows_inserted": {"type": "integer"},
                "rows_updated": {"type": "integer"},
                "rows_voided": counts,
                "items_rejected": counts,
                "sources_read": {"type": "integer"},
                "sources_failed": {"type": "array", "items": _ref("SourceFailure")},
                "oldest_built_at": ISO_TIME,
                "duration_seconds": {"type": "number"},
            },
        },
        "DrainRequest": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "id": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_ROW_ID, "description": "Same as `?id=`."},
                **_now(settings),
            },
        },
        "DrainSummary": {
            "type": "object",
            "required": ["now", "abandoned", "due", "claimed", "outcomes", "details", "lateness_seconds", "halted"],
            "properties": {
                "now": {"type": "string"},
                "abandoned": {"type": "integer", "description": "Claims failed as abandoned (never retried)."},
                "due": {"type": "integer"},
                "claimed": {"type": "integer", "description": "Rows this call's compare-and-swap won."},
                "outcomes": {**counts, "description": "Settled rows by outcome: sent, failed, disabled, too_late, ..."},
                "details": {**counts, "description": "`outcome:detail` counts, e.g. `failed:BadDeviceToken`."},
                "lateness_seconds": {
                    "type": "object",
                    "properties": {k: {"type": ["number", "null"]} for k in ("p50", "p95", "p99", "max")},
                },
                "tokens_invalidated": {"type": "integer"},
                "voided_by_token": {"type": "integer"},
                "halted": {"type": ["string", "null"], "description": "An APNs configuration fault or outage (`apns_unreachable: ...`) that stopped claiming."},
                "returned_to_pending": {"type": "integer", "description": "Rows whose send certainly never reached APNs, pending again (details: `pending:reason`)."},
                "duration_seconds": {"type": "number"},
            },
        },
        "DeviceRegistration": {
            "type": "object",
            "required": ["apns_token"],
            "additionalProperties": False,
            "description": "Replaces the device: exactly these rules and sources. Omitted optional fields take their defaults.",
            "properties": {
                "apns_token": {"type": "string", "pattern": APNS_TOKEN_PATTERN, "description": "Hex APNs device token."},
                "reminder_lead_seconds": {
                    "type": ["integer", "null"], "minimum": 0, "maximum": MAX_LEAD_SECONDS,
                    "description": f"The lead of rule `lead:N`; default {settings.default_lead_seconds}.",
                },
                "extra_rules": {
                    "type": ["array", "null"], "maxItems": MAX_EXTRA_RULES,
                    "items": {"type": "string", "description": "`lead:N` or `lead:N@expiry`"},
                },
                "source_urls": {
                    "type": ["array", "null"], "maxItems": MAX_SOURCES,
                    "items": {"type": "string", "maxLength": MAX_URL_LENGTH, "description": "http(s) URL of a JSON or iCalendar feed"},
                },
                "tz": {
                    "type": ["string", "null"], "maxLength": MAX_ZONE_NAME, "pattern": ZONE_NAME_PATTERN,
                    "description": "IANA time zone (`Europe/Berlin`); omitted or null keeps the stored one (the widget reports it too).",
                },
                "all_day_rules": {
                    "type": ["array", "null"], "maxItems": MAX_EXTRA_RULES,
                    "items": {"type": "string", "description": "`day:N@HH:MM`: N days before the day, at that local time"},
                    "description": "Rules for all-day items; default `[\"day:0@09:00\"]`, `[]` for none.",
                },
                "quiet_hours": {
                    "type": ["string", "null"], "pattern": QUIET_HOURS_PATTERN,
                    "description": "`22:00-07:00` in the device's zone; reminders due inside are held to its end.",
                },
                "alarms": {
                    "type": ["boolean", "null"],
                    "description": "Use each calendar event's own alarms (VALARM) as its rules; default false.",
                },
            },
        },
        "Device": {
            "type": "object",
            "required": ["id", "apns_token", "reminder_lead_seconds", "extra_rules", "source_urls", "chunk"],
            "properties": {
                "id": {"type": "string"},
                "apns_token": {"type": "string"},
                "reminder_lead_seconds": {"type": "integer"},
                "extra_rules": {"type": "array", "items": {"type": "string"}},
                "source_urls": {"type": "array", "items": {"type": "string"}},
                "chunk": {"type": "integer"},
                "last_tz_offset_seconds": {"type": ["integer", "null"]},
                "tz_name": {"type": ["string", "null"]},
                "all_day_rules": {"type": "array", "items": {"type": "string"}},
                "quiet_hours": {"type": ["string", "null"]},
                "use_alarms": {"type": "boolean"},
                "reminders_built_at": ISO_TIME,
                "token_invalid_at": ISO_TIME,
                "token_invalid_reason": {"type": ["string", "null"]},
                "created_at": ISO_TIME,
                "updated_at": ISO_TIME,
                "has_credential": {"type": "boolean", "description": "The device has its own credential (only its hash is stored)."},
            },
        },
        "Registration": {
            "allOf": [_ref("Device")],
            "properties": {"credential": _CREDENTIAL},
        },
        "Credential": {
            "type": "object",
            "required": ["device_id", "credential"],
            "properties": {"device_id": {"type": "string"}, "credential": _CREDENTIAL},
        },
        "Removed": {
            "type": "object",
            "required": ["device_id", "rows_voided"],
            "properties": {"device_id": {"type": "string"}, "rows_voided": {"type": "integer"}},
        },
        "SourceFailure": {
            "type": "object",
            "required": ["url", "error"],
            "properties": {
                "url": {"type": "string"},
                "error": {
                    "type": "string",
                    "description": "A short code, never text from the answer: `timeout`, `http_404`, `too_large`, "
                    "`address_refused`, `insecure_redirect`, `not_json`, `not_icalendar`, ...",
                },
            },
        },
        "Feed": {
            "type": "object",
            "required": ["device_id", "items", "sources_failed"],
            "properties": {
                "device_id": {"type": "string"},
                "items": {"type": "array", "items": _ref("FeedItem")},
                "sources_failed": {"type": "array", "items": _ref("SourceFailure")},
            },
        },
        "FeedItem": {
            "type": "object",
            "required": ["id", "title", "startsAt", "expiresAt"],
            "properties": {
                "id": {"type": "string", "description": "Namespaced by source: `7:standup`."},
                "title": {"type": "string"},
                "body": {"type": ["string", "null"]},
                "startsAt": {"type": "integer", "description": "Unix seconds."},
                "expiresAt": {"type": "integer", "description": "Unix seconds."},
            },
        },
    }


def _paths() -> dict[str, Any]:
    bearer = [{"bearer": []}]
    device_or_bearer = [{"deviceCredential": []}, {"bearer": []}]
    return {
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Open. Checks the database (a connection and the migrated schema).",
                "responses": {"200": _json(_ref("Health"), "Healthy."), "503": _json(_ref("Health"), "The database is unavailable.")},
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Open. Prometheus text format.",
                "responses": {"200": {"description": "Metrics.", "content": {"text/plain": {"schema": {"type": "string"}}}}},
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "Open. This document.",
                "responses": {"200": _json({"type": "object"}, "The OpenAPI document.")},
            }
        },
        "/internal/reminders/build": {
            "post": {
                "operationId": "build",
                "summary": "Compose feeds and make queue rows match them (the build cron, or an immediate rebuild).",
                "security": bearer,
                "requestBody": {"required": False, "content": {"application/json": {"schema": _ref("BuildRequest")}}},
                "responses": {
                    "200": _json(_ref("BuildSummary"), "The build summary."),
                    "400": MALFORMED, "401": UNAUTHORIZED, "404": NO_DEVICE, "413": TOO_LARGE, "422": INVALID,
                },
            }
        },
        "/internal/reminders/drain": {
            "post": {
                "operationId": "drain",
                "summary": "Claim and send every due row, or only row `id` if it is due. At most once per row.",
                "security": bearer,
                "parameters": [
                    {
                        "name": "id", "in": "query", "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ROW_ID},
                        "description": "Drain only this queue row (an exact-time scheduler's call).",
                    }
                ],
                "requestBody": {"required": False, "content": {"application/json": {"schema": _ref("DrainRequest")}}},
                "responses": {
                    "200": _json(_ref("DrainSummary"), "The drain summary; `due: 0` when the row is not due or already settled."),
                    "400": MALFORMED, "401": UNAUTHORIZED, "413": TOO_LARGE, "422": INVALID,
                    "503": _error("REMINDERS_ENABLED=true but APNs credentials are missing or unreadable; nothing was claimed."),
                },
            }
        },
        "/v1/devices/{device_id}": {
            "parameters": [DEVICE_ID_PARAM],
            "get": {
                "operationId": "getDevice",
                "security": bearer,
                "responses": {"200": _json(_ref("Device"), "The device."), "401": UNAUTHORIZED, "404": NO_DEVICE},
            },
            "put": {
                "operationId": "putDevice",
                "summary": "Create or replace a device.",
                "security": bearer,
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("DeviceRegistration")}}},
                "responses": {
                    "200": _json(_ref("Registration"), "The stored device; `credential` when this call issued one."),
                    "400": MALFORMED, "401": UNAUTHORIZED, "413": TOO_LARGE, "422": INVALID,
                },
            },
            "delete": {
                "operationId": "deleteDevice",
                "summary": "Delete a device; its pending rows are voided (`device_removed`).",
                "security": bearer,
                "responses": {"200": _json(_ref("Removed"), "Removed."), "401": UNAUTHORIZED, "404": NO_DEVICE},
            },
        },
        "/v1/devices/{device_id}/credential": {
            "parameters": [DEVICE_ID_PARAM],
            "post": {
                "operationId": "rotateDeviceCredential",
                "summary": "Issue the device a new credential (shown once); the one it replaces stops working at once.",
                "security": device_or_bearer,
                "responses": {"200": _json(_ref("Credential"), "The new credential."), "401": DEVICE_UNAUTHORIZED, "404": NO_DEVICE},
            },
        },
        "/v1/devices/{device_id}/feed": {
            "parameters": [DEVICE_ID_PARAM],
            "get": {
                "operationId": "getFeed",
                "summary": "The widget's feed, item bounds in Unix seconds; stores `tz` only when it changed (best-effort).",
                "security": device_or_bearer,
                "parameters": [
                    {
                        "name": "tz", "in": "query", "required": False,
                        "schema": {
                            "anyOf": [
                                {"type": "string", "maxLength": MAX_ZONE_NAME, "pattern": ZONE_NAME_PATTERN},
                                {"type": "integer", "minimum": -MAX_TZ_OFFSET_SECONDS, "maximum": MAX_TZ_OFFSET_SECONDS},
                            ]
                        },
                        "description": "The widget's IANA time zone (`Europe/Berlin`), or (old widgets) its UTC offset in seconds.",
                    }
                ],
                "responses": {
                    "200": _json(_ref("Feed"), "The composed feed."), "401": DEVICE_UNAUTHORIZED, "404": NO_DEVICE, "422": INVALID,
                },
            }
        },
    }


UNAVAILABLE = _error(
    "The database is not at this release's migration head (`schema_not_current`, `detail` is the one line "
    "naming both revisions), or it is unreachable or timed out (`database_unavailable`)."
)


def _with_unavailable(paths: dict[str, Any]) -> dict[str, Any]:
    """Every route that reads the ledger may answer 503 (a route's own 503 keeps its description)."""
    for path, item in paths.items():
        if path in ("/metrics", "/openapi.json"):
            continue
        for method, operation in item.items():
            if method in ("get", "put", "post", "delete"):
                operation["responses"].setdefault("503", UNAVAILABLE)
    return paths


def document(settings: Settings) -> dict[str, Any]:
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
        "paths": _with_unavailable(_paths()),
        "components": {
            "schemas": _schemas(settings),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "The internal token, REMINDERS_TOKEN."},
                "deviceCredential": {"type": "http", "scheme": "bearer", "description": "The device's own credential."},
            },
        },
    }
