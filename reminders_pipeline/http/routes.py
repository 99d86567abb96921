"""The route table: each path and method, its credential and body as dependencies, and every
answer it gives, so FastAPI's ``/openapi.json`` lists exactly the statuses the route returns.

Answers every route of its kind gives (401 for a protected one, 400/413/422 for a body, 503 for
one that reads the ledger) are added by ``_answers``; each route lists the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Security
from fastapi.openapi.utils import get_openapi
from fastapi.params import Depends as Dependency
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPBearer

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.http.answers import (
    Acknowledged,
    BuildSummary,
    Credential,
    Device,
    DrainSummary,
    Error,
    Feed,
    Health,
    Registration,
    Removed,
    Snoozed,
    VapidPublicKey,
)
from reminders_pipeline.http.contract import (
    MAX_BODY_BYTES,
    TAKES_NOW,
    BuildRequest,
    DeviceRegistration,
    DoneRequest,
    DrainRequest,
    Request,
    SnoozeRequest,
)
from reminders_pipeline.http.parsing import Guard, json_body

if TYPE_CHECKING:
    from reminders_pipeline.http.app import Api

INTERNAL_SCHEME = HTTPBearer(scheme_name="bearer", description="The internal token, REMINDERS_TOKEN.", auto_error=False)
DEVICE_SCHEME = HTTPBearer(scheme_name="deviceCredential", description="The device's own credential.", auto_error=False)
DESCRIPTION = (
    "Internal build/drain routes, the device API and the widget feed. Internal and management routes "
    "need `Authorization: Bearer $REMINDERS_TOKEN` (or `$REMINDERS_TOKEN_PREVIOUS` while rotating it); "
    "with the variable unset they all answer 401. A device's own routes (its feed, its credential) "
    "also take that device's own credential, issued when it is registered. "
    "Errors are JSON `{error, detail, field?}`; a request the app cannot use is a 4xx, never a 500."
)
DRAIN_ID = "Drain only this queue row (an exact-time scheduler's call)."
FEED_TZ = "The widget's IANA time zone (`Europe/Berlin`), or (old widgets) its UTC offset in seconds."
FEED_LOCALE = (
    "The widget's locale (`de-DE`): the language and clock of the device's alerts, stored only when it "
    "changed; one CLDR does not know is ignored."
)

Answers = dict[int | str, dict[str, Any]]


def answer(description: str, model: Any = Error) -> dict[str, Any]:
    return {"description": description, "model": model}


UNAUTHORIZED = answer("`REMINDERS_TOKEN` unset, or a missing or wrong `Authorization: Bearer` token.")
DEVICE_UNAUTHORIZED = answer(
    "A missing or wrong `Authorization: Bearer`: neither this device's own credential nor the internal token."
)
BODY_ANSWERS: Answers = {
    400: answer("The body is not JSON."),
    413: answer(f"The body is larger than {MAX_BODY_BYTES} bytes."),
    422: answer("Validation error; `field` names the offending field."),
}
NO_DEVICE = answer("No such device.")
UNAVAILABLE = answer(
    "The database is not at this release's migration head (`schema_not_current`, `detail` is the one line "
    "naming both revisions), or it is unreachable or timed out (`database_unavailable`)."
)
ACTION_ANSWERS: Answers = {
    401: answer(
        "`unauthorized`: not this device's own credential (nor the internal token); `wrong_action_token`: "
        "not the token of this reminder's alert."
    ),
    404: answer("`no_reminder`: this device has no such reminder (another device's row is not found either)."),
    409: answer(
        "`not_sent` (the row sent no alert), `event_ended`, `event_changed` (cancelled, declined or muted; "
        "an agenda: its day left with no event), `unsubscribed`, `event_moved` (snooze only: the event moved since "
        "this alert; snooze its newer one), `snooze_limit` (12 snoozes already) or `busy` (try again). Nothing "
        "was changed."
    ),
}


def _answers(own: Answers, *, auth: str = "open", body: bool = False, ledger: bool = True) -> Answers:
    """Every answer a route may give: those of its kind, then its own."""
    implied: Answers = {}
    if auth != "open":
        implied[401] = UNAUTHORIZED if auth == "internal" else DEVICE_UNAUTHORIZED
    if body:
        implied |= BODY_ANSWERS
    if ledger:
        implied[503] = UNAVAILABLE
    return implied | own


def mount(app: FastAPI, api: Api) -> None:
    """Every route of the app, in the order the document lists them."""
    internal = [Security(INTERNAL_SCHEME), Guard(api.internal)]
    device = [Security(DEVICE_SCHEME), Security(INTERNAL_SCHEME), Guard(api.device)]

    def body(model: type[Request], *, required: bool = False) -> Dependency:
        return Depends(json_body(model, api.settings, required=required))

    add = app.router.add_api_route
    add(
        "/healthz",
        api.healthz,
        operation_id="healthz",
        summary="Open. Checks the database (a connection and the migrated schema).",
        responses={200: answer("Healthy.", Health), 503: answer("The database is unavailable.", Health)},
    )
    add(
        "/metrics",
        api.metrics_text,
        operation_id="metrics",
        summary="Open. Prometheus text format.",
        response_class=PlainTextResponse,
        responses={200: {"description": "Metrics."}},
    )
    add(
        "/openapi.json",
        api.openapi_json,
        operation_id="openapi",
        summary="Open. This document.",
        responses={200: answer("The OpenAPI document.", dict[str, Any])},
    )
    add(
        "/internal/reminders/build",
        api.build,
        methods=["POST"],
        operation_id="build",
        summary="Compose feeds and make queue rows match them (the build cron, or an immediate rebuild).",
        dependencies=[*internal, body(BuildRequest)],
        responses=_answers(
            {200: answer("The build summary.", BuildSummary), 404: NO_DEVICE}, auth="internal", body=True
        ),
    )
    add(
        "/internal/reminders/drain",
        api.drain,
        methods=["POST"],
        operation_id="drain",
        summary="Claim and send every due row, or only row `id` if it is due. At most once per row.",
        dependencies=[*internal, body(DrainRequest)],
        responses=_answers(
            {
                200: answer("The drain summary; `due: 0` when the row is not due or already settled.", DrainSummary),
                503: answer(
                    "REMINDERS_ENABLED=true but APNs credentials are missing or unreadable; nothing was claimed."
                ),
            },
            auth="internal",
            body=True,
        ),
    )
    path = "/v1/devices/{device_id}"
    add(
        path,
        api.get_device,
        operation_id="getDevice",
        dependencies=internal,
        responses=_answers({200: answer("The device.", Device), 404: NO_DEVICE}, auth="internal"),
    )
    add(
        path,
        api.put_device,
        methods=["PUT"],
        operation_id="putDevice",
        summary="Create or replace a device.",
        dependencies=[*internal, body(DeviceRegistration, required=True)],
        responses=_answers(
            {200: answer("The stored device; `credential` when this call issued one.", Registration)},
            auth="internal",
            body=True,
        ),
    )
    add(
        path,
        api.delete_device,
        methods=["DELETE"],
        operation_id="deleteDevice",
        summary="Delete a device; its pending rows are voided (`device_removed`).",
        dependencies=internal,
        responses=_answers({200: answer("Removed.", Removed), 404: NO_DEVICE}, auth="internal"),
    )
    add(
        f"{path}/credential",
        api.rotate_device_credential,
        methods=["POST"],
        operation_id="rotateDeviceCredential",
        summary="Issue the device a new credential (shown once); the one it replaces stops working at once.",
        dependencies=device,
        responses=_answers(
            {
                200: answer("The new credential.", Credential),
                404: NO_DEVICE,
                409: answer(
                    "`credential_changed`: a concurrent rotation replaced the credential this one meant to replace."
                ),
            },
            auth="device",
        ),
    )
    add(
        f"{path}/feed",
        api.feed,
        operation_id="getFeed",
        summary="The widget's feed, item bounds in Unix seconds; stores `tz` only when it changed (best-effort).",
        dependencies=device,
        responses=_answers(
            {200: answer("The composed feed.", Feed), 404: NO_DEVICE, 422: BODY_ANSWERS[422]}, auth="device"
        ),
    )
    for action, model, endpoint, summary, done in (
        (
            "snooze",
            SnoozeRequest,
            api.snooze,
            "Snooze a sent alert: one `snooze:N` row, however often asked, sent at its time with the same guards.",
            answer("The snooze's row.", Snoozed),
        ),
        (
            "done",
            DoneRequest,
            api.done,
            "Done on a sent alert: the event's other pending reminders on this device are settled `acknowledged`.",
            answer("How many pending reminders were settled.", Acknowledged),
        ),
    ):
        add(
            f"{path}/reminders/{{row_id}}/{action}",
            endpoint,
            methods=["POST"],
            operation_id=f"{action}Reminder",
            summary=summary,
            dependencies=[*device, body(model, required=True)],
            responses=_answers({200: done, **ACTION_ANSWERS}, auth="device", body=True),
        )
    add(
        "/v1/vapid-public-key",
        api.vapid_public_key,
        operation_id="vapidPublicKey",
        summary="Open. The `applicationServerKey` a web client passes to `PushManager.subscribe`.",
        responses={
            200: answer("The deployment's VAPID public key.", VapidPublicKey),
            404: answer("`webpush_not_configured`: this deployment sends no Web Push."),
        },
    )


def document(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """FastAPI's document of the routes, with what only this deployment's settings say: ``now``
    listed only where it is accepted, the chunk range, the default lead. FastAPI's own 422 body
    is never answered (``errors.validation_error`` answers ``Error``), so it is not listed."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc["components"]["schemas"]
        if not settings.http_accept_now:
            for model in TAKES_NOW:
                schemas[model.__name__]["properties"].pop("now")
        schemas["BuildRequest"]["properties"]["chunk"]["anyOf"][0]["maximum"] = settings.chunk_count - 1
        schemas["DeviceRegistration"]["properties"]["reminder_lead_seconds"]["description"] += (
            f" Default {settings.default_lead_seconds}."
        )
        for item in doc["paths"].values():
            for operation in item.values():
                if "HTTPValidationError" in str(operation["responses"].get("422", "")):
                    del operation["responses"]["422"]
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        app.openapi_schema = doc
    return app.openapi_schema
