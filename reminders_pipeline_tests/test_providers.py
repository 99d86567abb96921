"""Web Push and FCM beside APNs, end to end on SQLite and PostgreSQL: the CLI registers and
builds, the drain sends through the mock push service (which checks the VAPID JWT and decrypts
every payload with the subscription's key, as a browser would) and the mock FCM (which checks the
OAuth token its own token endpoint issued), both over HTTP/2 TLS, and the test reads what each
received and the rows. Times are the real clock's: a push service reads ``TTL`` against it."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from click.testing import CliRunner, Result

from reminders_pipeline.cli import main
from reminders_pipeline.config.settings import Settings, SettingsError
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Notification
from reminders_pipeline.providers.base import SendResult
from reminders_pipeline.providers.fcm import FcmSender
from reminders_pipeline.providers.push_subscription import origin_of
from reminders_pipeline.providers.webpush import PushServices, WebPushSender, generate_key
from reminders_pipeline_testing.mock_apns import MockApns
from reminders_pipeline_testing.mock_fcm import Answer as FcmAnswer
from reminders_pipeline_testing.mock_fcm import MockFcm
from reminders_pipeline_testing.mock_webpush import Answer, MockWebPush

from .support import TOKEN, rows
from .test_http_support import error_of, http_settings

FCM_TOKEN = "fcm-registration-token-" + "x" * 40
PAYLOAD = {"aps": {"alert": {"title": "Standup", "body": "Starts at 09:00"}}, "reminder": {"id": 1}}


@pytest.fixture(scope="module")
def push(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockWebPush]:
    with MockWebPush(workdir=tmp_path_factory.mktemp("mock-webpush")) as server:
        yield server


@pytest.fixture(scope="module")
def fcm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockFcm]:
    with MockFcm(workdir=tmp_path_factory.mktemp("mock-fcm")) as server:
        yield server


@pytest.fixture
def env(push: MockWebPush, fcm: MockFcm, fresh_mock: MockApns, tmp_path: Path, db_url: str) -> dict[str, str]:
    """Every provider configured, each against its mock; sending on."""
    push.reset()
    fcm.reset()
    generate_key(str(tmp_path / "vapid.pem"))
    return {
        "REMINDERS_DATABASE_URL": db_url,
        "REMINDERS_ENABLED": "true",
        **fresh_mock.env(),
        "REMINDERS_VAPID_PRIVATE_KEY_FILE": str(tmp_path / "vapid.pem"),
        "REMINDERS_VAPID_SUBJECT": "mailto:ops@example.org",
        "REMINDERS_WEBPUSH_CA_FILE": str(push.ca_file),
        "REMINDERS_WEBPUSH_ALLOW_NETWORKS": "127.0.0.0/8",
        "REMINDERS_FCM_CREDENTIALS_FILE": str(fcm.service_account_file()),
        "REMINDERS_FCM_URL": fcm.url,
        "REMINDERS_FCM_CA_FILE": str(fcm.ca_file),
    }


@pytest.fixture
def run(env: dict[str, str]) -> Callable[..., Result]:
    runner = CliRunner()

    def invoke(*args: str, code: int = 0, **extra: str) -> Result:
        result = runner.invoke(main, list(args), env={**env, **extra}, catch_exceptions=False)
        assert result.exit_code == code, result.output
        return result

    return invoke


def soon(feeds: Any, path: str = "/a.json", *titles: str) -> str:
    """A feed whose events start in 30 minutes (a lead of 1800 s: due now) and end 30 minutes later."""
    start = int(time.time()) + 1800
    events = [
        {"id": f"e{i}", "title": t, "startsAt": start + i, "expiresAt": start + i + 1800}
        for i, t in enumerate(titles or ("Standup",))
    ]
    return str(feeds.items(path, events))


def subscribed(run: Callable[..., Result], push: MockWebPush, tmp_path: Path, url: str, **answer: Any) -> dict:
    subscription = push.subscribe(Answer(**answer) if answer else None)
    (tmp_path / "sub.json").write_text(json.dumps(subscription))
    out = json.loads(
        run("device", "put", "web", "--webpush-subscription", str(tmp_path / "sub.json"), "--lead", "1800",
            "--source", url).output
    )  # fmt: skip
    assert (out["provider"], out["apns_token"]) == ("webpush", None)
    assert out["webpush_endpoint"] == f"{push.origin}/…"  # the endpoint's path is the subscription's secret
    return subscription


def device_of(run: Callable[..., Result], device_id: str) -> dict:
    return next(d for d in json.loads(run("device", "list").output) if d["id"] == device_id)


def drained(run: Callable[..., Result]) -> dict:
    run("build", "--all")
    return json.loads(run("drain").output)


def test_a_web_push_reminder_is_encrypted_to_the_browser_and_read_back_as_it_would_show(run, push, feeds, tmp_path, db):
    subscription = subscribed(run, push, tmp_path, soon(feeds, "/a.json", "Standup"))
    summary = drained(run)
    assert summary["outcomes"] == {"sent": 1}
    (request,) = push.wait_for_requests(1)
    assert request.endpoint == subscription["endpoint"] and request.status == 201
    assert request.protocol == "h2"
    row = rows(db, device_id="web")[0]
    assert request.payload["title"] == "Standup" and request.payload["body"].startswith("Starts")
    assert request.payload["category"] == "REMINDER" and request.payload["reminder"]["id"] == row["id"]
    assert request.payload["tag"] and request.urgency == "high" and len(request.topic) <= 32
    starts = row["event_at"].whole_seconds
    assert starts - time.time() - 5 <= request.ttl <= starts - request.at + 1  # until the event starts
    assert (row["status"], row["outcome"]) == ("settled", "sent")


def test_a_gone_subscription_marks_the_device_and_voids_its_other_reminders(run, push, feeds, tmp_path, db):
    url = soon(feeds, "/a.json", "First")
    later = int(time.time()) + 7200
    feeds.items(
        "/a.json",
        [
            {"id": "now", "title": "First", "startsAt": later - 5400, "expiresAt": later - 3600},
            {"id": "later", "title": "Later", "startsAt": later, "expiresAt": later + 1800},
        ],
    )
    subscribed(run, push, tmp_path, url, status=410)
    summary = drained(run)
    assert summary["outcomes"] == {"failed": 1} and summary["tokens_invalidated"] == 1
    assert summary["voided_by_token"] == 1
    got = {r["item_id"].split(":", 1)[1]: r for r in rows(db, device_id="web")}
    assert got["now"]["outcome_detail"] == "subscription_gone"
    assert (got["later"]["outcome"], got["later"]["outcome_detail"]) == ("voided", "token_invalid")
    assert device_of(run, "web")["token_invalid_reason"] == "subscription_gone"


@pytest.mark.parametrize(("status", "retry_after"), [(429, 600), (503, None)])
def test_a_throttled_or_unavailable_push_service_returns_the_row_to_pending_after_its_wait(
    run, push, feeds, tmp_path, db, status, retry_after
):
    subscribed(run, push, tmp_path, soon(feeds), status=status, retry_after=retry_after)
    before = Instant.now()
    summary = drained(run)
    assert summary["returned_to_pending"] == 1
    (row,) = rows(db, device_id="web")
    assert row["status"] == "pending" and row["outcome_detail"] == f"http_{status}"
    if retry_after:  # Retry-After honoured, beyond the exponential backoff's first wait (seconds)
        assert row["not_before"] - before >= retry_after
    assert len(push.requests) == 1  # not sent again by this drain


def test_a_payload_too_large_fails_its_row_alone(run, push, feeds, tmp_path, db):
    subscribed(run, push, tmp_path, soon(feeds), status=413)
    summary = drained(run)
    assert summary["outcomes"] == {"failed": 1}
    (row,) = rows(db, device_id="web")
    assert row["outcome_detail"] == "PayloadTooLarge"
    assert device_of(run, "web")["token_invalid_at"] is None


def test_an_endpoint_inside_the_network_is_refused_at_registration_and_at_send(run, push, feeds, tmp_path, db):
    subscription = push.subscribe()
    (tmp_path / "sub.json").write_text(json.dumps(subscription))
    refused = run(
        "device", "put", "web", "--webpush-subscription", str(tmp_path / "sub.json"), "--source", soon(feeds),
        code=2, REMINDERS_WEBPUSH_ALLOW_NETWORKS="",
    )  # fmt: skip
    assert "internal address" in refused.output
    subscribed(run, push, tmp_path, soon(feeds))  # allowed while registering
    summary = json.loads(run("build", "--all").output) and json.loads(
        run("drain", REMINDERS_WEBPUSH_ALLOW_NETWORKS="").output
    )
    assert summary["outcomes"] == {"failed": 1}
    (row,) = rows(db, device_id="web")
    assert row["outcome_detail"] == "address_refused" and push.requests == []


@pytest.mark.parametrize(
    "body",
    [
        {"endpoint": "http://push.example/x", "keys": {"p256dh": "AAAA", "auth": "AAAA"}},
        {"endpoint": "https://push.example/x", "keys": {"p256dh": "AAAA", "auth": "AAAA"}},
        {"endpoint": "https://push.example/x"},
        ["not", "an", "object"],
    ],
)
def test_a_malformed_subscription_is_a_bad_argument_naming_it(run, tmp_path, feeds, body):
    (tmp_path / "sub.json").write_text(json.dumps(body))
    result = run("device", "put", "web", "--webpush-subscription", str(tmp_path / "sub.json"), code=2)
    assert "--webpush-subscription" in result.output or "webpush_subscription" in result.output


def test_an_fcm_reminder_carries_the_alert_its_ttl_and_collapse_key(run, fcm, feeds, db):
    out = json.loads(run("device", "put", "droid", "--fcm-token", FCM_TOKEN, "--lead", "1800", "--source",
                         soon(feeds, "/a.json", "Review")).output)  # fmt: skip
    assert (out["provider"], out["fcm_token"], out["apns_token"]) == ("fcm", FCM_TOKEN, None)
    assert drained(run)["outcomes"] == {"sent": 1}
    (request,) = fcm.wait_for_requests(1)
    message = request.message
    assert message["notification"]["title"] == "Review" and message["token"] == FCM_TOKEN
    (row,) = rows(db, device_id="droid")
    assert json.loads(message["data"]["reminder"])["id"] == row["id"]
    assert message["android"]["priority"] == "HIGH" and message["android"]["collapse_key"] == message["data"]["tag"]
    ttl = int(message["android"]["ttl"].rstrip("s"))
    assert 0 < ttl <= row["event_at"].whole_seconds - request.at + 1
    assert row["outcome"] == "sent" and fcm.tokens_issued == 1


def test_fcm_answers_are_mapped_per_device(run, fcm, feeds, db):
    url = soon(feeds, "/a.json", "One")
    tokens = {name: f"{name}-{'t' * 40}" for name in ("gone", "bad", "busy", "fine")}
    for name, token in tokens.items():
        run("device", "put", name, "--fcm-token", token, "--lead", "1800", "--source", url)
    fcm.script(tokens["gone"], FcmAnswer(error_code="UNREGISTERED"))
    fcm.script(tokens["bad"], FcmAnswer(error_code="INVALID_ARGUMENT"))
    fcm.script(tokens["busy"], FcmAnswer(error_code="QUOTA_EXCEEDED", retry_after=900))
    summary = drained(run)
    assert (summary["outcomes"], summary["tokens_invalidated"], summary["returned_to_pending"]) == (
        {"sent": 1, "failed": 2},
        1,
        1,
    )
    got = {r["device_id"]: r for r in rows(db)}
    assert got["gone"]["outcome_detail"] == "UNREGISTERED" and device_of(run, "gone")["token_invalid_at"]
    assert got["bad"]["outcome_detail"] == "INVALID_ARGUMENT" and not device_of(run, "bad")["token_invalid_at"]
    assert got["busy"]["status"] == "pending" and got["busy"]["not_before"] - Instant.now() > 600
    assert got["fine"]["outcome"] == "sent"


def test_fcm_access_tokens_are_refreshed_across_expiry_and_after_a_refusal(fcm, env):
    settings = Settings.from_env(env)
    note = Notification(1, "droid", FCM_TOKEN, PAYLOAD, "collapse", int(time.time()) + 600, provider="fcm")

    async def sends() -> list[list[SendResult]]:
        sender = FcmSender(settings)
        try:
            fcm.token_lifetime = 1  # the mock refuses it a second later; google-auth asks anew each time
            first = await sender.send_many([note])
            await asyncio.sleep(1.2)
            second = await sender.send_many([note])
            fcm.token_lifetime = 3600
            await sender.send_many([note])  # a long-lived token, cached
            fcm.revoke_tokens()
            refused = await sender.send_many([note])  # 401: a configuration fault, the token forgotten
            again = await sender.send_many([note])
            return [first, second, refused, again]
        finally:
            await sender.aclose()

    issued = fcm.tokens_issued
    first, second, refused, again = asyncio.run(sends())
    assert [r.ok for r in first + second] == [True, True]
    assert (refused[0].ok, refused[0].config_fault, refused[0].status) == (False, True, 401)
    assert again[0].ok and fcm.tokens_issued - issued == 4


def test_one_drain_sends_each_row_once_to_its_own_provider(run, push, fcm, fresh_mock, feeds, tmp_path, db):
    url = soon(feeds, "/a.json", "Mixed")
    subscription = subscribed(run, push, tmp_path, url)
    run("device", "put", "droid", "--fcm-token", FCM_TOKEN, "--lead", "1800", "--source", url)
    run("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    summary = drained(run)
    assert summary["outcomes"] == {"sent": 3}
    assert summary["providers"] == {"apns:sent": 1, "webpush:sent": 1, "fcm:sent": 1}
    assert [r.endpoint for r in push.wait_for_requests(1)] == [subscription["endpoint"]]
    assert [r.token for r in fcm.wait_for_requests(1)] == [FCM_TOKEN]
    assert [r.token for r in fresh_mock.wait_for_requests(1)] == [TOKEN]
    assert sorted(r["device_id"] for r in rows(db) if r["outcome"] == "sent") == ["droid", "phone", "web"]
    assert drained(run)["outcomes"] == {}  # nothing twice
    assert (len(push.requests), len(fcm.requests), len(fresh_mock.requests)) == (1, 1, 1)
    from reminders_pipeline.http.metrics import read_snapshot  # noqa: PLC0415

    snapshot = read_snapshot(db, Instant.now() + 1, 3600, 60)
    assert snapshot.by_provider == {("apns", "sent"): 1, ("webpush", "sent"): 1, ("fcm", "sent"): 1}


def test_a_dry_run_settles_every_provider_disabled_and_sends_nothing(run, push, fcm, feeds, tmp_path, db):
    url = soon(feeds)
    subscribed(run, push, tmp_path, url)
    run("device", "put", "droid", "--fcm-token", FCM_TOKEN, "--lead", "1800", "--source", url)
    run("build", "--all")
    summary = json.loads(run("drain", REMINDERS_ENABLED="false").output)
    assert summary["outcomes"] == {"disabled": 2}
    assert summary["providers"] == {"webpush:disabled": 1, "fcm:disabled": 1}
    assert push.requests == [] and fcm.requests == []


def test_the_vapid_key_pair_is_generated_once_and_its_public_key_served(run, tmp_path, serve, settings):
    out = json.loads(run("vapid", "generate", "--out", str(tmp_path / "k.pem")).output)
    assert (tmp_path / "k.pem").stat().st_mode & 0o077 == 0
    run("vapid", "generate", "--out", str(tmp_path / "k.pem"), code=2)
    served = serve(http_settings(settings, vapid_private_key_file=str(tmp_path / "k.pem")))
    assert served.anon.get("/v1/vapid-public-key").json() == {"public_key": out["public_key"]}
    unconfigured = serve(http_settings(settings)).anon.get("/v1/vapid-public-key")
    assert unconfigured.status_code == 404 and error_of(unconfigured)["error"] == "webpush_not_configured"


def test_the_device_api_takes_a_subscription_or_an_fcm_token_and_refuses_an_internal_endpoint(
    serve, settings, push, feeds, env
):
    keys = {
        "vapid_private_key_file": env["REMINDERS_VAPID_PRIVATE_KEY_FILE"],
        "fcm_credentials_file": env["REMINDERS_FCM_CREDENTIALS_FILE"],
    }
    served = serve(http_settings(settings, webpush_allow_networks=("127.0.0.0/8",), **keys))
    subscription = push.subscribe()
    put = served.api.put("/v1/devices/web", json={"webpush_subscription": subscription, "source_urls": [soon(feeds)]})
    assert put.status_code == 200, put.text
    assert (put.json()["provider"], put.json()["webpush_endpoint"]) == ("webpush", f"{push.origin}/…")
    put = served.api.put("/v1/devices/droid", json={"fcm_token": FCM_TOKEN})
    assert (put.json()["provider"], put.json()["fcm_token"]) == ("fcm", FCM_TOKEN)
    both = served.api.put("/v1/devices/x", json={"fcm_token": FCM_TOKEN, "apns_token": TOKEN})
    assert both.status_code == 422 and error_of(both)["field"] == "target"
    unconfigured = serve(http_settings(settings)).api.put("/v1/devices/droid2", json={"fcm_token": FCM_TOKEN})
    assert unconfigured.status_code == 422 and error_of(unconfigured)["field"] == "fcm_token"
    strict = serve(http_settings(settings, **keys))
    inside = strict.api.put("/v1/devices/web2", json={"webpush_subscription": push.subscribe()})
    assert inside.status_code == 422 and error_of(inside)["field"] == "webpush_subscription"
    bad = strict.api.put("/v1/devices/web3", json={"webpush_subscription": {"endpoint": "https://x.example/1"}})
    assert bad.status_code == 422


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        ({"status": 401}, "vapid_refused"),
        ({"status": 403}, "http_403"),
        ({"status": 201, "delay": 3.0}, "timeout"),
    ],
)
def test_what_one_users_endpoint_answers_fails_its_row_alone(
    run, push, fresh_mock, feeds, tmp_path, db, answer, detail
):
    """The endpoint is a user's: a 401 or 403 it answers, or an answer it holds past the send
    timeout, fails that row only. Nothing halts, and the iPhone beside it gets its alert."""
    url = soon(feeds)
    subscribed(run, push, tmp_path, url, **answer)
    run("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    run("build", "--all")
    started = time.monotonic()
    summary = json.loads(run("drain", REMINDERS_SEND_TIMEOUT_SECONDS="1").output)
    assert time.monotonic() - started < 2.9  # not held for the endpoint's 3 s
    assert summary["halted"] is None and summary["providers"] == {"apns:sent": 1, "webpush:failed": 1}
    assert {r["device_id"]: r["outcome_detail"] for r in rows(db)}["web"] == detail
    assert len(fresh_mock.requests) == 1


def test_many_users_endpoints_failing_are_no_outage_of_ours(run, push, fresh_mock, feeds, tmp_path, db):
    url = soon(feeds)
    for i in range(25):  # past REMINDERS_SEND_HALT_AFTER: an outage, were it APNs answering
        subscription = push.subscribe(Answer(status=503))
        (tmp_path / f"sub{i}.json").write_text(json.dumps(subscription))
        run("device", "put", f"web{i}", "--webpush-subscription", str(tmp_path / f"sub{i}.json"), "--lead", "1800",
            "--source", url)  # fmt: skip
    run("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    summary = drained(run)
    assert summary["halted"] is None and summary["returned_to_pending"] == 25
    assert summary["providers"] == {"apns:sent": 1}


@pytest.mark.parametrize(
    ("header", "waits"),
    [("\u00b2", None), ("100000000000000000000", 86400.0), ("Fri, 31 Dec 9999 23:59:59 GMT", 86400.0), ("7", 7.0)],
)
def test_a_retry_after_is_read_with_care_and_capped_at_a_day(header, waits):
    from reminders_pipeline.providers.webpush import retry_after  # noqa: PLC0415

    assert retry_after(header, time.time()) == waits


def test_a_retry_after_date_counts_from_now_and_a_passed_one_waits_nothing():
    from reminders_pipeline.providers.webpush import retry_after  # noqa: PLC0415

    now = 1_789_084_800.0  # Fri, 11 Sep 2026 00:00:00 GMT
    assert retry_after("Fri, 11 Sep 2026 00:02:00 GMT", now) == 120.0
    assert retry_after("Thu, 10 Sep 2026 23:00:00 GMT", now) == 0.0


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (201, SendResult(1, True, status=201)),
        (404, SendResult(1, False, reason="subscription_gone", status=404, token_invalid=True)),
        (410, SendResult(1, False, reason="subscription_gone", status=410, token_invalid=True)),
        (413, SendResult(1, False, reason="PayloadTooLarge", status=413)),
        (503, SendResult(1, False, reason="http_503", status=503, retry=True, outage=False)),
        (502, SendResult(1, False, reason="http_502", status=502, outage=False)),
        (401, SendResult(1, False, reason="vapid_refused", status=401)),
    ],
)
def test_a_push_services_answer_is_its_rows_outcome(status, expected):
    """The module docstring's table of ``webpush.py``, answer by answer."""
    from reminders_pipeline.providers.webpush import answer  # noqa: PLC0415

    assert answer(1, status, {}, answered_at=0.0) == expected


