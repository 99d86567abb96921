"""Every answer but success as the one JSON shape ``{error, detail, field?}``.

FastAPI's own answers (its 422 body, Starlette's plain 404 and 405) are rewritten into that shape
here, so a client parses one error body whatever refused its request.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match

from reminders_pipeline.config.log_throttle import first_line
from reminders_pipeline.domain.phrases import MAX_LOCALE_LENGTH
from reminders_pipeline.domain.zones import MAX_TZ_OFFSET_SECONDS
from reminders_pipeline.ledger.schema import MAX_ROW_ID

log = logging.getLogger(__name__)


ROW_ID_DETAIL = f"a queue row id: a whole number from 1 to {MAX_ROW_ID}"
TZ_DETAIL = f"an IANA time zone like Europe/Berlin, or a UTC offset in seconds, -{MAX_TZ_OFFSET_SECONDS} to {MAX_TZ_OFFSET_SECONDS}"
LOCALE_DETAIL = f"a BCP 47 tag like de-DE, at most {MAX_LOCALE_LENGTH} characters"
# What a parameter FastAPI refuses is said to be, as ``parsing.py`` says it of one it refuses itself.
PARAMETER_DETAILS = {"id": ROW_ID_DETAIL, "row_id": ROW_ID_DETAIL, "tz": TZ_DETAIL, "locale": LOCALE_DETAIL}


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


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


def _first(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error to report: the body's before a parameter's (the body is checked first), the device id
    last (no such device); within the body an unknown key first (as a misspelling it explains the
    rest), else the model's order."""
    return min(
        errors,
        key=lambda e: (
            e["loc"][0] != "body",
            tuple(e["loc"]) == ("path", "device_id"),
            e["type"] != "extra_forbidden",
            str(e["loc"][1]) if e["type"] == "extra_forbidden" else "",
        ),
    )


async def validation_error(request: Request, exc: Exception) -> Response:
    """A 422 naming one field, as every other validation error of this API does."""
    assert isinstance(exc, RequestValidationError)
    first = _first(list(exc.errors()))
    if tuple(first["loc"]) == ("path", "device_id"):  # a path that cannot name a device names none
        return no_device(request.path_params["device_id"]).response()
    field = str(first["loc"][1]) if len(first["loc"]) > 1 else "body"
    if first["type"] == "extra_forbidden":
        expected = getattr(request.state, "body_fields", ())
        return invalid(field, f"unknown field; expected one of {', '.join(sorted(expected))}").response()
    if first["loc"][0] in ("query", "path"):
        return invalid(field, PARAMETER_DETAILS.get(field, first["msg"])).response()
    ctx = first.get("ctx") or {}
    return invalid(field, str(ctx["error"]) if first["type"] == "value_error" else first["msg"]).response()


def _allowed(request: Request) -> str:
    """Every method of every route at this path: FastAPI routes one method per endpoint, and a 405
    names them all, HEAD wherever GET is."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) and 405 (wrong method) as JSON, keeping ``Allow``."""
    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = _allowed(request)
    body = {"error": codes.get(exc.status_code, "http_error"), "detail": exc.detail}
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


async def database_error(request: Request, exc: Exception) -> Response:
    """The database is unreachable, timed out a statement (statement_timeout), or no pooled
    connection freed up in time: the service is unavailable, not broken."""
    log.warning(
        "%s %s: database unavailable: %s: %s", request.method, request.url.path, type(exc).__name__, first_line(exc)
    )
    detail = "the database is unreachable or did not answer in time; retry later"
    return JSONResponse(
        {"error": "database_unavailable", "detail": detail}, status_code=503, headers={"Retry-After": "5"}
    )


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug: JSON like every other answer. Starlette re-raises afterwards, so the server logs it."""
    return JSONResponse({"error": "internal", "detail": "internal error; see the server log"}, status_code=500)
