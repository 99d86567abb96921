"""Authentication, the open routes, and JSON answers for everything the router itself refuses."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from starlette.routing import Route

from reminders_pipeline.http import app as app_module
from reminders_pipeline.http import parsing
from reminders_pipeline.ledger.db import Database

from .test_http_support import SECRET, error_of, http_settings

# Every protected route, with a body that would be valid: auth must refuse before anything runs.
PROTECTED = [
    ("POST", "/internal/reminders/build", {}),
    ("POST", "/internal/reminders/drain", {}),
    ("POST", "/internal/reminders/drain?id=1", None),
    ("GET", "/v1/devices/dev-1", None),
    ("PUT", "/v1/devices/dev-1", {"apns_token": "ab" * 32}),
    ("DELETE", "/v1/devices/dev-1", None),
    ("GET", "/v1/devices/dev-1/feed?tz=3600", None),
    ("POST", "/v1/devices/dev-1/credential", None),
    ("POST", "/v1/devices/dev-1/reminders/1/snooze", {"token": "0" * 32, "seconds": 60}),
    ("POST", "/v1/devices/dev-1/reminders/1/done", {"token": "0" * 32}),
]


def call(client: httpx.Client, method: str, path: str, body: object, **headers: str) -> httpx.Response:
    return client.request(method, path, json=body, headers=headers)


def test_token_unset_closes_every_protected_route(serve, settings):
    s = serve(http_settings(settings, token=None))
    for method, path, body in PROTECTED:
        for headers in (
            {},
            {"Authorization": "Bearer"},
            {"Authorization": f"Bearer {SECRET}"},
            {"Authorization": "Bearer None"},
        ):
            r = call(s.anon, method, path, body, **headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert error_of(r)["error"] == "unauthorized" and "REMINDERS_TOKEN" in r.json()["detail"]
            assert r.headers["www-authenticate"].startswith("Bearer")
    assert s.put_device().status_code == 401  # the authorised client too: nothing opens it
    assert s.rows() == []


WRONG_AUTHORIZATION = [
    None,
    "",
    "Bearer",
    "Bearer  wrong",
    "Bearer wrong",
    f"Bearer {SECRET}x",
    f"Bearer {SECRET[:-1]}",
    f"Basic {SECRET}",
    SECRET,
    f"Token {SECRET}",
    "Bearer tést",  # non-ASCII: compared as bytes, never a TypeError
]


def test_wrong_or_missing_bearer_is_401(served):
    for authorization in WRONG_AUTHORIZATION:
        for method, path, body in PROTECTED:
            headers = [] if authorization is None else [("Authorization", authorization.encode("utf-8"))]
            r = served.anon.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, authorization, r.text)
            assert error_of(r)["error"] == "unauthorized"
    assert served.rows() == []


def test_no_unauthenticated_body_is_read_or_parsed(served, monkeypatch):
    """FastAPI reads a body before it solves dependencies; the credential is checked before that."""
    parsed = []
    monkeypatch.setattr(parsing, "parse_json", lambda body: parsed.append(body))
    big = {"apns_token": "ab" * 32, "extra_rules": ["lead:60"] * 20_000}  # near the 256 KiB bound
    for method, path, body in [*PROTECTED, ("PUT", "/v1/devices/dev-1", big)]:
        if body is not None:
            r = served.anon.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401, (method, path, r.text)
    assert parsed == []


def test_a_json_body_is_read_whatever_its_content_type(served):
    """``curl -d`` sends form-urlencoded, a browser's string ``fetch`` text/plain: both JSON here."""
    for content_type in ("application/x-www-form-urlencoded", "text/plain;charset=UTF-8", "application/json"):
        body = json.dumps({"apns_token": "ab" * 32, "reminder_lead_seconds": 600})
        r = served.api.put("/v1/devices/dev-1", content=body, headers={"Content-Type": content_type})
        assert r.status_code in (200, 201), (content_type, r.text)
        assert served.api.get("/v1/devices/dev-1").json()["reminder_lead_seconds"] == 600
        r = served.api.post("/internal/reminders/build", content="{}", headers={"Content-Type": content_type})
        assert r.status_code == 200, (content_type, r.text)


def test_right_bearer_opens_the_routes_case_insensitive_scheme(served):
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = served.anon.get("/v1/devices/dev-1", headers={"Authorization": f"{scheme} {SECRET}"})
        assert r.status_code == 404 and error_of(r)["error"] == "not_found"  # past auth: the device is unknown


def test_bearer_is_compared_in_constant_time(served, monkeypatch):
    seen = []

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    real = app_module.hmac.compare_digest
    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    assert served.anon.get("/v1/devices/x", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert served.api.get("/v1/devices/x").status_code == 404
    assert seen == [(b"nope", SECRET.encode()), (SECRET.encode(), SECRET.encode())]


def test_healthz_is_open_and_checks_the_database(served, db):
    r = served.anon.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok", "database": db.dialect}


def test_healthz_answers_503_when_the_ledger_is_missing(serve, settings, tmp_path: Path):
    empty = Database(f"sqlite:///{tmp_path / 'never-migrated.sqlite3'}")
    try:
        s = serve(http_settings(settings), database=empty)
        r = s.anon.get("/healthz")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
    finally:
        empty.dispose()


def test_openapi_and_metrics_are_open(served):
    doc = served.anon.get("/openapi.json")
    assert doc.status_code == 200 and doc.json()["openapi"].startswith("3.")
    metrics = served.anon.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")


def test_openapi_document_lists_exactly_the_routes(served):
    doc = served.anon.get("/openapi.json").json()
    documented = {(path, m.upper()) for path, ops in doc["paths"].items() for m in ops if m != "parameters"}
    routed = {(r.path, m) for r in served.app.app.routes if isinstance(r, Route) for m in (r.methods or ()) - {"HEAD"}}
    assert documented == routed
    protected = {
        (p, m.upper())
        for p, ops in doc["paths"].items()
        for m, op in ops.items()
        if m != "parameters" and op.get("security")
    }
    templated = {
        (p.split("?")[0].replace("dev-1", "{device_id}").replace("/1/", "/{row_id}/"), m) for m, p, _ in PROTECTED
    }
    assert protected == templated


def test_unknown_route_and_wrong_method_answer_json(served):
    r = served.api.get("/nowhere")
    assert r.status_code == 404 and error_of(r)["error"] == "not_found"
    r = served.api.patch("/v1/devices/dev-1")
    assert r.status_code == 405 and error_of(r)["error"] == "method_not_allowed"
    assert set(r.headers["allow"].replace(" ", "").split(",")) >= {"GET", "PUT", "DELETE"}
    r = served.api.get("/internal/reminders/drain")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