def test_a_push_services_retry_after_date_counts_from_its_answer():
    from email.utils import formatdate  # noqa: PLC0415

    import httpx  # noqa: PLC0415

    from reminders_pipeline.providers.webpush import answer  # noqa: PLC0415

    headers = httpx.Headers({"Retry-After": formatdate(time.time() + 120, usegmt=True)})  # as the client gives them
    busy = answer(1, 429, headers, answered_at=0.0)
    assert busy.retry and busy.retry_after is not None and 100 <= busy.retry_after <= 120


def fcm_error(status: int, code: str) -> dict[str, Any]:
    """FCM v1's error body: the FcmError's code in the details, else the status's name."""
    details = [{"@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError", "errorCode": code}]
    return {"error": {"code": status, "status": "NOT_FOUND" if status == 404 else "X", "details": details}}


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (404, "UNREGISTERED", SendResult(1, False, reason="UNREGISTERED", status=404, token_invalid=True)),
        (401, "THIRD_PARTY_AUTH_ERROR", SendResult(1, False, reason="THIRD_PARTY_AUTH_ERROR", status=401)),
        (
            403,
            "SENDER_ID_MISMATCH",
            SendResult(
                1, False, reason="fcm:SENDER_ID_MISMATCH", status=403, retry=True, outage=False, maybe_ours=True
            ),
        ),
        (503, "UNAVAILABLE", SendResult(1, False, reason="UNAVAILABLE", status=503, retry=True)),
        (429, "QUOTA_EXCEEDED", SendResult(1, False, reason="QUOTA_EXCEEDED", status=429, retry=True)),
        (502, "", SendResult(1, False, reason="X", status=502, outage=False)),
        (400, "INVALID_ARGUMENT", SendResult(1, False, reason="INVALID_ARGUMENT", status=400)),
    ],
)
def test_fcms_answer_is_its_rows_outcome(status, code, expected):
    """The module docstring's table of ``fcm.py``, answer by answer."""
    import httpx  # noqa: PLC0415

    from reminders_pipeline.providers.fcm import answer  # noqa: PLC0415

    assert answer(1, httpx.Response(status, json=fcm_error(status, code)), answered_at=0.0) == expected


