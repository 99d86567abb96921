"""A fixed list of requests replayed against a fresh app: each answer's status, ``error`` code and
(for a 4xx) ``field`` must be exactly the recorded one in ``data/http_replay.json``.

The list covers every route with good and bad credentials, valid and invalid bodies, queries and
ids, malformed JSON, wrong types, unknown fields, oversized values, wrong methods and unknown
routes, so a change to how requests are routed, authenticated or validated shows up as a changed
answer. It runs in order on a fresh database: the registrations early in the list are what later
requests find, and the device credentials they issue are the ones the ``device`` requests present.
Every route that takes ``now`` is given a fixed one. A deliberate change of behaviour is recorded
again with ``REMINDERS_REPLAY_RECORD=1`` and reviewed as a diff of the fixture.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reminders_pipeline.config.settings import Settings

from .support import NOW, NOW_S
from .test_http_support import APNS_TOKEN, SECRET, Served, http_settings, serve  # noqa: F401 - fixtures

FIXTURE = Path(__file__).parent / "data" / "http_replay.json"
RECORD = os.environ.get("REMINDERS_REPLAY_RECORD") == "1"
ABSENT = object()  # no JSON body at all (``None`` is the JSON ``null``)


@dataclass(frozen=True)
class Call:
    """One request: which app answers it (``test`` accepts ``now``, ``production`` refuses it) and
    which credential it presents (see ``Replay.headers``)."""

    name: str
    method: str
    path: str
    auth: str = "internal"
    json: Any = ABSENT
    content: bytes | None = None
    app: str = "test"


def put(name: str, body: Any, device_id: str = "dev-9", auth: str = "internal") -> Call:
    return Call(name, "PUT", f"/v1/devices/{device_id}", auth, json=body)


def build(name: str, body: Any = ABSENT, auth: str = "internal", **kw: Any) -> Call:
    return Call(name, "POST", "/internal/reminders/build", auth, json=body, **kw)


def drain(name: str, body: Any = ABSENT, query: str = "", auth: str = "internal", **kw: Any) -> Call:
    return Call(name, "POST", f"/internal/reminders/drain{query}", auth, json=body, **kw)


def feed(name: str, query: str = "", device_id: str = "dev-1", auth: str = "device") -> Call:
    return Call(name, "GET", f"/v1/devices/{device_id}/feed{query}", auth)


def rotate(name: str, device_id: str = "dev-1", auth: str = "internal") -> Call:
    return Call(name, "POST", f"/v1/devices/{device_id}/credential", auth)


TOKEN = {"apns_token": APNS_TOKEN}
OVERSIZED = b" " * 300_000
LONG_ID = "x" * 129

CALLS = [
    # -- open routes
    Call("healthz", "GET", "/healthz", "none"),
    Call("healthz with a wrong bearer", "GET", "/healthz", "wrong"),
    Call("healthz HEAD", "HEAD", "/healthz", "none"),
    Call("metrics", "GET", "/metrics", "none"),
    Call("openapi", "GET", "/openapi.json", "none"),
    Call("openapi on the production app", "GET", "/openapi.json", "none", app="production"),
    # -- registrations the rest of the list relies on
    put("register dev-1", TOKEN, "dev-1"),
    put(
        "register dev-2 with every field",
        {
            **TOKEN,
            "reminder_lead_seconds": 600,
            "extra_rules": ["lead:60", "lead:300@expiry"],
            "source_urls": [],
            "all_day_rules": [],
            "tz": "Europe/Berlin",
            "quiet_hours": "22:00-07:00",
            "alarms": True,
        },
        "dev-2",
    ),
    put("replace dev-1", {**TOKEN, "reminder_lead_seconds": 1800, "tz": None}, "dev-1"),
    put("register with an integral float lead", {**TOKEN, "reminder_lead_seconds": 3600.0}, "dev-3"),
    put("register with a loopback source", {**TOKEN, "source_urls": ["http://127.0.0.1:9/feed.json"]}, "dev-4"),
    # -- PUT: credentials are checked before the body is read
    put("put without a bearer", TOKEN, auth="none"),
    put("put with a wrong bearer", TOKEN, auth="wrong"),
    put("put with basic auth", TOKEN, auth="basic"),
    put("put with a device credential", TOKEN, "dev-1", auth="device"),
    Call("put malformed without a bearer", "PUT", "/v1/devices/dev-9", "none", content=b"{"),
    Call("put oversized without a bearer", "PUT", "/v1/devices/dev-9", "none", content=OVERSIZED),
    # -- PUT: invalid bodies, each naming its field
    put("put empty object", {}),
    put("put short token", {"apns_token": "xyz"}),
    put("put token with newline", {"apns_token": APNS_TOKEN + "\n"}),
    put("put token as number", {"apns_token": 12345}),
    put("put token as null", {"apns_token": None}),
    put("put negative lead", {**TOKEN, "reminder_lead_seconds": -1}),
    put("put lead as text", {**TOKEN, "reminder_lead_seconds": "3600"}),
    put("put lead as bool", {**TOKEN, "reminder_lead_seconds": True}),
    put("put fractional lead", {**TOKEN, "reminder_lead_seconds": 1.5}),
    put("put oversized lead", {**TOKEN, "reminder_lead_seconds": 10**30}),
    put("put rules as text", {**TOKEN, "extra_rules": "lead:60"}),
    put("put unparsable rule", {**TOKEN, "extra_rules": ["lead:x"]}),
    put("put rule as number", {**TOKEN, "extra_rules": [60]}),
    put("put rule with bad expiry", {**TOKEN, "extra_rules": ["lead:60@noon"]}),
    put("put too many rules", {**TOKEN, "extra_rules": [f"lead:{i}" for i in range(200)]}),
    put("put ftp source", {**TOKEN, "source_urls": ["ftp://example.com/feed"]}),
    put("put source with NUL", {**TOKEN, "source_urls": ["http://a\u0000b/"]}),
    put("put unparsable source", {**TOKEN, "source_urls": ["http://[::1/"]}),
    put("put source with bad port", {**TOKEN, "source_urls": ["http://a:99999/"]}),
    put("put too many sources", {**TOKEN, "source_urls": [f"http://h/{i}" for i in range(101)]}),
    put("put oversized source", {**TOKEN, "source_urls": ["http://h/" + "a" * 5000]}),
    put("put sources as object", {**TOKEN, "source_urls": {"a": 1}}),
    put("put bad all-day rule", {**TOKEN, "all_day_rules": ["day:x"]}),
    put("put all-day rules as text", {**TOKEN, "all_day_rules": "day:1@09:00"}),
    put("put unknown zone", {**TOKEN, "tz": "Not/AZone"}),
    put("put zone as number", {**TOKEN, "tz": 3600}),
    put("put oversized zone", {**TOKEN, "tz": "A" * 300}),
    put("put bad quiet hours", {**TOKEN, "quiet_hours": "25:00-07:00"}),
    put("put quiet hours as number", {**TOKEN, "quiet_hours": 22}),
    put("put alarms as text", {**TOKEN, "alarms": "yes"}),
    put("put alarms as number", {**TOKEN, "alarms": 1}),
    put("put unknown field", {**TOKEN, "lead": 60}),
    put("put two unknown fields and a bad one", {"zz": 1, "aa": 2, "apns_token": 1}),
    put("put array body", ["not", "an", "object"]),
    put("put string body", "text"),
    put("put null body", None),
    put("put bad path id", TOKEN, "bad%20id"),
    put("put oversized path id", TOKEN, LONG_ID),
    Call("put no body", "PUT", "/v1/devices/dev-9", content=b""),
    Call("put whitespace body", "PUT", "/v1/devices/dev-9", content=b"  \n"),
    Call("put truncated JSON", "PUT", "/v1/devices/dev-9", content=b"{"),
    Call("put not JSON", "PUT", "/v1/devices/dev-9", content=b"not json"),
    Call("put NaN", "PUT", "/v1/devices/dev-9", content=b'{"apns_token": NaN}'),
    Call("put invalid UTF-8", "PUT", "/v1/devices/dev-9", content=b"\xff\xfe\x00"),
    Call("put deep nesting", "PUT", "/v1/devices/dev-9", content=b"[" * 100_000),
    Call("put oversized body", "PUT", "/v1/devices/dev-9", content=OVERSIZED),
    put("put oversized JSON value", {"apns_token": "a" * 300_000}),
    # -- GET and DELETE a device
    Call("get dev-1", "GET", "/v1/devices/dev-1"),
    Call("get unknown device", "GET", "/v1/devices/ghost"),
    Call("get bad id", "GET", "/v1/devices/not%20an%20id"),
    Call("get oversized id", "GET", f"/v1/devices/{LONG_ID}"),
    Call("get without a bearer", "GET", "/v1/devices/dev-1", "none"),
    Call("get with a wrong bearer", "GET", "/v1/devices/dev-1", "wrong"),
    Call("get with the device credential", "GET", "/v1/devices/dev-1", "device"),
    Call("delete dev-3", "DELETE", "/v1/devices/dev-3"),
    Call("delete dev-3 again", "DELETE", "/v1/devices/dev-3"),
    Call("delete bad id", "DELETE", "/v1/devices/not%20an%20id"),
    Call("delete without a bearer", "DELETE", "/v1/devices/dev-2", "none"),
    Call("delete with the device credential", "DELETE", "/v1/devices/dev-1", "device"),
    Call("patch a device", "PATCH", "/v1/devices/dev-1"),
    Call("post a device", "POST", "/v1/devices/dev-1", json=TOKEN),
    # -- build
    build("build all", {"now": NOW.stored}),
    build("build with no body", content=b""),
    build("build empty object no now", {}),
    build("build one device", {"device_id": "dev-1", "now": NOW.stored}),
    build("build unknown device", {"device_id": "ghost", "now": NOW.stored}),
    build("build one chunk", {"chunk": 0, "now": NOW.stored}),
    build("build integral float chunk", {"chunk": 1.0, "now": NOW.stored}),
    build("build now as Unix seconds", {"now": NOW_S}),
    build("build chunk too large", {"chunk": 16}),
    build("build negative chunk", {"chunk": -1}),
    build("build chunk as text", {"chunk": "1"}),
    build("build chunk as bool", {"chunk": True}),
    build("build device and chunk", {"device_id": "dev-1", "chunk": 0}),
    build("build device id as number", {"device_id": 7}),
    build("build device id with space", {"device_id": "has space"}),
    build("build oversized device id", {"device_id": LONG_ID}),
    build("build now as words", {"now": "yesterday"}),
    build("build naive now", {"now": "2026-09-10T08:00:00"}),
    build("build huge now", {"now": 1e300}),
    build("build now before 1970", {"now": "1969-12-31T23:59:59Z"}),
    build("build now as bool", {"now": True}),
    build("build unknown field", {"devices": ["dev-1"]}),
    build("build array body", [1, 2]),
    build("build null body", None),
    build("build truncated JSON", content=b'{"chunk": '),
    build("build NaN", content=b'{"chunk": NaN}'),
    build("build oversized body", content=OVERSIZED),
    build("build without a bearer", {}, auth="none"),
    build("build with a wrong bearer", {}, auth="wrong"),
    build("build with a bare token", {}, auth="bare"),
    build("build with the device credential", {}, auth="device"),
    build("build malformed without a bearer", content=b"{", auth="none"),
    build("build oversized without a bearer", content=OVERSIZED, auth="none"),
    build("build now on production", {"now": NOW.stored}, app="production"),
    build("build on production", {}, app="production"),
    Call("get build", "GET", "/internal/reminders/build"),
    # -- drain
    drain("drain all", {"now": NOW.stored}),
    drain("drain by query id", {"now": NOW.stored}, "?id=1"),
    drain("drain by body id", {"id": 1, "now": NOW.stored}),
    drain("drain by agreeing ids", {"id": 1, "now": NOW.stored}, "?id=1"),
    drain("drain integral float id", {"id": 1.0, "now": NOW.stored}),
    drain("drain query id zero", query="?id=0"),
    drain("drain negative query id", query="?id=-1"),
    drain("drain query id as text", query="?id=abc"),
    drain("drain fractional query id", query="?id=1.5"),
    drain("drain empty query id", query="?id="),
    drain("drain oversized query id", query="?id=99999999999999999999"),
    drain("drain two query ids", query="?id=1&id=2"),
    drain("drain fullwidth query id", query="?id=%EF%BC%91"),
    drain("drain body id as text", {"id": "1"}),
    drain("drain body id as bool", {"id": True}),
    drain("drain body id zero", {"id": 0}),
    drain("drain oversized body id", {"id": 2**63}),
    drain("drain fractional body id", {"id": 1.5}),
    drain("drain disagreeing ids", {"id": 2}, "?id=1"),
    drain("drain unknown field", {"row": 1}),
    drain("drain bad now", {"now": "soon"}),
    drain("drain truncated JSON", content=b"{]"),
    drain("drain array body", []),
    drain("drain oversized body", content=OVERSIZED),
    drain("drain without a bearer", {}, auth="none"),
    drain("drain with a wrong bearer", {}, auth="wrong"),
    drain("drain by id without a bearer", query="?id=1", auth="none"),
    drain("drain with the device credential", {}, auth="device"),
    drain("drain now on production", {"now": NOW.stored}, app="production"),
    drain("drain on production", app="production"),
    Call("get drain", "GET", "/internal/reminders/drain"),
    # -- the feed
    feed("feed with its credential"),
    feed("feed with the internal token", auth="internal"),
    feed("feed with a zone", "?tz=Europe/Berlin"),
    feed("feed with an offset", "?tz=3600"),
    feed("feed with a negative offset", "?tz=-3600"),
    feed("feed zone as words", "?tz=abc"),
    feed("feed fractional offset", "?tz=1.5"),
    feed("feed offset too large", "?tz=99999"),
    feed("feed offset too small", "?tz=-64801"),
    feed("feed empty zone", "?tz="),
    feed("feed hex offset", "?tz=0x10"),
    feed("feed offset with newline", "?tz=3600%0A"),
    feed("feed two zones", "?tz=60&tz=120"),
    feed("feed with another device's credential", auth="other"),
    feed("feed without a bearer", auth="none"),
    feed("feed with a wrong bearer", auth="wrong"),
    feed("feed unknown device", device_id="ghost", auth="internal"),
    feed("feed unknown device with a credential", device_id="ghost"),
    feed("feed NUL in id", device_id="nul%00byte", auth="internal"),
    feed("feed oversized id", device_id=LONG_ID, auth="internal"),
    Call("post feed", "POST", "/v1/devices/dev-1/feed"),
    # -- credentials
    rotate("rotate by operator"),
    rotate("rotate by the device", auth="device"),
    rotate("rotate with the replaced credential", auth="stale"),
    feed("feed with the replaced credential", auth="stale"),
    feed("feed with the new credential"),
    rotate("rotate with another device's credential", auth="other"),
    rotate("rotate without a bearer", auth="none"),
    rotate("rotate with a wrong bearer", auth="wrong"),
    rotate("rotate unknown device", "ghost"),
    rotate("rotate unknown device with a credential", "ghost", auth="device"),
    rotate("rotate bad id", "not%20an%20id"),
    Call("get credential", "GET", "/v1/devices/dev-1/credential"),
    # -- the router itself
    Call("unknown route", "GET", "/nowhere"),
    Call("unknown route without a bearer", "GET", "/nowhere", "none"),
    Call("devices collection", "GET", "/v1/devices"),
    Call("below a device", "GET", "/v1/devices/dev-1/extra"),
    Call("internal prefix", "POST", "/internal/reminders"),
    Call("trailing slash", "GET", "/healthz/", "none"),
    Call("post healthz", "POST", "/healthz", "none"),
    Call("put metrics", "PUT", "/metrics"),
    Call("delete openapi", "DELETE", "/openapi.json"),
    # -- a removed device's credential opens nothing
    Call("delete dev-1", "DELETE", "/v1/devices/dev-1"),
    feed("feed of a removed device with its credential"),
    Call("get removed device", "GET", "/v1/devices/dev-1"),
]


class Replay:
    """Sends the calls in order, presenting the credentials the registrations issued."""

    def __init__(self, apps: dict[str, Served]) -> None:
        self.apps = apps
        self.credentials: dict[str, str] = {}
        self.replaced = "never-issued"

    def headers(self, auth: str) -> dict[str, str]:
        given = {
            "internal": f"Bearer {SECRET}",
            "wrong": "Bearer wrong",
            "basic": f"Basic {SECRET}",
            "bare": SECRET,
            "device": f"Bearer {self.credentials.get('dev-1', '')}",
            "other": f"Bearer {self.credentials.get('dev-2', '')}",
            "stale": f"Bearer {self.replaced}",
        }
        return {} if auth == "none" else {"Authorization": given[auth]}

    def send(self, call: Call) -> dict[str, Any]:
        extra: dict[str, Any] = {} if call.json is ABSENT else {"json": call.json}
        if call.content is not None:
            extra = {"content": call.content, "headers": {"Content-Type": "application/json"}}
        headers = {**self.headers(call.auth), **extra.pop("headers", {})}
        r = self.apps[call.app].anon.request(call.method, call.path, headers=headers, **extra)
        is_json = r.content and r.headers.get("content-type", "").startswith("application/json")
        body = r.json() if is_json else None
        self.keep_credential(body)
        answer = body if isinstance(body, dict) else {}
        return {
            "name": call.name,
            "method": call.method,
            "path": call.path[:80],
            "auth": call.auth,
            "status": r.status_code,
            "error": answer.get("error"),
            "field": answer.get("field") if 400 <= r.status_code < 500 else None,
        }

    def keep_credential(self, body: Any) -> None:
        if not isinstance(body, dict) or not isinstance(body.get("credential"), str):
            return
        device_id = body.get("device_id", body.get("id"))
        if device_id == "dev-1" and "dev-1" in self.credentials:
            self.replaced = self.credentials["dev-1"]
        self.credentials[str(device_id)] = body["credential"]


def dump(entries: list[dict[str, Any]]) -> str:
    """One request a line, so a changed answer is a one-line diff."""
    return "[\n" + ",\n".join(json.dumps(e, ensure_ascii=False) for e in entries) + "\n]\n"


def test_every_recorded_answer_is_replayed_exactly(serve: Callable[..., Served], settings: Settings) -> None:  # noqa: F811 - the imported fixture
    assert len({c.name for c in CALLS}) == len(CALLS), "call names must be unique"
    apps = {
        "test": serve(http_settings(settings)),
        "production": serve(http_settings(settings, http_accept_now=False)),
    }
    replay = Replay(apps)
    got = [replay.send(call) for call in CALLS]
    if RECORD:
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(dump(got))
    expected = json.loads(FIXTURE.read_text())
    assert [e["name"] for e in got] == [e["name"] for e in expected], "the calls and the fixture differ"
    changed = [(e, g) for e, g in zip(expected, got, strict=True) if e != g]
    assert not changed, "\n".join(f"expected {e}\n     got {g}" for e, g in changed)
