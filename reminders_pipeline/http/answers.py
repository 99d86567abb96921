"""The bodies of the HTTP shell's answers, as pydantic models for FastAPI's ``/openapi.json``: what
each route returns (``routes.py`` names them), beside the error shape every refusal shares. The
routes build their answers as plain JSON; these models document them. They list the fields
clients rely on and allow more, so the core can add summary fields without breaking the contract;
``test_http_schemathesis.py`` checks every answer against them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from reminders_pipeline.domain.wire import Provider

StoredTime = Annotated[str | None, Field(description="Stored time, ISO-8601 UTC: 2026-09-10T08:30:00.000Z")]
Counts = dict[str, int]
CREDENTIAL = (
    "The device's own bearer for its own routes, shown only in the answer that issues it; the ledger keeps its "
    "SHA-256. A registration that replaces a device keeps its credential (absent here)."
)


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
