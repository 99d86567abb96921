"""Credentials and the clock over HTTP.

The widget's routes take the device's own credential (issued on registration, shown once, kept
as a hash, rotatable), never needing the internal token; that token keeps the internal and
management routes and can be rotated without downtime; and ``now`` is refused over the wire
unless a test deployment turned it on.
"""

from __future__ import annotations

import hashlib
import json

import httpx
from click.testing import CliRunner

from reminders_pipeline import ledger
from reminders_pipeline.cli import main
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.devices.credentials import CREDENTIAL_BYTES
from reminders_pipeline.ledger.schema import devices

from .support import NOW, TOKEN, item
from .test_http_support import SECRET, error_of, http_settings

FAR_FUTURE = "2999-01-01T00:00:00Z"


def stored_hash(db, device_id: str) -> str | None:
    with db.read() as conn:
        return ledger.device_credential_hash(conn, device_id)


def test_now_is_refused_over_http_unless_a_test_setting_allows_it(serve, settings, feeds):
    """Anyone with the token could otherwise stamp devices built in 2999 or expire every row."""
    s = serve(http_settings(settings, http_accept_now=False))
    url = feeds.items("/a.json", [item("e", 600)])
    assert s.put_device("phone-1", source_urls=[url]).status_code == 200
    for path, body in (
        ("/internal/reminders/build", {"now": FAR_FUTURE}),
        ("/internal/reminders/drain", {"now": FAR_FUTURE}),
        ("/internal/reminders/build", {"now": None}),
        ("/internal/reminders/drain", {"id": 1, "now": NOW.stored}),
    ):
        r = s.api.post(path, json=body)
        assert r.status_code == 422, (path, body, r.text)
        assert error_of(r)["field"] == "now" and "REMINDERS_HTTP_ACCEPT_NOW" in r.json()["detail"]
    with s.db.read() as conn:
        assert ledger.get_device(conn, "phone-1").reminders_built_at is None  # nothing ran
    doc = s.anon.get("/openapi.json").json()["components"]["schemas"]
    assert "now" not in doc["BuildRequest"]["properties"] and "now" not in doc["DrainRequest"]["properties"]

    built = s.api.post("/internal/reminders/build", json={})  # the server's clock: fine
    assert built.status_code == 200 and built.json()["now"] < "2999"
    misspelt = s.api.post("/internal/reminders/build", json={"device": "phone-1"})
    assert misspelt.status_code == 422 and "now" not in misspelt.json()["detail"].split("expected one of")[1]


def test_now_setting_reads_only_exactly_true():
    assert Settings.from_env({}).http_accept_now is False
    assert Settings.from_env({"REMINDERS_HTTP_ACCEPT_NOW": "1"}).http_accept_now is False
    assert Settings.from_env({"REMINDERS_HTTP_ACCEPT_NOW": "true"}).http_accept_now is True


def test_registration_issues_a_credential_once_and_stores_only_its_hash(served, db):
    r = served.put_device("phone-1")
    assert r.status_code == 200
    credential = r.json()["credential"]
    assert len(credential) >= 43 and len(set(credential)) > 10  # 32 random bytes, URL-safe base64
    assert stored_hash(db, "phone-1") == hashlib.sha256(credential.encode()).hexdigest()
    with db.read() as conn:
        everything = json.dumps([ledger.get_device(conn, "phone-1").as_dict()]) + repr(ledger.list_devices(conn))
    assert credential not in everything and stored_hash(db, "phone-1") not in everything

    again = served.put_device("phone-1", reminder_lead_seconds=600)  # a replacing PUT keeps it
    assert again.status_code == 200 and "credential" not in again.json() and again.json()["has_credential"] is True
    assert served.as_device(credential).get("/v1/devices/phone-1/feed").status_code == 200
    assert "credential" not in served.api.get("/v1/devices/phone-1").json()
    assert CREDENTIAL_BYTES == 32