def test_fcms_acceptance_keeps_the_messages_name_its_last_64_characters():
    import httpx  # noqa: PLC0415

    from reminders_pipeline.providers.fcm import answer  # noqa: PLC0415

    name = "projects/reminders-test/messages/0:" + "1" * 40
    accepted = answer(1, httpx.Response(200, json={"name": name}), answered_at=0.0)
    assert accepted == SendResult(1, True, status=200, provider_message_id=name[-64:])


def test_a_request_never_answered_counts_toward_fcms_outage_and_never_toward_ours_for_a_users_endpoint():
    """FCM's front end is our provider; a Web Push endpoint is a user's choice. Never written: back
    to pending (``not-sent:`` and what held it); written: maybe delivered, failed, never retried."""
    import httpx  # noqa: PLC0415

    from reminders_pipeline.providers import (
        fcm,  # noqa: PLC0415
        webpush,  # noqa: PLC0415
    )

    for module, outage in ((fcm, True), (webpush, False)):
        refused = module.transport_failure(1, httpx.ConnectError("refused"), written=False)
        assert refused == SendResult(1, False, reason="not-sent:connect_failed", retry=True, outage=outage)
        late = module.transport_failure(1, httpx.ReadTimeout("no answer"), written=True)
        assert late == SendResult(1, False, reason="timeout", outage=outage)
    stalled = fcm.transport_failure(1, httpx.ConnectTimeout("stalled"), written=False)
    pooled = fcm.transport_failure(1, TimeoutError(), written=False, connecting=False)
    assert (stalled.reason, pooled.reason) == ("not-sent:connect_timeout", "not-sent:pool_timeout")


