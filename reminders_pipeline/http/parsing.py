"""What a request carries, read before an endpoint sees a value: its JSON body, bounded, after its
credential; its ids and query parameters, as the core types them.

The core trusts its typed callers (the CLI, Dagster), and a value it was never meant to see (a
20-digit id, a NUL byte, a lead longer than the epoch) would surface as a database error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import params
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.devices.registration import DEVICE_ID_PATTERN, DEVICE_ID_SHAPE, DeviceSpec
from reminders_pipeline.domain.calendar_settings import CalendarSettings
from reminders_pipeline.domain.phrases import LOCALE_SHAPE, MAX_LOCALE_LENGTH, LocaleError, canonical_locale
from reminders_pipeline.domain.zones import MAX_TZ_OFFSET_SECONDS, Zone, ZoneError, valid_zone_name
from reminders_pipeline.http.contract import MAX_BODY_BYTES, TAKES_NOW, DeviceRegistration
from reminders_pipeline.http.errors import LOCALE_DETAIL, ROW_ID_DETAIL, TZ_DETAIL, ApiError, invalid
from reminders_pipeline.ledger.schema import MAX_ROW_ID

ROW_ID_TEXT = re.compile(r"[0-9]{1,19}")
TZ_TEXT = re.compile(r"-?[0-9]{1,6}")
TOO_LARGE = ApiError(413, "too_large", f"the body is larger than {MAX_BODY_BYTES} bytes")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_json(body: bytes) -> Any:
    """The body as JSON (``None`` when blank), or the 400 that refuses it as the value.

    Parsed here rather than by pydantic: ``NaN`` is not JSON (400, not a number).
    """
    if not body.strip():
        return None
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return ApiError(400, "malformed_json", f"the body is not JSON: {exc}")


class BoundedRequest(Request):
    """A request whose body is read at most ``MAX_BODY_BYTES`` and whose JSON never raises.

    FastAPI reads the body before it solves a route's dependencies, and an unauthenticated body
    must be refused 401 whatever it holds: an oversized or malformed body is kept as the parsed
    value, an ``ApiError`` that ``json_body`` raises once the credential has been checked.
    """

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            body = bytearray()
            declared = self.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
                self._json: Any = TOO_LARGE
            else:
                async for chunk in self.stream():
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        self._json = TOO_LARGE
                        break
            self._body = bytes(body)
        return self._body

    async def json(self) -> Any:
        body = await self.body()
        if not hasattr(self, "_json"):
            self._json = parse_json(body)
        return self._json


@dataclass(frozen=True)
class Guard(params.Depends):
    """A route's credential check. ``ShellRoute`` runs it before anything reads the body (FastAPI
    reads a body before it solves the dependencies), so nothing unauthenticated is read or parsed."""


class ShellRoute(APIRoute):
    """A route that checks its credential (``Guard``) first, then reads a ``BoundedRequest``, its
    body JSON whatever its Content-Type says; it answers HEAD as GET, as Starlette's routes do."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        given = list(kwargs.pop("dependencies", None) or ())
        self.guards = [d.dependency for d in given if isinstance(d, Guard) and d.dependency is not None]
        super().__init__(path, endpoint, dependencies=[d for d in given if not isinstance(d, Guard)], **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            # No Content-Type: FastAPI then takes the body as JSON (``strict_content_type=False``),
            # as ``curl -d`` and a browser's text/plain ``fetch`` send it.
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            checked = BoundedRequest({**request.scope, "headers": headers}, request.receive)
            for guard in self.guards:
                await guard(checked)
            return await handle(checked)

        return bounded

    def _as_get(self, scope: Scope) -> Scope:
        return {**scope, "method": "GET"} if scope.get("method") == "HEAD" and "GET" in (self.methods or ()) else scope

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        return super().matches(self._as_get(scope))

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().handle(self._as_get(scope), receive, send)


def json_body(model: type[BaseModel], settings: Settings, *, required: bool) -> Callable[[Request], Awaitable[None]]:
    """A dependency, after the credential's: the body a JSON object, a device id the path can
    name, ``now`` only where a test deployment asked for it; then FastAPI validates the model."""

    async def check(request: Request) -> None:
        doc = await request.json()
        if isinstance(doc, ApiError):
            raise doc
        if doc is None and not (await request.body()).strip():
            if required:
                raise invalid("body", "a JSON object body is required")
            return
        if not isinstance(doc, dict):
            raise invalid("body", "must be a JSON object")
        if "device_id" in request.path_params and not valid_device_id(request.path_params["device_id"]):
            raise invalid("id", DEVICE_ID_SHAPE)
        if model in TAKES_NOW:
            refuse_now(doc, settings)
        request.state.body_fields = tuple(f for f in model.model_fields if f != "now" or settings.http_accept_now)

    return check


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


def queue_row_id(text: str, field: str) -> int:
    """A queue row id as the path or the query gives it: ASCII digits, 1 to ``MAX_ROW_ID``."""
    if not ROW_ID_TEXT.fullmatch(text) or not 1 <= int(text) <= MAX_ROW_ID:
        raise invalid(field, ROW_ID_DETAIL)
    return int(text)


def parse_row_id(request: Request, from_body: int | None) -> int | None:
    """``?id=`` or the body's ``id`` (both only if they agree); None means sweep every due row."""
    texts = request.query_params.getlist("id")
    if len(texts) > 1:
        raise invalid("id", "give one id")
    from_query = queue_row_id(texts[0], "id") if texts else None
    if from_query is not None and from_body is not None and from_query != from_body:
        raise invalid("id", "the query and the body name different rows")
    return from_query if from_query is not None else from_body


def parse_tz(request: Request) -> Zone | None:
    """The zone a widget reports as ``tz``: an IANA zone name (checked against the zone database)
    or, from old widgets, a UTC offset in seconds."""
    texts = request.query_params.getlist("tz")
    if not texts:
        return None
    if len(texts) > 1:
        raise invalid("tz", TZ_DETAIL)
    if TZ_TEXT.fullmatch(texts[0]) and abs(int(texts[0])) <= MAX_TZ_OFFSET_SECONDS:
        return Zone(offset_seconds=int(texts[0]))
    try:
        return Zone(valid_zone_name(texts[0]))
    except ZoneError:
        raise invalid("tz", TZ_DETAIL) from None


def parse_locale(request: Request) -> str | None:
    """The locale a widget reports as ``locale`` (``de-DE``), as stored; None when it sends none,
    or one CLDR does not know (the feed answers all the same, and the stored locale stays)."""
    texts = request.query_params.getlist("locale")
    if not texts:
        return None
    if len(texts) > 1 or len(texts[0]) > MAX_LOCALE_LENGTH or not re.fullmatch(LOCALE_SHAPE, texts[0]):
        raise invalid("locale", LOCALE_DETAIL)
    try:
        return canonical_locale(texts[0])
    except LocaleError:
        return None
