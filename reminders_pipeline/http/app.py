"""The HTTP shell on FastAPI: the routes, their credentials as dependencies, and the app.

Every answer is JSON (``/metrics`` aside). A request the app cannot use is a 4xx whose body names
what is wrong (``field`` for a validation error), never a 500. Each route's dependencies check its
credential first, then its body (``parsing.json_body``); FastAPI validates the body with its
``contract.py`` model and generates ``/openapi.json`` from the same routes and models, each route
listing the answers it gives (``routes.py``).

Core calls block (source reads and sends run ``asyncio.run`` inside), so each runs in Starlette's
threadpool; the event loop only parses and answers.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import cached_property
from typing import Annotated, Any

from fastapi import Body, FastAPI, Path, Query
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

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
    MAX_DEVICE_ID,
    DeviceError,
    put_device,
    remove_device,
)
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.http import errors, routes
from reminders_pipeline.http.contract import (
    BuildRequest,
    DeviceRegistration,
    DoneRequest,
    DrainRequest,
    LocaleTag,
    RowId,
    SnoozeRequest,
    TzOffset,
    ZoneName,
    anchored,
)
from reminders_pipeline.http.errors import ApiError, invalid, no_device
from reminders_pipeline.http.metrics import Metrics
from reminders_pipeline.http.parsing import (
    ShellRoute,
    device_spec,
    parse_locale,
    parse_row_id,
    parse_tz,
    queue_row_id,
    valid_device_id,
)
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.ledger.schema import MAX_ROW_ID
from reminders_pipeline.planning.build import build as run_build
from reminders_pipeline.planning.widget_feed import feed_as_reported
from reminders_pipeline.providers.base import SenderFactory
from reminders_pipeline.providers.routing import checked_sender_factory
from reminders_pipeline.providers.webpush import served_public_key
from reminders_pipeline.sending.drain import drain as run_drain

log = logging.getLogger(__name__)

DEVICE_ERROR_FIELDS = {"rules": "extra_rules", "sources": "source_urls"}  # DeviceError names -> body keys
BEARER_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="reminders"'}
NO_CREDENTIAL = credential_hash(b"")  # compared against when a device has none, so the work is the same
# Documented as the core types them. A device id FastAPI refuses answers 404 (errors.py); a row id
# is parsed again from its text, as strictly as before (pydantic also takes " 1" and "1_0").
DEVICE_ID_PATH = Path(pattern=anchored(DEVICE_ID_PATTERN), max_length=MAX_DEVICE_ID)
ROW_ID_PATH = Path(ge=1, le=MAX_ROW_ID, description="The queue row of the alert acted on.")


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
        # Set by the server on SIGTERM or Ctrl-C: a drain in flight claims nothing more (the server
        # still waits for its request, so what is on the wire is answered and settled).
        self.stopping = threading.Event()

    # -- credentials: each route's first dependency

    @staticmethod
    def bearer(request: Request) -> bytes | None:
        """The presented bearer's raw bytes (header text is latin-1 decoded); None for another scheme."""
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        return credentials.strip().encode("latin-1") if scheme.lower() == "bearer" else None

    def is_internal(self, given: bytes | None) -> bool:
        """Compared in constant time with every accepted token (no early exit reveals which)."""
        return given is not None and any([hmac.compare_digest(given, token) for token in self.tokens])

    async def internal(self, request: Request) -> None:
        """The internal token; with it unset every internal and management route is closed."""
        if not self.tokens:
            raise ApiError(
                401, "unauthorized", "REMINDERS_TOKEN is not set: protected routes are closed", headers=BEARER_CHALLENGE
            )
        if not self.is_internal(self.bearer(request)):
            raise ApiError(
                401, "unauthorized", "missing or wrong 'Authorization: Bearer' token", headers=BEARER_CHALLENGE
            )
        await self.require_schema()

    async def device(self, request: Request) -> None:
        """The device's own credential, for its own routes only (or the internal token, an operator's).
        The schema is checked first, so a missing ledger is never made by reading a credential from it."""
        await self.require_schema()
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

    # -- open routes

    async def healthz(self) -> Response:
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

    async def metrics_text(self) -> Response:
        body = await run_in_threadpool(self.metrics.render)
        return Response(body, headers={"Content-Type": self.metrics.content_type})

    async def openapi_json(self, request: Request) -> Response:
        return JSONResponse(routes.document(request.app, self.settings))

    # -- internal: what the crons do

    async def build(self, body: Annotated[BuildRequest | None, Body()] = None) -> Response:
        """``{}`` every device; ``{"device_id"}`` the immediate rebuild; ``{"chunk"}`` one partition."""
        body = body or BuildRequest.model_validate({})
        if {"device_id", "chunk"} <= body.model_fields_set:
            raise invalid("chunk", "give device_id or chunk, not both")
        kwargs: dict[str, Any] = {}
        if body.device_id is not None:
            if await run_in_threadpool(self._device, body.device_id) is None:
                raise no_device(body.device_id)
            kwargs = {"device_ids": [body.device_id]}
        elif body.chunk is not None:  # exactly what the Dagster asset does for one partition
            if body.chunk >= self.settings.chunk_count:
                raise invalid("chunk", f"Input should be less than or equal to {self.settings.chunk_count - 1}")
            kwargs = {"chunks": [body.chunk], "limit": self.settings.chunk_size}
        summary = await run_in_threadpool(lambda: run_build(self.db, self.settings, now=body.now, **kwargs))
        return JSONResponse(summary.as_dict())

    async def drain(
        self,
        request: Request,
        body: Annotated[DrainRequest | None, Body()] = None,
        id: Annotated[RowId | None, Query(description=routes.DRAIN_ID)] = None,  # noqa: A002
    ) -> Response:
        """Every due row, or just ``id`` if it is due; a second call for the same row sends nothing."""
        body = body or DrainRequest.model_validate({})
        row = parse_row_id(request, body.id)
        factory = self.sender_factory
        if factory is None:
            try:  # APNs credentials are checked here, before anything is claimed
                factory = await run_in_threadpool(checked_sender_factory, self.db, self.settings)
            except ValueError as exc:
                raise ApiError(503, "sender_unavailable", str(exc)) from None
        summary = await run_in_threadpool(
            lambda: run_drain(self.db, self.settings, factory, now=body.now, row_id=row, stop=self.stopping)
        )
        self.metrics.observe_drain(summary)
        return JSONResponse(summary.as_dict())

    # -- the device API

    def _device(self, device_id: str) -> ledger.DeviceRecord | None:
        with self.db.read() as conn:
            return ledger.get_device(conn, device_id)

    async def get_device(self, device_id: Annotated[str, DEVICE_ID_PATH]) -> Response:
        record = await run_in_threadpool(self._device, device_id)
        if record is None:
            raise no_device(device_id)
        return JSONResponse(record.as_dict())

    async def put_device(
        self, device_id: Annotated[str, DEVICE_ID_PATH], body: Annotated[DeviceRegistration, Body()]
    ) -> Response:
        """Create or replace: exactly these rules and sources; omitted optional fields take defaults."""
        spec = device_spec(device_id, body, self.settings)
        try:
            registration = await run_in_threadpool(put_device, self.db, self.settings, spec)
        except DeviceError as exc:
            raise invalid(DEVICE_ERROR_FIELDS.get(exc.field, exc.field), exc.message) from None
        return JSONResponse(registration.as_dict())  # with ``credential`` the one time it is issued

    async def delete_device(self, device_id: Annotated[str, DEVICE_ID_PATH]) -> Response:
        """Voids the device's pending rows (``device_removed``); the ledger keeps what was sent."""
        voided = await run_in_threadpool(remove_device, self.db, device_id)
        if voided is None:
            raise no_device(device_id)
        return JSONResponse({"device_id": device_id, "rows_voided": voided})

    async def rotate_device_credential(self, request: Request, device_id: Annotated[str, DEVICE_ID_PATH]) -> Response:
        """A new credential for the device, shown this once; the one it replaces stops working."""
        given = self.bearer(request)
        presented = None if self.is_internal(given) else credential_hash(given or b"")
        try:
            credential = await run_in_threadpool(rotate_credential, self.db, device_id, presented)
        except CredentialChanged as exc:
            raise ApiError(409, "credential_changed", str(exc)) from None
        if credential is None:
            raise no_device(device_id)
        return JSONResponse({"device_id": device_id, "credential": credential})

    # -- a person's actions on an alert

    async def snooze(
        self,
        request: Request,
        device_id: Annotated[str, DEVICE_ID_PATH],
        row_id: Annotated[int, ROW_ID_PATH],
        body: Annotated[SnoozeRequest, Body()],
    ) -> Response:
        row = queue_row_id(request.path_params["row_id"], "row_id")
        until = None if body.until is None else Instant.from_unix(body.until)
        snoozed = await self._act(
            lambda: actions.snooze(self.db, device_id, row, body.token, seconds=body.seconds, until=until, now=body.now)
        )
        return JSONResponse({"device_id": device_id, **snoozed.as_dict()})

    async def done(
        self,
        request: Request,
        device_id: Annotated[str, DEVICE_ID_PATH],
        row_id: Annotated[int, ROW_ID_PATH],
        body: Annotated[DoneRequest, Body()],
    ) -> Response:
        row = queue_row_id(request.path_params["row_id"], "row_id")
        settled = await self._act(
            lambda: actions.done(
                self.db, device_id, row, body.token, same_within=self.settings.rearm_threshold_seconds, now=body.now
            )
        )
        return JSONResponse({"device_id": device_id, "row_id": row, "acknowledged": settled})

    @staticmethod
    async def _act(act: Callable[[], Any]) -> Any:
        try:
            return await run_in_threadpool(act)
        except actions.ActionError as exc:
            raise ApiError(exc.status, exc.code, exc.message, exc.field) from None

    # -- the widget's feed

    async def feed(
        self,
        request: Request,
        device_id: Annotated[str, DEVICE_ID_PATH],
        tz: Annotated[ZoneName | TzOffset | None, Query(description=routes.FEED_TZ)] = None,
        locale: Annotated[LocaleTag | None, Query(description=routes.FEED_LOCALE)] = None,
    ) -> Response:
        """The composed feed, item bounds in Unix seconds (the wire contract), soonest first."""
        reported, stored_locale = parse_tz(request), parse_locale(request)
        composed = await run_in_threadpool(
            feed_as_reported, self.db, self.settings, device_id, reported, stored_locale, self.metrics.tz_write_failed
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

    async def vapid_public_key(self) -> Response:
        if self.vapid_key is None:
            raise ApiError(404, "webpush_not_configured", "this deployment sends no Web Push")
        return JSONResponse({"public_key": self.vapid_key})

    @cached_property
    def vapid_key(self) -> str | None:
        """Read once: a new key needs a restart."""
        return served_public_key(self.settings)


def _announce_schema(db: Database) -> None:
    """At startup, say once in the log why routes will answer 503; the server starts regardless,
    so an instance started before ``reminders db upgrade`` serves as soon as it has run."""
    try:
        migrate.require_head(db)
    except migrate.SchemaNotCurrent as exc:
        log.warning("%s; every route but /metrics and /openapi.json answers 503 until then", exc)
    except Exception as exc:  # noqa: BLE001 - an unreachable database is reported by each request
        log.warning("database unavailable at startup: %s: %s", type(exc).__name__, first_line(exc))


def create_app(settings: Settings, db: Database | None = None, sender_factory: SenderFactory | None = None) -> FastAPI:
    """The app. ``db``: share an engine (tests); otherwise one is made and disposed at shutdown.

    ``sender_factory``: replaces APNs (tests pass ``RecordingSender().factory()``); by default the
    drain route builds the APNs sender per call, checking credentials before it claims anything.
    """
    owned = db is None
    database = db if db is not None else Database.for_settings(settings)
    api = Api(settings, database, sender_factory, Metrics(database, settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(_announce_schema, database)
        yield
        if owned:
            database.dispose()

    app = FastAPI(
        title="reminders_pipeline",
        version="1",
        description=routes.DESCRIPTION,
        openapi_url=None,  # served as a route of its own, so the document lists it as before
        docs_url=None,
        redoc_url=None,
        strict_content_type=False,  # a JSON body without a Content-Type is read as JSON, as before
        lifespan=lifespan,
        exception_handlers={
            ApiError: errors.api_error,
            RequestValidationError: errors.validation_error,
            HTTPException: errors.http_error,
            OperationalError: errors.database_error,
            PoolTimeout: errors.database_error,
            Exception: errors.internal_error,
        },
    )
    app.router.route_class = ShellRoute
    routes.mount(app, api)
    app.state.api = api
    return app