def test_fcm_token_endpoint_throttling_or_timing_out_is_unreachable_and_any_other_4xx_refuses_our_key():
    """408 and 429 from the token endpoint say nothing of our key: the rows wait, nothing halts."""
    from google.auth.exceptions import RefreshError  # noqa: PLC0415

    from reminders_pipeline.providers.fcm import REFUSED, UNREACHABLE, token_failure  # noqa: PLC0415

    failed = RefreshError("token refresh failed")
    assert [token_failure(failed, s) for s in (408, 429, 500, 503, None)] == [UNREACHABLE] * 5
    assert [token_failure(failed, s) for s in (400, 401, 403, 404)] == [REFUSED] * 4


def test_fcm_refusing_our_credentials_halts_the_drain_and_says_so(run, fcm, feeds, db, caplog):
    url = soon(feeds, "/a.json", "One")
    run("device", "put", "droid", "--fcm-token", FCM_TOKEN, "--lead", "1800", "--source", url)
    fcm.script(FCM_TOKEN, FcmAnswer(status=403))  # a front end's refusal of our project: no device's code
    with caplog.at_level("ERROR"):
        summary = drained(run)
    assert summary["halted"] == "fcm:PERMISSION_DENIED"
    assert any("FCM configuration fault" in r.getMessage() for r in caplog.records)


