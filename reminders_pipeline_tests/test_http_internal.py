"""The internal routes the crons (or an exact-time scheduler) call: build and drain, by id or sweep."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from reminders_pipeline.devices.registration import chunk_of
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.providers.base import RecordingSender

from .support import NOW, at, item
from .test_http_support import SECRET, error_of, http_settings


def two_devices(s, feeds) -> None:
    a = feeds.items("/a.json", [item("ea", 7200)])
    b = feeds.items("/b.json", [item("eb", 7200)])
    assert s.put_device("dev-a", source_urls=[a]).status_code == 200
    assert s.put_device("dev-b", source_urls=[b]).status_code == 200


def live_with_two_rows(serve, settings, feeds):
    """An enabled app with a recording sender, two devices and their two rows built (due at +3600)."""
    sender = RecordingSender()
    s = serve(http_settings(settings, enabled=True), sender.factory())
    two_devices(s, feeds)
    build(s)
    return s, sender


def build(s, **body) -> dict:
    r = s.api.post("/internal/reminders/build", json={"now": NOW.stored, **body})
    assert r.status_code == 200, r.text
    return r.json()


DRAIN_AT = at(3605)  # the rows' send_after and 5 s


def drain(s, row_id: int | None = None, now: Instant = DRAIN_AT, **kw) -> httpx.Response:
    return s.api.post(
        "/internal/reminders/drain", params={} if row_id is None else {"id": row_id}, json={"now": now.stored}, **kw
    )


def test_build_by_device_builds_only_that_device(served, feeds):
    two_devices(served, feeds)
    summary = build(served, device_id="dev-a")
    assert (summary["devices_built"], summary["rows_inserted"], summary["sources_read"]) == (1, 1, 1)
    assert {r["device_id"] for r in served.rows()} == {"dev-a"}
    assert served.api.get("/v1/devices/dev-a").json()["reminders_built_at"] == NOW.stored
    assert served.api.get("/v1/devices/dev-b").json()["reminders_built_at"] is None


def test_build_by_chunk_and_build_all(served, feeds):
    two_devices(served, feeds)
    chunk = chunk_of("dev-a", served.settings.chunk_count)
    summary = build(served, chunk=chunk)
    assert summary["devices_built"] == 1 + (chunk_of("dev-b", served.settings.chunk_count) == chunk)
    everything = build(served)
    assert everything["devices_built"] == 2
    assert {r["device_id"] for r in served.rows()} == {"dev-a", "dev-b"}
    # An empty body, and no body at all, both mean every device.
    for content in (b"", b"{}"):
        r = served.api.post("/internal/reminders/build", content=content)
        assert r.status_code == 200 and r.json()["devices_built"] == 2


def test_build_bad_requests_are_4xx_json(served, feeds):
    two_devices(served, feeds)
    cases = [
        ({"chunk": served.settings.chunk_count}, 422, "chunk"),
        ({"chunk": -1}, 422, "chunk"),
        ({"chunk": "1"}, 422, "chunk"),
        ({"device_id": "dev-a", "chunk": 0}, 422, "chunk"),
        ({"device_id": 7}, 422, "device_id"),
        ({"device_id": "has space"}, 422, "device_id"),
        ({"now": "yesterday"}, 422, "now"),
        ({"now": "2026-09-10T08:00:00"}, 422, "now"),  # naive: ambiguous
        ({"now": 1e300}, 422, "now"),
        ({"now": "1969-12-31T23:59:59Z"}, 422, "now"),
        ({"devices": ["dev-a"]}, 422, "devices"),
        ([1, 2], 422, "body"),
    ]
    for body, status, field in cases:
        r = served.api.post("/internal/reminders/build", json=body)
        assert r.status_code == status, (body, r.text)
        assert error_of(r)["field"] == field, (body, r.text)
    r = served.api.post("/internal/reminders/build", json={"device_id": "ghost"})
    assert r.status_code == 404 and error_of(r)["error"] == "not_found"
    r = served.api.post("/internal/reminders/build", content=b'{"chunk": ')
    assert r.status_code == 400 and error_of(r)["error"] == "malformed_json"
    assert served.rows() == []


def test_drain_by_id_twice_sends_once(serve, settings, feeds):
    s, sender = live_with_two_rows(serve, settings, feeds)
    first, second = sorted(r["id"] for r in s.rows())

    r = drain(s, first)
    assert r.status_code == 200, r.text
    assert (r.json()["due"], r.json()["claimed"], r.json()["outcomes"]) == (1, 1, {"sent": 1})
    again = drain(s, first, now=at(3610))
    assert again.status_code == 200 and (again.json()["due"], again.json()["claimed"], again.json()["outcomes"]) == (
        0,
        0,
        {},
    )
    assert [n.row_id for n in sender.sent] == [first]
    # Only that row: the other due row waits for its own call (or a sweep).
    assert {r["id"]: r["status"] for r in s.rows()} == {first: "settled", second: "pending"}


def test_drain_by_id_in_the_body_or_both_agreeing(serve, settings, feeds):
    s, sender = live_with_two_rows(serve, settings, feeds)
    first, second = sorted(r["id"] for r in s.rows())
    r = s.api.post("/internal/reminders/drain", json={"id": first, "now": at(3605).stored})
    assert r.json()["outcomes"] == {"sent": 1}
    r = s.api.post("/internal/reminders/drain", params={"id": second}, json={"id": second, "now": at(3605).stored})
    assert r.json()["outcomes"] == {"sent": 1}
    assert sorted(n.row_id for n in sender.sent) == [first, second]


def test_drain_by_id_before_it_is_due_does_nothing(serve, settings, feeds):
    s, sender = live_with_two_rows(serve, settings, feeds)
    row_id = min(r["id"] for r in s.rows())
    r = drain(s, row_id, now=at(3599))  # send_after is at(3600)
    assert r.status_code == 200 and (r.json()["due"], r.json()["claimed"]) == (0, 0)
    assert sender.sent == [] and {r["status"] for r in s.rows()} == {"pending"}
    r = drain(s, 987654)  # no such row: nothing due, still a 200 (a scheduler must not retry it)
    assert r.status_code == 200 and r.json()["due"] == 0


def test_drain_without_id_sweeps_every_due_row(serve, settings, feeds):
    s, sender = live_with_two_rows(serve, settings, feeds)
    r = s.api.post("/internal/reminders/drain", json={"now": at(3605).stored})
    assert r.status_code == 200 and (r.json()["due"], r.json()["outcomes"]) == (2, {"sent": 2})
    assert r.json()["lateness_seconds"]["max"] == 5.0
    assert len(sender.sent) == 2


def test_drain_is_a_dry_run_unless_enabled(served, feeds):
    two_devices(served, feeds)
    build(served)
    r = drain(served)
    assert r.status_code == 200 and r.json()["outcomes"] == {"disabled": 2}


def test_drain_bad_ids_are_422(served):
    for query in ("id=0", "id=-1", "id=abc", "id=1.5", "id=", "id=99999999999999999999", "id=1&id=2", "id=%EF%BC%91"):
        r = served.api.post(f"/internal/reminders/drain?{query}")
        assert r.status_code == 422 and error_of(r)["field"] == "id", (query, r.text)
    for body in ({"id": "1"}, {"id": True}, {"id": 0}, {"id": 2**63}, {"id": 1.5}):
        r = served.api.post("/internal/reminders/drain", json=body)
        assert r.status_code == 422 and error_of(r)["field"] == "id", (body, r.text)
    r = served.api.post("/internal/reminders/drain?id=1", json={"id": 2})
    assert r.status_code == 422 and error_of(r)["field"] == "id"
    r = served.api.post("/internal/reminders/drain", json={"row": 1})
    assert r.status_code == 422 and error_of(r)["field"] == "row"
    r = served.api.post("/internal/reminders/drain", content=b"{]")
    assert r.status_code == 400 and error_of(r)["error"] == "malformed_json"


def test_drain_without_apns_credentials_is_503_and_claims_nothing(serve, settings, feeds):
    s = serve(http_settings(settings, enabled=True))  # no sender factory: the real APNs one, unconfigured
    two_devices(s, feeds)
    build(s)
    r = drain(s)
    assert r.status_code == 503, r.text
    body = error_of(r)
    assert body["error"] == "sender_unavailable" and "REMINDERS_APNS_" in body["detail"]
    assert {row["status"] for row in s.rows()} == {"pending"}


def test_simultaneous_drains_of_one_row_send_it_once(serve, settings, feeds):
    s, sender = live_with_two_rows(serve, settings, feeds)
    row_id = min(r["id"] for r in s.rows())
    callers = 16
    barrier = threading.Barrier(callers)

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=s.url, timeout=60, headers={"Authorization": f"Bearer {SECRET}"}) as client:
            barrier.wait()
            return client.post("/internal/reminders/drain", params={"id": row_id}, json={"now": at(3605).stored})

    with ThreadPoolExecutor(callers) as pool:
        answers = list(pool.map(one, range(callers)))
    assert [a.status_code for a in answers] == [200] * callers
    assert sum(a.json()["claimed"] for a in answers) == 1
    assert sum(a.json()["outcomes"].get("sent", 0) for a in answers) == 1
    assert [n.row_id for n in sender.sent] == [row_id]
    assert [(r["status"], r["outcome"]) for r in s.rows() if r["id"] == row_id] == [("settled", "sent")]
