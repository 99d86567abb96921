"""Routes, authentication and request parsing for the HTTP shell.

Every answer is JSON (``/metrics`` aside). A request the app cannot use is a 4xx whose body names
what is wrong (``field`` for a validation error), never a 500. Each route serves operations that
``contract.py`` declares (the route table pairs each with its endpoint), and the handler enforces
the operation's credential and checks its body against its model before the endpoint sees a
value: the core trusts its typed callers (the CLI, Dagster), and a value it was never meant to see
(a 20-digit id, a NUL byte, a lead longer than the epoch) would surface as a database error. The
same operations, walked from the routes the app serves, generate ``/openapi.json``.

Core calls block (source reads and sends run ``asyncio.run`` inside), so each runs in Starlette's
threadpool; the event loop only parses and answers.

Longer than 350 lines because every route, their shared authentication and the parsing of each
parameter are declared together, so what each route accepts reads in one file.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import cached_property
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reminders_pipeline import ledger
from reminders_pipeline.config.log_throttle import first_line
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.devices import actions
from reminders_pipeline.devices.credentials import (
    CredentialChanged,
    credential_hash,
    rotate_credential,
    stored_credential_hash,
)
from reminders_pipeline.devices.registration import (
    DEVICE_ID_PATTERN,
    DEVICE_ID_SHAPE,
    DeviceError,
    DeviceSpec,
    put_device,
    remove_device,
)
from reminders_pipeline.domain.calendar_settings import CalendarSettings
from reminders_pipeline.domain.phrases import LOCALE_SHAPE, MAX_LOCALE_LENGTH, LocaleError, canonical_locale
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.zones import MAX_TZ_OFFSET_SECONDS, Zone, ZoneError, valid_zone_name
from reminders_pipeline.http.contract import (
    BUILD,
    DELETE_DEVICE,
    DONE,
    DRAIN,
    FEED,
    GET_DEVICE,
    HEALTHZ,
    MAX_BODY_BYTES,
    METRICS,
    OPENAPI,
    PUT_DEVICE,
    ROTATE_CREDENTIAL,
    SNOOZE,
    TAKES_NOW,
    VAPID_PUBLIC_KEY,
    BuildRequest,
    Contract,
    DeviceRegistration,
    DoneRequest,
    DrainRequest,
    Operation,
    SnoozeRequest,
    document,
)
from reminders_pipeline.http.metrics import Metrics
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.ledger.schema import MAX_ROW_ID
from reminders_pipeline.planning.build import build as run_build
from reminders_pipeline.planning.widget_feed import ComposedFeed, compose_feed
from reminders_pipeline.providers.base import SenderFactory
from reminders_pipeline.providers.routing import checked_sender_factory
from reminders_pipeline.providers.webpush import load_key, public_key_text
from reminders_pipeline.sending.drain import drain as run_drain

log = logging.getLogger(__name__)

ROW_ID_TEXT = re.compile(r"[0-9]{1,19}")
TZ_TEXT = re.compile(r"-?[0-9]{1,6}")
DEVICE_ERROR_FIELDS = {"rules": "extra_rules", "sources": "source_urls"}  # DeviceError names -> body keys
BEARER_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="reminders"'}
NO_CREDENTIAL = credential_hash(b"")  # compared against when a device has none, so the work is the same

Endpoint = Callable[[Request], Awaitable[Response]]
Handler = Callable[..., Awaitable[Response]]  # an endpoint, with its validated body if the operation takes one
Body = TypeVar("Body", bound=BaseModel)


class ApiError(Exception):
    """Any answer but success: a status, a stable ``error`` code, a message, and the field at fault."""

    def __init__(
        self, status: int, error: str, detail: str, field: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.status, self.error, self.detail, self.field, self.headers = status, error, detail, field, headers

    def response(self) -> JSONResponse:
        body: dict[str, Any] = {"error": self.error, "detail": self.detail}
        if self.field is not None:
            body["field"] = self.field
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def invalid(field: str, detail: str) -> ApiError:
    return ApiError(422, "invalid", detail, field)


def no_device(device_id: str) -> ApiError:
    return ApiError(404, "not_found", f"no device {device_id!r}")


# ---------------------------------------------------------------- parsing


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


async def read_json(request: Request, *, required: bool) -> dict[str, Any] | None:
    """The body as a JSON object; ``None`` for an empty optional body. Bounded by ``MAX_BODY_BYTES``.

    Read here rather than by pydantic's JSON parser: ``NaN`` is not JSON (400, not a number), and
    the size bound holds while the body streams in.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, "too_large", f"the body is larger than {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, "too_large", f"the body is larger than {MAX_BODY_BYTES} bytes")
    if not body.strip():
        if required:
            raise invalid("body", "a JSON object body is required")
        return None
    try:
        doc = json.loads(bytes(body), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, "malformed_json", f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise invalid("body", "must be a JSON object")
    return doc


def validated(model: type[Body], doc: dict[str, Any]) -> Body:
    """The body as its contract model, or a 422 naming one field: an unknown key first (as a
    misspelling it explains the rest), else the first field in the model's order."""
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    first = min(
        errors,
        key=lambda e: (e["type"] != "extra_forbidden", str(e["loc"][0]) if e["type"] == "extra_forbidden" else ""),
    )
    field = str(first["loc"][0]) if first["loc"] else "body"
    if first["type"] == "extra_forbidden":
        raise invalid(field, f"unknown field; expected one of {', '.join(sorted(model.model_fields))}")
    raise invalid(field, str(first["ctx"]["error"]) if first["type"] == "value_error" else first["msg"])


def refuse_now(doc: dict[str, Any], settings: Settings) -> None:
    """``now`` only where a test deployment asked for it: over the wire it would let anyone holding
    the token stamp devices built in 2999 or settle every pending row ``event_expired``."""
    if "now" in doc and not settings.http_accept_now:
        raise invalid(
            "now", "not accepted: the routes run on the server's clock (REMINDERS_HTTP_ACCEPT_NOW=true is for tests)"
        )


def valid_device_id(device_id: Any) -> bool:
    return isinstance(device_id, str) and DEVICE_ID_PATTERN.fullmatch(device_id) is not None


def device_spec(device_id: str, body: DeviceRegistration, settings: Settings) -> DeviceSpec:
    """The PUT body as a ``DeviceSpec``, omitted fields defaulted; the core's ``validate`` still has the last word."""
    return DeviceSpec.requested(
        settings,
        device_id,
        apns_token=body.apns_token,
        webpush=body.webpush_subscription.model_dump() if body.webpush_subscription else None,
        fcm_token=body.fcm_token,
        lead=body.reminder_lead_seconds,
        rules=body.extra_rules or (),
        sources=body.source_urls or (),
        tz=body.tz,
        all_day_rules=body.all_day_rules,
        quiet_hours=body.quiet_hours,
        alarms=bool(body.alarms),
        attendees=body.attendees or (),
        locale=body.locale,
        clock=body.clock,
        calendars={
            c.url: CalendarSettings(_tuple(c.rules), c.interruption_level, c.breakthrough, c.muted, c.travel_seconds)
            for c in body.calendars or ()
        },
    )


def _tuple(rules: list[str] | None) -> tuple[str, ...] | None:
    return None if rules is None else tuple(rules)


def parse_row_id(request: Request, from_body: int | None) -> int | None:
    """``?id=`` or the body's ``id`` (both only if they agree); None means sweep every due row."""
    texts = request.query_params.getlist("id")
    if len(texts) > 1:
        raise invalid("id", "give one id")
    from_query = None
    if texts:
        if not ROW_ID_TEXT.fullmatch(texts[0]) or not 1 <= int(texts[0]) <= MAX_ROW_ID:
            raise invalid("id", f"a queue row id: a whole number from 1 to {MAX_ROW_ID}")
        from_query = int(texts[0])
    if from_query is not None and from_body is not None and from_query != from_body:
        raise invalid("id", "the query and the body name different rows")
    return from_query if from_query is not None else from_body


def path_row_id(request: Request) -> int:
    """The reminder a device's action names (``{row_id}``)."""
    text = request.path_params["row_id"]
    if not ROW_ID_TEXT.fullmatch(text) or not 1 <= int(text) <= MAX_ROW_ID:
        raise invalid("row_id", f"a queue row id: a whole number from 1 to {MAX_ROW_ID}")
    return int(text)


def parse_tz(request: Request) -> Zone | None:
    """The zone a widget reports as ``tz``: an IANA zone name (checked against the zone database)
    or, from old widgets, a UTC offset in seconds."""
    texts = request.query_params.getlist("tz")
    if not texts:
        return None
    message = f"an IANA time zone like Europe/Berlin, or a UTC offset in seconds, -{MAX_TZ_OFFSET_SECONDS} to {MAX_TZ_OFFSET_SECONDS}"
    if len(texts) > 1:
        raise invalid("tz", message)
    if TZ_TEXT.fullmatch(texts[0]) and abs(int(texts[0])) <= MAX_TZ_OFFSET_SECONDS:
        return Zone(offset_seconds=int(texts[0]))
    try:
        return Zone(valid_zone_name(texts[0]))
    except ZoneError:
        raise invalid("tz", message) from None


def parse_locale(request: Request) -> str | None:
    """The locale a widget reports as ``locale`` (``de-DE``), as stored; None when it sends none,
    or one CLDR does not know (the feed answers all the same, and the stored locale stays)."""
    texts = request.query_params.getlist("locale")
    message = f"a BCP 47 tag like de-DE, at most {MAX_LOCALE_LENGTH} characters"
    if not texts:
        return None
    if len(texts) > 1 or len(texts[0]) > MAX_LOCALE_LENGTH or not re.fullmatch(LOCALE_SHAPE, texts[0]):
        raise invalid("locale", message)
    try:
        return canonical_locale(texts[0])
    except LocaleError:
        return None


def _stored_already(reported: Zone, record: ledger.DeviceRecord) -> bool:
    """Whether the device already has the zone name, or the offset, its widget reports."""
    if reported.tz_name is not None:
        return reported.tz_name == record.tz_name
    return reported.offset_seconds == record.last_tz_offset_seconds


# ---------------------------------------------------------------- the routes


class Api:
    """The endpoints, bound to one settings value, one database and one metrics registry."""

    def __init__(
        self, settings: Settings, db: Database, sender_factory: SenderFactory | None, metrics: Metrics
    ) -> None:
        self.settings = settings
        self.db = db
        self.sender_factory = sender_factory
        self.metrics = metrics
        # The internal token, and while it is being rotated the one before it; none if unset.
        current = (settings.token, settings.token_previous) if settings.token else ()
        self.tokens = tuple(t.encode("utf-8") for t in current if t)
        self.contract = Contract(settings)
        self.document: dict[str, Any] = {}  # set by create_app, from the routes the app serves
        # Set by the server on SIGTERM or Ctrl-C: a drain in flight claims nothing more (the server
        # still waits for its request, so what is on the wire is answered and settled).
        self.stopping = threading.Event()

    @staticmethod
    def bearer(request: Request) -> bytes | None:
        """The presented bearer's raw bytes (header text is latin-1 decoded); None for another scheme."""
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        return credentials.strip().encode("latin-1") if scheme.lower() == "bearer" else None

    def is_internal(self, given: bytes | None) -> bool:
        """Compared in constant time with every accepted token (no early exit reveals which)."""
        return given is not None and any([hmac.compare_digest(given, token) for token in self.tokens])

    def check_auth(self, request: Request) -> None:
        """Unset token: every internal and management route is closed."""
        if not self.tokens:
            raise ApiError(
                401, "unauthorized", "REMINDERS_TOKEN is not set: protected routes are closed", headers=BEARER_CHALLENGE
            )
        if not self.is_internal(self.bearer(request)):
            raise ApiError(
                401, "unauthorized", "missing or wrong 'Authorization: Bearer' token", headers=BEARER_CHALLENGE
            )

    async def check_device_auth(self, request: Request) -> None:
        """The device's own credential, for its own routes only (or the internal token, an operator's)."""
        given = self.bearer(request)
        if self.is_internal(given):
            return
        device_id = request.path_params["device_id"]
        stored = (
            await run_in_threadpool(stored_credential_hash, self.db, device_id)
            if given and valid_device_id(device_id)
            else None
        )
        matched = hmac.compare_digest(credential_hash(given or b""), stored or NO_CREDENTIAL)
        if stored is None or not matched:
            detail = "missing or wrong 'Authorization: Bearer': this device's own credential (or REMINDERS_TOKEN)"
            raise ApiError(401, "unauthorized", detail, headers=BEARER_CHALLENGE)

    async def require_schema(self) -> None:
        """503 with the one-line reason until the database is at this release's migration head.

        Checked once per engine: after the first success it is a flag test on the event loop.
        """
        if self.db.at_head:
            return
        try:
            await run_in_threadpool(migrate.require_head, self.db)
        except migrate.SchemaNotCurrent as exc:
            raise ApiError(503, "schema_not_current", str(exc)) from None

    async def authorize(self, op: Operation, request: Request) -> None:
        """The operation's credential; a device's own routes check the schema first, so a missing
        ledger is never made by reading a credential from it."""
        if op.auth == "internal":
            self.check_auth(request)
            await self.require_schema()
        elif op.auth == "device":
            await self.require_schema()
            await self.check_device_auth(request)
        elif op.auth != "open":
            raise AssertionError(f"operation {op.operation_id} has no credential check for {op.auth!r}")

    async def parse_body(self, op: Operation, request: Request) -> BaseModel:
        """The operation's body as this deployment's model of it.

        A body addressed to a path that cannot name a device is refused once the body is read,
        before it is validated.
        """
        assert op.body is not None
        doc = await read_json(request, required=op.body_required) or {}
        if "device_id" in request.path_params and not valid_device_id(request.path_params["device_id"]):
            raise invalid("id", DEVICE_ID_SHAPE)
        if op.body in TAKES_NOW:
            refuse_now(doc, self.settings)
        return validated(self.contract.model(op.body), doc)

    def handler(self, op: Operation, endpoint: Handler) -> Endpoint:
        """Authentication before anything else: an unauthenticated body is never read."""

        async def handle(request: Request) -> Response:
            await self.authorize(op, request)
            if op.body is None:
                return await endpoint(request)
            return await endpoint(request, await self.parse_body(op, request))

        handle.__name__ = endpoint.__name__
        return handle

    # -- open routes

    async def healthz(self, request: Request) -> Response:
        """Open, for load balancers: proves a connection and the migrated schema."""
        try:
            await run_in_threadpool(self._probe)
        except migrate.SchemaNotCurrent as exc:
            log.warning("health check failed: %s", exc)
            return JSONResponse({"status": "unavailable", "database": self.db.dialect, "detail": str(exc)}, 503)
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            log.warning("health check failed: %s: %s", type(exc).__name__, first_line(exc))
            return JSONResponse(
                {"status": "unavailable", "database": self.db.dialect, "detail": type(exc).__name__}, 503
            )
        return JSONResponse({"status": "ok", "database": self.db.dialect})

    def _probe(self) -> None:
        migrate.require_head(self.db)
        with self.db.read() as conn:
            ledger.ping(conn)

    async def metrics_text(self, request: Request) -> Response:
        body = await run_in_threadpool(self.metrics.render)
        return Response(body, headers={"Content-Type": self.metrics.content_type})

    async def openapi_json(self, request: Request) -> Response:
        return JSONResponse(self.document)

    # -- internal: what the crons do

    async def build(self, request: Request, body: BuildRequest) -> Response:
        """``{}`` every device; ``{"device_id"}`` the immediate rebuild; ``{"chunk"}`` one partition."""
        if {"device_id", "chunk"} <= body.model_fields_set:
            raise invalid("chunk", "give device_id or chunk, not both")
        now, kwargs = getattr(body, "now", None), dict[str, Any]()
        if body.device_id is not None:
            if await run_in_threadpool(self._device, body.device_id) is None:
                raise no_device(body.device_id)
            kwargs = {"device_ids": [body.device_id]}
        elif body.chunk is not None:  # exactly what the Dagster asset does for one partition
            kwargs = {"chunks": [body.chunk], "limit": self.settings.chunk_size}
        summary = await run_in_threadpool(lambda: run_build(self.db, self.settings, now=now, **kwargs))
        return JSONResponse(summary.as_dict())

    async def drain(self, request: Request, body: DrainRequest) -> Response:
        """Every due row, or just ``id`` if it is due; a second call for the same row sends nothing."""
        now, row_id = getattr(body, "now", None), parse_row_id(request, body.id)
        factory = self.sender_factory
        if factory is None:
            try:  # APNs credentials are checked here, before anything is claimed
                factory = await run_in_threadpool(checked_sender_factory, self.db, self.settings)
            except ValueError as exc:
                raise ApiError(503, "sender_unavailable", str(exc)) from None
        summary = await run_in_threadpool(
            lambda: run_drain(self.db, self.settings, factory, now=now, row_id=row_id, stop=self.stopping)
        )
        self.metrics.observe_drain(summary)
        return JSONResponse(summary.as_dict())

    # -- the device API

    def _device(self, device_id: str) -> ledger.DeviceRecord | None:
        with self.db.read() as conn:
            return ledger.get_device(conn, device_id)

    async def get_device(self, request: Request) -> Response:
        device_id = request.path_params["device_id"]
        record = await run_in_threadpool(self._device, device_id) if valid_device_id(device_id) else None
        if record is None:
            raise no_device(device_id)
        return JSONResponse(record.as_dict())

    async def put_device(self, request: Request, body: DeviceRegistration) -> Response:
        """Create or replace: exactly these rules and sources; omitted optional fields take defaults."""
        spec = device_spec(request.path_params["device_id"], body, self.settings)
        try:
            registration = await run_in_threadpool(put_device, self.db, self.settings, spec)
        except DeviceError as exc:
            raise invalid(DEVICE_ERROR_FIELDS.get(exc.field, exc.field), exc.message) from None
        return JSONResponse(registration.as_dict())  # with ``credential`` the one time it is issued

    async def delete_device(self, request: Request) -> Response:
        """Voids the device's pending rows (``device_removed``); the ledger keeps what was sent."""
        device_id = request.path_params["device_id"]
        voided = await run_in_threadpool(remove_device, self.db, device_id) if valid_device_id(device_id) else None
        if voided is None:
            raise no_device(device_id)
        return JSONResponse({"device_id": device_id, "rows_voided": voided})

    async def rotate_device_credential(self, request: Request) -> Response:
        """A new credential for the device, shown this once; the one it replaces stops working."""
        device_id = request.path_params["device_id"]
        given = self.bearer(request)
        presented = None if self.is_internal(given) else credential_hash(given or b"")
        try:
            credential = (
                await run_in_threadpool(rotate_credential, self.db, device_id, presented)
                if valid_device_id(device_id)
                else None
            )
        except CredentialChanged as exc:
            raise ApiError(409, "credential_changed", str(exc)) from None
        if credential is None:
            raise no_device(device_id)
        return JSONResponse({"device_id": device_id, "credential": credential})

    # -- a person's actions on an alert

    async def snooze(self, request: Request, body: SnoozeRequest) -> Response:
        device_id, row_id = request.path_params["device_id"], path_row_id(request)
        until = None if body.until is None else Instant.from_unix(body.until)
        now = getattr(body, "now", None)
        snoozed = await self._act(
            lambda: actions.snooze(self.db, device_id, row_id, body.token, seconds=body.seconds, until=until, now=now)
        )
        return JSONResponse({"device_id": device_id, **snoozed.as_dict()})

    async def done(self, request: Request, body: DoneRequest) -> Response:
        device_id, row_id = request.path_params["device_id"], path_row_id(request)
        now = getattr(body, "now", None)
        settled = await self._act(
            lambda: actions.done(
                self.db, device_id, row_id, body.token, same_within=self.settings.rearm_threshold_seconds, now=now
            )
        )
        return JSONResponse({"device_id": device_id, "row_id": row_id, "acknowledged": settled})

    @staticmethod
    async def _act(act: Callable[[], Any]) -> Any:
        try:
            return await run_in_threadpool(act)
        except actions.ActionError as exc:
            raise ApiError(exc.status, exc.code, exc.message, exc.field) from None

    # -- the widget's feed

    async def feed(self, request: Request) -> Response:
        """The composed feed, item bounds in Unix seconds (the wire contract), soonest first."""
        device_id = request.path_params["device_id"]
        reported, locale = parse_tz(request), parse_locale(request)
        composed = (
            await run_in_threadpool(self._feed, device_id, reported, locale) if valid_device_id(device_id) else None
        )
        if composed is None:
            raise no_device(device_id)
        return JSONResponse(
            {
                "device_id": device_id,
                "items": composed.items,
                "sources_failed": composed.sources_failed,
                "vapid_public_key": self.vapid_key,
            }
        )

    async def vapid_public_key(self, request: Request) -> Response:
        if self.vapid_key is None:
            raise ApiError(404, "webpush_not_configured", "this deployment sends no Web Push")
        return JSONResponse({"public_key": self.vapid_key})

    @cached_property
    def vapid_key(self) -> str | None:
        """The VAPID public key, when Web Push is configured and its key reads (read once: a new key
        needs a restart; one that does not read is logged, and no web client can subscribe)."""
        if not self.settings.vapid_private_key_file:
            return None
        try:
            return public_key_text(load_key(self.settings))
        except RuntimeError as exc:
            log.error("no VAPID public key to serve: %s", exc)
            return None

    def _feed(self, device_id: str, reported: Zone | None, locale: str | None) -> ComposedFeed | None:
        record = self._device(device_id)
        if record is None:
            return None
        if reported is not None and not _stored_already(reported, record):
            self._store_zone(device_id, reported)  # before composing: floating calendar times use the zone
        if locale is not None and locale != record.locale:
            self._store_locale(device_id, locale)
        return compose_feed(self.db, self.settings, device_id)

    def _store_locale(self, device_id: str, locale: str) -> None:
        """Conditional and best-effort, as ``_store_zone``: a locale can never fail a feed request."""
        try:
            with self.db.write() as conn:
                ledger.store_locale(conn, device_id, locale)
        except Exception as exc:  # noqa: BLE001
            log.warning(
                "could not store the locale %s for %s: %s: %s", locale, device_id, type(exc).__name__, first_line(exc)
            )

    def _store_zone(self, device_id: str, reported: Zone) -> None:
        """Conditional (only a changed zone or offset reaches here, and the UPDATE re-checks) and best-effort."""
        try:
            with self.db.write() as conn:
                if reported.tz_name is not None:
                    ledger.store_tz_name(conn, device_id, reported.tz_name)
                elif reported.offset_seconds is not None:
                    ledger.store_tz_offset(conn, device_id, reported.offset_seconds)
        except Exception as exc:  # noqa: BLE001 - a zone can never fail a feed request
            self.metrics.tz_write_failed()
            log.warning(
                "could not store the zone %s for %s: %s: %s",
                reported.tz_name or reported.offset_seconds,
                device_id,
                type(exc).__name__,
                first_line(exc),
            )

    # -- wiring

    def routes(self) -> list[Route]:
        """The route table: each operation of the contract and the endpoint that serves it."""
        table: list[tuple[Operation, Handler]] = [
            (HEALTHZ, self.healthz),
            (METRICS, self.metrics_text),
            (OPENAPI, self.openapi_json),
            (BUILD, self.build),
            (DRAIN, self.drain),
            (GET_DEVICE, self.get_device),
            (PUT_DEVICE, self.put_device),
            (DELETE_DEVICE, self.delete_device),
            (ROTATE_CREDENTIAL, self.rotate_device_credential),
            (FEED, self.feed),
            (SNOOZE, self.snooze),
            (DONE, self.done),
            (VAPID_PUBLIC_KEY, self.vapid_public_key),
        ]
        by_path: dict[str, list[tuple[Operation, Endpoint]]] = {}
        for op, endpoint in table:
            by_path.setdefault(op.path, []).append((op, self.handler(op, endpoint)))
        return [OperationRoute(path, served) for path, served in by_path.items()]


class OperationRoute(Route):
    """One path and its operations: one route for all its methods, so a 405 lists them all in ``Allow``."""

    def __init__(self, path: str, served: list[tuple[Operation, Endpoint]]) -> None:
        self.operations = [op for op, _ in served]
        handlers = {op.method: handler for op, handler in served}

        async def dispatch(request: Request) -> Response:
            return await (handlers.get(request.method) or handlers["GET"])(request)  # HEAD is answered as GET

        dispatch.__name__ = served[0][1].__name__
        super().__init__(path, dispatch, methods=list(handlers))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) and 405 (wrong method) as JSON, keeping ``Allow``."""
    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    body = {"error": codes.get(exc.status_code, "http_error"), "detail": exc.detail}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _database_error(request: Request, exc: Exception) -> Response:
    """The database is unreachable, timed out a statement (statement_timeout), or no pooled
    connection freed up in time: the service is unavailable, not broken."""
    log.warning(
        "%s %s: database unavailable: %s: %s", request.method, request.url.path, type(exc).__name__, first_line(exc)
    )
    detail = "the database is unreachable or did not answer in time; retry later"
    return JSONResponse(
        {"error": "database_unavailable", "detail": detail}, status_code=503, headers={"Retry-After": "5"}
    )


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug: JSON like every other answer. Starlette re-raises afterwards, so the server logs it."""
    return JSONResponse({"error": "internal", "detail": "internal error; see the server log"}, status_code=500)