def test_a_provider_devices_use_but_the_deployment_cannot_reach_is_refused_before_any_claim(
    run, push, fresh_mock, feeds, tmp_path, db
):
    """Issue 38 (13): with Web Push configured and the APNs secret not mounted, `reminders drain`
    and `reminders dispatch` stop before any claim with exit status 2 and a line naming APNs and
    its settings, as docs/operations.md says; the rows stay pending for a drain that can send them.
    (Before: the drain started and failed every APNs row `provider_not_configured:apns`.)"""
    url = soon(feeds, "/a.json", "Standup")
    subscribed(run, push, tmp_path, url)
    run("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    run("build", "--all")
    unmounted = {k: "" for k in fresh_mock.env() if k.startswith("REMINDERS_APNS_")}
    for command in (("drain",), ("dispatch", "--seconds", "1")):
        out = run(*command, code=2, **unmounted).output
        assert "apns" in out and "REMINDERS_APNS_KEY_FILE" in out and "nothing was claimed" in out, out
    assert {(r["device_id"], r["status"]) for r in rows(db)} == {("web", "pending"), ("phone", "pending")}
    assert json.loads(run("drain").output)["outcomes"] == {"sent": 2}  # mounted again: both go


def _lengthen_titles(db: Any, title: str) -> None:
    """Give every queued row ``title``: feeds cap titles at 256 characters, so only a row written
    directly reaches a longer one."""
    from reminders_pipeline.ledger.schema import notification_queue  # noqa: PLC0415

    with db.write() as conn:
        conn.execute(notification_queue.update().values(title=title))


def test_a_long_title_is_cut_to_each_providers_own_limit_and_sent(run, push, fcm, fresh_mock, feeds, tmp_path, db):
    """Each provider's form of the alert is fitted to its own limit: Web Push's plaintext to the
    3,993 bytes one aes128gcm record of 4,096 leaves, FCM's message to 4,096 bytes, APNs' JSON
    body to 4 KB; each mock refuses more, as the real service does."""
    url = soon(feeds, "/a.json", "Long")
    subscribed(run, push, tmp_path, url)
    run("device", "put", "droid", "--fcm-token", FCM_TOKEN, "--lead", "1800", "--source", url)
    run("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    run("build", "--all")
    _lengthen_titles(db, "Ü" * 5000)
    summary = json.loads(run("drain").output)
    assert summary["outcomes"] == {"sent": 3}, rows(db)
    (web,) = push.wait_for_requests(1)
    assert web.status == 201 and web.payload["title"].endswith("…") and web.payload["title"].startswith("ÜÜÜ")
    assert 3993 - 16 <= len(web.plaintext) <= 3993
    (droid,) = fcm.wait_for_requests(1)
    assert droid.status == 200 and droid.message["notification"]["title"].endswith("…")
    (phone,) = fresh_mock.wait_for_requests(1)
    assert phone.status == 200 and phone.payload["aps"]["alert"]["title"].endswith("…")
    shown = {r["device_id"]: json.loads(r["payload"])["payload"]["aps"]["alert"]["title"] for r in rows(db)}
    assert shown["web"] == web.payload["title"] and shown["droid"] == droid.message["notification"]["title"]


def test_a_long_body_from_a_feed_fits_web_push(run, push, feeds, tmp_path, db):
    """A body at the feed's 2,048-character cap, 4,096 bytes of UTF-8: over Web Push's limit
    once wrapped, under APNs'."""
    start = int(time.time()) + 1800
    event = {"id": "e", "title": "Talk", "body": "é" * 2048, "startsAt": start, "expiresAt": start + 1800}
    subscribed(run, push, tmp_path, str(feeds.items("/a.json", [event])))
    assert drained(run)["outcomes"] == {"sent": 1}, rows(db)
    (web,) = push.wait_for_requests(1)
    assert web.payload["body"].endswith("…") and web.payload["title"] == "Talk" and len(web.plaintext) <= 3993


def test_fcm_sender_id_mismatch_from_every_device_is_our_key_from_another_project(run, fcm, feeds, db, caplog):
    """A service-account key of another project makes FCM answer ``SENDER_ID_MISMATCH`` for every
    token: once three devices in a row answer it, a configuration fault of FCM, not dead devices.
    The rows stay pending, to go once the key is mended."""
    url = soon(feeds, "/a.json", "One")
    for i in range(3):
        run("device", "put", f"droid{i}", "--fcm-token", f"{FCM_TOKEN}{i}", "--lead", "1800", "--source", url)
    fcm.script_default(FcmAnswer(error_code="SENDER_ID_MISMATCH"))
    with caplog.at_level("ERROR"):
        summary = drained(run)
    assert summary["halted"] == "fcm:SENDER_ID_MISMATCH (answered for 3 devices in a row)"
    assert summary["tokens_invalidated"] == 0 and summary["returned_to_pending"] == 3
    assert all(device_of(run, f"droid{i}")["token_invalid_at"] is None for i in range(3))
    assert {(r["status"], r["attempts"]) for r in rows(db)} == {("pending", 1)}
    assert any("FCM configuration fault" in r.getMessage() for r in caplog.records)


def test_one_device_with_a_token_of_another_app_halts_no_one(run, fcm, fresh_mock, feeds, db):
    """``SENDER_ID_MISMATCH`` for one device is its token of another app's project: its row goes
    again until its attempts are spent, then fails; FCM never halts and the other devices, on FCM
    and APNs, get their alerts."""
    url = soon(feeds, "/a.json", "One")
    foreign = "foreign-" + "t" * 40
    run("device", "put", "droid", "--fcm-token", FCM_TOKEN, "--lead", "1800", "--source", url)
    run("device", "put", "stranger", "--fcm-token", foreign, "--lead", "1800", "--source", url)
    run("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    fcm.script(foreign, FcmAnswer(error_code="SENDER_ID_MISMATCH"))
    fast = {"REMINDERS_SEND_RETRY_BASE_SECONDS": "0", "REMINDERS_SEND_RETRY_MAX_SECONDS": "0"}
    run("build", "--all")
    summary = json.loads(run("drain", **fast).output)
    assert summary["halted"] is None and summary["providers"] == {"apns:sent": 1, "fcm:sent": 1}
    for _ in range(2):  # REMINDERS_SEND_MAX_ATTEMPTS: 3 in all
        summary = json.loads(run("drain", **fast).output)
        assert summary["halted"] is None
    got = {r["device_id"]: (r["status"], r["outcome"], r["outcome_detail"]) for r in rows(db)}
    assert got["stranger"] == ("settled", "failed", "fcm:SENDER_ID_MISMATCH")
    assert device_of(run, "stranger")["token_invalid_at"] is None


def test_fcm_third_party_auth_error_fails_that_row_alone(run, fcm, fresh_mock, feeds, db):
    """``THIRD_PARTY_AUTH_ERROR`` is the APNs certificate or web push key of the app behind one
    token: that row fails, the device stays, nothing halts, the others are sent."""
    url = soon(feeds, "/a.json", "One")
    other = "other-" + "t" * 40
    run("device", "put", "droid", "--fcm-token", FCM_TOKEN, "--lead", "1800", "--source", url)
    run("device", "put", "droid2", "--fcm-token", other, "--lead", "1800", "--source", url)
    run("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    fcm.script(FCM_TOKEN, FcmAnswer(error_code="THIRD_PARTY_AUTH_ERROR"))
    summary = drained(run)
    assert summary["halted"] is None and summary["tokens_invalidated"] == 0
    assert summary["providers"] == {"apns:sent": 1, "fcm:sent": 1, "fcm:failed": 1}
    got = {r["device_id"]: (r["status"], r["outcome"], r["outcome_detail"]) for r in rows(db)}
    assert got["droid"] == ("settled", "failed", "THIRD_PARTY_AUTH_ERROR")
    assert device_of(run, "droid")["token_invalid_at"] is None


@pytest.fixture(scope="module")
def push6(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockWebPush]:
    """A push service whose endpoints have an IPv6 literal host: ``https://[::1]:<port>/wpush/…``."""
    with MockWebPush(workdir=tmp_path_factory.mktemp("mock-webpush6"), host="::1") as server:
        yield server


BOTH_LOOPBACKS = {"REMINDERS_WEBPUSH_ALLOW_NETWORKS": "127.0.0.0/8,::1/128"}


def put_web(
    run: Callable[..., Result], push: MockWebPush, tmp_path: Path, device: str, url: str, **answer: Any
) -> dict:
    """Register ``device`` with a new subscription of ``push``; returns the subscription."""
    subscription = push.subscribe(Answer(**answer) if answer else None)
    (tmp_path / f"{device}.json").write_text(json.dumps(subscription))
    run("device", "put", device, "--webpush-subscription", str(tmp_path / f"{device}.json"), "--lead", "1800",
        "--source", url, **BOTH_LOOPBACKS)  # fmt: skip
    return subscription


def both_cas(tmp_path: Path, *mocks: MockWebPush) -> dict[str, str]:
    """The environment that trusts each mock's CA (each mock has its own)."""
    (tmp_path / "cas.pem").write_text("".join(m.ca_file.read_text() for m in mocks))
    return {"REMINDERS_WEBPUSH_CA_FILE": str(tmp_path / "cas.pem"), **BOTH_LOOPBACKS}


def test_an_ipv6_literal_endpoint_is_signed_for_its_origin_and_harms_no_other_row(
    run, push, push6, feeds, tmp_path, db
):
    """The VAPID ``aud`` of ``https://[::1]:port/…`` is ``https://[::1]:port``; neither that row
    nor the row beside it in the batch fails for it."""
    push6.reset()
    url = soon(feeds)
    put_web(run, push, tmp_path, "web4", url)
    put_web(run, push6, tmp_path, "web6", url)
    run("build", "--all")
    summary = json.loads(run("drain", **both_cas(tmp_path, push, push6)).output)
    assert {r["device_id"]: (r["outcome"], r["outcome_detail"]) for r in rows(db)} == {
        "web4": ("sent", None),
        "web6": ("sent", None),
    }
    assert summary["outcomes"] == {"sent": 2}
    (request,) = push6.wait_for_requests(1)
    assert request.status == 201 and request.endpoint.startswith("https://[::1]:")


def test_a_vapid_subject_with_a_path_signs_every_row(run, push, feeds, tmp_path, db):
    """RFC 8292 lets ``sub`` be any https URI: a contact page's path is kept, and signing it fails nothing."""
    put_web(run, push, tmp_path, "web", soon(feeds))
    run("build", "--all")
    subject = "https://example.com/contact"
    summary = json.loads(run("drain", REMINDERS_VAPID_SUBJECT=subject).output)
    assert summary["outcomes"] == {"sent": 1}, rows(db)
    (request,) = push.wait_for_requests(1)
    token = request.headers["authorization"].split("t=", 1)[1].split(",", 1)[0]
    assert jwt.decode(token, options={"verify_signature": False})["sub"] == subject


@pytest.mark.parametrize("subject", ["mailto:ops", "mailto:@example.com", "https://", "https://user@example.com/x"])
def test_a_vapid_subject_no_push_service_would_take_is_refused_when_settings_are_read(subject):
    with pytest.raises(SettingsError, match="REMINDERS_VAPID_SUBJECT"):
        Settings.from_env({"REMINDERS_VAPID_SUBJECT": subject})


def test_a_drain_with_an_unusable_vapid_subject_stops_before_claiming(run, push, feeds, tmp_path, db):
    put_web(run, push, tmp_path, "web", soon(feeds))
    run("build", "--all")
    refused = run("drain", code=2, REMINDERS_VAPID_SUBJECT="mailto:ops")
    assert "REMINDERS_VAPID_SUBJECT" in refused.output
    (row,) = rows(db, device_id="web")
    assert (row["status"], row["attempts"]) == ("pending", 0) and push.requests == []


def test_a_row_that_cannot_be_signed_fails_alone_and_the_batch_beside_it_is_sent(push, env):
    """A stored endpoint that no longer parses (``https://[::1``) fails its own row; the row sent
    beside it in the same batch is recorded as what it was: sent."""
    good = push.subscribe()
    broken = {**good, "endpoint": "https://[::1/wpush/x"}
    notes = [
        Notification(i, f"web{i}", json.dumps({"endpoint": s["endpoint"], **s["keys"]}), PAYLOAD, "collapse",
                     int(time.time()) + 600, provider="webpush")
        for i, s in enumerate((good, broken), start=1)
    ]  # fmt: skip

    async def sends() -> list[SendResult]:
        sender = WebPushSender(Settings.from_env(env))
        try:
            return await sender.send_many(notes)
        finally:
            await sender.aclose()

    results = {r.row_id: r for r in asyncio.run(sends())}
    assert results[1].ok and results[1].status == 201
    assert (results[2].ok, results[2].retry, results[2].reason) == (False, False, "invalid:ValueError")
    assert len(push.wait_for_requests(1)) == 1


def test_endpoints_spelled_differently_are_one_push_service_signed_for_its_origin(push, env):
    """``HTTPS://127.0.0.1:port/…`` and ``https://127.0.0.1:port/…`` are one origin: one entry of
    per-host state, and the ``aud`` the push service expects for both."""
    subscriptions = [push.subscribe(), push.subscribe()]
    endpoints = [subscriptions[0]["endpoint"].replace("https://", "HTTPS://"), subscriptions[1]["endpoint"]]
    notes = [
        Notification(i, f"web{i}", json.dumps({"endpoint": e, **s["keys"]}), PAYLOAD, "collapse",
                     int(time.time()) + 600, provider="webpush")
        for i, (e, s) in enumerate(zip(endpoints, subscriptions), start=1)
    ]  # fmt: skip

    async def sends() -> tuple[list[SendResult], list[str]]:
        sender = WebPushSender(Settings.from_env(env))
        try:
            return await sender.send_many(notes), list(sender.services.entries)
        finally:
            await sender.aclose()

    results, origins = asyncio.run(sends())
    assert [(r.ok, r.status) for r in results] == [(True, 201), (True, 201)]
    assert origins == [push.origin]


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        ("HTTPS://Push.Example:443/x", "https://push.example"),
        ("https://push.example/x", "https://push.example"),
        ("https://push.example:8443/x?y", "https://push.example:8443"),
        ("https://[::1]:8443/wpush/a", "https://[::1]:8443"),
        ("https://[2001:DB8::1]/a", "https://[2001:db8::1]"),
    ],
)
def test_an_endpoints_origin_is_normalized(url, origin):
    assert origin_of(url) == origin


def test_per_push_service_state_stays_bounded_and_never_drops_one_in_use():
    services = PushServices(per_host=2, limit=10)
    with services.use("https://busy.example") as busy:
        busy.authorization = (time.time() + 3600, "vapid t=…")
        for i in range(5000):
            with services.use(f"https://push{i}.example"):
                pass
        assert len(services.entries) <= 10
        assert services.entries["https://busy.example"] is busy  # held: kept while the others come and go
    assert "https://push4999.example" in services.entries  # the most recently used stays


@pytest.mark.parametrize("status", [502, 504])
def test_a_gateway_answer_that_may_hide_an_accepted_push_fails_the_row_and_is_not_sent_again(
    run, push, feeds, tmp_path, db, status
):
    """A 502 or 504 comes from a gateway that may have handed the message on: sending it again
    could show the alert twice."""
    subscribed(run, push, tmp_path, soon(feeds), status=status)
    summary = drained(run)
    assert (summary["outcomes"], summary["returned_to_pending"]) == ({"failed": 1}, 0)
    (row,) = rows(db, device_id="web")
    assert (row["status"], row["outcome_detail"]) == ("settled", f"http_{status}")
    assert len(push.requests) == 1


@pytest.mark.parametrize(
    ("answer", "retried", "detail"),
    [(502, False, "UNKNOWN"), (504, False, "DEADLINE_EXCEEDED"), (500, True, "INTERNAL"), (503, True, "UNAVAILABLE")],
)
def test_fcm_retries_only_the_5xx_it_documents_as_not_processed(run, fcm, feeds, db, answer, retried, detail):
    """A 502 or 504 (a front end's, or a deadline past) may come after FCM took the message; 500 and
    503 FCM documents as not processed, to be retried with backoff."""
    run("device", "put", "droid", "--fcm-token", FCM_TOKEN, "--lead", "1800", "--source", soon(feeds))
    fcm.script(FCM_TOKEN, FcmAnswer(status=answer))
    summary = drained(run)
    (row,) = rows(db, device_id="droid")
    assert (row["status"] == "pending", summary["returned_to_pending"]) == (retried, int(retried))
    assert row["outcome_detail"] == detail and summary["halted"] is None
    assert len(fcm.requests) == 1


def closed_port() -> int:
    """A local port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fcm_send(env: dict[str, str], **extra: str) -> tuple[SendResult, float]:
    """One FCM send through a new sender; its result and how long it took."""
    settings = Settings.from_env({**env, **extra})
    note = Notification(1, "droid", FCM_TOKEN, PAYLOAD, "collapse", int(time.time()) + 600, provider="fcm")

    async def send() -> tuple[SendResult, float]:
        sender = FcmSender(settings)
        try:
            started = time.monotonic()
            (result,) = await sender.send_many([note])
            return result, time.monotonic() - started
        finally:
            await sender.aclose()

    return asyncio.run(send())


def test_fcm_token_endpoint_unreachable_is_never_written_and_no_configuration_fault(fcm, env, tmp_path):
    """Refused, answering 503, or holding its answer past the send timeout: the token endpoint
    failing for now says nothing of our key. The rows certainly never left: back to pending."""
    key = json.loads(Path(env["REMINDERS_FCM_CREDENTIALS_FILE"]).read_text())
    (tmp_path / "refused.json").write_text(json.dumps({**key, "token_uri": f"https://127.0.0.1:{closed_port()}/token"}))
    quick = {"REMINDERS_SEND_TIMEOUT_SECONDS": "1"}  # what the token request is given at most
    results = [fcm_send(env, REMINDERS_FCM_CREDENTIALS_FILE=str(tmp_path / "refused.json"), **quick)]
    fcm.script_token(503)
    results.append(fcm_send(env, **quick))
    fcm.script_token(503, delay=5.0)
    results.append(fcm_send(env, **quick))
    for result, took in results:
        assert (result.ok, result.retry, result.status, result.config_fault) == (False, True, None, False)
        assert result.reason == "fcm_token_unreachable" and took < 1.5
    assert fcm.requests == []


def test_fcm_token_endpoint_refusing_our_key_is_a_configuration_fault(fcm, env):
    fcm.script_token(400)  # invalid_grant: the key is not (or no longer) the service account's
    result, _ = fcm_send(env)
    assert (result.ok, result.retry, result.config_fault) == (False, True, True)
    assert result.reason == "fcm:not-sent:token_refresh" and fcm.requests == []


def test_fcm_token_endpoint_down_halts_nothing_and_the_iphone_is_sent(run, fcm, fresh_mock, feeds, db):
    url = soon(feeds, "/a.json", "One")
    run("device", "put", "droid", "--fcm-token", FCM_TOKEN, "--lead", "1800", "--source", url)
    run("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url)
    fcm.script_token(503)
    summary = drained(run)
    assert summary["halted"] is None and summary["providers"] == {"apns:sent": 1}
    (row,) = rows(db, device_id="droid")
    assert (row["status"], row["attempts"], row["outcome_detail"]) == ("pending", 0, "fcm_token_unreachable")
