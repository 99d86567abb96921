"""The device API and the widget feed over HTTP: CRUD, validation naming the field, voiding on
delete, the feed in Unix seconds, and the tz capture (conditional, best-effort)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import event, text

from reminders_pipeline import ledger
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.sources.urls import shown_url

from .support import NOW, NOW_S, item
from .test_http_support import APNS_TOKEN, error_of


def test_device_crud_round_trip(served, feeds):
    url = feeds.items("/a.json", [])
    r = served.put_device("phone-1", reminder_lead_seconds=600, extra_rules=["lead:0@expiry"], source_urls=[url])
    assert r.status_code == 200, r.text
    created = r.json()
    assert created.pop("credential")  # issued with the registration, shown this once
    assert (created["id"], created["reminder_lead_seconds"], created["extra_rules"], created["source_urls"]) == (
        "phone-1",
        600,
        ["lead:0@expiry"],
        [url],
    )
    assert served.api.get("/v1/devices/phone-1").json() == created

    # PUT replaces: exactly these rules and sources; omitted optional fields take their defaults.
    r = served.put_device("phone-1", apns_token="CD" * 32)
    assert r.status_code == 200
    replaced = served.api.get("/v1/devices/phone-1").json()
    assert replaced["apns_token"] == "cd" * 32
    assert (replaced["reminder_lead_seconds"], replaced["extra_rules"], replaced["source_urls"]) == (
        served.settings.default_lead_seconds,
        [],
        [],
    )

    r = served.api.delete("/v1/devices/phone-1")
    assert r.status_code == 200 and r.json() == {"device_id": "phone-1", "rows_voided": 0}
    for method in ("GET", "DELETE"):
        r = served.api.request(method, "/v1/devices/phone-1")
        assert r.status_code == 404 and error_of(r)["error"] == "not_found"


def test_unknown_device_is_404_everywhere(served):
    for method, path, body in [
        ("GET", "/v1/devices/ghost", None),
        ("DELETE", "/v1/devices/ghost", None),
        ("GET", "/v1/devices/ghost/feed", None),
        ("GET", "/v1/devices/ghost/feed?tz=60", None),
        ("POST", "/internal/reminders/build", {"device_id": "ghost"}),
        ("GET", "/v1/devices/not%20an%20id", None),  # cannot exist: no database round trip
        ("GET", "/v1/devices/nul%00byte/feed", None),
    ]:
        r = served.api.request(method, path, json=body)
        assert r.status_code == 404, (method, path, r.text)
        assert error_of(r)["error"] == "not_found"


INVALID_PUTS = [
    ("d", {}, "apns_token"),
    ("d", {"apns_token": "xyz"}, "apns_token"),
    ("d", {"apns_token": APNS_TOKEN + "\n"}, "apns_token"),
    ("d", {"apns_token": 12345}, "apns_token"),
    ("d", {"apns_token": APNS_TOKEN, "reminder_lead_seconds": -1}, "reminder_lead_seconds"),
    ("d", {"apns_token": APNS_TOKEN, "reminder_lead_seconds": "3600"}, "reminder_lead_seconds"),
    ("d", {"apns_token": APNS_TOKEN, "reminder_lead_seconds": True}, "reminder_lead_seconds"),
    ("d", {"apns_token": APNS_TOKEN, "reminder_lead_seconds": 1.5}, "reminder_lead_seconds"),
    ("d", {"apns_token": APNS_TOKEN, "reminder_lead_seconds": 10**30}, "reminder_lead_seconds"),
    ("d", {"apns_token": APNS_TOKEN, "extra_rules": "lead:60"}, "extra_rules"),
    ("d", {"apns_token": APNS_TOKEN, "extra_rules": ["lead:x"]}, "extra_rules"),
    ("d", {"apns_token": APNS_TOKEN, "extra_rules": [60]}, "extra_rules"),
    ("d", {"apns_token": APNS_TOKEN, "extra_rules": ["lead:60@noon"]}, "extra_rules"),
    ("d", {"apns_token": APNS_TOKEN, "source_urls": ["ftp://example.com/feed"]}, "source_urls"),
    ("d", {"apns_token": APNS_TOKEN, "source_urls": ["http://a\u0000b/"]}, "source_urls"),
    ("d", {"apns_token": APNS_TOKEN, "source_urls": ["http://[::1/"]}, "source_urls"),
    ("d", {"apns_token": APNS_TOKEN, "source_urls": ["http://a:99999/"]}, "source_urls"),
    ("d", {"apns_token": APNS_TOKEN, "source_urls": [f"http://h/{i}" for i in range(101)]}, "source_urls"),
    ("d", {"apns_token": APNS_TOKEN, "source_urls": {"a": 1}}, "source_urls"),
    ("d", {"apns_token": APNS_TOKEN, "lead": 60}, "lead"),
    ("d", ["not", "an", "object"], "body"),
    ("bad%20id", {"apns_token": APNS_TOKEN}, "id"),
    ("x" * 129, {"apns_token": APNS_TOKEN}, "id"),
]


def test_put_validation_is_422_naming_the_field(served):
    for path_id, body, field in INVALID_PUTS:
        r = served.api.put(f"/v1/devices/{path_id}", json=body)
        assert r.status_code == 422, (body, r.text)
        assert error_of(r)["field"] == field, (body, r.text)
    assert served.api.get("/v1/devices/d").status_code == 404  # nothing was written


def test_malformed_or_oversized_bodies_are_4xx_json(served):
    for content in (b"{", b"not json", b'{"apns_token": NaN}', b"\xff\xfe\x00", b"[" * 100_000):
        r = served.api.put("/v1/devices/d", content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (content[:20], r.text)
        assert error_of(r)["error"] == "malformed_json"
    r = served.api.put("/v1/devices/d", content=b"")
    assert r.status_code == 422 and error_of(r)["field"] == "body"
    r = served.api.put("/v1/devices/d", content=b" " * 300_000)
    assert r.status_code == 413 and error_of(r)["error"] == "too_large"


def test_delete_voids_pending_rows(served, feeds):
    url = feeds.items("/a.json", [item("e1", 7200), item("e2", 9000)])
    served.put_device("phone-1", source_urls=[url])
    built = served.api.post("/internal/reminders/build", json={"device_id": "phone-1", "now": NOW.stored})
    assert built.json()["rows_inserted"] == 2
    r = served.api.delete("/v1/devices/phone-1")
    assert r.status_code == 200 and r.json()["rows_voided"] == 2
    assert {(row["status"], row["outcome"], row["outcome_detail"]) for row in served.rows()} == {
        ("settled", "voided", "device_removed")
    }


def test_feed_round_trip_in_unix_seconds(served, feeds):
    a = feeds.items("/a.json", [item("later", 7200, body="bring cake"), item("soon", 600, duration=1)])
    b = feeds.items("/b.json", [item("middle", 3600)])
    served.put_device("phone-1", source_urls=[a, b])
    r = served.api.get("/v1/devices/phone-1/feed")
    assert r.status_code == 200, r.text
    feed = r.json()
    assert feed["device_id"] == "phone-1" and feed["sources_failed"] == []
    got = [(i["id"].split(":", 1)[1], i["startsAt"], i["expiresAt"], i["body"]) for i in feed["items"]]
    assert got == [
        ("soon", NOW_S + 600, NOW_S + 601, None),
        ("middle", NOW_S + 3600, NOW_S + 5400, None),
        ("later", NOW_S + 7200, NOW_S + 9000, "bring cake"),
    ]
    assert all(type(i["startsAt"]) is int and type(i["expiresAt"]) is int for i in feed["items"])  # not ISO, not floats


def test_feed_reports_a_failed_source_and_still_answers(served, feeds):
    ok = feeds.items("/ok.json", [item("e", 3600)])
    bad = feeds.fail("/bad.json", 500)
    served.put_device("phone-1", source_urls=[ok, bad])
    feed = served.api.get("/v1/devices/phone-1/feed").json()
    assert [i["title"] for i in feed["items"]] == ["Event e"]
    assert feed["sources_failed"] == [{"url": shown_url(bad), "error": "http_500"}]


def test_feed_tz_that_is_not_an_offset_is_422(served):
    served.put_device("phone-1")
    for tz in ("abc", "1.5", "99999", "-64801", "", "0x10", "3600\n"):
        r = served.api.get("/v1/devices/phone-1/feed", params={"tz": tz})
        assert r.status_code == 422 and error_of(r)["field"] == "tz", tz
    r = served.api.get("/v1/devices/phone-1/feed?tz=60&tz=120")
    assert r.status_code == 422 and error_of(r)["field"] == "tz"


@contextmanager
def tz_writes(db: Database) -> Iterator[list[str]]:
    """Every statement that touches ``last_tz_offset_seconds`` or opens a write, while inside."""
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "last_tz_offset_seconds" in statement and statement.lstrip().upper().startswith("UPDATE"):
            seen.append(statement)
        if statement.strip().upper() == "BEGIN IMMEDIATE":
            seen.append(statement)

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(db.engine, "before_cursor_execute", record)


def stored_tz(db: Database, device_id: str = "phone-1") -> int | None:
    with db.read() as conn:
        record = ledger.get_device(conn, device_id)
    assert record is not None
    return record.last_tz_offset_seconds


def test_tz_is_written_only_when_it_changes(served, db):
    served.put_device("phone-1")
    with tz_writes(db) as seen:
        assert served.api.get("/v1/devices/phone-1/feed?tz=3600").status_code == 200
    assert len([s for s in seen if s.startswith("UPDATE")]) == 1 and stored_tz(db) == 3600

    for query in ("?tz=3600", "?tz=3600", "", "?tz=03600"):
        with tz_writes(db) as seen:
            assert served.api.get(f"/v1/devices/phone-1/feed{query}").status_code == 200
        assert seen == [], query  # unchanged: no UPDATE, and on SQLite not even a write transaction
    assert stored_tz(db) == 3600

    with tz_writes(db) as seen:
        assert served.api.get("/v1/devices/phone-1/feed?tz=-18000").status_code == 200
    assert len([s for s in seen if s.startswith("UPDATE")]) == 1 and stored_tz(db) == -18000


@contextmanager
def broken_tz_writes(db: Database) -> Iterator[None]:
    """A trigger that makes every write of ``last_tz_offset_seconds`` fail, on either backend."""
    with db.write() as conn:
        if db.dialect == "sqlite":
            conn.execute(
                text(
                    "CREATE TRIGGER tz_broken BEFORE UPDATE OF last_tz_offset_seconds ON devices "
                    "BEGIN SELECT RAISE(ABORT, 'tz writes are broken'); END"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE FUNCTION tz_broken() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'tz writes are broken'; END $$"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER tz_broken BEFORE UPDATE OF last_tz_offset_seconds ON devices "
                    "FOR EACH ROW EXECUTE FUNCTION tz_broken()"
                )
            )
    try:
        yield
    finally:
        with db.write() as conn:  # the PostgreSQL test database outlives this test
            conn.execute(text("DROP TRIGGER IF EXISTS tz_broken" + ("" if db.dialect == "sqlite" else " ON devices")))
            if db.dialect != "sqlite":
                conn.execute(text("DROP FUNCTION IF EXISTS tz_broken()"))


def test_a_failing_tz_write_never_fails_the_feed(served, db, feeds):
    url = feeds.items("/a.json", [item("e", 3600)])
    served.put_device("phone-1", source_urls=[url])
    with broken_tz_writes(db):
        with tz_writes(db) as seen:
            r = served.api.get("/v1/devices/phone-1/feed?tz=7200")
        assert any(s.startswith("UPDATE") for s in seen)  # the write was attempted, and failed
        assert r.status_code == 200, r.text
        assert [i["title"] for i in r.json()["items"]] == ["Event e"]
        assert stored_tz(db) is None
    metrics = served.anon.get("/metrics").text
    assert "reminders_tz_write_failures_total 1.0" in metrics
    # Once writes work again the next feed read stores it.
    assert served.api.get("/v1/devices/phone-1/feed?tz=7200").status_code == 200
    assert stored_tz(db) == 7200


CALENDAR = "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//t//EN\r\nBEGIN:VEVENT\r\nUID:c\r\nDTSTART:20300101T090000Z\r\nSUMMARY:C\r\nEND:VEVENT\r\nEND:VCALENDAR\r\n"


def test_feed_requests_cannot_multiply_reads_of_a_source(served, feeds):
    """A device credential must not make the server read (and inflate) a hostile source at will: a
    source read in the last REMINDERS_FEED_CACHE_SECONDS is served from its recorded read, failures
    included."""
    ok = feeds.items("/cached.json", [item("e", 3600)])
    bad = feeds.fail("/down.json", 503)
    calendar = feeds.calendar("/cal.ics", CALENDAR)
    served.put_device("phone-1", source_urls=[ok, bad, calendar])
    answers = [served.api.get("/v1/devices/phone-1/feed").json() for _ in range(5)]
    assert (feeds.hits["/cached.json"], feeds.hits["/down.json"], feeds.hits["/cal.ics"]) == (1, 1, 1)
    assert all(
        a["items"] == answers[0]["items"] and a["sources_failed"] == answers[0]["sources_failed"] for a in answers
    )
    assert [i["title"] for i in answers[0]["items"]] == ["Event e"]
    assert answers[0]["sources_failed"] == [{"url": shown_url(bad), "error": "http_503"}]