def _announce_schema(db: Database) -> None:
    """At startup, say once in the log why routes will answer 503; the server starts regardless,
    so an instance started before ``reminders db upgrade`` serves as soon as it has run."""
    try:
        migrate.require_head(db)
    except migrate.SchemaNotCurrent as exc:
        log.warning("%s; every route but /metrics and /openapi.json answers 503 until then", exc)
    except Exception as exc:  # noqa: BLE001 - an unreachable database is reported by each request
        log.warning("database unavailable at startup: %s: %s", type(exc).__name__, first_line(exc))


def create_app(
    settings: Settings, db: Database | None = None, sender_factory: SenderFactory | None = None
) -> Starlette:
    """The app. ``db``: share an engine (tests); otherwise one is made and disposed at shutdown.

    ``sender_factory``: replaces APNs (tests pass ``RecordingSender().factory()``); by default the
    drain route builds the APNs sender per call, checking credentials before it claims anything.
    """
    owned = db is None
    database = db if db is not None else Database.for_settings(settings)
    api = Api(settings, database, sender_factory, Metrics(database, settings))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(_announce_schema, database)
        yield
        if owned:
            database.dispose()

    app = Starlette(
        routes=api.routes(),
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            OperationalError: _database_error,
            PoolTimeout: _database_error,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )
    served = [op for route in app.routes if isinstance(route, OperationRoute) for op in route.operations]
    api.document = document(api.contract, served)
    app.state.api = api
    return app