def test_the_widget_needs_only_its_own_credential_even_with_the_internal_token_unset(serve, settings, feeds):
    s = serve(http_settings(settings))
    url = feeds.items("/a.json", [item("e", 3600)])
    phone = s.put_device("phone-1", source_urls=[url]).json()["credential"]
    other = s.put_device("phone-2", source_urls=[url]).json()["credential"]

    closed = serve(http_settings(settings, token=None))  # same ledger, REMINDERS_TOKEN unset
    widget = closed.as_device(phone)
    r = widget.get("/v1/devices/phone-1/feed?tz=7200")
    assert r.status_code == 200 and [i["title"] for i in r.json()["items"]] == ["Event e"]
    with s.db.read() as conn:
        assert ledger.get_device(conn, "phone-1").last_tz_offset_seconds == 7200  # the tz capture too

    for client, path in (
        (closed.as_device(other), "/v1/devices/phone-1/feed"),
        (widget, "/v1/devices/phone-2/feed"),
        (widget, "/v1/devices/phone-2/credential"),
        (widget, "/v1/devices/ghost/feed"),
        (closed.anon, "/v1/devices/phone-1/feed"),
    ):
        method = "POST" if path.endswith("credential") else "GET"
        r = client.request(method, path)
        assert r.status_code == 401 and error_of(r)["error"] == "unauthorized", (path, r.text)


def test_a_device_credential_opens_nothing_but_its_own_routes(served):
    credential = served.put_device("phone-1").json()["credential"]
    widget = served.as_device(credential)
    for method, path, body in [
        ("GET", "/v1/devices/phone-1", None),
        ("PUT", "/v1/devices/phone-1", {"apns_token": TOKEN}),
        ("DELETE", "/v1/devices/phone-1", None),
        ("POST", "/internal/reminders/build", {"device_id": "phone-1"}),
        ("POST", "/internal/reminders/drain", {}),
    ]:
        r = widget.request(method, path, json=body)
        assert r.status_code == 401, (method, path, r.text)
    assert served.api.get("/v1/devices/phone-1/feed").status_code == 200  # the operator's token still reads it


def test_a_credential_rotates_by_route_and_by_cli(served, db_url):
    old = served.put_device("phone-1").json()["credential"]
    r = served.as_device(old).post("/v1/devices/phone-1/credential")  # the device rotates its own
    assert r.status_code == 200 and r.json()["device_id"] == "phone-1"
    new = r.json()["credential"]
    assert new != old
    assert served.as_device(old).get("/v1/devices/phone-1/feed").status_code == 401
    assert served.as_device(new).get("/v1/devices/phone-1/feed").status_code == 200

    by_operator = served.api.post("/v1/devices/phone-1/credential")
    assert by_operator.status_code == 200 and served.as_device(new).get("/v1/devices/phone-1/feed").status_code == 401
    assert served.api.post("/v1/devices/ghost/credential").status_code == 404

    runner = CliRunner()
    done = runner.invoke(main, ["device", "rotate-credential", "phone-1"], env={"REMINDERS_DATABASE_URL": db_url})
    assert done.exit_code == 0, done.output
    from_cli = json.loads(done.output)["credential"]
    assert served.as_device(from_cli).get("/v1/devices/phone-1/feed").status_code == 200
    assert served.as_device(by_operator.json()["credential"]).get("/v1/devices/phone-1/feed").status_code == 401
    missing = runner.invoke(main, ["device", "rotate-credential", "ghost"], env={"REMINDERS_DATABASE_URL": db_url})
    assert missing.exit_code == 2 and "no device 'ghost'" in missing.output


def test_cli_registration_prints_the_credential_once(db_url):
    runner = CliRunner()
    env = {"REMINDERS_DATABASE_URL": db_url}
    first = json.loads(runner.invoke(main, ["device", "put", "phone-1", "--apns-token", TOKEN], env=env).output)
    again = json.loads(runner.invoke(main, ["device", "put", "phone-1", "--apns-token", TOKEN], env=env).output)
    assert first["credential"] and "credential" not in again and again["has_credential"] is True


def test_a_device_registered_before_credentials_gets_one_on_its_next_registration(served, db):
    served.put_device("phone-1")
    with db.write() as conn:  # as the 0004 migration leaves an existing device
        conn.execute(devices.update().values(credential_hash=None))
    r = served.put_device("phone-1")
    assert r.status_code == 200 and r.json()["credential"]
    assert stored_hash(db, "phone-1") == hashlib.sha256(r.json()["credential"].encode()).hexdigest()


def test_the_internal_token_rotates_without_downtime(serve, settings):
    s = serve(http_settings(settings, token="new-token", token_previous=SECRET))
    for token, status in ((SECRET, 404), ("new-token", 404), ("older-token", 401)):
        r = s.anon.get("/v1/devices/ghost", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == status, (token, r.text)
    assert (
        s.anon.post("/internal/reminders/build", headers={"Authorization": "Bearer new-token"}, json={}).status_code
        == 200
    )

    closed = serve(http_settings(settings, token=None, token_previous=SECRET))  # a previous token alone opens nothing
    assert closed.api.get("/v1/devices/ghost").status_code == 401
    assert Settings.from_env({"REMINDERS_TOKEN_PREVIOUS": "p"}).token_previous == "p"


def test_of_ten_concurrent_rotations_by_the_device_exactly_one_wins(served):
    """Ten rotations presenting the same credential at once: one 200, the others refused (409
    ``credential_changed``, or 401 once the winner's swap is visible), and only the winner's
    credential opens the device. Before the compare-and-swap, all ten got 200 and nine of the
    credentials they were shown were already dead."""
    import threading

    old = served.put_device("phone-1").json()["credential"]
    gate = threading.Barrier(10)
    answers: list[httpx.Response] = []

    def rotate() -> None:
        client = served.as_device(old)
        gate.wait()
        answers.append(client.post("/v1/devices/phone-1/credential"))

    threads = [threading.Thread(target=rotate) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in answers)
    assert statuses.count(200) == 1 and set(statuses) <= {200, 401, 409}, statuses
    assert all(error_of(r)["error"] == "credential_changed" for r in answers if r.status_code == 409)
    winner = next(r.json()["credential"] for r in answers if r.status_code == 200)
    assert served.as_device(winner).get("/v1/devices/phone-1/feed").status_code == 200


def test_a_rotation_swaps_only_the_credential_it_read(db, settings):
    """The core's compare-and-swap, ten threads each replacing the same old hash: one returns a
    credential, nine raise ``CredentialChanged``; an operator's rotation (no hash given) replaces
    whatever is stored."""
    import threading

    from reminders_pipeline.devices.credentials import CredentialChanged, credential_hash, rotate_credential

    from .support import device

    device(db, settings, "phone-1", sources=[])
    first = rotate_credential(db, "phone-1")
    gate = threading.Barrier(10)
    outcomes: list[str] = []

    def rotate() -> None:
        gate.wait()
        try:
            outcomes.append("won" if rotate_credential(db, "phone-1", credential_hash(first)) else "unknown")
        except CredentialChanged:
            outcomes.append("changed")

    threads = [threading.Thread(target=rotate) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["changed"] * 9 + ["won"]
    assert rotate_credential(db, "phone-1") is not None and rotate_credential(db, "ghost") is None


def test_registrations_adding_the_same_new_sources_in_opposite_orders_never_deadlock(db, settings, feeds):
    """15 pairs of registrations, each pair adding the same five new source URLs in opposite
    orders at once: every one succeeds (URLs are inserted sorted, so neither waits on the other's
    unique-index entries in the reverse order)."""
    import threading

    from reminders_pipeline.devices.registration import DeviceSpec, put_device

    from .support import TOKEN

    errors: list[BaseException] = []
    for pair in range(15):
        urls = [feeds.url(f"/pair{pair}/{i}.json") for i in range(5)]
        gate = threading.Barrier(2)

        def put(device_id: str, order: list[str]) -> None:
            gate.wait()  # noqa: B023 - joined in this iteration
            try:
                put_device(db, settings, DeviceSpec(device_id, TOKEN, 3600, (), tuple(order)))
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

        threads = [
            threading.Thread(target=put, args=(f"p{pair}a", urls)),
            threading.Thread(target=put, args=(f"p{pair}b", urls[::-1])),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
